"""The vLLM engine's pure logic on CPU: the learner -> vLLM name map, bucket metadata, fingerprints, seeds,
version stamps, and VllmEngine driven by a fake AsyncLLM shaped like either supported API: 0.33 (a paused
"wait" rejects new requests; every token labelled with the engine's weight version) or 0.26 (no labels, no
version methods, a paused engine queues new requests, requests beyond max_running wait and are held across a
pause). The fake records which weights really produced each token, so the tests check labels against truth.
The real API is checked by test_vllm_contract.py (marker `vllm`) and tests/gpu (marker `gpu`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from actors import factory
from actors import vllm_engine
from common import vllm_weights
from common import weights
from common.messages import SamplingParams
from tests.helpers.paths import REPO



# ---- the name map ------------------------------------------------------------------------------


def test_vllm_name_strips_wrapper_prefixes_only():
    assert vllm_weights.vllm_name("module.model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert vllm_weights.vllm_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert vllm_weights.vllm_name("module._orig_mod.lm_head.weight") == "lm_head.weight"
    assert vllm_weights.vllm_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_names_of_a_qwen2_are_identity_and_land_where_vllm_fuses_them(tiny_model_dir):
    lay = weights.layout(vllm_engine.meta_model(tiny_model_dir))
    assert [vllm_weights.vllm_name(n) for n in lay.names] == list(lay.names)  # HF checkpoint names, as vLLM loads them
    targets = {n: vllm_weights.vllm_target(n) for n in lay.names if n.startswith("model.layers.0.")}
    p = "model.layers.0."
    # Worked out from vLLM's Qwen2 mapper: q/k/v -> qkv_proj shards q/k/v; gate/up -> gate_up_proj shards 0/1.
    assert targets == {
        p + "self_attn.q_proj.weight": (p + "self_attn.qkv_proj.weight", "q"),
        p + "self_attn.q_proj.bias": (p + "self_attn.qkv_proj.bias", "q"),
        p + "self_attn.k_proj.weight": (p + "self_attn.qkv_proj.weight", "k"),
        p + "self_attn.k_proj.bias": (p + "self_attn.qkv_proj.bias", "k"),
        p + "self_attn.v_proj.weight": (p + "self_attn.qkv_proj.weight", "v"),
        p + "self_attn.v_proj.bias": (p + "self_attn.qkv_proj.bias", "v"),
        p + "self_attn.o_proj.weight": (p + "self_attn.o_proj.weight", None),
        p + "mlp.gate_proj.weight": (p + "mlp.gate_up_proj.weight", 0),
        p + "mlp.up_proj.weight": (p + "mlp.gate_up_proj.weight", 1),
        p + "mlp.down_proj.weight": (p + "mlp.down_proj.weight", None),
        p + "input_layernorm.weight": (p + "input_layernorm.weight", None),
        p + "post_attention_layernorm.weight": (p + "post_attention_layernorm.weight", None),
    }
    assert vllm_weights.vllm_target(vllm_weights.FINGERPRINT_PARAM) == (vllm_weights.FINGERPRINT_PARAM, None)
    assert vllm_weights.FINGERPRINT_PARAM in lay.names
    assert "lm_head.weight" not in lay.names  # tied: sent once, as the embedding


def test_bucket_meta_and_tensors_follow_the_bucket_plan(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(weights, "BUCKET_NUMEL", 3000)  # several buckets on the tiny model
    model = vllm_engine.meta_model(tiny_model_dir)
    lay = weights.layout(model)
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(0))
    plan = weights.bucket_plan(lay)
    assert len(plan) > 2
    names, shapes = [], []
    for first, end, start, stop in plan:
        meta = vllm_weights.bucket_meta(lay, first, end, torch.bfloat16)
        assert meta["dtype_names"] == ["bfloat16"] * (end - first)
        pairs = vllm_weights.bucket_tensors(lay, first, end, flat[start:stop])
        assert [n for n, _ in pairs] == meta["names"] and [list(t.shape) for _, t in pairs] == meta["shapes"]
        assert_close(torch.cat([t.reshape(-1) for _, t in pairs]), flat[start:stop])
        names += meta["names"]
        shapes += meta["shapes"]
    assert names == list(lay.names) and shapes == [list(s) for s in lay.shapes]


def test_fingerprint_matches_after_rounding_to_the_generators_dtype():
    t = torch.linspace(-1, 1, 1001) + 1e-4  # most values are not representable in bf16
    assert vllm_weights.fingerprint(t, torch.bfloat16) == vllm_weights.fingerprint(t.to(torch.bfloat16))
    assert vllm_weights.fingerprint(t, torch.bfloat16) != vllm_weights.fingerprint(t)
    u = t.clone()
    u[500] += 0.5
    assert vllm_weights.fingerprint(u, torch.bfloat16) != vllm_weights.fingerprint(t, torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        vllm_weights.torch_dtype("int8")


# ---- pure helpers of the engine ------------------------------------------------------------------


def test_choose_engine_follows_the_devices_the_launcher_gave():
    assert factory.choose_engine("auto", {"CUDA_VISIBLE_DEVICES": ""}) == "torch"  # the launcher's CPU-only roles
    assert factory.choose_engine("auto", {"CUDA_VISIBLE_DEVICES": "2,3"}) == "vllm"
    assert factory.choose_engine("torch", {"CUDA_VISIBLE_DEVICES": "0"}) == "torch"
    assert factory.choose_engine("vllm", {"CUDA_VISIBLE_DEVICES": ""}) == "vllm"
    with pytest.raises(ValueError, match="auto"):
        factory.choose_engine("gpu", {})
    assert vllm_engine.visible_device_count({"CUDA_VISIBLE_DEVICES": "4,5"}) == 2
    assert vllm_engine.visible_device_count({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_request_seeds_leave_room_for_vllms_child_seeds():
    seeds = [vllm_engine.request_seed(s) for s in range(2000)]
    assert len(set(seeds)) == 2000 and all(s % vllm_engine.MAX_N == 0 for s in seeds)
    assert vllm_engine.request_seed(7) == vllm_engine.request_seed(7)
    # vLLM gives child j the seed s + j: prompts' child ranges [s, s + MAX_N) never overlap
    ranges = sorted(seeds)
    assert all(b - a >= vllm_engine.MAX_N for a, b in zip(ranges, ranges[1:]))


def test_sampling_kwargs_ask_for_the_sampled_tokens_logprob():
    kw = vllm_engine.sampling_kwargs(8, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=64), 5, [0, 3])
    assert kw == dict(n=8, temperature=0.7, top_p=0.9, max_tokens=64, logprobs=0,
                      stop_token_ids=[0, 3], detokenize=False, flat_logprobs=True)  # unseeded
    seeded = vllm_engine.sampling_kwargs(8, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=64), 5, [0, 3], True)
    assert seeded == {**kw, "seed": vllm_engine.request_seed(5)}
    greedy = vllm_engine.sampling_kwargs(1, SamplingParams(temperature=0.0, top_p=0.5, max_new_tokens=4), 0, [0])
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0
    with pytest.raises(ValueError, match="samples per prompt"):
        vllm_engine.sampling_kwargs(0, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), 0, [0])


def test_engine_kwargs_select_processed_logprobs_and_the_transport():
    s = vllm_engine.VllmSettings(transport="nccl")
    kw = vllm_engine.engine_kwargs("/m", s, 2, native_nccl=True)
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert kw["tensor_parallel_size"] == 2 and kw["worker_extension_cls"] == vllm_engine.EXTENSION
    assert kw["weight_transfer_config"] == {"backend": "nccl"}
    assert "weight_transfer_config" not in vllm_engine.engine_kwargs("/m", s, 2, native_nccl=False)  # extension fallback
    assert "weight_transfer_config" not in vllm_engine.engine_kwargs("/m", vllm_engine.VllmSettings(), 1, native_nccl=True)
    assert "max_model_len" not in kw
    assert vllm_engine.engine_kwargs("/m", vllm_engine.VllmSettings(max_model_len=512), 1, False)["max_model_len"] == 512


def test_settings_refuse_unknown_modes_with_the_choices():
    with pytest.raises(ValueError, match="finish"):
        vllm_engine.VllmSettings(weight_update="abort")
    with pytest.raises(ValueError, match="rpc"):
        vllm_engine.VllmSettings(transport="gloo")
    with pytest.raises(ValueError, match="fraction"):
        vllm_engine.VllmSettings(gpu_memory_utilization=1.5)


@dataclass
class Span:
    version: str
    start: int
    end: int


def test_versions_from_spans():
    assert vllm_engine.versions_from_spans([Span("0", 0, 2), Span("1", 2, 5)], 5).tolist() == [0, 0, 1, 1, 1]
    assert vllm_engine.versions_from_spans([], 0).tolist() == []
    assert vllm_engine.versions_from_spans(None, 3) is None
    with pytest.raises(RuntimeError, match="contiguous"):
        vllm_engine.versions_from_spans([Span("0", 0, 2), Span("1", 3, 5)], 5)
    with pytest.raises(RuntimeError, match="cover 4 of 5"):
        vllm_engine.versions_from_spans([Span("0", 0, 4)], 5)
    with pytest.raises(RuntimeError, match="'default'"):
        vllm_engine.versions_from_spans([Span("default", 0, 1)], 1)


class FlatLP:
    """vLLM's FlatLogprobs as far as the engine reads it."""

    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = list(token_ids), list(logprobs)

    def __len__(self):
        return len(self.token_ids)

    def __getitem__(self, t):
        return {self.token_ids[t]: SimpleNamespace(logprob=self.logprobs[t])}


