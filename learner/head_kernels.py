"""The fused head's two passes over a chunk's logits, as kernels that read the logits in the model dtype once.

learner/fused_head.py computes a chunk's logits with one GEMM (bf16 in, fp32 accumulation, rounded to the model
dtype as vLLM's are) and hands them to a pair of functions:

    stats(logits [c, V], targets [c], temperature) -> (lse, log pi(target), entropy), [c] fp32 each
    grad(logits [c, V], lse, targets, entropy, g_lp, g_ent, temperature) -> dz [c, V] in the model dtype

where g_lp, g_ent are the per-token gradients already divided by T (or None), and

    z = logits / T,  p = softmax(z),  dz = g_lp * (onehot(y) - p) - g_ent * p * (z - lse + H)

Three implementations, picked by `learner.logprob_head` (learner/logprobs.py):

- "fused" (`EAGER`): torch ops in place on an fp32 copy of the chunk: ~8 fp32 passes over [c, V] forward and
  backward. The numbers the fused head has always given.
- "triton" (`TRITON`): one program per token row streams the row's logits in blocks of `BLOCK_V`, with an online
  softmax (running max m, s = sum exp(z - m), u = sum exp(z - m) (z - m); H = log s - u / s, lse = m + log s, both
  kept relative to the running max so nothing cancels), and picks the target's logit; the backward's program
  writes dz over the logits in place. Per vocabulary entry and token: 2 bytes written by the GEMM and 2 read
  forward; 2 written, 2 + 2 read and 2 written backward (two more GEMMs read dz), against ~106 bytes of fp32
  traffic eagerly. On a CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`): the correctness tests.
- "inductor" (`INDUCTOR`): the same maths as plain torch ops, `torch.compile`d (dynamic shapes, so the last, shorter
  chunk does not recompile): inductor fuses each into reductions over the model-dtype logits with no fp32 buffer.

Which is faster on a GPU is for the learner stage of the GPU proof to say (hardware/proof.py; docs/gpu.md).
"""

from __future__ import annotations

import functools

import torch

BLOCK_V = 4096  # vocabulary entries a program holds at once: 38 blocks for Qwen2.5's 152,064
NUM_WARPS = 8


# ---- eager (today's fused head) ---------------------------------------------------------------------------------

def eager_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """In place on fp32 z (a copy of bf16 logits; fp32 logits themselves): two fp32 [c, V] buffers at the peak."""
    z = logits.float()
    if temperature != 1.0:  # no [c, V] pass for nothing
        z.div_(temperature)
    top = z.amax(-1, keepdim=True)
    z.sub_(top)  # z - max: exp cannot overflow
    e = torch.exp(z)
    total = e.sum(-1)
    log_total = total.log()
    lse = top[:, 0] + log_total
    logp = z.gather(-1, targets[:, None])[:, 0] - log_total
    entropy = log_total - e.mul_(z).sum(-1) / total  # H = lse - sum p z = log_total - sum(e * (z - max)) / total
    return lse, logp, entropy


def _entropy_grad_(logp: torch.Tensor, p: torch.Tensor, entropy: torch.Tensor, g_ent: torch.Tensor) -> torch.Tensor:
    """logp [c, V] <- g_ent * dH/dz = -g_ent * p * (log p + H), in place. Its own function so a test can see that
    it is never called when the entropy gets no gradient."""
    return logp.add_(entropy[:, None]).mul_(p).mul_(-g_ent[:, None])


