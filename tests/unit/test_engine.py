import json
import threading

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from actors.engine import Engine, TorchEngine, gumbel_noise, row_seeds, sampling_logprobs
from common import messages
from common import vllm_weights
from common import weights
from common.messages import SamplingParams
from common.transport import free_port
from common.weights import flatten
from learner.nccl import wait_until


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return TorchEngine(tiny_model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


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


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_each_completion_reports_the_summed_entropy_of_its_sampling_distribution(engine, top_p):
    """On-policy entropy for held-out evaluations: the sum over the response's own tokens (none past its end) of the
    entropy of the distribution each token was drawn from (temperature and top-p applied)."""
    # Forced lengths: rows end at different steps, so tokens past a row's end would show up in its sum.
    sp = SamplingParams(temperature=0.7, top_p=top_p, max_new_tokens=10, forced_length_median=5, forced_length_sigma=1.0)
    prompt = [5, 6, 7, 8]
    completions = engine.generate([prompt], 6, sp, [3])[0]
    for c in completions:
        ids = torch.tensor([prompt + c.token_ids.tolist()])
        with torch.no_grad():
            logp = sampling_logprobs(engine.model(ids).logits[0, len(prompt) - 1 : -1], 0.7, top_p)
        want = float(-(logp.exp() * logp.clamp(min=-1e30)).sum())
        assert c.entropy == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert c.entropy > 0
    assert len({len(c.token_ids) for c in completions}) > 1


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

    from actors.engine import stop_token_ids
    from actors.factory import load_engine
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
    from actors.engine import _StaticKV

    assert _StaticKV.supports(engine.model), "the tiny model should take the fast path"
    prompts = [[5, 6, 7], [8], list(range(3, 30))]
    sp = SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0, max_new_tokens=12)
    fast = engine.generate(prompts, 3, sp, [11, 12, 13])
    monkeypatch.setattr(_StaticKV, "supports", classmethod(lambda cls, model: False))
    slow = engine.generate(prompts, 3, sp, [11, 12, 13])
    for gf, gs in zip(fast, slow):
        for a, b in zip(gf, gs):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=5e-5)
            assert a.finish_reason == b.finish_reason


# Recorded with the torch engine on the CPU (tests/conftest.py tiny model; prompts [5, 6, 7]
# and [8, 9, 10, 11, 12], seeds 3 and 4, n = 2, 10 tokens): the token ids and each completion's logprob sum.
# Re-record only if the tiny model itself changes (a transformers upgrade that initialises Qwen2 differently).
RECORDED = {
    0.0: ([[[7] * 10, [7] * 10], [[12] * 10, [12] * 10]], [[-52.84216, -52.84216], [-51.53921, -51.53921]]),
    1.0: ([[[259, 228, 82, 313, 254, 101, 6, 279, 208, 19], [179, 6, 147, 8, 237, 180, 98, 91, 76, 270]],
           [[120, 107, 97, 310, 73, 313, 43, 217, 231, 65], [149, 57, 166, 67, 234, 212, 235, 64, 34, 176]]],
          [[-57.63232, -57.15683], [-57.49318, -57.87101]]),
}


