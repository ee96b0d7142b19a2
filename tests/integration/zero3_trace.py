"""One learner rank with ZeRO-3 on the CPU: train a few steps and print DeepSpeed's parameter-fetch trace state.

Run by tests/integration/test_zero3_trace.py in its own process (torch.distributed is set up once per process),
from the repository root:
    python -m tests.integration.zero3_trace MODEL_DIR
Prints one JSON line: {"complete": [bool after each step], "prefetch_bucket": int}.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from broker.rules import GroupRules
from common import messages
from common.config import load_config
from learner.batch import batch_from_config
from learner.trainer import Trainer, init_distributed, thread_setup
from tests.helpers.groups import rollout_group, sample


def groups(rng: np.random.Generator, n: int) -> list[messages.RolloutGroup]:
    out = []
    for g in range(n):
        samples = []
        for j in range(4):
            toks = rng.integers(3, 60, size=12)
            samples.append(sample(toks, j % 2, logprobs=-1.0, versions=0))
        out.append(rollout_group(samples, prompt=rng.integers(3, 60, size=6), incarnation="z3", ticket=g, prompt_id=g))
    return out


def main(model_dir: str) -> None:
    cfg = load_config(None, ["learner.zero_stage=3", "rollout.groups_per_step=4", "rollout.group_size=4",
                             "learner.micro_batch_tokens=64", "learner.log_entropy_delta=false"])
    thread_setup(cfg)
    init_distributed()
    trainer = Trainer(cfg, model_dir)
    coordinator = trainer.engine.optimizer.parameter_offload.get_param_coordinator()
    rng = np.random.default_rng(0)
    complete = []
    for step in range(3):
        batch = groups(rng, 4)
        trainer.train_step(batch_from_config(batch, GroupRules.of(cfg).rewards(batch), cfg, version=step, ranks=1))
        complete.append(coordinator.is_complete_trace())
    print(json.dumps({"complete": complete}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
