import numpy as np
import pytest
import torch
from torch.testing import assert_close

from actors.engine import CpuEngine, gumbel_noise, sampling_logprobs
from common.messages import SamplingParams
from common.weights import flatten


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return CpuEngine(tiny_model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


SP = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12)


def test_samples_depend_only_on_seed_not_batch(engine):
    alone = engine.generate([[5, 6, 7]], 3, SP, [42])[0]
    batched = engine.generate([[9, 10, 11, 12, 13], [5, 6, 7]], 3, SP, [7, 42])[1]
    for a, b in zip(alone, batched):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    other = engine.generate([[5, 6, 7]], 3, SP, [43])[0]
    assert any(not np.array_equal(a.token_ids, o.token_ids) for a, o in zip(alone, other))


def test_behaviour_logprobs_match_a_fresh_forward(engine):
    sp = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=10)
    prompt = [5, 6, 7, 8]
    for c in engine.generate([prompt], 2, sp, [3])[0]:
        ids = torch.tensor([prompt + c.token_ids.tolist()])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(prompt) - 1 : -1] / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(c.token_ids).long()[:, None])[:, 0]
        assert_close(torch.from_numpy(c.logprobs), ref, rtol=1e-4, atol=1e-4)


def test_top_p_keeps_smallest_prefix_and_renormalises():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = sampling_logprobs(logits, 1.0, 0.75)  # 0.5 + 0.3 >= 0.75 -> keep two
    assert torch.isinf(lp[0, 2:]).all()
    assert_close(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))


def test_gumbel_noise_is_a_function_of_seed_step_and_token():
    a = gumbel_noise(torch.tensor([1, 2]), 5, 100)
    b = gumbel_noise(torch.tensor([2]), 5, 100)
    assert_close(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    # Standard Gumbel: mean = Euler-Mascheroni 0.5772, var = pi^2/6 = 1.645
    big = gumbel_noise(torch.arange(64), 0, 4096)
    assert abs(big.mean().item() - 0.5772) < 0.02 and abs(big.var().item() - 1.645) < 0.05


def test_stops_at_eos_and_reports_length(engine):
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)
    eos = int(engine.stop_ids[0])
    free = engine.generate([[5, 6]], 2, sp, [1])[0]
    for c in free:  # a random model rarely says EOS: it runs to the limit
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
        assert (c.token_ids[:-1] != eos).all() and len(c.token_ids) <= 4
    head = engine.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos] = 100.0  # EOS certain from the first token
    engine.model.lm_head = biased
    try:
        out = engine.generate([[5, 6]], 2, sp, [1])[0]
    finally:
        engine.model.lm_head = head
    for c in out:
        assert c.token_ids.tolist() == [eos] and c.finish_reason == "stop"
        assert c.logprobs[0] > -1e-3


def test_weights_swapped_mid_generation_stamp_new_version(engine):
    original = flatten(engine.model).clone()
    calls = {"n": 0}

    def hook():
        calls["n"] += 1
        if calls["n"] == 4:  # before the 4th forward: tokens 0..2 came from v0, the rest from v7
            engine.load_flat(original * 1.0, 7)

    try:
        out = engine.generate([[5, 6]], 1, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8), [11], hook)[0][0]
    finally:
        engine.load_flat(original, 0)
    n = len(out.token_ids)
    expected = [0, 0, 0] + [7] * (n - 3)
    assert out.versions.tolist() == expected[:n]


def test_temperature_zero_is_greedy_with_untempered_logprobs(engine):
    sp = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=8)
    prompt = [5, 6, 7, 8]
    a, b = engine.generate([prompt], 2, sp, [1])[0]
    c = engine.generate([prompt], 1, sp, [999])[0][0]
    np.testing.assert_array_equal(a.token_ids, b.token_ids)  # seeds do not matter: no noise
    np.testing.assert_array_equal(a.token_ids, c.token_ids)
    ids = torch.tensor([prompt + a.token_ids.tolist()])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1]
    assert torch.equal(logits.argmax(-1), torch.from_numpy(a.token_ids).long())
    ref = torch.log_softmax(logits, -1).max(-1).values
    assert_close(torch.from_numpy(a.logprobs), ref, rtol=1e-4, atol=1e-4)


def test_any_stop_token_ends_a_response(tiny_model_dir, tmp_path):
    """Chat models end a turn with e.g. <|im_end|> and also stop at <|endoftext|>: generation_config lists both."""
    import json
    import shutil

    from actors.engine import load_engine, stop_token_ids
    from common.config import Config

    model = tmp_path / "chat"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    engine, tok = load_engine(Config(), str(model))
    assert stop_token_ids(tok, str(model)) == sorted({tok.eos_token_id, 7, 9})
    head = engine.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[9] = 100.0  # the second stop id, not the tokenizer's EOS
    engine.model.lm_head = biased
    out = engine.generate([[5, 6]], 1, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), [1])[0][0]
    assert out.token_ids.tolist() == [9] and out.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_fast_decode_path_equals_the_transformers_cache_path(engine, monkeypatch, temperature):
    """The preallocated-KV decode path (_StaticKV) and the generic transformers-cache path (_HfCache) give the
    same tokens and logprobs, prompts of different lengths left-padded together, n samples per prompt."""
    import actors.engine as E

    assert E._StaticKV.supports(engine.model), "the tiny model should take the fast path"
    prompts = [[5, 6, 7], [8], list(range(3, 30))]
    sp = SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0, max_new_tokens=12)
    fast = engine.generate(prompts, 3, sp, [11, 12, 13])
    monkeypatch.setattr(E._StaticKV, "supports", classmethod(lambda cls, model: False))
    slow = engine.generate(prompts, 3, sp, [11, 12, 13])
    for gf, gs in zip(fast, slow):
        for a, b in zip(gf, gs):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=5e-5)
            assert a.finish_reason == b.finish_reason
