"""Varlen attention over packed rows (learner/attention.py, learner.batch.Packed) on the CPU: the same numbers as the
dense-mask sdpa path, no sample attending to its neighbour, no mask built at all, and the call fitted to each of
torch's varlen signatures. torch's CUDA kernels themselves are checked in tests/gpu/test_learner_kernels.py."""

import inspect

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from common import messages
from learner import attention
from learner.batch import TrainSample, pack
from tests.helpers.paths import BASE_MODEL


def samples(lengths: list[tuple[int, int]], seed: int = 0) -> list[TrainSample]:
    """(prompt, response) token counts -> samples of random tokens of the built-in model's vocabulary."""
    rng = np.random.default_rng(seed)
    out = []
    for p, r in lengths:
        ids = rng.integers(3, 397, p + r)
        out.append(TrainSample(input_ids=messages.to_bytes(ids, messages.TOKEN_DTYPE), prompt_len=p,
                               behav_logprobs=messages.to_bytes(np.zeros(r), messages.LOGPROB_DTYPE),
                               versions=messages.to_bytes(np.zeros(r), messages.VERSION_DTYPE), advantage=1.0))
    return out


def model(attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(BASE_MODEL, attn_implementation=attention.resolve(attn, cuda=False))


def logp_of(m, mb) -> torch.Tensor:
    logits = m(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **mb.attn_kwargs()).logits
    return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, mb.targets[0, :, None])[:, 0]


ROW = [(5, 9), (3, 20), (7, 4)]  # three samples of unequal length, GQA model (4 query heads, 2 KV heads)


def test_pack_keeps_the_sample_boundaries_on_the_host_and_for_the_device():
    mb = pack(samples(ROW), [0, 1, 2], pad_id=0)
    assert mb.seq_lens == (14, 23, 11) and mb.max_len == 23 and mb.num_seqs == 3 and mb.row_tokens == 48
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == [0, 14, 37, 48]
    assert mb.input_ids.shape == (1, 48) and mb.targets.shape == mb.mask.shape == (1, 47)
    kw = mb.attn_kwargs()
    assert kw["cu_seq_lens_q"] is kw["cu_seq_lens_k"] is mb.cu_seqlens and kw["max_length_q"] == kw["max_length_k"] == 23
    moved = mb.to(torch.device("cpu"))
    assert moved.seq_lens == mb.seq_lens and torch.equal(moved.cu_seqlens, mb.cu_seqlens)
    empty = pack(samples(ROW), [], pad_id=0)
    assert empty.num_seqs == 0 and empty.row_tokens == 0 and empty.cu_seqlens.tolist() == [0, 1]


def test_varlen_equals_the_dense_mask_path_in_values_and_gradients():
    mb = pack(samples(ROW), [0, 1, 2], pad_id=0)
    dense, varlen = model("sdpa"), model("varlen")
    assert varlen.config._attn_implementation == attention.VARLEN
    a, b = logp_of(dense, mb), logp_of(varlen, mb)
    assert_close(b, a, rtol=1e-5, atol=1e-5)
    (a * mb.mask[0]).sum().backward()
    (b * mb.mask[0]).sum().backward()
    for (name, p), q in zip(dense.named_parameters(), varlen.parameters()):  # fp32, other summation orders
        assert_close(q.grad, p.grad, rtol=1e-4, atol=2e-6 * float(p.grad.abs().max()), msg=name)


def test_no_sample_attends_to_its_neighbour():
    """A token planted in the first sample moves nothing of the other two (to the bit), while a token planted in the
    second moves the second's later log-probabilities (the change can show)."""
    m = model("varlen").eval()
    base = samples(ROW)
    rows = [pack(base, [0, 1, 2], pad_id=0)]
    for which, pos in ((0, 2), (1, 4)):
        changed = list(base)
        ids = messages.as_array(base[which].input_ids, messages.TOKEN_DTYPE).copy()
        ids[pos] = (ids[pos] + 7) % 397
        changed[which] = TrainSample(input_ids=messages.to_bytes(ids, messages.TOKEN_DTYPE),
                                     prompt_len=base[which].prompt_len, behav_logprobs=base[which].behav_logprobs,
                                     versions=base[which].versions, advantage=1.0)
        rows.append(pack(changed, [0, 1, 2], pad_id=0))
    with torch.no_grad():
        ref, first, second = (logp_of(m, mb) for mb in rows)
    assert torch.equal(first[14:], ref[14:])  # samples 2 and 3 (row positions 14..) untouched by sample 1's change
    assert not torch.equal(first[:14], ref[:14])
    assert torch.equal(second[:14], ref[:14]) and torch.equal(second[37:], ref[37:])
    assert not torch.equal(second[14 + 4:37], ref[14 + 4:37])


