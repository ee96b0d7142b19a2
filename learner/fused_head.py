"""The LM head fused with log pi(target) and the full-vocabulary entropy: one autograd op, no logits kept.

For hidden h [N, H], head weight W [V, H] (bias b [V] optional), targets y [N] and temperature T, per token:

    z = (h @ W^T + b) rounded to the model dtype, then .float() / T    # [V]
    lse = logsumexp(z),  log pi(y) = z_y - lse,  H = lse - sum_j p_j z_j    (p = softmax(z))

The rounding of z to the model dtype is kept on purpose: vLLM's behaviour logprobs come from bf16 logits upcast
to fp32, and the importance ratios compare against them.

The forward runs `chunk` tokens at a time and saves only h, W, b, y and two floats per token (lse, H); the
backward recomputes each chunk's logits once and forms d logits directly,

    dz = [g_lp * (onehot(y) - p) - g_H * p * (log p + H)] / T        (log p + H = z - sum_j p_j z_j)

then dh = dz @ W and dW += dz^T @ h. The passes over a chunk's logits (its statistics forward, dz backward) are
the `kernels` of learner/head_kernels.py: "fused" (torch ops in place on an fp32 copy, the default), "triton"
(one Triton program per row reading the model-dtype logits once, dz written over them) or "inductor" (the same
maths compiled). The GEMMs stay cuBLAS's in every case. What autograd would do instead (`learner/logprobs.py`'s
chunked path) keeps the fp32 log-softmax and its exp for the chunk it recomputes and replays each op's backward:
about four fp32 [chunk x V] buffers at its peak on CPU (tests/bench/test_bench_head.py). Here the peak is two
with the "fused" kernels (one in the backward when the entropy gets no gradient: `set_materialize_grads(False)`
lets an unused output's gradient arrive as None, and its branch is skipped), and with "triton" one [chunk x V]
buffer in the model dtype. Values and gradients equal a float64 reference to fp32
rounding (tests/unit/test_fused_head.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from learner.head_kernels import KERNELS

PROFILE_LABEL = "covrl/head"  # what a torch.profiler trace attributes the head's time to, forward and backward


def _add_weight_grad_(dw: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """dw += dz^T @ h, in place, in dw's dtype (the weight's): one GEMM that accumulates in fp32 inside and rounds
    once per chunk."""
    dw.addmm_(dz.T, h)


class FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, kernels: str):
        """hidden [N, H] (model dtype), weight [V, H], bias [V] or None, targets [N] int64
        -> ([N] log pi(target) fp32, [N] entropy fp32)."""
        with record_function(PROFILE_LABEL):
            stats = KERNELS[kernels][0]
            n = hidden.shape[0]
            logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
            for s in range(0, n, chunk):
                part = slice(s, s + chunk)
                # logits in the model dtype (rounded as vLLM's are), a fresh buffer the kernels may overwrite
                lse[part], logp[part], entropy[part] = stats(F.linear(hidden[part], weight, bias), targets[part],
                                                             temperature)
            ctx.set_materialize_grads(False)
            ctx.temperature, ctx.chunk, ctx.kernels = temperature, chunk, kernels
            # H is kept for the entropy's gradient (no reduction over V again); the caller gets a copy, so an
            # in-place edit of the returned entropy cannot invalidate what the backward reads.
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        return logp, entropy.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        """g_lp, g_ent [N] or None -> grads for (hidden, weight, bias); None for what needs none."""
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        none = (None,) * 4
        if (g_lp is None and g_ent is None) or not (want_h or want_w or want_b):
            return None, None, None, *none
        with record_function(PROFILE_LABEL):
            temperature, chunk, grad = ctx.temperature, ctx.chunk, KERNELS[ctx.kernels][1]
            # d/dz of z = logits / T carries a 1/T: folded into the per-token grads rather than a [c, V] pass.
            g_lp = g_lp.float() / temperature if g_lp is not None else None
            g_ent = g_ent.float() / temperature if g_ent is not None else None
            dh = torch.empty_like(hidden) if want_h else None
            # dW is summed over chunks in place in the weight's dtype: with bf16 weights each chunk's GEMM rounds its
            # sum to bf16 once, as autograd's chunked head does when it adds each chunk's gradient into .grad; an
            # fp32 accumulator would cost a [V, H] fp32 buffer, a bf16 temporary per chunk and a final copy
            # (4.4 GB at Qwen2.5-7B's head, against the gradient's own 1.1 GB). db (small) is summed in fp32.
            dw = torch.zeros_like(weight) if want_w else None
            db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
            for s in range(0, hidden.shape[0], chunk):
                h, part = hidden[s : s + chunk], slice(s, s + chunk)
                # dz [c, V] in the model dtype, as the .float() in autograd's forward would give back
                dz = grad(F.linear(h, weight, bias), lse[part], targets[part], entropy[part],
                          g_lp[part] if g_lp is not None else None, g_ent[part] if g_ent is not None else None,
                          temperature)
                if want_b:
                    db.add_(dz.sum(0, dtype=torch.float32))
                if want_h:
                    torch.mm(dz, weight, out=dh[s : s + chunk])
                if want_w:
                    _add_weight_grad_(dw, dz, h)
                del dz
            db = db.to(bias.dtype) if want_b else None
        return dh, dw, db, *none


def fused_logprobs_and_entropy(
    hidden: torch.Tensor,  # [N, H] final hidden states, model dtype
    weight: torch.Tensor,  # [V, H] the LM head's weight
    bias: torch.Tensor | None,  # [V] or None
    targets: torch.Tensor,  # [N] int64 token ids to score
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    kernels: str = "fused",
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] log pi(target), [N] entropy), fp32, differentiable w.r.t. hidden, weight and bias. `kernels`: how a
    chunk's logits are reduced and differentiated (learner/head_kernels.py KERNELS)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: the head runs `chunk` tokens at a time, so it must be >= 1 "
                         "(learner.logprob_chunk_tokens)")
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: one of {tuple(KERNELS)} (learner.logprob_head)")
    return FusedHead.apply(hidden, weight, bias, targets, temperature, chunk, kernels)
