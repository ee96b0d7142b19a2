"""The GPU proof's generation stage (hardware/gen_bench.py, hardware/proof.py `generation`) on the CPU: the lengths
it imposes on vLLM's requests, covrl's loop and engine driven on the same drawn workload with a weight publish into
the same engine (the torch engine standing in for vLLM, as in the stage's rehearsal), and how the stage turns the
worker's results into ratios, goals and checks. The whole stage is rehearsed by `python3 -m hardware.proof
--rehearse-cpu --stages generation` (tests/bench/test_bench_gpu_rehearsal.py, in `make bench`)."""

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import torch

from actors.vllm_engine import request_seed
from hardware import gen_bench
from hardware.gen_bench import Bench, Groups, ImposedLengths
from hardware.proof import CPU, Checks, Ctx, StageLog, gen_checks, gen_goals, gen_record


def test_imposed_lengths_set_each_requests_length_by_its_groups_seed_and_refuse_a_stranger():
    make = ImposedLengths(lambda **kw: kw)
    assert make(seed=5, max_tokens=64) == {"seed": 5, "max_tokens": 64}  # nothing imposed yet: vLLM's as given
    make.set(Groups(prompts=[[1], [2]], seeds=[11, 12], lengths=[3, 9]))
    got = make(n=4, seed=request_seed(12), max_tokens=64, logprobs=0)
    assert got == {"n": 4, "seed": request_seed(12), "max_tokens": 9, "min_tokens": 9, "logprobs": 0}
    with pytest.raises(ValueError, match="none of this workload's groups"):
        make(n=4, seed=request_seed(13), max_tokens=64)


@pytest.fixture
def spec(tiny_model_dir, monkeypatch) -> dict:
    """The worker's spec on the tiny model: the torch engine in 4 rows (2 groups of 2 at once, so the loop refills)."""
    settings = gen_bench.Workload.settings
    # transport.recv_timeout_s 1: ActorLoop does not ask again when every group it held comes back in one turn and
    # its free room equals what it last asked for (the hub closed that room when it gave the work), so it waits
    # recv_timeout_s (30 s by default) for nothing; the stage runs with the default and shows it.
    monkeypatch.setattr(gen_bench.Workload, "settings",
                        lambda self, torch_lengths: [*settings(self, torch_lengths), "transport.recv_timeout_s=1"])
    spec = {"model": tiny_model_dir, "dtype": "float32", "device": "cpu", "engine": "torch", "group_size": 2,
            "max_num_seqs": 4, "gpu_memory_utilization": None, "publishes": 2, "first_run_s": 20,
            "workloads": {"heavy": dict(groups=6, median=4, sigma=1.2, max_new_tokens=32)},
            "warmup": dict(groups=2, median=2, sigma=0.0, max_new_tokens=2), "deadline_unix": time.time() + 120,
            "build_estimate_s": {"eager": 30, "graphs": 60}, "publish_estimate_s": 20}
    return spec


def test_the_loop_and_the_engine_generate_the_drawn_workload_and_a_publish_lands_in_the_engine(spec):
    b = Bench(spec)
    engine, _ = b.make_torch()
    wl = b.workloads[0]
    drawn = b.groups["heavy"].lengths  # per sample: the torch engine draws them itself, from the hub's seeds
    for variant in ("engine", "loop"):
        r = b.variant(variant, engine, wl)
        assert r["status"] == "measured" and r["tokens_per_s"] > 0, r
        assert (r["tokens"], r["samples"], r["length_max"]) == (sum(drawn), len(drawn), max(drawn)), (variant, r)
    assert r["groups_back"] == 6 and r["rejected"] == {} and r["exit_code"] == 0 and r["startup_s"] >= 0
    out = b.publish(engine, "rpc")
    assert [v["version"] for v in out["versions"]] == [1, 2] and all(v["checksums_equal"] for v in out["versions"])
    assert out["fingerprint_equal"] and out["versions"][-1]["load_s"] is not None
    assert b.unavailable("nccl")["status"] == "not_run" and b.unavailable("rpc") is None