def test_no_mask_is_built_for_varlen(monkeypatch):
    import transformers.masking_utils as mu

    def tripwire(*a, **k):
        raise AssertionError("a mask was built")

    for name in ("find_packed_sequence_indices", "sdpa_mask", "eager_mask"):
        monkeypatch.setattr(mu, name, tripwire, raising=False)
    mb = pack(samples(ROW), [0, 1, 2], pad_id=0)
    with torch.no_grad():
        logp_of(model("varlen"), mb)
        with pytest.raises(AssertionError, match="a mask was built"):  # the tripwire is on the dense path's way
            logp_of(model("sdpa"), mb)


def _recording(signature: str):
    """A stand-in for torch's varlen_attn with `signature` that records its call and returns the query."""
    calls = []
    ns: dict = {}
    exec(f"def fn{signature}:\n    calls.append((query, key, value, locals()))\n    return query", {"calls": calls}, ns)
    return ns["fn"], calls


SIGNATURES = {  # torch's, by version (shared/notes/gpu-speed.md section 3)
    "2.10": "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)",
    "2.11": "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1))",
    "2.12": "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, "
            "window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)",
}


@pytest.mark.parametrize("version", sorted(SIGNATURES))
def test_the_call_fits_each_torch_signature(version):
    fn, calls = _recording(SIGNATURES[version])
    plan = attention.varlen_plan(fn)
    q, kv = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    attention.varlen_call(plan, q, kv, kv, cu, 6, 8 ** -0.5, groups=2)
    _, key, _, args = calls[0]
    causal = {"2.10": ("is_causal", True)}.get(version, ("window_size", (-1, 0)))
    assert args[causal[0]] == causal[1]
    assert args["max_q"] == args["max_k"] == 6 and args["cu_seq_q"] is cu
    if version == "2.12":
        assert args["enable_gqa"] is True and key.shape[1] == 2  # GQA by the kernel
    else:
        assert key.shape[1] == 4 and torch.equal(key[:, 1], kv[:, 0]) and torch.equal(key[:, 2], kv[:, 1])
    if version == "2.10":  # no scale to pass: only the default one is accepted
        with pytest.raises(RuntimeError, match="takes no scale"):
            attention.varlen_call(plan, q, kv, kv, cu, 6, 0.5, groups=2)
    else:
        assert args["scale"] == 8 ** -0.5


def test_an_unknown_signature_is_refused_with_what_to_do():
    fn, _ = _recording("(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)")
    with pytest.raises(RuntimeError, match='attn_implementation = "sdpa"'):
        attention.varlen_plan(fn)
    assert "window_size" in str(inspect.signature(attention.torch_varlen()))  # the CPU torch's own (2.13)


def test_auto_picks_varlen_only_where_flash_kernels_run(monkeypatch):
    bf16, fp32 = torch.bfloat16, torch.float32
    assert attention.resolve("auto", cuda=False) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # a Hopper GPU
    assert attention.resolve("auto", cuda=True, dtype=bf16) == attention.VARLEN  # flash-attn is not installed here
    assert attention.resolve("auto", cuda=True, dtype=fp32) == "sdpa"  # FlashAttention takes bf16 / fp16 only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))  # before sm80: no flash kernels
    assert attention.resolve("auto", cuda=True, dtype=bf16) == "sdpa"
    assert attention.resolve("varlen", cuda=False) == attention.VARLEN  # asked for: one sdpa per sample there
    assert attention.resolve("eager", cuda=True) == "eager"


def test_compiled_layers_equal_the_plain_model_and_reuse_their_graphs():
    """`learner.compile_layers` with torch.compile's eager backend (the tracing; inductor's kernels are measured by
    the GPU learner stage): the same numbers as the plain model, and a row of the same packing with other tokens
    reuses the first graphs. (On the CPU the per-sample attention loop is unrolled, so another packing compiles
    again; on CUDA the boundaries are tensors and the longest sample a dynamic int: tests/gpu/test_learner_kernels.py
    checks that other packings reuse the graphs there.)"""
    import torch._dynamo

    from learner.trainer import compile_layers

    torch._dynamo.reset()
    plain, compiled = model("varlen").eval(), model("varlen").eval()
    compile_layers(compiled, backend="eager")
    rows = [pack(samples(ROW, seed=s), [0, 1, 2], 0) for s in (0, 1)]
    with torch.no_grad():
        assert_close(logp_of(compiled, rows[0]), logp_of(plain, rows[0]), rtol=1e-5, atol=1e-5)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert_close(logp_of(compiled, rows[1]), logp_of(plain, rows[1]), rtol=1e-5, atol=1e-5)
    assert graphs >= 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
