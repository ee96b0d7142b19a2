"""The GPU proof's memory against common/memplan.py's plan (hardware/proof.py): the learner stage's peak per budget
beside `learner_gpu` for the config the variant runs, and the generation stage's vLLM KV cache in tokens beside the
plan's KV term; a miss is a verdict recorded in the figures, never a failed check, and the CPU rehearsal records
the plan alone (no CUDA peak, no vLLM)."""

import argparse
import json

import pytest

from common import memplan
from hardware.proof import (CPU, GPU, LEARNER_SHAPES, MEMPLAN_TOLERANCE, Checks, Ctx, StageLog, gen_goals,
                            gen_line_handler, gen_record, learner_memory_plan, learner_variant)


def _ctx(tmp_path, rehearse: bool, name: str = "learner") -> Ctx:
    log = StageLog(str(tmp_path / f"{name}.log"), name)
    return Ctx(args=argparse.Namespace(rehearse_cpu=rehearse), scale=CPU if rehearse else GPU, facts={},
               deadline=None, log=log, checks=Checks(log))


def _figures(shape: str, dtype: str = "bfloat16") -> dict:
    sh = LEARNER_SHAPES[shape]
    return {"dtype": dtype, "zero_stage": 1, "shapes": {shape: {
        "model_config": sh["model"], "samples": sh["samples"], "response_tokens": sh["response_tokens"]}}}


@pytest.mark.parametrize("shape,variant,budget", [("0.5b", "sdpa-chunked", 8192), ("7b-4l", "varlen-fused-gc", 20480)])
def test_the_learner_plan_is_learner_gpu_for_the_variants_config_beside_the_measured_peak(tmp_path, shape, variant,
                                                                                        budget):
    ctx, over = _ctx(tmp_path, rehearse=False), learner_variant(variant)
    b = {"micro_batch_tokens": budget, "peak_allocated_gib": 9.5}
    m = learner_memory_plan(ctx, _figures(shape), shape, over, b)
    # the same terms, summed, as memplan gives for the config the worker builds (one rank, rank 0, on CUDA)
    model = memplan.Shape.from_config({"model_type": "qwen2", **LEARNER_SHAPES[shape]["model"]})
    assert m["plan_params"] == model.params and sum(m["terms"].values()) == pytest.approx(m["plan_bytes"], abs=16)
    assert m["plan_bytes"] > m["plan_allocator_bytes"] > 0 and "CUDA runtime" in m["terms"]
    assert m["peak_bytes"] == int(9.5 * 2**30) and m["peak_over_plan"] == round(m["peak_bytes"] / m["plan_bytes"], 4)
    assert m["within_tolerance"] == (abs(m["peak_bytes"] / m["plan_bytes"] - 1) <= MEMPLAN_TOLERANCE)
    assert m["tolerance"] == MEMPLAN_TOLERANCE == 0.15 and m["cuda"] is True
    # checkpointing keeps one layer's activations; the gc variant's plan says so
    name = "activations (checkpointed)" if over["learner.gradient_checkpointing"] else "activations"
    assert m["terms"][name] > 0


def test_a_peak_within_15_percent_is_within_and_one_outside_is_a_finding_not_a_failed_check(tmp_path):
    ctx = _ctx(tmp_path, rehearse=False)
    over, fig = learner_variant("varlen-fused"), _figures("0.5b")
    plan = learner_memory_plan(ctx, fig, "0.5b", over, {"micro_batch_tokens": 8192, "peak_allocated_gib": 1.0})
    p = plan["plan_bytes"]
    near = learner_memory_plan(ctx, fig, "0.5b", over, {"micro_batch_tokens": 8192, "peak_allocated_bytes": 0.9 * p})
    far = learner_memory_plan(ctx, fig, "0.5b", over, {"micro_batch_tokens": 8192, "peak_allocated_bytes": 1.3 * p})
    assert near["within_tolerance"] is True and near["peak_over_plan"] == 0.9 and "peak_bytes_from" not in near
    assert far["within_tolerance"] is False and far["peak_over_plan"] == 1.3
    oom = learner_memory_plan(ctx, fig, "0.5b", over, {"micro_batch_tokens": 8192, "peak_allocated_gib": 70.0,
                                                       "error": "OutOfMemoryError: ..."})
    assert oom["within_tolerance"] is None and "out of memory" in oom["why"] and oom["peak_bytes"] > 0
    assert ctx.checks.results == {}  # no check was made of it