def test_sampled_logprobs_from_flat_and_dict_forms():
    assert_close(vllm_engine.sampled_logprobs([4, 2], FlatLP([4, 2], [-0.5, -1.5])), np.array([-0.5, -1.5], dtype=np.float32))
    dicts = [{4: SimpleNamespace(logprob=-0.5)}, {2: SimpleNamespace(logprob=-1.5), 9: SimpleNamespace(logprob=-3.0)}]
    assert_close(vllm_engine.sampled_logprobs([4, 2], dicts), np.array([-0.5, -1.5], dtype=np.float32))
    with pytest.raises(RuntimeError, match="logprobs=0"):
        vllm_engine.sampled_logprobs([4, 2], None)


def test_to_completion_maps_reasons_and_refuses_aborts():
    out = SimpleNamespace(token_ids=[5, 0], logprobs=FlatLP([5, 0], [-0.1, -0.2]), finish_reason="stop",
                          weight_versions=[Span("3", 0, 2)])
    c = vllm_engine.to_completion(out, None)
    assert c.token_ids.dtype == np.int32 and c.versions.tolist() == [3, 3] and c.finish_reason == "stop"
    old_vllm = SimpleNamespace(**{**vars(out), "weight_versions": None})
    assert vllm_engine.to_completion(old_vllm, 2).versions.tolist() == [2, 2]
    with pytest.raises(RuntimeError, match="per-token weight versions"):
        vllm_engine.to_completion(old_vllm, None)
    with pytest.raises(RuntimeError, match="abort"):
        vllm_engine.to_completion(SimpleNamespace(**{**vars(out), "finish_reason": "abort"}), None)


