"""Worker for tests/integration/test_learner_step.py: real train steps (DeepSpeed, one gloo rank, the built-in model)
under each attention and head the learner offers, from the same weights on the same batches, and the host reads
inside the micro-batch loop counted.

    python -m tests.integration.learner_step_check [--cuda]    (from the repository root; prints one JSON line)

Per variant (`learner.attn_implementation`, `learner.logprob_head`): the step metrics of two steps, and the host
reads (`Tensor.item`, `.tolist`, `.cpu`, `bool()`, `float()`, `int()`, indexing by a boolean mask, `nonzero`: each a
device sync on a GPU) made by the code
of the micro-batch loop: the forward, loss and backward (`Trainer._backward`), the step sums (`micro_sums`,
`accumulate`) and the ESS sums. Counted with a torch function mode, which sees every such call on a tensor; those
made inside DeepSpeed (ZeRO-3's fetch checks) are counted apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

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
from tests.helpers.groups import rollout_group, sample

HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "argwhere"}  # output sizes read back from the device
# (attention, head, ZeRO stage): the last is the fused head under ZeRO-3, whose weight is gathered once per forward
# and once per backward by DeepSpeed's module hooks.
# With --cuda (tests/gpu/test_learner_kernels.py): bf16, today's path and the new one, CUDA's syncs watched too.
CUDA_VARIANTS = (("sdpa", "chunked", 1), ("varlen", "fused", 1))
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


class DeviceSyncs:
    """On CUDA: the device syncs CUDA's sync debug mode reports while active ("warn": each sync a warning at the
    Python line that caused it), `calls` covrl's (and transformers'), `library` DeepSpeed's."""

    def __init__(self):
        self.calls: list[str] = []
        self.library: list[str] = []

    @contextlib.contextmanager
    def watching(self):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in seen:
            if "synchroniz" in str(w.message):
                where = f"{w.filename}:{w.lineno}"
                (self.library if f"{os.sep}deepspeed{os.sep}" in w.filename else self.calls).append(where)


def counted(fn, reads: HostReads, syncs: DeviceSyncs | None = None):
    def wrapper(*a, **k):
        with reads, (syncs.watching() if syncs is not None else contextlib.nullcontext()):
            return fn(*a, **k)

    return wrapper


def release_head_after_forward(head: torch.nn.Module) -> None:
    """Make ZeRO-3 let go of the head's weight between its forward and its backward. The built-in model's
    parameters are small enough that DeepSpeed keeps them whole (`stage3_param_persistence_threshold`, and its reuse
    distance on one rank); a real model's head is released, and its backward must gather it again before the fused
    head's backward reads it. A forward hook registered after DeepSpeed's runs after its release step."""
    released: list[str] = []

    def release(module, inputs, output):
        w = module.weight
        w.ds_persist = False
        if w.ds_status.name == "AVAILABLE" and not w.ds_active_sub_modules:
            w.partition()
        released.append(w.ds_status.name)

    head.register_forward_hook(release)
    head.released = released


def groups(rng: np.random.Generator, n: int, vocab: int) -> list[messages.RolloutGroup]:
    """n groups of 4 responses of 5 to 40 tokens (rows packed from samples of unequal length)."""
    out = []
    for g in range(n):
        samples = []
        for j in range(4):
            toks = rng.integers(3, vocab, size=int(rng.integers(5, 41)))
            logprobs = np.full(len(toks), -np.log(vocab)) + 0.1 * rng.standard_normal(len(toks))
            samples.append(sample(toks, j % 2, logprobs=logprobs, versions=0))
        prompt = rng.integers(3, vocab, size=int(rng.integers(4, 12)))
        out.append(rollout_group(samples, prompt=prompt, incarnation="step", ticket=g, prompt_id=g))
    return out


def main(cuda: bool) -> None:
    base = ["rollout.groups_per_step=4", "rollout.group_size=4", "learner.micro_batch_tokens=96", "learner.lr=1e-3",
            "learner.ess_step_scaling=\"sqrt\""] + (["model.dtype=\"bfloat16\""] if cuda else [])
    init_distributed()
    rng = np.random.default_rng(0)
    steps = [groups(rng, 4, 397) for _ in range(2)]
    out = {}
    for attn, head, zero in (CUDA_VARIANTS if cuda else VARIANTS):
        cfg = load_config(None, base + [f"learner.attn_implementation=\"{attn}\"", f"learner.logprob_head=\"{head}\"",
                                        f"learner.zero_stage={zero}"])
        thread_setup(cfg)
        torch.manual_seed(0)
        trainer = Trainer(cfg, BUILTIN_MODEL)
        if zero == 3:
            release_head_after_forward(trainer.module.lm_head)
        loop, sums = HostReads(), HostReads()
        syncs = DeviceSyncs() if cuda else None
        trainer._backward = counted(trainer._backward, loop, syncs)
        trainer.ess.add = counted(trainer.ess.add, sums, syncs)
        plain = trainer_mod.micro_sums, trainer_mod.accumulate
        trainer_mod.micro_sums, trainer_mod.accumulate = counted(plain[0], sums, syncs), counted(plain[1], sums, syncs)
        rows, micro = [], 0
        for version, step in enumerate(steps):
            batch = batch_from_config(step, GroupRules.of(cfg).rewards(step), cfg, version=version, ranks=1)
            micro += len(batch.plan[0][0])
            rows.append(step_metrics(trainer.train_step(batch)))
        trainer_mod.micro_sums, trainer_mod.accumulate = plain
        name = f"{attn}+{head}" + ("+zero3" if zero == 3 else "")
        out[name] = {"metrics": rows, "micro_batches": micro, "loop_reads": loop.calls, "sum_reads": sums.calls,
                     "deepspeed_reads": len(loop.library), "attention": trainer.module.config._attn_implementation,
                     "head_released": sorted(set(getattr(trainer.module.lm_head, "released", []))),
                     "device_syncs": syncs.calls if syncs else None,
                     "deepspeed_syncs": len(syncs.library) if syncs else None}
        del trainer
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(cuda="--cuda" in sys.argv[1:])
