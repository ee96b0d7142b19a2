"""The fused LM head (learner/fused_head.py) against a float64 reference at the real 152k vocabulary, against the
chunked head, and through `install_token_forward` on a tiny Qwen2.

Tolerances. The fused head computes in fp32 (eps 1.2e-7); the reference in float64 on the same inputs. Its values
sum 152k exponentials and its gradients sum 152k (dh) or 48 (dW) products, so each element is off by a few eps
times the size of the whole tensor, not of that element (dW is mostly entries ~1e-5 next to a few ~5): measured
here, at most 4e-6 of the tensor's largest entry (logits up to ~25). We allow rtol 1e-5 plus atol 1e-5 x the
tensor's largest |entry|: a 10x margin, and far below any real mistake (a missing 1/T, a dropped entropy term or
an off-by-one chunk moves entries by > 1e-2 of the scale).
"""

import copy

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from learner import head_kernels
from learner.fused_head import PROFILE_LABEL, fused_logprobs_and_entropy
from learner.logprobs import install_token_forward, logprobs_and_entropy, resolve_head
from tests.helpers.heads import _close, _leaves, _loss

V, N, H = 151_936, 48, 16  # Qwen2.5's vocabulary; few tokens and a narrow hidden so the file stays fast
T = 0.7
CHUNK = 20  # 48 tokens: chunks of 20, 20 and 8


def _inputs(bias: bool = True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5  # logits ~ N(0, 4) / T: a spread-out, realistic softmax
    b = torch.randn(V, generator=g) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, targets


def _reference(hidden, weight, bias, targets):
    """All logits at once in float64: log_softmax, gather, -(p log p).sum."""
    z = hidden @ weight.T
    z = (z if bias is None else z + bias) / T
    logp_all = torch.log_softmax(z, dim=-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("terms", ["logp+entropy", "logp", "entropy"])
def test_values_and_gradients_equal_float64_reference(terms, monkeypatch):
    hidden, weight, bias, targets = _inputs()
    entropy_chunks = []
    real = head_kernels._entropy_grad_
    monkeypatch.setattr(head_kernels, "_entropy_grad_", lambda *a: entropy_chunks.append(1) or real(*a))

    h, w, b = _leaves(hidden, weight, bias)
    lp, ent = fused_logprobs_and_entropy(h, w, b, targets, temperature=T, chunk=CHUNK)
    _loss(lp, ent, terms).backward()
    h64, w64, b64 = _leaves(hidden, weight, bias, dtype=torch.float64)
    lp64, ent64 = _reference(h64, w64, b64, targets)
    _loss(lp64, ent64, terms).backward()

    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    _close(lp, lp64)
    _close(ent, ent64)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert got.dtype == torch.float32
        _close(got, want)
    # The entropy's gradient term runs once per chunk when the loss uses it, never when it does not.
    assert len(entropy_chunks) == (0 if terms == "logp" else 3)


def test_equals_chunked_head_in_fp32():
    hidden, weight, _, targets = _inputs(bias=False)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    h1, h2, w = _leaves(hidden, hidden, weight)
    lp, ent = fused_logprobs_and_entropy(h1, w, None, targets, temperature=T, chunk=CHUNK)
    lp_c, ent_c = logprobs_and_entropy(head, h2, targets, temperature=T, chunk=CHUNK)
    _loss(lp, ent, "logp+entropy").backward()
    _loss(lp_c, ent_c, "logp+entropy").backward()
    # Both fp32 on the same fp32 logits. The chunked head is the less exact of the two: against the float64
    # reference it is off by up to 1.3e-5 of a tensor's scale (its entropy sums p log p over 152k terms), the
    # fused head by 1e-6 at most; so the difference is the chunked head's rounding, allowed 5e-5 of the scale.
    for got, want in ((lp, lp_c), (ent, ent_c), (h1.grad, h2.grad), (w.grad, head.weight.grad)):
        assert_close(got, want, rtol=1e-5, atol=5e-5 * want.abs().max().item())


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_frozen_weight_gets_no_gradient_and_no_weight_gemm():
    hidden, weight, _, targets = _inputs(bias=False)
    h, h64 = hidden.clone().requires_grad_(), hidden.double().requires_grad_()
    lp, ent = fused_logprobs_and_entropy(h, weight, None, targets, temperature=T, chunk=CHUNK)  # weight frozen
    with _OpNames() as ops:
        _loss(lp, ent, "logp+entropy").backward()
    lp64, ent64 = _reference(h64, weight.double(), None, targets)
    _loss(lp64, ent64, "logp+entropy").backward()
    assert weight.grad is None
    assert not any(name.startswith("addmm") for name in ops.names), "dW += dz^T h ran for a frozen weight"
    _close(h.grad, h64.grad)

    # The other way round: a hidden state that needs no gradient (the weight's is still right).
    w = weight.clone().requires_grad_()
    lp, ent = fused_logprobs_and_entropy(hidden, w, None, targets, temperature=T, chunk=CHUNK)
    _loss(lp, ent, "logp").backward()
    w64 = weight.double().requires_grad_()
    _loss(*_reference(hidden.double(), w64, None, targets), "logp").backward()
    _close(w.grad, w64.grad)


def test_empty_input_and_no_grad():
    w = torch.randn(300, 8, requires_grad=True)
    h = torch.zeros(0, 8, requires_grad=True)
    lp, ent = fused_logprobs_and_entropy(h, w, None, torch.zeros(0, dtype=torch.long), temperature=T)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))
    with torch.no_grad():
        lp, ent = fused_logprobs_and_entropy(torch.randn(5, 8), w, None, torch.zeros(5, dtype=torch.long), chunk=2)
    assert lp.grad_fn is None and (lp <= 0).all() and (ent >= 0).all()
    with pytest.raises(ValueError, match="chunk"):
        fused_logprobs_and_entropy(torch.randn(5, 8), w, None, torch.zeros(5, dtype=torch.long), chunk=0)


