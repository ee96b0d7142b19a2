"""Full parameters out of a DeepSpeed module, one bucket at a time, with or without ZeRO-3.

Under ZeRO-3 each rank holds a shard of every parameter. Publishing and checkpointing need whole
parameters, so they walk `weights.bucket_plan` (whole parameters, BUCKET_NUMEL elements at a time): every
rank enters `GatheredParameters` for the bucket (a collective), rank 0 copies the bucket out, and the
gathered memory is freed before the next one. No rank ever holds more than one gathered bucket, and
the publisher sends each bucket before asking for the next (checkpoints alone assemble a whole state
dict, on rank 0, as any saved model directory needs). Every rank must drain the same iterators in the
same order; without ZeRO-3 only rank 0 calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from common import weights


def _gathered(params: list[torch.nn.Parameter], zero3: bool):
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def params_device(module: torch.nn.Module) -> torch.device:
    """Where the module's parameters live (under ZeRO-3 the shards, and every gathered bucket, are there too)."""
    return next(module.parameters()).device


def scratch_for(module: torch.nn.Module, lay: weights.Layout) -> torch.Tensor:
    """A buffer for `param_buckets(..., scratch=)`: the size of the largest bucket, on the parameters' device.

    A bucket is assembled where the parameters are (`torch.cat(..., out=)` cannot cross devices); the
    publisher copies each bucket into its own host vector before anything goes over gloo."""
    numel = max(end - start for _, _, start, end in weights.bucket_plan(lay))
    return torch.empty(numel, dtype=torch.float32, device=params_device(module))


def param_buckets(module: torch.nn.Module, lay: weights.Layout, zero3: bool,
                  scratch: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """fp32 flat buckets in `weights.bucket_plan(lay)` order (the weight channel's wire order), on the parameters'
    device (a CUDA learner's buckets are on its GPU).

    A bucket is a copy (under ZeRO-3 the gather is freed on exit). With `scratch` (`scratch_for(module, lay)`)
    every bucket is written into that one buffer (which must be on the parameters' device), so a bucket is valid only until the next is asked for;
    a fresh 128 MiB tensor per bucket costs as much in page faults as the copy itself."""
    params = [p for _, p in module.named_parameters()]
    for first, end, start, stop in weights.bucket_plan(lay):
        group = params[first:end]
        with torch.no_grad(), _gathered(group, zero3):
            parts = [p.detach().reshape(-1).float() for p in group]
            bucket = torch.cat(parts) if scratch is None else torch.cat(parts, out=scratch[: stop - start])
        yield bucket


def full_state_dict(module: torch.nn.Module, lay: weights.Layout, zero3: bool) -> dict[str, torch.Tensor]:
    """name -> full fp32 tensor (tied weights once, as in `named_parameters`); a collective under ZeRO-3."""
    out: dict[str, torch.Tensor] = {}
    for (first, end, _, _), bucket in zip(weights.bucket_plan(lay), param_buckets(module, lay, zero3), strict=True):
        for name, part in weights.bucket_views(lay, first, end, bucket):
            out[name] = part.clone()
    return out