def _tiny_engine(tiny_model_dir, **kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return TorchEngine(tiny_model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_torch_engine_on_cpu_reproduces_the_recorded_cpu_engine_samples(tiny_model_dir, temperature):
    engine = _tiny_engine(tiny_model_dir, device="cpu")
    assert engine.device == torch.device("cpu") and engine.stop_ids.device == engine.device
    sp = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=10)
    out = engine.generate([[5, 6, 7], [8, 9, 10, 11, 12]], 2, sp, [3, 4])
    tokens, sums = RECORDED[temperature]
    assert [[c.token_ids.tolist() for c in g] for g in out] == tokens
    np.testing.assert_allclose([[float(c.logprobs.sum()) for c in g] for g in out], sums, atol=1e-4)
    for c in (c for g in out for c in g):
        assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32 and c.versions.dtype == np.int32
        assert c.finish_reason == "length"


def test_noise_is_the_recorded_pure_function():
    """Row seeds and Gumbel noise as recorded before the device argument (int64 hashing, float64 logs)."""
    seeds = row_seeds([3, 2**40 + 5], 2)
    assert seeds.tolist() == [4084703050, 1209985876, 1660730884, 3445672355]
    assert torch.equal(row_seeds([3, 2**40 + 5], 2, "cpu"), seeds)
    g = gumbel_noise(seeds, 7, 1000)
    assert g.dtype == torch.float64 and g.shape == (4, 1000)
    expected = torch.tensor([[0.86015255937096546, 0.44710425634866818, 0.07233498013191464],
                             [1.12666880890915455, 0.68935683191267050, 0.81893964000118880],
                             [0.44508673348927258, 2.23356791113573649, -0.74405453472366490],
                             [0.77542826730940473, -0.47408278285366523, 0.43934519076121609]], dtype=torch.float64)
    assert_close(g[:, :3], expected, rtol=1e-14, atol=0)
    assert g.argmax(-1).tolist() == [458, 91, 69, 243]


@pytest.mark.parametrize("fast", [True, False])
def test_generation_makes_every_tensor_on_the_engine_device(engine, monkeypatch, fast):
    """With torch's default device set to "meta", a tensor made without naming its device would be a meta tensor
    and fail to mix with the CPU model's: this is how a CPU run catches what would put a tensor on the host
    while the model is on a GPU (both decode paths; greedy, and tempered with top-p)."""
    from actors.engine import _StaticKV

    if not fast:
        monkeypatch.setattr(_StaticKV, "supports", classmethod(lambda cls, model: False))
    for sp in (SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=5),
               SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5)):
        expected = engine.generate([[5, 6, 7], [8]], 2, sp, [3, 4])
        torch.set_default_device("meta")
        try:
            out = engine.generate([[5, 6, 7], [8]], 2, sp, [3, 4])
        finally:
            torch.set_default_device(None)
        for ge, go in zip(expected, out):
            for a, b in zip(ge, go):
                np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_load_engine_picks_cuda_when_visible_and_caps_memory_before_loading(tiny_model_dir, monkeypatch, caplog):
    import logging

    import msgspec

    from actors import factory
    from common.config import Config

    cfg = Config()
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, dtype="bfloat16"),
                                  generator=msgspec.structs.replace(cfg.generator, engine="torch"))
    with caplog.at_level(logging.INFO, logger="covrl.engine"):  # this machine: no CUDA -> today's CPU engine, bf16
        engine, _ = factory.load_engine(cfg, tiny_model_dir)
    assert engine.device == torch.device("cpu") and engine.model.dtype == torch.bfloat16
    assert "generator engine: torch on cpu, bfloat16" in caplog.text
    assert len(engine.generate([[5, 6]], 1, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3), [1])[0]) == 1

    events = []  # a GPU process (faked): device "cuda", the allocator capped before the model is built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(factory, "apply_memory_fraction", lambda device: events.append(("cap", device)) or 0.35)
    monkeypatch.setattr(factory, "StreamingTorchEngine", lambda path, **kw: events.append(("engine", kw["device"], kw["dtype"])))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="covrl.engine"):
        factory.load_engine(cfg, tiny_model_dir)
    assert events == [("cap", "cuda"), ("engine", "cuda", torch.bfloat16)]
    assert "generator engine: torch on cuda, bfloat16, allocator capped at 0.35 of the GPU" in caplog.text


def test_the_torch_engine_runs_model_dtype_auto_as_its_device_resolves_it(tiny_model_dir, monkeypatch):
    """In a run config.toml names the dtype the launcher resolved; "auto" reaches the engine only outside one (covrl
    evaluate): fp32 on the CPU, as every recorded CPU run, bf16 on a GPU of compute capability 8.0 or more."""
    import msgspec

    from actors import factory
    from common.config import Config

    cfg = Config()
    cfg = msgspec.structs.replace(cfg, generator=msgspec.structs.replace(cfg.generator, engine="torch"))
    assert cfg.model.dtype == "auto"
    engine, _ = factory.load_engine(cfg, tiny_model_dir)
    assert engine.device == torch.device("cpu") and engine.model.dtype == torch.float32
    built = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(factory, "apply_memory_fraction", lambda device: None)
    monkeypatch.setattr(factory, "StreamingTorchEngine", lambda path, **kw: built.append((kw["device"], kw["dtype"])))
    factory.load_engine(cfg, tiny_model_dir)
    assert built == [("cuda", torch.bfloat16)]


# ---- the weight interface: the actor's receiver drives every engine through `Engine` ------------------------