class StandInLLM:
    """AsyncLLM as covrl's VllmEngine and the bench use it, 0.26-shaped (no version labels): every request's n
    samples get `length` tokens; weights go through covrl's real worker extension into `Loaded`."""

    def __init__(self, worker, length: int = 5):
        self.worker, self.length, self.params, self.calls = worker, length, [], []

    async def generate(self, prompt, params, request_id):
        self.params.append(params)
        await asyncio.sleep(0.001)
        lp = [{1: SimpleNamespace(logprob=-0.1)}] * self.length
        yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(index=j, token_ids=[1] * self.length, logprobs=lp,
                                                                      finish_reason="length") for j in range(params.n)])

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append("reset")
        return True

    async def pause_generation(self, *, mode, clear_cache=True):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]


class Loaded:
    """What the worker extension sees of vLLM's model: the tensors `load_weights` was given."""

    def __init__(self):
        self.tensors = {}

    def load_weights(self, pairs):
        self.tensors.update({name: t.clone() for name, t in pairs})

    def named_parameters(self):
        return list(self.tensors.items())


def test_the_vllm_variants_share_one_engine_and_covrls_requests_carry_the_imposed_length(spec, tiny_model_dir):
    """The vLLM branch on a stand-in AsyncLLM: the bare variants run on the engine's own loop, covrl's engine and
    loop build their requests as always with max_tokens = min_tokens = the group's drawn length, the prefix cache is
    reset before every run, and an rpc publish (then an ipc one, where this checkout has it) pauses the engine and
    loads into the worker (the fingerprint)."""
    from actors import vllm_engine
    from hardware.gen_bench import BenchEngine

    class Worker(vllm_engine.CovrlWorkerExtension):
        def __init__(self):
            self.device, self.rank, model = torch.device("cpu"), 0, Loaded()
            self.model_runner = SimpleNamespace(get_model=lambda: model)

    b = Bench({**spec, "engine": "vllm"})
    llm = StandInLLM(Worker())
    api = SimpleNamespace(SamplingParams=ImposedLengths(lambda **kw: SimpleNamespace(**kw)), FINAL_ONLY="final",
                          Retryable=vllm_engine.NeverRaised, version_spans=False, engine_versions=False,
                          finish_takes_version=False, native_nccl=False, nccl_fields=None, version="stand-in")
    engine = BenchEngine(tiny_model_dir, stop_ids=[0], llm=llm, api=api,
                         settings=vllm_engine.VllmSettings(poll_s=0.002))
    try:
        g, covrl = b.groups["heavy"], {}
        for variant in gen_bench.VARIANTS:
            r = b.variant(variant, engine, b.workloads[0])
            assert r["status"] == "measured" and r["tokens"] == 6 * 2 * 5, (variant, r)  # the stand-in's 5 tokens
            covrl.update({p.seed: p for p in llm.params[-6:] if hasattr(p, "seed")})
        assert sorted(p.max_tokens for p in covrl.values()) == sorted(g.lengths)  # one drawn length per group
        assert all(p.min_tokens == p.max_tokens and p.logprobs == 0 for p in covrl.values())
        bare = llm.params[-6 * 2:-6]  # the plain variant's: the length, and none of covrl's parameters
        assert all(p.min_tokens == p.max_tokens and not hasattr(p, "logprobs") for p in bare)
        assert llm.calls.count("reset") == 4
        out = b.publish(engine, "rpc")
        assert out["fingerprint_equal"] and all(v["checksums_equal"] for v in out["versions"])
        assert llm.calls[-2:] == ["pause", "resume"] and out["versions"][-1]["engine_update_s"] > 0
        if gen_bench.ipc_missing() is None:  # the same engine over ipc (the CPU's shm slots), other weights
            ipc = b.publish(engine, "ipc")
            assert ipc["fingerprint_equal"] and ipc["fingerprint_learner"] != out["fingerprint_learner"]
            assert [v["load_s"] for v in ipc["versions"]] == [None, None]  # loaded by the receive itself
            assert engine.settings.transport == "rpc"  # as it was
    finally:
        engine.close()