def test_importing_the_engine_imports_neither_vllm_nor_cuda():
    code = ("import sys, torch, actors.engine, actors.vllm_engine, common.vllm_weights; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialised'")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr


# ---- VllmEngine over a fake AsyncLLM -------------------------------------------------------------


class Retryable(Exception):
    pass


class FakeModel:
    """What the worker extension sees of vLLM's model: load_weights and named_parameters."""

    def __init__(self, lay):
        self.loaded: dict[str, torch.Tensor] = {}
        self.norm = torch.nn.Parameter(torch.zeros(lay.shapes[lay.names.index(vllm_weights.FINGERPRINT_PARAM)]))

    def load_weights(self, pairs):
        for name, t in pairs:
            self.loaded[name] = t.clone()
            if name == vllm_weights.FINGERPRINT_PARAM:
                self.norm.data.copy_(t)

    def named_parameters(self):
        return [(vllm_weights.FINGERPRINT_PARAM, self.norm)]


class FakeWorker(vllm_engine.CovrlWorkerExtension):
    def __init__(self, model):
        self.device, self.rank = torch.device("cpu"), 0
        self.model_runner = SimpleNamespace(get_model=lambda: model)


class FakeLLM:
    """AsyncLLM as VllmEngine uses it: every request steps its n children one token per tick.

    `shape` is the API it imitates. "0.33": a paused engine ("wait") rejects new requests with Retryable; every
    token is labelled with the engine's version (update_weight_version / finish_weight_update(weight_version)).
    "0.26": no labels and no version methods; a paused engine queues new requests in every mode; at most
    `max_running` requests run, the rest wait, and a "wait" pause completes when the running ones are done, so
    waiting requests are held across the update. Either way `truth` records, per request and child, the weight
    epoch (loads so far) under which each token was really produced."""

    def __init__(self, worker, length=20, tick_s=0.004, shape="0.33", max_running=1 << 30):
        self.worker, self.length, self.tick_s, self.shape, self.max_running = worker, length, tick_s, shape, max_running
        self.calls: list[tuple] = []
        self.label, self.paused, self.mode, self.inflight, self.ticks = "default", False, None, 0, 0
        self.running, self.epoch, self.loaded_since_pause = 0, 0, False
        self.reject_next = 0
        self.seen_params = []
        self.truth: dict[str, list[list[int]]] = {}
        self.prompts: dict[str, list[int]] = {}
        if shape == "0.33":
            self.update_weight_version = self._update_weight_version

    async def _update_weight_version(self, v):
        self.calls.append(("version", v))
        self.label = v

    async def _admit(self):
        if self.shape == "0.33":
            if self.reject_next or (self.paused and self.mode == "wait"):
                self.reject_next = max(0, self.reject_next - 1)
                raise Retryable("Generation is paused. Please retry after it resumes.")
        while self.paused or self.running >= self.max_running:  # 0.26: queued, never rejected
            await asyncio.sleep(0.001)
        self.running += 1

    async def generate(self, prompt, params, request_id):
        self.seen_params.append(params)
        self.prompts[request_id] = prompt["prompt_token_ids"]
        await self._admit()
        self.inflight += 1
        try:
            rows = [([], [], [], []) for _ in range(params.n)]
            for t in range(self.length):
                while self.paused and self.mode == "keep":
                    await asyncio.sleep(0.001)
                for j, (toks, lps, labels, epochs) in enumerate(rows):
                    toks.append((prompt["prompt_token_ids"][-1] + (getattr(params, "seed", None) or 0) // vllm_engine.MAX_N + j + t) % 97 + 1)
                    lps.append(-0.01 * (t + 1))
                    labels.append(self.label)
                    epochs.append(self.epoch)
                self.ticks += 1
                await asyncio.sleep(self.tick_s)
            self.truth[request_id] = [epochs for _, _, _, epochs in rows]
            outs = [self._output(j, toks, lps, labels) for j, (toks, lps, labels, _) in enumerate(rows)]
            yield SimpleNamespace(request_id=request_id, outputs=outs[::-1], finished=True)  # any order: sorted by index
        finally:
            self.inflight -= 1
            self.running -= 1

    def _output(self, j, toks, lps, labels):
        out = SimpleNamespace(index=j, token_ids=toks, logprobs=FlatLP(toks, lps), finish_reason="length")
        if self.shape == "0.33":
            spans, start = [], 0
            for i in range(1, len(labels) + 1):
                if i == len(labels) or labels[i] != labels[start]:
                    spans.append(Span(labels[start], start, i))
                    start = i
            out.weight_versions = spans
        return out

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))
        self.paused, self.mode, self.loaded_since_pause = True, mode, False
        while mode == "wait" and self.running:
            await asyncio.sleep(0.001)

    async def resume_generation(self):
        self.calls.append(("resume",))
        if self.loaded_since_pause:
            self.epoch += 1
        self.paused = False

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        if method in ("covrl_load_weights", "covrl_receive_nccl"):
            self.loaded_since_pause = True
        if method.startswith("covrl_"):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [None]

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request.init_info))

    async def start_weight_update(self):
        self.calls.append(("start",))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info))
        self.loaded_since_pause = True

    async def finish_weight_update(self, **kw):
        if self.shape == "0.26" and kw:
            raise TypeError(f"finish_weight_update() got an unexpected keyword argument {next(iter(kw))!r}")
        self.calls.append(("finish", kw.get("weight_version")))
        if self.shape == "0.33":
            self.label = kw["weight_version"]


