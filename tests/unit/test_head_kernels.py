"""The fused head's Triton and inductor kernels (learner/head_kernels.py) against the float64 reference, on CPU.

The Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are first built in
this process): the same kernel source the GPU compiles, executed block by block in numpy. The interpreter is slow
(~0.5 s per 1,000 rows x 152k entries), so most cases use a vocabulary of 10,007 (not a multiple of the 4,096-wide
block: the masked tail is exercised) and one case the real 152k. The inductor kernels are torch.compile'd on the
CPU's C++ backend (~10 s a graph). Tolerances as tests/unit/test_fused_head.py: rtol 1e-5 plus atol 1e-5 of the
tensor's largest entry in fp32; in bf16 the kernels are compared with today's eager head on the same bf16 logits.
"""

import pytest
import torch
from torch.testing import assert_close

from common.config import triton_interpreted
from learner import head_kernels
from learner.fused_head import fused_logprobs_and_entropy
from learner.logprobs import resolve_head
from tests.helpers.heads import _close, _leaves, _loss

pytest.importorskip("triton")

V_SMALL, N, H = 10_007, 24, 16
CHUNK = 10  # 24 tokens: chunks of 10, 10 and 4


@pytest.fixture(autouse=True)
def interpreter():
    """tests/unit/conftest.py turned the interpreter on before triton was imported; it is needed without CUDA."""
    assert torch.cuda.is_available() or triton_interpreted()


def _inputs(v: int, n: int = N, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(v, H, generator=g) * 0.5  # logits ~ N(0, 4) / T
    b = torch.randn(v, generator=g) if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,), generator=g)


def _reference(hidden, weight, bias, targets, temperature):
    z = hidden @ weight.T
    z = (z if bias is None else z + bias) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def _against_reference(kernels: str, terms: str, v: int, temperature: float, n: int = N, chunk: int = CHUNK):
    hidden, weight, bias, targets = _inputs(v, n)
    h, w, b = _leaves(hidden, weight, bias)
    lp, ent = fused_logprobs_and_entropy(h, w, b, targets, temperature=temperature, chunk=chunk, kernels=kernels)
    _loss(lp, ent, terms).backward()
    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    lp64, ent64 = _reference(h64, w64, b64, targets, temperature)
    _loss(lp64, ent64, terms).backward()
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (n,)
    _close(lp, lp64)
    _close(ent, ent64)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        _close(got, want)


@pytest.mark.parametrize("terms", ["logp+entropy", "logp", "entropy"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_triton_equals_float64_reference(terms, temperature):
    """Values and gradients of hidden, weight and bias; the entropy's gradient on and off; T != 1 and T = 1."""
    _against_reference("triton", terms, V_SMALL, temperature)


def test_triton_at_qwen_vocabulary():
    """152k: 38 blocks a row, the online softmax rescaled 37 times, the last block masked. With 6 tokens, dh's fp32
    GEMM over 152k products is itself off the float64 reference by 2e-5 of its scale in the eager head too (same
    GEMM): dh is held to the eager head's, everything else to the reference."""
    hidden, weight, bias, targets = _inputs(151_936, n=6)
    grads = {}
    for kernels in ("fused", "triton"):
        h, w, b = _leaves(hidden, weight, bias)
        lp, ent = fused_logprobs_and_entropy(h, w, b, targets, temperature=0.7, chunk=4, kernels=kernels)
        _loss(lp, ent, "logp+entropy").backward()
        grads[kernels] = h.grad
    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    lp64, ent64 = _reference(h64, w64, b64, targets, 0.7)
    _loss(lp64, ent64, "logp+entropy").backward()
    for got, want in ((lp, lp64), (ent, ent64), (w.grad, w64.grad), (b.grad, b64.grad)):
        _close(got, want)
    assert_close(grads["triton"], grads["fused"], rtol=1e-5, atol=1e-6 * grads["fused"].abs().max().item())


@pytest.mark.parametrize("terms", ["logp+entropy", "logp"])
def test_inductor_equals_float64_reference(terms):
    _against_reference("inductor", terms, V_SMALL, 0.7)


def test_online_softmax_keeps_entropy_exact_with_large_logits():
    """Logits near 90 in one late block and the rest near 0: a kernel that summed p z unshifted, or rescaled the
    running sums wrongly when the max moves, would lose the entropy (it is ~1e-3 here) to cancellation."""
    hidden, weight, _, targets = _inputs(V_SMALL, n=4, bias=False)
    bias = torch.zeros(V_SMALL)
    bias[9_000:9_003] = torch.tensor([90.0, 89.0, 85.0])
    h, w, b = _leaves(hidden, weight * 0.01, bias)
    lp, ent = fused_logprobs_and_entropy(h, w, b, targets, temperature=1.0, chunk=4, kernels="triton")
    lp64, ent64 = _reference(hidden.double(), weight.double() * 0.01, bias.double(), targets, 1.0)
    assert_close(ent.double(), ent64, rtol=1e-4, atol=1e-7)
    assert_close(lp.double(), lp64, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kernels", ["triton", "inductor"])
def test_bf16_kernels_equal_the_eager_head_on_the_same_bf16_logits(kernels):
    """In bf16 every head rounds the logits (and dz) to bf16 as vLLM does; the kernels then work in fp32 on the same
    numbers as the eager head, so values agree to fp32 rounding and gradients to one bf16 step of dz."""
    hidden, weight, _, targets = _inputs(V_SMALL, bias=False)
    out = {}
    for name in ("fused", kernels):
        h, w = _leaves(hidden, weight, dtype=torch.bfloat16)
        lp, ent = fused_logprobs_and_entropy(h, w, None, targets, temperature=0.7, chunk=CHUNK, kernels=name)
        _loss(lp, ent, "logp+entropy").backward()
        assert h.grad.dtype == w.grad.dtype == torch.bfloat16
        out[name] = (lp, ent, h.grad.float(), w.grad.float())
    for got, want in zip(out[kernels], out["fused"]):
        scale = want.abs().max().item()
        assert_close(got, want, rtol=0, atol=(1e-5 if got.dtype == torch.float32 and got.ndim == 1 else 1e-2) * scale)


def test_triton_leaves_frozen_weight_alone_and_handles_no_tokens():
    hidden, weight, _, targets = _inputs(V_SMALL, bias=False)
    h = hidden.clone().requires_grad_()
    lp, ent = fused_logprobs_and_entropy(h, weight, None, targets, temperature=0.7, chunk=CHUNK, kernels="triton")
    _loss(lp, ent, "logp+entropy").backward()
    assert weight.grad is None and h.grad is not None
    w = weight.clone().requires_grad_()
    lp, ent = fused_logprobs_and_entropy(torch.zeros(0, H, requires_grad=True), w, None,
                                         torch.zeros(0, dtype=torch.long), kernels="triton")
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_triton_head_is_refused_in_one_line_without_cuda_or_interpreter(monkeypatch):
    assert resolve_head("triton", cuda=False) == "triton"  # the interpreter is on (fixture)
    assert resolve_head("inductor", cuda=False) == "inductor"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="need CUDA") as e:
        resolve_head("triton", cuda=False)
    assert "\n" not in str(e.value)
    assert resolve_head("triton", cuda=True) == "triton"
    with pytest.raises(ValueError, match="kernels"):
        fused_logprobs_and_entropy(torch.zeros(2, 4), torch.zeros(8, 4), None, torch.zeros(2, dtype=torch.long),
                                   kernels="cuda")
    assert set(head_kernels.KERNELS) == {"fused", "triton", "inductor"}
