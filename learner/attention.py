"""Packed rows attended one sample at a time, with no mask: the learner's "varlen" attention.

A learner micro-batch is one padding-free row of several samples (`learner.batch.pack`). Given only restarting
`position_ids`, transformers 5.x detects the packing (a host sync per forward) and builds a dense [N x N]
block-causal boolean mask for sdpa: correct, but every score of the row is computed, K/V are repeated for GQA, and
flash kernels are ruled out. Here the row's sample boundaries travel with the forward instead, as the keyword
arguments FlashAttention integrations read (`cu_seq_lens_q/k` [n + 1] int32 on the device, `max_length_q/k`
Python ints, `Packed.attn_kwargs`), plus the lengths on the host (`seq_lens`), so nothing is read back:

- on CUDA, torch's own FlashAttention-2 varlen kernels (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10);
  its signature differs between 2.10 (`is_causal`), 2.11 (`window_size`, no GQA) and 2.12 (`enable_gqa`), so the
  call is read from the installed signature once (`varlen_plan`);
- elsewhere (the CPU, an fp32 model, a GPU before sm80), one causal sdpa call per sample: the same maths, for tests
  and for a user who wants the cost of a row to grow with its samples' squared lengths rather than its own.

`register()` adds the function to transformers' `AttentionInterface` as `VARLEN`; a model loaded with
`attn_implementation=VARLEN` then builds no mask at all (transformers skips mask creation for an attention name
it has no mask function for). `resolve(choice)` turns `learner.attn_implementation` into what
`from_pretrained` gets.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

VARLEN = "covrl_varlen"  # the name transformers knows the function by


def torch_varlen() -> Callable | None:
    """torch's varlen attention function, or None where this torch has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


HALF = (torch.bfloat16, torch.float16)  # what FlashAttention kernels take


def flash_capable(dtype: torch.dtype, cuda: bool) -> bool:
    """Whether torch's varlen FlashAttention kernels can run a model of `dtype` here: CUDA, an sm80+ GPU, bf16 or
    fp16, and a torch that has them."""
    return (cuda and dtype in HALF and torch_varlen() is not None
            and torch.cuda.get_device_capability() >= (8, 0))


def resolve(choice: str, cuda: bool | None = None, dtype: torch.dtype = torch.bfloat16) -> str:
    """`learner.attn_implementation` -> the `attn_implementation` for `from_pretrained`, for a model of `dtype`.
    "auto": `VARLEN` where torch's varlen FlashAttention kernels can run it (`flash_capable`); else
    flash_attention_2 on CUDA in bf16 / fp16 where flash-attn is installed (torch < 2.10); else sdpa (the CPU, an
    fp32 model). `VARLEN` before flash_attention_2: the same kernels, and transformers' flash_attention_2 path still
    checks the packing on the host every forward. "varlen": `VARLEN` (registered here; it attends one sample at a
    time with sdpa where the kernels cannot run)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if choice == "auto":
        if flash_capable(dtype, cuda):
            choice = "varlen"
        elif cuda and dtype in HALF and importlib.util.find_spec("flash_attn"):
            return "flash_attention_2"
        else:
            return "sdpa"
    if choice == "varlen":
        register()
        return VARLEN
    return choice


def register() -> None:
    """Make `VARLEN` a transformers attention implementation (idempotent), and read how to call torch's varlen
    kernels where it has them."""
    global _PLAN
    from transformers import AttentionInterface

    fn = torch_varlen()
    if fn is not None and _PLAN is None:
        _PLAN = varlen_plan(fn)
    AttentionInterface.register(VARLEN, varlen_attention)


@dataclass(frozen=True)
class VarlenPlan:
    """How to call this torch's `varlen_attn` causally: its keyword arguments and whether K/V must be repeated to
    the query's head count (no GQA support). Read from its signature once (`varlen_plan`), not inside a forward, so
    a compiled layer traces no `inspect` call."""

    fn: Callable
    kwargs: dict
    repeat_kv: bool
    takes_scale: bool  # 2.10's has no scale: it always uses 1/sqrt(head_dim)


def varlen_plan(fn: Callable) -> VarlenPlan:
    """The plan for one of torch's `varlen_attn` signatures: is_causal (2.10) or window_size = (-1, 0) (2.11+);
    GQA through enable_gqa where it exists (2.12+), else K/V repeated."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        raise RuntimeError(f"torch.nn.attention.varlen.varlen_attn{inspect.signature(fn)} has neither window_size "
                           f"nor is_causal: this torch's varlen API is not one covrl knows; use "
                           f"learner.attn_implementation = \"sdpa\"")
    gqa = "enable_gqa" in params
    if gqa:
        kwargs["enable_gqa"] = True
    return VarlenPlan(fn=fn, kwargs=kwargs, repeat_kv=not gqa, takes_scale="scale" in params)