# The NCCL info fields of each version: 0.33 reads `packed` from the init info, 0.26 from each update's info.
NCCL_INIT = frozenset({"master_address", "master_port", "rank_offset", "world_size"})
NCCL_UPDATE = frozenset({"names", "dtype_names", "shapes"})
NCCL_FIELDS = {"0.33": (NCCL_INIT | {"packed"}, NCCL_UPDATE),
               "0.26": (NCCL_INIT, NCCL_UPDATE | {"packed", "packed_buffer_size_bytes", "packed_num_buffers"})}


def fake_api(native=True, shape="0.33"):
    new = shape == "0.33"
    return SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw), FINAL_ONLY="final_only",
                           Retryable=Retryable if new else vllm_engine.NeverRaised, version_spans=new, engine_versions=new,
                           finish_takes_version=new,
                           native_nccl=native, nccl_fields=NCCL_FIELDS[shape], version=f"fake {shape}",
                           InitRequest=lambda init_info: SimpleNamespace(init_info=init_info),
                           UpdateRequest=lambda update_info: SimpleNamespace(update_info=update_info))


@pytest.fixture
def make_engine(tiny_model_dir):
    engines = []

    def make(weight_update="finish", native=True, shape="0.33", **kw):
        lay = weights.layout(vllm_engine.meta_model(tiny_model_dir))
        llm = FakeLLM(FakeWorker(FakeModel(lay)), shape=shape, **kw)
        eng = vllm_engine.VllmEngine(tiny_model_dir, stop_ids=[0], llm=llm, api=fake_api(native, shape),
                            settings=vllm_engine.VllmSettings(weight_update=weight_update, poll_s=0.002))
        engines.append(eng)
        return eng, llm

    yield make
    for eng in engines:
        eng.close()


