"""The torch engine (actors/engine.py `TorchEngine`) on a CUDA device, against the same engine on the CPU.

Models: the built-in arith-base (a trained 4-layer Qwen2 whose answers end at EOS, so the stop path runs) and the
tiny random model of tests/conftest.py; nothing is downloaded. Skipped without CUDA (here and in
tests/conftest.py). The counter-based Gumbel noise is a function of (seed, step, token) on any device, so CPU
fp32 and CUDA fp32 must draw the same tokens; their logprobs differ only by float32 kernel rounding."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from actors.engine import TorchEngine, gumbel_noise, row_seeds, stop_token_ids
from common.runfiles import apply_memory_fraction
from common import weights
from common.messages import SamplingParams
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = os.path.join(REPO, "assets", "arith-base")
MAX_DLOGP = 1e-4  # |logprob difference| allowed between CPU fp32 and CUDA fp32, per token
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=48)
T1 = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=48)
SEEDS = list(range(100, 108))


@pytest.fixture(scope="module", autouse=True)
def full_fp32_matmuls():
    """CPU-vs-CUDA equality needs real fp32 GEMMs on the GPU: TF32 (10-bit mantissa) would move logits by ~1e-3."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tokenizer(path=MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _make(device, dtype=torch.float32, path=MODEL):
    tok = _tokenizer(path)
    stops = stop_token_ids(tok, path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    return TorchEngine(path, eos_token_id=stops, pad_token_id=pad, dtype=dtype, device=device)


@pytest.fixture(scope="module")
def prompts():
    from hardware.check import arith_prompts

    return arith_prompts(_tokenizer(), len(SEEDS))  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def cpu():
    return _make("cpu")


@pytest.fixture(scope="module")
def gpu():
    return _make("cuda")


def _assert_same_samples(a, b, max_dlogp=MAX_DLOGP):
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            np.testing.assert_array_equal(ca.token_ids, cb.token_ids)
            np.testing.assert_array_equal(ca.versions, cb.versions)
            assert ca.finish_reason == cb.finish_reason
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, rtol=0, atol=max_dlogp)


def test_engine_lives_on_the_gpu(gpu):
    assert gpu.device.type == "cuda" and gpu.device.index is not None
    assert all(p.device == gpu.device for p in gpu.model.parameters())
    assert gpu.stop_ids.device == gpu.device


def test_noise_is_the_same_on_cpu_and_cuda():
    seeds = row_seeds([3, 2**40 + 5, 7, 123456789], 4)
    on_gpu = row_seeds([3, 2**40 + 5, 7, 123456789], 4, "cuda")
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), seeds)  # integer hashing: bit-identical
    for step in (0, 1, 57):
        a, b = gumbel_noise(seeds, step, 151_936), gumbel_noise(on_gpu, step, 151_936)
        assert b.device.type == "cuda" and b.dtype == torch.float64
        assert_close(b.cpu(), a, rtol=1e-14, atol=1e-14)  # float64 logs: equal to an ulp or two
        assert torch.equal(b.argmax(-1).cpu(), a.argmax(-1))


@pytest.mark.parametrize("sp", [GREEDY, T1], ids=["greedy", "t1"])
def test_cpu_and_cuda_fp32_draw_the_same_tokens(cpu, gpu, prompts, sp):
    a = cpu.generate(prompts, 2, sp, SEEDS)
    b = gpu.generate(prompts, 2, sp, SEEDS)
    _assert_same_samples(a, b)
    assert any(c.finish_reason == "stop" for g in b for c in g)  # the trained model ends its answers at EOS


def test_both_decode_paths_agree_on_cuda(gpu, prompts, monkeypatch):
    from actors.engine import _StaticKV

    fast = gpu.generate(prompts, 2, T1, SEEDS)
    monkeypatch.setattr(_StaticKV, "supports", classmethod(lambda cls, model: False))
    slow = gpu.generate(prompts, 2, T1, SEEDS)
    _assert_same_samples(fast, slow, max_dlogp=5e-5)


def test_tiny_model_cpu_and_cuda_agree(tiny_model_dir):
    """A random model: flat distributions, every token sampled, max_new_tokens reached."""
    a, b = _make("cpu", path=tiny_model_dir), _make("cuda", path=tiny_model_dir)
    prompts = [[5, 6, 7], [8], list(range(3, 30))]
    for sp in (SamplingParams(temperature=t, top_p=1.0, max_new_tokens=16) for t in (0.0, 0.7, 1.0)):
        _assert_same_samples(a.generate(prompts, 3, sp, [11, 12, 13]), b.generate(prompts, 3, sp, [11, 12, 13]))