def test_each_engines_kv_cache_is_recorded_beside_the_plan_on_the_rehearsal_the_plan_alone(spec, capsys):
    """The engine event carries `kv_cache`: memplan's vLLM KV term for the same config (a nominal 80 GiB GPU where
    there is none) in bytes and tokens, and, on the torch engine, nothing measured, with why."""
    b = Bench(spec)
    assert b.build("eager") is not None
    events = [json.loads(x[len(gen_bench.RESULT_TAG):]) for x in capsys.readouterr().out.splitlines()
              if x.startswith(gen_bench.RESULT_TAG)]
    (ev,) = [e for e in events if e["event"] == "engine"]
    plan, got = ev["kv_cache"]["plan"], ev["kv_cache"]["measured"]
    assert plan["gpu_bytes"] == gen_bench.NOMINAL_GPU_BYTES and "nominal" in plan["gpu_bytes_source"]
    assert plan["kv_cache_bytes"] > 0 and plan["kv_bytes_per_token"] > 0 and plan["params"] > 0
    assert plan["kv_tokens"] == int(plan["kv_cache_bytes"] // plan["kv_bytes_per_token"]) > 0
    assert plan["gpu_memory_utilization"] == 0.85  # the config's default: the rehearsal's spec names none
    assert got["kv_tokens"] is None and "CPU rehearsal" in got["reason"]


def test_the_kv_plan_is_memplans_vllm_term_for_the_stages_engine(tiny_model_dir):
    from common import memplan
    from common.config import load_config

    spec = {"model": tiny_model_dir, "device": "cpu", "dtype": "bfloat16", "max_num_seqs": 256,
            "gpu_memory_utilization": 0.5}
    plan = gen_bench.kv_plan(spec, eager=True, prompt_tokens=40, new_tokens=1024)
    cfg = load_config(None, ['generator.engine="vllm"', 'model.dtype="bfloat16"', "generator.max_num_seqs=256",
                             "generator.gpu_memory_utilization=0.5", "generator.enforce_eager=true"])
    with open(f"{tiny_model_dir}/config.json") as f:
        shape = memplan.Shape.from_config(json.load(f))
    terms, _ = memplan.vllm_gpu(cfg, shape, 1, float(gen_bench.NOMINAL_GPU_BYTES))
    assert plan["kv_cache_bytes"] == int(next(t.bytes for t in terms if t.name == "vLLM KV cache")) > 0
    assert plan["kv_bytes_per_token"] == memplan.kv_bytes_per_token(shape, 2, 1)
    assert plan["terms"] == {t.name: int(t.bytes) for t in terms}
    assert "error" in gen_bench.kv_plan({**spec, "model": "/nonexistent"}, True, 40, 1024)  # recorded, not raised


def test_vllms_kv_blocks_are_read_from_the_front_ends_config_or_say_why_not():
    cache = SimpleNamespace(num_gpu_blocks=1000, block_size=16)
    got = gen_bench.vllm_kv_blocks(SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache)))
    assert got == {"kv_tokens": 16000, "num_gpu_blocks": 1000, "block_size": 16,
                   "source": "AsyncLLM.vllm_config.cache_config"}
    core = SimpleNamespace(engine_core=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache)))
    assert gen_bench.vllm_kv_blocks(core)["source"] == "AsyncLLM.engine_core.vllm_config.cache_config"
    unset = SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=None, block_size=16)))
    none = gen_bench.vllm_kv_blocks(unset)
    assert none["kv_tokens"] is None and "num_gpu_blocks None" in none["reason"]
    assert gen_bench.vllm_kv_blocks(object())["kv_tokens"] is None


def _ctx(tmp_path, rehearse: bool) -> Ctx:
    log = StageLog(str(tmp_path / "generation.log"), "generation")
    return Ctx(args=argparse.Namespace(rehearse_cpu=rehearse), scale=CPU, facts={}, deadline=None, log=log,
               checks=Checks(log))


def _run(tps: float, tokens: int = 4000, longest: int = 60, **extra) -> dict:
    return {"status": "measured", "tokens": tokens, "samples": 400, "length_mean": 10.0, "length_max": longest,
            "longest_over_mean": longest / 10.0, "seconds": tokens / tps, "tokens_per_s": tps, **extra}


