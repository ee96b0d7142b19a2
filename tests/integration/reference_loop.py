"""The synchronous reference: generate -> score -> train -> load weights, one process, no hub.

Built from the same pieces as the async system (the actor's `rollout`, the
learner's batcher and trainer), walking the same prompt order with the same
seeds. With max_staleness_steps = 0 and one generator the async run must end
with the same parameters. Usage, from the repository root (covrl installed, or PYTHONPATH=.):
    python -m tests.integration.reference_loop RUN_DIR OUT.safetensors
(RUN_DIR/config.toml is the config; the run need not have happened.)
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from actors.actor import rollout
from actors.engine import TorchEngine
from broker.rules import GroupRules
from common import messages
from common import weights
from common.runfiles import read_run_config
from common.data import PromptSource, model_dir
from common.rewards import RewardPool
from common.seeds import prompt_seed
from learner.batch import batch_from_config
from learner.trainer import Trainer, init_distributed, thread_setup


def setup(cfg):
    """One process's torch.distributed world of one, and what a loop needs: (tokenizer, engine, trainer, prompts)."""
    from transformers import AutoTokenizer

    thread_setup(cfg)
    torch.manual_seed(cfg.run.seed)
    init_distributed()
    path = model_dir(cfg)
    tok = AutoTokenizer.from_pretrained(path)
    engine = TorchEngine(path, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok, engine, Trainer(cfg, path), PromptSource(cfg, tok)


def main(run_dir: str, out: str, micro_batch_tokens: int | None = None) -> None:
    cfg = read_run_config(run_dir)
    tok, engine, trainer, source = setup(cfg)
    order = source.order(0)
    gps, r = cfg.rollout.groups_per_step, cfg.rollout
    sampling = messages.SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                forced_length_median=r.forced_length_median, forced_length_sigma=r.forced_length_sigma)
    with RewardPool.from_config(cfg.reward) as pool:
        for step in range(1, cfg.run.steps + 1):
            items = [
                messages.WorkItem(ticket=slot, prompt_id=pid, epoch=0,
                           prompt_ids=messages.to_bytes(source[pid].ids, messages.TOKEN_DTYPE),
                           answer=source[pid].answer, data_source=source[pid].data_source, seed=prompt_seed(cfg.run.seed, 0, pid))
                for slot, pid in enumerate(order[(step - 1) * gps : step * gps], start=(step - 1) * gps)
            ]
            work = messages.Work(items=items, group_size=r.group_size, sampling=sampling, policy_version=step - 1)
            groups = rollout(work, engine=engine, tokenizer=tok, pool=pool, receiver=None, gen_id=0, incarnation="ref", wait_s=0)
            if cfg.learner.filter.dynamic_sampling:
                raise SystemExit("the reference loop does not filter groups: run it with learner.filter.dynamic_sampling=false")
            batch = batch_from_config(groups, GroupRules.of(cfg).rewards(groups), cfg, version=step - 1, ranks=1, micro_batch_tokens=micro_batch_tokens)
            trainer.train_step(batch)
            engine.load_flat(weights.flatten(trainer.module), step)
    # clone: tied weights (lm_head = embed_tokens) share memory, which safetensors refuses to save
    save_file({k: v.detach().clone() for k, v in trainer.module.state_dict().items()}, out)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("out")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="override the run's micro-batch budget")
    a = ap.parse_args()
    main(a.run_dir, a.out, a.micro_batch_tokens)