SP = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=20)


def test_generate_submits_one_request_per_prompt_and_returns_groups(make_engine):
    eng, llm = make_engine()
    assert llm.calls[0] == ("version", "0")  # labelled before any request
    groups = eng.generate([[1, 2], [3], [4, 5, 6]], 4, SP, [10, 11, 12])
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    assert [p.n for p in llm.seen_params] == [4, 4, 4] and all(p.logprobs == 0 for p in llm.seen_params)
    assert [p.seed for p in llm.seen_params] == [vllm_engine.request_seed(s) for s in (10, 11, 12)]  # seed_requests: on
    assert all(p.output_kind == "final_only" for p in llm.seen_params)
    for g in groups:
        for j, c in enumerate(g):
            assert len(c.token_ids) == 20 and c.versions.tolist() == [0] * 20 and c.finish_reason == "length"
        assert g[0].token_ids[0] != g[1].token_ids[0]  # sorted by index: child j is sample j
    with pytest.raises(ValueError, match="one seed per prompt"):
        eng.generate([[1]], 2, SP, [1, 2])


def test_finish_mode_update_lets_in_flight_requests_end_on_the_old_weights(make_engine, tiny_model_dir):
    eng, llm = make_engine("finish")
    lay = eng.lay
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(1))
    applied = threading.Event()

    def hook():  # the actor's receiver.apply(engine): staged weights arrive mid-generation
        if llm.ticks >= 5 and not applied.is_set():
            applied.set()
            eng.load_flat(flat, 1)

    groups = eng.generate([[1], [2]], 2, SP, [0, 1], before_forward=hook)
    assert applied.is_set() and eng.version == 1
    assert all(c.versions.tolist() == [0] * 20 for g in groups for c in g)  # finished on version 0
    kinds = [c[0] if c[0] != "rpc" else c[1] for c in llm.calls[1:]]
    n_buckets = len(weights.bucket_plan(lay))
    assert kinds == ["pause"] + ["covrl_load_weights"] * n_buckets + ["version", "resume"]
    assert llm.calls[1] == ("pause", "wait", True) and ("version", "1") in llm.calls
    # the worker extension loaded every parameter under its vLLM name, rounded to bf16
    model = llm.worker.model_runner.get_model()
    assert list(model.loaded) == list(lay.names)
    offset = 0
    for name, shape in zip(lay.names, lay.shapes):
        n = int(np.prod(shape))
        assert_close(model.loaded[name], flat[offset:offset + n].view(shape).to(torch.bfloat16))
        offset += n
    assert eng.fingerprint() == [vllm_weights.fingerprint(model.loaded[vllm_weights.FINGERPRINT_PARAM])]
    later = eng.generate([[3]], 1, SP, [2])
    assert later[0][0].versions.tolist() == [1] * 20


