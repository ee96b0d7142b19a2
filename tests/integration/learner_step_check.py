"""Worker for tests/integration/test_learner_step.py: real train steps (DeepSpeed, one gloo rank, the built-in model)
under each attention and head the learner offers, from the same weights on the same batches, and the host reads
inside the micro-batch loop counted.

    python -m tests.integration.learner_step_check     (from the repository root; prints one JSON line)

Per variant (`learner.attn_implementation`, `learner.logprob_head`): the step metrics of two steps, and the host
reads (`Tensor.item`, `.tolist`, `.cpu`, `bool()`, `float()`, `int()`, indexing by a boolean mask, `nonzero`: each a
device sync on a GPU) made by the code
of the micro-batch loop: the forward, loss and backward (`Trainer._backward`), the step sums (`micro_sums`,
`accumulate`) and the ESS sums. Counted with a torch function mode, which sees every such call on a tensor; those
made inside DeepSpeed (ZeRO-3's fetch checks) are counted apart.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from broker.rules import GroupRules
from common import messages
from common.config import load_config
from common.data import BUILTIN_MODEL
from learner import trainer as trainer_mod
from learner.batch import batch_from_config
from learner.trainer import Trainer, init_distributed, step_metrics, thread_setup

HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "argwhere"}  # output sizes read back from the device
# (attention, head, ZeRO stage): the last is the fused head under ZeRO-3, whose weight is gathered once per forward
# and once per backward by DeepSpeed's module hooks.
VARIANTS = (("sdpa", "chunked", 1), ("varlen", "chunked", 1), ("sdpa", "fused", 1), ("varlen", "fused", 1),
            ("varlen", "fused", 3))


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host: `calls` those made by covrl's own code (and
    transformers', which it calls), `library` those made inside DeepSpeed (ZeRO-3's parameter coordinator checks
    its fetches on the host: not ours to remove, reported apart)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.library: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        read = None
        if name in HOST_READS or name in DATA_DEPENDENT:
            read = name
        elif name in ("__getitem__", "__setitem__") and _bool_index(args[1]):
            read = f"{name}[bool]"  # the result's size is the mask's count, read back
        if read is not None:
            (self.library if _caller_is_deepspeed() else self.calls).append(read)
        return func(*args, **(kwargs or {}))


def _caller_is_deepspeed() -> bool:
    """Whether the innermost frame outside torch and this file is DeepSpeed's."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path and not path.endswith("learner_step_check.py"):
            return f"{os.sep}deepspeed{os.sep}" in path
        frame = frame.f_back
    return False


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def counted(fn, reads: HostReads):
    def wrapper(*a, **k):
        with reads:
            return fn(*a, **k)

    return wrapper


def groups(rng: np.random.Generator, n: int, vocab: int) -> list[messages.RolloutGroup]:
    """n groups of 4 responses of 5 to 40 tokens (rows packed from samples of unequal length)."""
    out = []
    for g in range(n):
        samples = []
        for j in range(4):
            toks = rng.integers(3, vocab, size=int(rng.integers(5, 41)))
            samples.append(messages.Sample(
                token_ids=messages.to_bytes(toks, messages.TOKEN_DTYPE),
                logprobs=messages.to_bytes(np.full(len(toks), -np.log(vocab)) + 0.1 * rng.standard_normal(len(toks)),
                                           messages.LOGPROB_DTYPE),
                versions=messages.to_bytes(np.zeros(len(toks)), messages.VERSION_DTYPE), reward=float(j % 2),
                finish_reason="stop", score_status="ok"))
        out.append(messages.RolloutGroup(gen_id=0, incarnation="step", ticket=g, prompt_id=g, epoch=0,
                                         prompt_ids=messages.to_bytes(rng.integers(3, vocab, size=int(rng.integers(4, 12))),
                                                                      messages.TOKEN_DTYPE),
                                         samples=samples, gen_time_s=0.0))
    return out


def main() -> None:
    base = ["rollout.groups_per_step=4", "rollout.group_size=4", "learner.micro_batch_tokens=96", "learner.lr=1e-3",
            "learner.ess_step_scaling=\"sqrt\""]
    init_distributed()
    rng = np.random.default_rng(0)
    steps = [groups(rng, 4, 397) for _ in range(2)]
    out = {}
    for attn, head, zero in VARIANTS:
        cfg = load_config(None, base + [f"learner.attn_implementation=\"{attn}\"", f"learner.logprob_head=\"{head}\"",
                                        f"learner.zero_stage={zero}"])
        thread_setup(cfg)
        torch.manual_seed(0)
        trainer = Trainer(cfg, BUILTIN_MODEL)
        loop, sums = HostReads(), HostReads()
        trainer._backward = counted(trainer._backward, loop)
        trainer.ess.add = counted(trainer.ess.add, sums)
        plain = trainer_mod.micro_sums, trainer_mod.accumulate
        trainer_mod.micro_sums, trainer_mod.accumulate = counted(plain[0], sums), counted(plain[1], sums)
        rows, micro = [], 0
        for version, step in enumerate(steps):
            batch = batch_from_config(step, GroupRules.of(cfg).rewards(step), cfg, version=version, ranks=1)
            micro += len(batch.plan[0][0])
            rows.append(step_metrics(trainer.train_step(batch)))
        trainer_mod.micro_sums, trainer_mod.accumulate = plain
        name = f"{attn}+{head}" + ("+zero3" if zero == 3 else "")
        out[name] = {"metrics": rows, "micro_batches": micro, "loop_reads": loop.calls, "sum_reads": sums.calls,
                     "deepspeed_reads": len(loop.library), "attention": trainer.module.config._attn_implementation}
        del trainer
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