def eager_grad(logits, lse, targets, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """dz formed in z's fp32 buffer, then rounded to the model dtype (as autograd's .float() would give back)."""
    dz = logits.float()
    dz = (dz.div_(temperature) if temperature != 1.0 else dz).sub_(lse[:, None])  # [c, V] log p
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
    return dz.to(logits.dtype)


# ---- inductor: the same maths, out of place, for torch.compile to fuse --------------------------------------------

def _stats_math(logits, targets, inv_t):
    z = logits.float() * inv_t
    top = z.amax(-1, keepdim=True)
    e = torch.exp(z - top)
    total = e.sum(-1)
    log_total = total.log()
    zy = z.gather(-1, targets[:, None])[:, 0]
    return top[:, 0] + log_total, zy - top[:, 0] - log_total, log_total - (e * (z - top)).sum(-1) / total


def _grad_math(logits, lse, targets, entropy, g_lp, g_ent, inv_t):
    logp = logits.float() * inv_t - lse[:, None]
    p = torch.exp(logp)
    dz = torch.zeros_like(p)
    if g_lp is not None:
        hit = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
        dz = g_lp[:, None] * (hit.to(p.dtype) - p)
    if g_ent is not None:
        dz = dz - g_ent[:, None] * p * (logp + entropy[:, None])
    return dz.to(logits.dtype)


@functools.cache
def _compiled():
    return (torch.compile(_stats_math, dynamic=True, fullgraph=True),
            torch.compile(_grad_math, dynamic=True, fullgraph=True))


def inductor_stats(logits, targets, temperature: float):
    return _compiled()[0](logits, targets, 1.0 / temperature)


def inductor_grad(logits, lse, targets, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    return _compiled()[1](logits, lse, targets, entropy, g_lp, g_ent, 1.0 / temperature)


# ---- triton -----------------------------------------------------------------------------------------------------

@functools.cache
def _triton_kernels():
    """The two kernels, built on first use (importing triton costs ~1 s, and its interpreter is read at
    decoration)."""
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(logits_ptr, stride, targets_ptr, lse_ptr, logp_ptr, ent_ptr, V: tl.constexpr, inv_t,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        m = tl.full([], -1e30, tl.float32)  # finite: the first block's rescale is exp(-huge) * 0, not 0 * inf
        s = tl.zeros([], tl.float32)
        u = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < V
            x = tl.load(base + cols, mask=live, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, 0))
            scale = tl.exp(m - m_new)
            d = tl.where(live, x - m_new, 0.0)
            e = tl.where(live, tl.exp(d), 0.0)
            u = scale * (u + s * (m - m_new)) + tl.sum(e * d, 0)  # sum e (z - m_new), rebased to the new max
            s = s * scale + tl.sum(e, 0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        y = tl.load(targets_ptr + row)
        zy = tl.load(base + y).to(tl.float32) * inv_t
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, zy - lse)
        tl.store(ent_ptr + row, log_s - u / s)

    @triton.jit
    def grad_kernel(logits_ptr, stride, targets_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, V: tl.constexpr, inv_t,
                    HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        lse = tl.load(lse_ptr + row)
        if HAS_LP:
            g_lp = tl.load(glp_ptr + row)
            y = tl.load(targets_ptr + row)
        if HAS_ENT:
            g_ent = tl.load(gent_ptr + row)
            h = tl.load(ent_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < V
            logp = tl.load(base + cols, mask=live, other=0.0).to(tl.float32) * inv_t - lse
            p = tl.exp(logp)
            dz = tl.zeros([BLOCK], tl.float32)
            if HAS_LP:
                dz = tl.where(cols == y, g_lp, 0.0) - g_lp * p
            if HAS_ENT:
                dz = dz - g_ent * p * (logp + h)
            tl.store(base + cols, dz.to(logits_ptr.dtype.element_ty), mask=live)

    return stats_kernel, grad_kernel


def _launch_args(logits: torch.Tensor) -> dict:
    if logits.stride(-1) != 1:
        raise ValueError("the head kernels read rows of contiguous logits; got a stride of "
                         f"{logits.stride(-1)} along the vocabulary")
    block = min(BLOCK_V, 1 << max(0, logits.shape[-1] - 1).bit_length())  # no wider than the vocabulary needs
    return {"BLOCK": block, "num_warps": NUM_WARPS}


def triton_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    stats_kernel, _ = _triton_kernels()
    c = logits.shape[0]
    lse, logp, entropy = (torch.empty(c, dtype=torch.float32, device=logits.device) for _ in range(3))
    if c:
        stats_kernel[(c,)](logits, logits.stride(0), targets, lse, logp, entropy, logits.shape[-1],
                           1.0 / temperature, **_launch_args(logits))
    return lse, logp, entropy


def triton_grad(logits, lse, targets, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """dz over `logits` in place (the caller's fresh recompute): one read and one write of it."""
    _, grad_kernel = _triton_kernels()
    c = logits.shape[0]
    if c:
        grad_kernel[(c,)](logits, logits.stride(0), targets, lse, entropy, lse if g_lp is None else g_lp,
                          lse if g_ent is None else g_ent, logits.shape[-1], 1.0 / temperature,
                          HAS_LP=g_lp is not None, HAS_ENT=g_ent is not None, **_launch_args(logits))
    return logits


KERNELS = {  # learner.logprob_head -> (stats, grad)
    "fused": (eager_stats, eager_grad),
    "triton": (triton_stats, triton_grad),
    "inductor": (inductor_stats, inductor_grad),
}