class _Recorder(Engine):
    """A minimal engine: a tiny model whose loads are recorded (what the torch engine's load_flat does, minus the
    sampler)."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
        self.version = 0
        self.loads: list[tuple[int, torch.Tensor]] = []

    def generate(self, prompts, n, sampling, seeds, before_forward=None):
        raise NotImplementedError("not generated with here")

    def load_flat(self, flat, version):
        self.loads.append((version, flat.clone()))
        weights.load_flat(self.model, flat)
        self.version = version


class _Direct(_Recorder):
    """An engine whose weights bypass this process (as vLLM's nccl transport): it announces a receiver before the
    rendezvous, reads the learner's NCCL address after it, and loads each FLAG_DIRECT version itself."""

    def __init__(self):
        super().__init__()
        self.address = None

    def _before_weight_rendezvous(self, store):
        vllm_weights.announce(store, tp=1, dtype=torch.bfloat16)

    def _after_weight_rendezvous(self, store, timeout_s):
        self.address = vllm_weights.read_address(store, timeout_s)

    def receive_weights(self, ch, lay, version, flags, out=None):
        if not flags & weights.FLAG_DIRECT:
            return super().receive_weights(ch, lay, version, flags, out)
        self.version = version  # a real engine receives over its NCCL group here
        return None


def _welcome(port):
    return messages.Welcome(protocol_version=messages.PROTOCOL_VERSION, run_id="r", weight_addr=f"127.0.0.1:{port}")


def _publish(pub, engine, version):
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(float(version))  # distinct weights per version, from the receiver's own model
    lay = weights.layout(engine.model)
    flat = weights.flatten(engine.model)
    pub.publish(version, lay, (flat[s:e].clone() for _, _, s, e in weights.bucket_plan(lay)))
    return flat


def test_the_receiver_stages_host_vectors_that_the_main_thread_loads(tmp_path):
    """The default path (torch engine, vLLM over rpc): each version arrives in a host vector; `wait_for` applies
    the newest; a version staged and never applied is skipped, its vector reused; the log has the checksum."""
    from actors.weight_receiver import WeightReceiver
    from learner.publisher import WeightPublisher

    engine, sender = _Recorder(), _Recorder()
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 30)
    receiver = WeightReceiver(_welcome(port), engine, 30, str(tmp_path / "gen0.jsonl"), weights.pair_prefix(0, "a"))
    receiver.start()
    pub.join(0, "a")
    assert wait_until(lambda: pub.channels, 30, 0.01)
    flats = {v: _publish(pub, sender, v) for v in (1, 2)}
    receiver.wait_for(2, 30)
    assert [v for v, _ in engine.loads] == [2] and torch.equal(engine.loads[0][1], flats[2])
    assert engine.version == 2 and torch.equal(weights.flatten(engine.model), flats[2])
    pub.stop()
    receiver.join(30)
    logged = [json.loads(line) for line in open(tmp_path / "gen0.jsonl")]
    lay = weights.layout(engine.model)
    assert [(r["version"], r["checksum"], r["direct"]) for r in logged] == [
        (v, weights.checksum(flats[v], lay), False) for v in (1, 2)]
    assert receiver.error is None and receiver.finished


def test_an_engine_that_receives_directly_joins_and_loads_through_the_same_interface(monkeypatch):
    """A direct engine's announcement makes the learner flag its versions FLAG_DIRECT; the receiver hands each
    to the engine (no host vector, nothing staged) and the version is the engine's at once."""
    from actors.weight_receiver import WeightReceiver
    from learner import nccl
    from learner.publisher import WeightPublisher

    class Sender:  # learner/nccl.NcclSender needs GPUs: this one sends nothing
        def __init__(self, host, port, world_size, device, timeout_s):
            pass

        def send_bucket(self, lay, first, end, bucket, dtype, cancelled=None):
            return 0

        def close(self):
            pass

    monkeypatch.setattr(nccl, "NcclSender", Sender)
    engine = _Direct()
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 30)
    receiver = WeightReceiver(_welcome(port), engine, 30, None, weights.pair_prefix(0, "d"))
    receiver.start()
    pub.join(0, "d")
    assert wait_until(lambda: pub.pending_direct, 30, 0.01)
    _publish(pub, _Recorder(), 1)  # builds the (stand-in) NCCL group, then flags version 1 direct
    receiver.wait_for(1, 30)
    assert engine.version == 1 and engine.loads == [] and receiver.staged is None
    assert engine.address["world_size"] == 2  # joined the learner's group after the rendezvous
    pub.stop()
    receiver.join(30)
    assert receiver.error is None


def test_a_direct_version_for_an_engine_without_a_direct_receiver_is_a_clear_error():
    port = free_port()
    engine = _Recorder()
    lay = weights.layout(engine.model)

    def learner():
        ch = weights.WeightChannel("127.0.0.1", port, 0, 2, 30)
        ch.start_header(1, lay, weights.FLAG_DIRECT).wait()

    t = threading.Thread(target=learner)
    t.start()
    ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30)
    version, flags = ch.receive_header(lay)
    with pytest.raises(RuntimeError, match="_Recorder announced no NCCL receiver"):
        engine.receive_weights(ch, lay, version, flags)
    t.join(10)