def test_profiler_attributes_forward_and_backward_to_the_head():
    w = torch.randn(300, 8, requires_grad=True)
    h = torch.randn(10, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lp, ent = fused_logprobs_and_entropy(h, w, None, torch.zeros(10, dtype=torch.long), chunk=4)
        (lp.sum() + ent.sum()).backward()
    assert sum(e.name == PROFILE_LABEL for e in prof.events()) == 2  # one forward, one backward
    # The chunked head's forward runs under the same range (its backward is attributed through autograd's sequence
    # numbers by the learner stage's time split), so the baseline's head time is not counted as the body's.
    head = torch.nn.Linear(8, 300, bias=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logprobs_and_entropy(head, h, torch.zeros(10, dtype=torch.long), chunk=4)
    ranges = [e for e in prof.events() if e.name == PROFILE_LABEL]
    assert len(ranges) == 1 and any(e.name == "aten::linear" and e.cpu_parent is not None for e in prof.events())


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)  # tied like Qwen2.5-0.5B: the head's grad joins the embedding's
    return Qwen2ForCausalLM(cfg).train()


def test_install_fused_matches_chunked_on_tiny_qwen2():
    chunked = install_token_forward(_tiny_qwen2(), head="chunked")
    fused = install_token_forward(copy.deepcopy(chunked), head="fused")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (1, 41), generator=g)
    row = {"input_ids": ids, "position_ids": torch.cat([torch.arange(25), torch.arange(16)])[None],  # two samples
           "targets": ids[:, 1:], "temperature": T, "chunk": 16}
    seen = []
    fused.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    adv = torch.linspace(-1.0, 1.0, 40)
    out = {}
    for name, model in (("chunked", chunked), ("fused", fused)):
        lp, ent = model(**row, output_attentions=False)  # an extra kwarg: it must reach the body
        (-(lp[0] * adv).sum() - 0.01 * ent.sum()).backward()
        out[name] = (lp, ent, {k: p.grad for k, p in model.named_parameters()})
    assert seen and seen[0]["output_attentions"] is False
    (lp_c, ent_c, grads_c), (lp_f, ent_f, grads_f) = out["chunked"], out["fused"]
    assert lp_f.shape == ent_f.shape == (1, 40)
    # Same fp32 model, same hidden states; the heads differ only in the order of fp32 reductions.
    assert_close(lp_f, lp_c, rtol=1e-6, atol=1e-5)
    assert_close(ent_f, ent_c, rtol=1e-6, atol=1e-5)
    assert grads_f.keys() == grads_c.keys()
    for k, gc in grads_c.items():
        assert_close(grads_f[k], gc, rtol=1e-5, atol=1e-6 * gc.abs().max().item(), msg=lambda m, k=k: f"{k}: {m}")


def test_resolve_head_and_reinstall():
    assert resolve_head("auto", cuda=True) == "fused" and resolve_head("auto", cuda=False) == "chunked"
    assert resolve_head("chunked", cuda=True) == "chunked" and resolve_head("fused", cuda=False) == "fused"
    with pytest.raises(ValueError, match="logprob_head"):
        resolve_head("flash", cuda=True)
    model = _tiny_qwen2()
    with pytest.raises(ValueError, match="resolve_head"):
        install_token_forward(model, head="auto")
    install_token_forward(model, head="fused")
    assert "forward" in model.lm_head.__dict__
    install_token_forward(model, head="chunked")  # back to the plain Linear head
    assert "forward" not in model.lm_head.__dict__
    assert model.lm_head(torch.zeros(2, 32)).shape == (2, 4096)