def test_the_stage_turns_results_into_ratios_goals_and_checks(tmp_path):
    """Against bare-covrl-params: the loop at 0.95x meets the 0.9 goal, covrl's parameters cost vLLM 0.8x, a 0.15 s
    publish meets 0.2 s; a variant that did other work, a tail under 5x, a failed CUDA-graph build and a run that
    errored each fail their check."""
    ctx = _ctx(tmp_path, rehearse=False)
    loop = dict(startup_s=0.5, groups_back=40, rejected={}, exit_code=0)
    events = [
        {"event": "plan", "variants": {}, "order": [], "workloads": {
            "heavy": {"groups": 40, "group_size": 10, "median": 8, "sigma": 0.7, "max_new_tokens": 99,
                      "lengths_per": "group", "drawn": {"length_mean": 10.0, "length_max": 60, "longest_over_mean": 6.0,
                                                        "tokens": 4000}},
            "fixed": {"groups": 40, "group_size": 10, "median": 10, "sigma": 0.0, "max_new_tokens": 10,
                      "lengths_per": "group", "drawn": {"length_mean": 10.0, "length_max": 10, "longest_over_mean": 1.0,
                                                        "tokens": 4000}}}},
        {"event": "engine", "engine": "eager", "status": "built", "build_s": 1.0, "what": "x"},
        {"event": "run", "engine": "eager", "workload": "heavy", "variant": "bare-covrl-params", **_run(800)},
        {"event": "run", "engine": "eager", "workload": "heavy", "variant": "loop", **_run(760, **loop)},
        {"event": "run", "engine": "eager", "workload": "heavy", "variant": "bare", **_run(1000)},
        {"event": "run", "engine": "eager", "workload": "fixed", "variant": "bare-covrl-params",
         **_run(900, longest=10)},
        {"event": "run", "engine": "eager", "workload": "fixed", "variant": "engine",
         **_run(850, tokens=3990, longest=10)},
        {"event": "run", "engine": "eager", "workload": "fixed", "variant": "loop", "status": "error", "error": "boom"},
        {"event": "publish", "transport": "rpc", "status": "measured", "assembly_s": 0.01, "bytes": 10**9,
         "fingerprint_equal": True, "fingerprint_generator": [1.0], "fingerprint_learner": 1.0,
         "versions": [{"version": 1, "end_to_end_s": 0.15, "publish_s": 0.1, "receive_s": 0.1, "load_s": 0.05,
                       "checksums_equal": True}]},
        {"event": "publish", "transport": "ipc", "status": "not_built", "reason": "not built"},
        {"event": "engine", "engine": "graphs", "status": "error", "error": "no compiler"},
        {"event": "done"},
    ]
    figures = {"goals": gen_goals(), "engines": {}, "runs": {}, "ratios": {}, "publish": {}}
    for e in events:
        gen_record(ctx, figures, e)
    heavy = figures["ratios"]["eager"]["heavy"]
    assert heavy["reference"] == "bare-covrl-params" and heavy["over_reference"]["loop"] == 0.95
    assert heavy["covrl_params_over_bare"] == 0.8
    assert figures["goals"]["loop"]["by_engine"]["eager"] == {"ratio": 0.95, "reference": "bare-covrl-params",
                                                              "met": True}
    assert figures["goals"]["publish"]["by_transport"]["rpc"]["met"] is True
    gen_checks(ctx, figures, 0)
    res = ctx.checks.results
    failed = sorted(k for k, ok in res.items() if not ok)
    assert failed == ["eager fixed loop: measured",
                      "eager fixed: every variant generated the same work (tokens, samples, longest)",
                      "the CUDA-graph engine built (or was skipped / not run, with why)"], failed
    assert res["eager heavy: the longest response >= 5x the mean"]
    assert res["eager heavy loop: every group back at the hub, none rejected, run_actor exited 0"]
    assert res["publish rpc: measured"] and res["eager heavy: the goal's pair measured (loop and its reference)"]
