"""The LM head fused with log pi(target) and the full-vocabulary entropy: one autograd op, no logits kept.

For hidden h [N, H], head weight W [V, H] (bias b [V] optional), targets y [N] and temperature T, per token:

    z = (h @ W^T + b) rounded to the model dtype, then .float() / T    # [V]
    lse = logsumexp(z),  log pi(y) = z_y - lse,  H = lse - sum_j p_j z_j    (p = softmax(z))

The rounding of z to the model dtype is kept on purpose: vLLM's behaviour logprobs come from bf16 logits upcast
to fp32, and the importance ratios compare against them.

The forward runs `chunk` tokens at a time and saves only h, W, b, y and two floats per token (lse, H); the
backward recomputes each chunk's logits once and forms d logits directly,

    dz = [g_lp * (onehot(y) - p) - g_H * p * (log p + H)] / T        (log p + H = z - sum_j p_j z_j)

in place, then dh = dz @ W and dW += dz^T @ h. What autograd would do instead (`learner/logprobs.py`'s chunked
path) keeps the fp32 log-softmax and its exp for the chunk it recomputes and replays each op's backward:
about four fp32 [chunk x V] buffers at its peak on CPU (tests/bench/test_bench_head.py). Here the peak is two
(one in the backward when the entropy gets no gradient: `set_materialize_grads(False)` lets an unused output's
gradient arrive as None, and its branch is skipped). Values and gradients equal a float64 reference to fp32
rounding (tests/unit/test_fused_head.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

PROFILE_LABEL = "covrl/head"  # what a torch.profiler trace attributes the head's time to, forward and backward


def _logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """[c, H] -> [c, V] fp32 logits / T, rounded to the model dtype first (as vLLM's are); a fresh buffer."""
    z = F.linear(hidden, weight, bias).float()  # fp32 model: linear's own output, no copy
    return z.div_(temperature)


def _entropy_grad_(logp: torch.Tensor, p: torch.Tensor, entropy: torch.Tensor, g_ent: torch.Tensor) -> torch.Tensor:
    """logp [c, V] <- g_ent * dH/dz = -g_ent * p * (log p + H), in place. Its own function so a test can see that
    it is never called when the entropy gets no gradient."""
    return logp.add_(entropy[:, None]).mul_(p).mul_(-g_ent[:, None])


def _grad_logits(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor,
                 g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> torch.Tensor:
    """One chunk's d loss / d z (z the [c, V] logits / T, recomputed; 1/T already in g_lp and g_ent), formed in z's
    buffer: g_lp * (onehot(y) - p) - g_ent * p * (log p + H)."""
    dz = z.sub_(lse[:, None])  # [c, V] log p
    if g_ent is None:
        dz.exp_().mul_(-g_lp[:, None])  # -g_lp * p
    else:
        p = torch.exp(dz)  # [c, V], the second full-size buffer
        _entropy_grad_(dz, p, entropy, g_ent)
        if g_lp is not None:
            dz.addcmul_(p, g_lp[:, None], value=-1.0)  # - g_lp * p
        del p
    if g_lp is not None:
        dz.scatter_add_(-1, targets[:, None], g_lp[:, None])  # + g_lp * onehot(y)
    return dz


def _add_weight_grad_(dw: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """dw += dz^T @ h, in place, in dw's dtype (the weight's): one GEMM that accumulates in fp32 inside and rounds
    once per chunk."""
    dw.addmm_(dz.T, h)


class FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int):
        """hidden [N, H] (model dtype), weight [V, H], bias [V] or None, targets [N] int64
        -> ([N] log pi(target) fp32, [N] entropy fp32)."""
        with record_function(PROFILE_LABEL):
            n = hidden.shape[0]
            logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
            for s in range(0, n, chunk):
                z = _logits(hidden[s : s + chunk], weight, bias, temperature)  # [c, V]
                top = z.amax(-1, keepdim=True)
                z.sub_(top)  # z - max: exp cannot overflow
                e = torch.exp(z)  # [c, V], the second and last full-size buffer
                total = e.sum(-1)
                log_total = total.log()
                lse[s : s + chunk] = top[:, 0] + log_total
                logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None])[:, 0] - log_total
                # H = lse - sum p z = log_total - sum(e * (z - max)) / total
                entropy[s : s + chunk] = log_total - e.mul_(z).sum(-1) / total
                del z, e
            ctx.set_materialize_grads(False)
            ctx.temperature, ctx.chunk = temperature, chunk
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
        if (g_lp is None and g_ent is None) or not (want_h or want_w or want_b):
            return None, None, None, None, None, None
        with record_function(PROFILE_LABEL):
            temperature, chunk = ctx.temperature, ctx.chunk
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
                dz = _grad_logits(_logits(h, weight, bias, temperature), lse[part], targets[part], entropy[part],
                                  g_lp[part] if g_lp is not None else None, g_ent[part] if g_ent is not None else None)
                if want_b:
                    db.add_(dz.sum(0))
                dz_m = dz.to(hidden.dtype)  # the model dtype, as the .float() in the forward's backward would give
                if want_h:
                    torch.mm(dz_m, weight, out=dh[s : s + chunk])
                if want_w:
                    _add_weight_grad_(dw, dz_m, h)
                del dz, dz_m
            db = db.to(bias.dtype) if want_b else None
        return dh, dw, db, None, None, None


def fused_logprobs_and_entropy(
    hidden: torch.Tensor,  # [N, H] final hidden states, model dtype
    weight: torch.Tensor,  # [V, H] the LM head's weight
    bias: torch.Tensor | None,  # [V] or None
    targets: torch.Tensor,  # [N] int64 token ids to score
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] log pi(target), [N] entropy), fp32, differentiable w.r.t. hidden, weight and bias."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: the head runs `chunk` tokens at a time, so it must be >= 1 "
                         "(learner.logprob_chunk_tokens)")
    return FusedHead.apply(hidden, weight, bias, targets, temperature, chunk)