def test_keep_mode_update_continues_requests_and_stamps_each_token(make_engine):
    eng, llm = make_engine("keep")
    flat = torch.zeros(eng.lay.numel)
    applied = threading.Event()

    def hook():
        if llm.ticks >= 5 and not applied.is_set():
            applied.set()
            eng.load_flat(flat, 7)

    groups = eng.generate([[1], [2]], 3, SP, [0, 1], before_forward=hook)
    assert llm.calls[1] == ("pause", "keep", True)
    for g in groups:
        for c in g:
            v = c.versions.tolist()
            k = v.index(7)  # a response that spans the update: old tokens keep 0, later ones carry 7
            assert 0 < k < 20 and v == [0] * k + [7] * (20 - k)
            assert len(c.token_ids) == 20


def true_versions(llm, prompt, versions_loaded):
    """Per child, the covrl version each token of `prompt`'s request was really produced under (the fake's epochs
    mapped through the versions loaded, in order)."""
    (rid,) = [r for r, p in llm.prompts.items() if p == prompt and r in llm.truth]
    return [[([0] + versions_loaded)[e] for e in epochs] for epochs in llm.truth[rid]]


def update_mid_generation(eng, llm, prompts, n, version):
    flat = torch.zeros(eng.lay.numel)
    applied = threading.Event()

    def hook():
        if llm.ticks >= 5 and not applied.is_set():
            applied.set()
            eng.load_flat(flat, version)

    groups = eng.generate(prompts, n, SP, list(range(len(prompts))), before_forward=hook)
    assert applied.is_set() and eng.version == version
    return groups


def test_vllm026_finish_mode_drains_so_each_token_carries_the_version_it_ran_on(make_engine):
    """0.26 labels no tokens and holds queued requests across a pause: covrl drains its own requests before pausing,
    so the version at submission is the version every token ran on, also for requests vLLM had queued."""
    eng, llm = make_engine("finish", shape="0.26", max_running=2)
    assert eng.drain and llm.calls == []  # no version label to set on 0.26
    prompts = [[1], [2], [3], [4]]
    groups = update_mid_generation(eng, llm, prompts, 2, 1)
    for prompt, group in zip(prompts, groups):
        assert [c.versions.tolist() for c in group] == true_versions(llm, prompt, [1]) == [[0] * 20] * 2
    assert [c[0] for c in llm.calls if c[0] != "rpc"] == ["pause", "resume"] and eng.counters["vllm/drain_s"] > 0
    later = eng.generate([[5]], 1, SP, [9])
    assert later[0][0].versions.tolist() == true_versions(llm, [5], [1])[0] == [1] * 20


def test_vllm026_without_the_drain_queued_requests_would_be_mislabelled(make_engine):
    """The control that makes the drain test able to fail: the same run with the drain off labels the requests
    vLLM held across the pause with the old version, though they ran on the new weights."""
    eng, llm = make_engine("finish", shape="0.26", max_running=2)
    eng.drain = False
    prompts = [[1], [2], [3], [4]]
    groups = update_mid_generation(eng, llm, prompts, 2, 1)
    wrong = [p for p, g in zip(prompts, groups) if [c.versions.tolist() for c in g] != true_versions(llm, p, [1])]
    assert wrong == [[3], [4]]  # the two that were queued behind max_running