def test_the_engine_owns_the_version_and_the_receiver_reports_what_has_arrived():
    """One owner: `engine.version` is the version of the weights held (tokens, eval). What has arrived (the
    heartbeat's policy_version, what wait_for waits for) is a staged vector's version, or the one being swapped
    in, else the engine's: never behind the engine, never ahead of what was received."""
    from actors.actor import Heartbeat
    from actors.weight_receiver import WeightReceiver
    from common.transport import HubSocket
    from learner.publisher import WeightPublisher

    class Gated(_Recorder):  # a load the test holds open, to look at the versions while it runs
        def __init__(self):
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def load_flat(self, flat, version):
            self.entered.set()
            assert self.release.wait(30)
            super().load_flat(flat, version)

    engine, port, key = Gated(), free_port(), b"k" * 32
    pub = WeightPublisher("127.0.0.1", port, 30)
    receiver = WeightReceiver(_welcome(port), engine, 30, None, weights.pair_prefix(0, "v"))
    hub = HubSocket("127.0.0.1", 0, key)
    beat = Heartbeat(hub.address, key, 0, "v", 0.02, receiver)
    try:
        receiver.start()
        beat.start()
        assert receiver.received == 0 == engine.version  # the base model, before anything arrives
        pub.join(0, "v")
        assert wait_until(lambda: pub.channels, 30, 0.01)
        _publish(pub, _Recorder(), 1)
        assert wait_until(lambda: receiver.staged is not None, 30, 0.01)
        assert receiver.received == 1 and engine.version == 0  # arrived, not yet the engine's
        applying = threading.Thread(target=receiver.apply)
        applying.start()
        assert engine.entered.wait(30)
        assert receiver.received == 1 and receiver.staged is None and engine.version == 0  # being swapped in

        def beats():
            while True:
                got = hub.recv(5)
                assert got is not None, "no heartbeat within 5 s"
                yield got[1].policy_version

        stream = beats()
        assert 1 in stream  # beats sent before version 1 arrived report 0; then 1, and never back while it loads
        assert [next(stream) for _ in range(3)] == [1, 1, 1]
        engine.release.set()
        applying.join(30)
        assert engine.version == 1 == receiver.received and receiver.applying is None
        receiver.wait_for(1, 1)  # already there: returns at once, nothing more to load
        assert [v for v, _ in engine.loads] == [1]
    finally:
        engine.release.set()
        beat.stop.set()
        pub.stop()
        receiver.join(30)
        beat.join(5)
        hub.close()


def test_forced_lengths_are_heavy_tailed_and_a_pure_function_of_the_row_seed():
    from actors.engine import forced_lengths

    rs = row_seeds(list(range(2000)), 8)
    L = forced_lengths(rs, 128, 1.0, 4096).double()
    assert torch.equal(forced_lengths(rs[:16], 128, 1.0, 4096), L[:16].long())  # per row, whatever the batch
    assert L.median().item() == pytest.approx(128, rel=0.05)
    assert L.mean().item() == pytest.approx(128 * np.exp(0.5), rel=0.05)  # lognormal mean: median x exp(sigma^2/2)
    assert forced_lengths(rs, 128, 1.0, 300).max().item() == 300 and forced_lengths(rs, 1, 5.0, 300).min().item() == 1


def test_forced_lengths_impose_each_length_and_keep_the_policys_logprobs(engine):
    from actors.engine import forced_lengths

    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=40, forced_length_median=12, forced_length_sigma=0.8)
    prompt, seeds = [5, 6, 7, 8], [3, 4]
    groups = engine.generate([prompt, prompt], 4, sp, seeds)
    want = forced_lengths(row_seeds(seeds, 4), 12, 0.8, 40).tolist()
    got = [len(c.token_ids) for g in groups for c in g]
    assert got == want and len(set(got)) > 2  # each row its own length
    stops = set(engine.stop_ids.tolist())
    for c in (c for g in groups for c in g):
        ids = c.token_ids.tolist()
        assert not stops & set(ids[:-1])  # no stop token before the imposed length
        if len(ids) < 40:
            assert ids[-1] in stops and c.finish_reason == "stop"
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = engine.model(full).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert_close(torch.from_numpy(c.logprobs), ref, rtol=1e-4, atol=1e-4)  # the policy's own logprobs
    plain = engine.generate([prompt], 4, SP, [3])[0]  # off (median 0): the model decides when to stop
    again = engine.generate([prompt], 4, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12,
                                                       forced_length_median=0, forced_length_sigma=3.0), [3])[0]
    assert [c.token_ids.tolist() for c in plain] == [c.token_ids.tolist() for c in again]
