"""Full parameters out of a DeepSpeed module, one bucket at a time, with or without ZeRO-3.

Under ZeRO-3 each rank holds a shard of every parameter. Publishing and checkpointing need whole
parameters, so they walk `weights.wire_plan`: every rank enters `GatheredParameters` for each load-plan bucket
(a collective: whole parameters BUCKET_NUMEL elements at a time, or one larger parameter alone, gathered once for
all its pieces), rank 0 copies each wire bucket out, and the gathered memory is freed before the next gather.
Every rank must drain the same iterators in the same order; without ZeRO-3 only rank 0 calls them.

Buckets are in the wire dtype (`weights.wire_dtype`: the parameters' own, bf16 for a bf16 model), never upcast:
a bf16 learner's bucket is a bf16 copy, and the scratch buffer is bounded by BUCKET_NUMEL elements even when a
single parameter (a 7B model's 545M-element embedding) is far larger. What a ZeRO-3 gather of such a parameter
still costs is the parameter itself, whole and in its own dtype (DeepSpeed gathers whole parameters); the split
bounds the scratch and removes the fp32 copy of it. Checkpoints alone assemble a whole state dict, on rank 0,
as any saved model directory needs.
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
    """A buffer for `param_buckets(..., scratch=)`: the size of the largest wire bucket (at most BUCKET_NUMEL
    elements), in the wire dtype, on the parameters' device.

    A bucket is assembled where the parameters are (`torch.cat(..., out=)` cannot cross devices); the
    publisher stages each bucket in its own host vector before anything goes over gloo."""
    numel = max(b.stop - b.start for b in weights.wire_plan(lay))
    return torch.empty(numel, dtype=weights.wire_dtype(module.parameters()), device=params_device(module))


def param_buckets(module: torch.nn.Module, lay: weights.Layout, zero3: bool,
                  scratch: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Flat buckets in `weights.wire_plan(lay)` order (the weight channel's wire order), in the wire dtype, on the
    parameters' device (a CUDA learner's buckets are on its GPU).

    A bucket is a copy (under ZeRO-3 the gather is freed once its load-plan bucket is done). With `scratch`
    (`scratch_for(module, lay)`) every bucket is written into that one buffer (which must be on the parameters'
    device), so a bucket is valid only until the next is asked for; a fresh 128 MiB tensor per bucket costs as
    much in page faults as the copy itself."""
    params = [p for _, p in module.named_parameters()]
    dtype = weights.wire_dtype(params)
    for group in weights.load_groups(weights.wire_plan(lay)):
        first, end = group[0].first, group[0].end
        if group[0].whole:  # whole parameters: gathered, copied, released, then handed over
            with _gathered(params[first:end], zero3):
                bucket = _whole(params[first:end], group[0].stop - group[0].start, dtype, scratch)
            yield bucket
        else:  # the pieces of one split parameter, from one gather held until its last piece is taken
            with _gathered(params[first:end], zero3):
                yield from _pieces(params[first], group, dtype, scratch)


def _whole(params: list[torch.nn.Parameter], numel: int, dtype: torch.dtype,
           scratch: torch.Tensor | None) -> torch.Tensor:
    """Whole parameters concatenated in `dtype`; `.to(dtype)` copies nothing when they are in it already."""
    parts = [p.detach().reshape(-1).to(dtype) for p in params]
    return torch.cat(parts) if scratch is None else torch.cat(parts, out=scratch[:numel])


def _pieces(param: torch.nn.Parameter, group: list[weights.WireBucket], dtype: torch.dtype,
            scratch: torch.Tensor | None) -> Iterator[torch.Tensor]:
    """The wire buckets of one split parameter, each a copy of at most BUCKET_NUMEL elements in `dtype`."""
    src = param.detach().reshape(-1)
    for b in group:
        piece = src[b.offset:b.offset + b.stop - b.start]
        yield piece.to(dtype, copy=True) if scratch is None else scratch[:piece.numel()].copy_(piece)


def full_state_dict(module: torch.nn.Module, lay: weights.Layout, zero3: bool,
                    keep: bool = True) -> dict[str, torch.Tensor]:
    """name -> full tensor in the wire dtype (the parameters' own, `weights.wire_dtype`; tied weights once, as in
    `named_parameters`) on the host, a split parameter assembled from its pieces; a collective under ZeRO-3, so
    every rank walks the buckets, but only a rank that `keep`s them copies them (to the host, one bucket at a time:
    the GPU never holds more than one gathered bucket beyond the model's shards; learner rank 0 writes the model)."""
    out: dict[str, torch.Tensor] = {}
    for b, bucket in zip(weights.wire_plan(lay), param_buckets(module, lay, zero3), strict=True):
        if not keep:
            continue
        if b.whole:
            out.update((name, part.to("cpu", copy=True)) for name, part in weights.bucket_views(lay, b.first, b.end, bucket))
            continue
        name = lay.names[b.first]
        if b.offset == 0:
            out[name] = torch.empty(lay.shapes[b.first], dtype=bucket.dtype, device="cpu")
        out[name].view(-1)[b.offset:b.offset + bucket.numel()].copy_(bucket)
    return out