def test_vllm026_keep_mode_is_refused_with_the_fix(make_engine):
    with pytest.raises(ValueError, match=r'weight_update = "finish" or install vllm==0\.33\.0'):
        make_engine("keep", shape="0.26")


def test_vllm033_keep_mode_labels_equal_what_each_token_ran_on(make_engine):
    eng, llm = make_engine("keep", shape="0.33")
    assert not eng.drain
    groups = update_mid_generation(eng, llm, [[1], [2]], 2, 7)
    for prompt, group in zip([[1], [2]], groups):
        truth = true_versions(llm, prompt, [7])
        assert [c.versions.tolist() for c in group] == truth and all(0 in v and 7 in v for v in truth)


def test_vllm026_native_nccl_puts_packed_in_the_update_and_finishes_without_a_version(make_engine, monkeypatch):
    monkeypatch.setattr(weights, "BUCKET_NUMEL", 3000)
    eng, llm = make_engine("finish", native=True, shape="0.26")
    eng.join_nccl("10.0.0.1", 29555, 3)
    assert llm.calls[-1] == ("init", dict(master_address="10.0.0.1", master_port=29555, rank_offset=1, world_size=3))
    eng.receive_nccl(4)
    calls = llm.calls[llm.calls.index(("pause", "wait", True)):]
    assert [c[0] for c in calls] == ["pause", "start"] + ["update"] * len(weights.bucket_plan(eng.lay)) + ["finish", "resume"]
    assert all(c[1]["packed"] is False for c in calls if c[0] == "update")
    assert calls[-2] == ("finish", None) and eng.version == 4 and llm.epoch == 1