def test_the_cpu_rehearsal_records_the_plan_and_no_peak_with_why(tmp_path):
    ctx = _ctx(tmp_path, rehearse=True)
    from hardware.proof import LEARNER_SHAPES_CPU

    sh = LEARNER_SHAPES_CPU["7b-4l"]
    fig = {"dtype": "float32", "zero_stage": 1, "shapes": {"7b-4l": {
        "model_config": sh["model"], "samples": sh["samples"], "response_tokens": sh["response_tokens"]}}}
    m = learner_memory_plan(ctx, fig, "7b-4l", learner_variant("sdpa-chunked"),
                            {"micro_batch_tokens": 320, "peak_rss_gib": 0.5})
    assert m["plan_bytes"] > 0 and m["cuda"] is False and m["terms"]["parameters"] > 0
    assert m["peak_bytes"] is None and m["peak_over_plan"] is None and m["within_tolerance"] is None
    assert "CPU rehearsal" in m["why"]


def test_a_config_this_checkout_refuses_records_the_error_instead_of_a_plan(tmp_path):
    m = learner_memory_plan(_ctx(tmp_path, rehearse=False), _figures("0.5b"), "0.5b",
                            {"learner.no_such_switch": True}, {"micro_batch_tokens": 8192, "peak_allocated_gib": 1.0})
    assert "error" in m and "plan_bytes" not in m and m["within_tolerance"] is None


def _kv_event(name: str, tokens, plan_tokens: int = 100_000) -> dict:
    plan = {"gpu_bytes": 80 * 2**30, "gpu_bytes_source": "torch", "gpu_memory_utilization": 0.5,
            "kv_cache_bytes": plan_tokens * 12288, "kv_bytes_per_token": 12288, "kv_tokens": plan_tokens}
    measured = ({"kv_tokens": tokens, "num_gpu_blocks": tokens // 16, "block_size": 16,
                 "source": "AsyncLLM.vllm_config"} if tokens else {"kv_tokens": None, "reason": "not reachable"})
    return {"event": "engine", "engine": name, "status": "built", "build_s": 1.0, "what": "x",
            "kv_cache": {"plan": plan, "measured": measured}}


def test_the_generation_stage_sets_vllms_kv_tokens_beside_the_plan_and_falls_back_to_its_log_line(tmp_path):
    ctx = _ctx(tmp_path, rehearse=False, name="generation")
    figures = {"goals": gen_goals(), "engines": {}, "runs": {}, "ratios": {}, "publish": {}}
    on_line = gen_line_handler(ctx, figures)
    on_line("GPU_PROOF_RESULT " + json.dumps(_kv_event("eager", 92_000)))
    eager = figures["engines"]["eager"]["kv_cache"]
    assert eager["kv_tokens"] == 92_000 and eager["kv_tokens_over_plan"] == 0.92 and eager["within_tolerance"] is True
    assert eager["log"] is None and eager["kv_tokens_source"] == "AsyncLLM.vllm_config"
    # the front end did not hold the block count: the engine core's start-up lines stand in
    on_line("(EngineCore_DP0 pid=7) INFO 11-28 [gpu_worker.py:1] Available KV cache memory: 1.5 GiB")
    on_line("(EngineCore_DP0 pid=7) INFO 11-28 [kv_cache_utils.py:1] GPU KV cache size: 130,000 tokens")
    on_line("GPU_PROOF_RESULT " + json.dumps(_kv_event("graphs", None)))
    graphs = figures["engines"]["graphs"]["kv_cache"]
    assert graphs["log"] == {"kv_tokens": 130_000, "available_kv_cache_gib": 1.5}
    assert graphs["kv_tokens"] == 130_000 and graphs["kv_tokens_over_plan"] == 1.3
    assert graphs["within_tolerance"] is False
    assert graphs["kv_bytes_over_plan"] == round(1.5 * 2**30 / (100_000 * 12288), 4)
    assert figures["memory_plan"]["within"] == {"eager KV cache": True, "graphs KV cache": False}
    assert ctx.checks.results == {}  # a verdict, not a check


def test_the_rehearsals_kv_record_has_the_plan_and_no_verdict(tmp_path):
    ctx = _ctx(tmp_path, rehearse=True, name="generation")
    figures = {"goals": gen_goals(), "engines": {}, "runs": {}, "ratios": {}, "publish": {}}
    e = _kv_event("eager", None)
    e["kv_cache"]["measured"]["reason"] = "CPU rehearsal: the torch engine stands in"
    gen_record(ctx, figures, e)
    kv = figures["engines"]["eager"]["kv_cache"]
    assert kv["plan"]["kv_tokens"] > 0 and kv["kv_tokens"] is None and kv["within_tolerance"] is None
    assert "CPU rehearsal" in kv["no_verdict"]