_PLAN: VarlenPlan | None = None  # set by `register` where torch has varlen kernels


def varlen_call(plan: VarlenPlan, query, key, value, cu: torch.Tensor, max_len: int, scale: float | None,
                groups: int) -> torch.Tensor:
    """Causal attention of each sample `cu` delimits to itself, [T, H, D] layout, with torch's varlen kernels
    (`groups` query heads per KV head)."""
    if groups > 1 and plan.repeat_kv:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if plan.takes_scale:
        return plan.fn(query, key, value, cu, cu, max_len, max_len, scale=scale, **plan.kwargs)
    if scale is not None and abs(scale * query.shape[-1] ** 0.5 - 1.0) > 1e-6:
        raise RuntimeError("this torch's varlen_attn takes no scale and the model's attention scale is not "
                           "1/sqrt(head_dim): use learner.attn_implementation = \"sdpa\"")
    return plan.fn(query, key, value, cu, cu, max_len, max_len, **plan.kwargs)


def per_sample_sdpa(query, key, value, seq_lens: tuple[int, ...], scale: float | None, groups: int) -> torch.Tensor:
    """The same attention as `varlen_call`, one causal sdpa call per sample ([T, H, D] layout): the CPU path."""
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out, start = [], 0
    for n in seq_lens:
        q, k, v = (x[start:start + n].transpose(0, 1) for x in (query, key, value))  # [H, n, D]
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] of one packed row ->
    ([1, T, Hq, D], None), each sample attending causally to itself only."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError("covrl's varlen attention needs one packed row and its sample boundaries (cu_seq_lens_q, "
                         "max_length_q, seq_lens: learner.batch.Packed.attn_kwargs()); it got none")
    if attention_mask is not None:
        raise ValueError("covrl's varlen attention got an attention mask: packed rows carry their boundaries instead")
    if sliding_window is not None:
        raise ValueError("covrl's varlen attention has no sliding window: use learner.attn_implementation = \"sdpa\" "
                         "for this model")
    if dropout:
        raise ValueError("covrl's varlen attention has no dropout (the learner trains with attention_dropout = 0)")
    unsupported = sorted(k for k in ("softcap", "s_aux") if kwargs.get(k) is not None)
    if unsupported or kwargs.get("is_causal", True) is False:
        raise ValueError(f"covrl's varlen attention is causal softmax attention only; this model asks for "
                         f"{unsupported or 'is_causal=False'}: use learner.attn_implementation = \"sdpa\"")
    groups = query.shape[1] // key.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    with torch.profiler.record_function("covrl/attention"):
        if q.is_cuda and _PLAN is not None and q.dtype in HALF:
            if not torch.compiler.is_compiling():
                CALLS["kernels"] += 1
            out = varlen_call(_PLAN, q.contiguous(), k.contiguous(), v.contiguous(), cu, kwargs["max_length_q"],
                              scaling, groups)
        else:
            if not torch.compiler.is_compiling():
                CALLS["per_sample_sdpa"] += 1
            out = per_sample_sdpa(q, k, v, kwargs["seq_lens"], scaling, groups)
    return out[None], None


# Which way each call of `varlen_attention` went in this process (a layer's call is one): torch's varlen kernels or
# the per-sample sdpa fallback. Read by the GPU proof's learner stage (hardware/learner_bench.py), which must see
# the kernels run, not the fallback, in a varlen variant; nothing else reads or resets it. Not counted inside a
# torch.compile'd layer (a Python side effect there would cost graphs): a compiled variant's calls read 0.
CALLS = {"kernels": 0, "per_sample_sdpa": 0}