def test_nccl_infos_refuse_fields_this_vllm_lacks():
    init = vllm_engine.nccl_init_info({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2},
                             NCCL_FIELDS["0.33"])
    assert init["packed"] is False
    meta = {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    assert vllm_engine.nccl_update_info(meta, NCCL_FIELDS["0.33"]) == meta
    assert vllm_engine.nccl_update_info(meta, NCCL_FIELDS["0.26"]) == {**meta, "packed": False}
    with pytest.raises(RuntimeError, match=r"no field\(s\) \['rank_offset'\].*weight_transport = \"rpc\""):
        vllm_engine.nccl_init_info({"rank_offset": 1}, (frozenset({"master_address", "packed"}), NCCL_UPDATE))
    with pytest.raises(RuntimeError, match="no `packed` flag"):  # neither info has it: the protocol is unknown
        vllm_engine.nccl_init_info({"rank_offset": 1}, (frozenset({"rank_offset"}), NCCL_UPDATE))


def test_a_request_rejected_while_paused_is_retried(make_engine):
    eng, llm = make_engine()
    llm.reject_next = 1
    groups = eng.generate([[1], [2]], 2, SP, [0, 1])
    assert eng.counters["vllm/requests_retried"] == 1
    assert len(llm.seen_params) == 3 and all(len(c.token_ids) == 20 for g in groups for c in g)


def test_native_nccl_update_runs_the_four_phases_per_version(make_engine, monkeypatch):
    monkeypatch.setattr(weights, "BUCKET_NUMEL", 3000)
    eng, llm = make_engine("finish", native=True)
    eng.join_nccl("10.0.0.1", 29555, 3)
    assert llm.calls[-1] == ("init", dict(master_address="10.0.0.1", master_port=29555, rank_offset=1, world_size=3,
                                          packed=False))
    eng.receive_nccl(4)
    calls = llm.calls[llm.calls.index(("pause", "wait", True)):]
    plan = weights.bucket_plan(eng.lay)
    assert [c[0] for c in calls] == ["pause", "start"] + ["update"] * len(plan) + ["finish", "resume"]
    assert calls[-2] == ("finish", "4") and eng.version == 4
    metas = [c[1] for c in calls if c[0] == "update"]
    assert [n for m in metas for n in m["names"]] == list(eng.lay.names)
    assert {d for m in metas for d in m["dtype_names"]} == {"bfloat16"}


def test_extension_nccl_fallback_without_the_native_api(make_engine):
    eng, llm = make_engine("finish", native=False)
    with pytest.raises(RuntimeError, match="join_nccl"):
        eng.receive_nccl(1)
    assert eng.nccl is None
    # join: the extension's own NCCL group (needs CUDA; here only the call is checked, not the group)
    llm.worker.covrl_init_nccl = lambda **kw: llm.calls.append(("ext-init", kw))
    eng.join_nccl("h", 1, 2)
    assert llm.calls[-1] == ("ext-init", dict(master_address="h", master_port=1, rank_offset=1, world_size=2))
    received = []
    llm.worker.covrl_receive_nccl = lambda names, dtypes, shapes: received.extend(names)
    eng.receive_nccl(2)
    assert received == list(eng.lay.names) and ("version", "2") in llm.calls and eng.version == 2


def test_gpu_check_refuses_in_one_line_without_cuda_or_vllm(monkeypatch, capsys):
    from hardware import check as gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("gpu_check: no CUDA device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "vllm" else object())
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "vllm is not importable" in err


def test_nccl_rendezvous_through_the_weight_channels_store():
    import datetime

    import torch.distributed as dist

    from common.transport import free_port

    port = free_port()
    timeout = datetime.timedelta(seconds=20)
    master = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
    learner, generator = dist.PrefixStore("gen3/abc", master), dist.PrefixStore("gen3/abc", client)
    got = {}
    t = threading.Thread(target=lambda: got.update(offer=vllm_weights.offer_address(learner, "10.1.2.3", 29123, 20)))
    t.start()  # the learner waits for the generator's announcement
    vllm_weights.announce(generator, 2, torch.bfloat16)
    assert vllm_weights.read_address(generator, 20) == {"host": "10.1.2.3", "port": 29123, "world_size": 3}
    t.join(20)
    assert got["offer"] == (3, torch.bfloat16)  # learner + 2 tensor-parallel workers; send in the generator's dtype


def test_direct_receiver_helpers_announce_and_join(make_engine):
    eng, llm = make_engine("finish", native=True)
    assert not eng.receives_weights_directly  # rpc by default: the actor's gloo path, unchanged
    store = {}
    fake_store = SimpleNamespace(set=store.__setitem__, get=lambda k: store[k].encode(), wait=lambda keys, timeout: None)
    eng.announce_receiver(fake_store)
    assert store[vllm_weights.ANNOUNCE_KEY] == '{"tp": 1, "dtype": "bfloat16"}'
    store[vllm_weights.ADDR_KEY] = '{"host": "h", "port": 7, "world_size": 2}'
    eng.join_via_store(fake_store, 5)
    assert llm.calls[-1][0] == "init" and llm.calls[-1][1]["world_size"] == 2 and eng.nccl == "native"


def test_the_engine_core_is_spawned_not_forked(make_engine, monkeypatch):
    """The generator runs threads (asyncio loop, weight receiver, gloo) before vLLM starts its
    engine core, so vLLM must spawn it; a method the user set explicitly is kept."""
    import importlib.util

    real, have_flashinfer = importlib.util.find_spec, [False]
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if have_flashinfer[0] else None) if name == "flashinfer" else real(name, *a))
    env = {}
    vllm_engine.use_spawn(env)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # no FlashInfer here: its sampler is off (vLLM 0.26 imports FlashInfer unguarded when it is on); a user's
    # explicit choice is kept
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    vllm_engine.use_spawn(env)
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    have_flashinfer[0] = True  # installed: vLLM's own default stands
    env = {}
    vllm_engine.use_spawn(env)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in env
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "forkserver"}
    vllm_engine.use_spawn(env)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "forkserver"


def test_requests_carry_seeds_unless_turned_off(make_engine):
    eng, llm = make_engine("finish")
    eng.generate([[1, 2]], 2, SP, [9])
    assert llm.seen_params[-1].seed == vllm_engine.request_seed(9)
    eng.settings = vllm_engine.VllmSettings(seed_requests=False, poll_s=0.002)  # vLLM's legacy V1 runner: seeds are slow there
    eng.generate([[1, 2]], 2, SP, [9])
    assert getattr(llm.seen_params[-1], "seed", None) is None
