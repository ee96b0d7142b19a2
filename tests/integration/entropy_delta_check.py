"""Worker for tests/integration/test_entropy_delta.py: one real train step (DeepSpeed, one gloo rank, the
built-in model and real rollouts), then actor/entropy_after and actor/entropy_delta recomputed by hand over
exactly the micro-batches `learner.entropy_delta_stride` picks. Prints a JSON line of both."""

from __future__ import annotations

import json
import os
import sys

import torch

from actors.actor import rollout
from broker.rules import GroupRules
from common import messages
from common.config import load_config
from common.rewards import RewardPool
from common.seeds import prompt_seed
from common.transport import free_port
from learner.batch import batch_from_config
from learner.trainer import Trainer, step_metrics
from tests.integration.reference_loop import setup


def entropy_sums(trainer: Trainer, micro: list) -> list[tuple[float, float]]:
    """(entropy sum, response tokens) of each micro-batch under the trainer's current weights."""
    out = []
    with torch.no_grad():
        for _, _, mb in micro:
            ent = trainer._logp_entropy(trainer.module, mb)[1]
            out.append((float((ent * mb.mask).sum()), float(mb.mask.sum())) if mb.num_seqs else (0.0, 0.0))
    return out


def main(stride: int) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cfg = load_config(None, ["rollout.groups_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=24",
                             "learner.micro_batch_tokens=96", "learner.lr=1e-3", f"learner.entropy_delta_stride={stride}",
                             "learner.filter.dynamic_sampling=false"])
    tok, engine, trainer, source = setup(cfg)
    r = cfg.rollout
    items = [messages.WorkItem(ticket=i, prompt_id=pid, epoch=0, prompt_ids=messages.to_bytes(source[pid].ids, messages.TOKEN_DTYPE),
                        answer=source[pid].answer, data_source=source[pid].data_source,
                        seed=prompt_seed(cfg.run.seed, 0, pid))
             for i, pid in enumerate(source.order(0)[:r.groups_per_step])]
    work = messages.Work(items=items, group_size=r.group_size, policy_version=0,
                  sampling=messages.SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens))
    with RewardPool.from_config(cfg.reward) as pool:
        groups = rollout(work, engine=engine, tokenizer=tok, pool=pool, receiver=None, gen_id=0, incarnation="x", wait_s=0)
    batch = batch_from_config(groups, GroupRules.of(cfg).rewards(groups), cfg, version=0, ranks=1)
    micro = trainer._micro(batch)
    before = entropy_sums(trainer, micro)
    met = step_metrics(trainer.train_step(batch))
    after = entropy_sums(trainer, micro)
    filled = [i for i, (_, _, mb) in enumerate(micro) if mb.num_seqs]
    picked = filled[::stride]
    tokens = sum(before[i][1] for i in picked)
    print(json.dumps({
        "micro_batches": len(filled), "picked": picked, "tokens_picked": tokens,
        "tokens_all": sum(b[1] for b in before),
        "logged": {"after": met["actor/entropy_after"], "delta": met["actor/entropy_delta"]},
        "by_hand": {"after": sum(after[i][0] for i in picked) / tokens,
                    "delta": sum(after[i][0] - before[i][0] for i in picked) / tokens},
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]))