def test_bf16_on_cuda_runs_with_finite_logprobs(prompts):
    engine = _make("cuda", torch.bfloat16)
    assert engine.model.dtype == torch.bfloat16
    for sp in (GREEDY, T1):
        out = engine.generate(prompts, 2, sp, SEEDS)
        for c in (c for g in out for c in g):
            assert len(c.token_ids) > 0 and c.logprobs.dtype == np.float32
            assert np.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()


def _perturbed(flat: torch.Tensor, scale: float = 0.3) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1)
    return flat + scale * flat.std() * torch.randn(flat.shape, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_load_flat_from_a_host_fp32_vector_into_cuda_params(prompts, dtype):
    engine, cpu = _make("cuda", dtype), _make("cpu")
    before = engine.generate(prompts, 2, T1, SEEDS)
    flat = _perturbed(weights.flatten(cpu.model))  # host fp32, as the weight receiver hands it over
    assert flat.device.type == "cpu" and flat.dtype == torch.float32
    engine.load_flat(flat, 3)
    # Fingerprint: every parameter holds the new vector, moved to the GPU and rounded to the engine's dtype.
    assert torch.equal(weights.flatten(engine.model).cpu(), flat.to(dtype).float())
    after = engine.generate(prompts, 2, T1, SEEDS)
    assert all((c.versions == 3).all() for g in after for c in g)
    changed = [not (len(x.token_ids) == len(y.token_ids) and np.allclose(x.logprobs, y.logprobs, atol=1e-3))
               for gx, gy in zip(before, after) for x, y in zip(gx, gy)]
    assert any(changed)
    if dtype == torch.float32:  # the same new weights on the CPU: the same samples
        cpu.load_flat(flat, 3)
        _assert_same_samples(cpu.generate(prompts, 2, T1, SEEDS), after)


def test_weights_swapped_mid_generation_on_cuda(gpu, cpu, prompts):
    original = weights.flatten(gpu.model).cpu()
    calls = {"n": 0}

    def hook():
        calls["n"] += 1
        if calls["n"] == 4:  # before the 4th forward: tokens 0..2 from v0, the rest from v7
            gpu.load_flat(_perturbed(original), 7)

    try:
        out = gpu.generate(prompts[:2], 1, T1, SEEDS[:2], hook)
    finally:
        gpu.load_flat(original, 0)
    for c in (g[0] for g in out):
        assert c.versions.tolist() == ([0, 0, 0] + [7] * len(c.versions))[: len(c.versions)]


def test_memory_fraction_caps_the_allocator():
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        assert apply_memory_fraction("cuda", {"COVRL_GPU_MEMORY_FRACTION": "0.5"}) == 0.5
        total = torch.cuda.get_device_properties(device).total_memory
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.6), dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


def test_the_continuous_batch_on_cuda_draws_the_static_batchs_samples():
    """`StreamingTorchEngine` (actors/continuous.py) on the GPU: 8 groups of 4 through 12 rows, so groups join as
    others leave; each equals `generate`'s static batch on the same device (same tokens, logprobs to fp32 rounding)."""
    from transformers import AutoTokenizer

    from actors.continuous import StreamingTorchEngine

    tok = AutoTokenizer.from_pretrained(MODEL)
    eng = StreamingTorchEngine(MODEL, eos_token_id=stop_token_ids(tok, MODEL), pad_token_id=tok.pad_token_id,
                               device="cuda", max_num_seqs=12)
    prompts = [list(tok(f"What is {i} + {2 * i + 3}?")["input_ids"]) for i in range(8)]
    ref = eng.generate(prompts, 4, T1, SEEDS)
    for i, p in enumerate(prompts):
        eng.submit(i, p, 4, T1, SEEDS[i])
    got = {}
    while eng.in_flight:
        got.update(eng.collect(0.05, lambda: None))
    for i in range(8):
        for a, b in zip(ref[i], got[i], strict=True):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            assert_close(torch.from_numpy(b.logprobs), torch.from_numpy(a.logprobs), rtol=0, atol=MAX_DLOGP)
