"""`make gpu-proof` is one command for the next GPU session: its whole logic (placement checks, the colocated
runs, checksums on both sides, checkpoint and resume, the throughput workers, the JSON it records) rehearsed on
the CPU at toy scale, so a GPU lease is never spent finding a bug in the script."""

import json
import os
import subprocess
import sys

import pytest

from hardware.proof import FIRST_LEASE_PLAN, FIRST_LEASE_TESTS_S

from tests.helpers.gpu_rehearsal import rehearse
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow


# The learner stage rides in the same rehearsal (one preflight for both): the untied stand-in of 7b-4l at one budget,
# the baseline, one variant that runs on a CPU, three that must be skipped there, and one that runs out of memory
# (injected) before another that must still be measured. About 20 s of the run.
LEARNER_ARGS = ("--learner-shapes", "7b-4l:320", "--learner-variants",
                "sdpa-chunked,varlen-fused,eager-chunked,sdpa-fused,sdpa-chunked-compile,varlen-triton",
                "--learner-steps", "1,1", "--learner-inject-oom", "eager-chunked")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict:
    return rehearse(tmp_path_factory.mktemp("gpu-proof"), "vllm-kit,vllm-tests,vllm-run,z1,learner", LEARNER_ARGS)[0]


def test_the_gpu_proof_passes_its_cpu_rehearsal(rehearsal):
    doc = rehearsal
    z1 = doc["stages"]["z1"]
    assert z1["passed"], doc
    # vLLM's own stages need a GPU (skipped, not passed); vllm-run's checks rehearse with the torch engine.
    assert doc["stages"]["vllm-kit"]["skipped"] and doc["stages"]["vllm-tests"]["skipped"]
    run = doc["stages"]["vllm-run"]
    assert run["passed"] and run["figures"]["engine"] == "torch" and run["figures"]["full_run"]["checksums_equal"] == 4
    assert run["figures"]["is_weight_mean"] == [1.0] * 4  # fp32 on both sides, on-policy: the same logprobs
    assert run["figures"]["zero_stage"] == 1
    full, resume = z1["figures"]["full_run"], z1["figures"]["resume"]
    assert full["checksums_equal"] == full["steps_logged"] == 4 and full["checkpoints"] == [2, 4]
    assert resume["resumed_from"] == 2 and resume["checksums_equal_after_resume"] == 3  # version 2 again, then 3, 4


def test_run_as_a_file_it_refuses_in_one_line(tmp_path):
    """`python3 hardware/proof.py` puts hardware/ first on the import path, so covrl's packages are not importable:
    the proof says so in one line and how to run it, rather than failing on an import (its top level imports only
    the standard library)."""
    # -S: without site-packages, where .venv's editable install would make covrl importable from anywhere
    out = subprocess.run([sys.executable, "-S", os.path.join(REPO, "hardware", "proof.py"), "--rehearse-cpu",
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "python3 -m hardware.proof" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_learner_stage_measures_each_variant_against_the_baseline_and_says_why_it_skips(rehearsal):
    stage = rehearsal["stages"]["learner"]
    assert stage["passed"] and not stage.get("skipped"), stage["checks"]
    fig = stage["figures"]
    assert fig["baseline"] == "sdpa-chunked" and fig["dtype"] == "float32"
    assert fig["memory_plan"]["tolerance"] == 0.15 and len(fig["memory_plan"]["within"]) == 2  # the measured two
    shape = fig["shapes"]["7b-4l"]
    v = shape["variants"]
    assert sorted(v) == sorted(LEARNER_ARGS[3].split(","))
    # Skipped on the CPU, with the reason, never as measured.
    assert v["varlen-fused"]["status"] == "skipped" and "need CUDA" in v["varlen-fused"]["reason"]
    assert v["sdpa-chunked-compile"]["status"] == "skipped" and "compile_layers" in v["sdpa-chunked-compile"]["reason"]
    assert v["varlen-triton"]["status"] == "skipped" and "need CUDA" in v["varlen-triton"]["reason"]
    # Out of memory at its first budget: recorded as such, not a failed check, and the next variant still ran.
    oom = v["eager-chunked"]
    assert oom["status"] == "out_of_memory" and "OutOfMemoryError" in oom["error"], oom
    assert not any("eager-chunked" in name for name, ok in stage["checks"].items() if not ok)
    for name in ("sdpa-chunked", "sdpa-fused"):
        rec = v[name]
        assert rec["status"] == "measured" and rec["all_steps_applied"], rec
        # What ran, from the live objects: transformers' sdpa (never covrl's varlen), the head asked, torch's
        # AdamW unfused on the CPU, fp32 parameters.
        assert rec["live"] == {"attention_calls": {"kernels": 0, "per_sample_sdpa": 0}, "head": name.split("-")[1],
                               "optimizer": "AdamW", "fused_adamw": False, "param_dtype": "float32",
                               "gradient_checkpointing": False}, rec["live"]
        (b,) = rec["budgets"]  # one budget: 8 samples of 64 tokens in rows of <= 320, so two micro-batches
        assert b["micro_batch_tokens"] == 320 and b["micro_batches"] == 2 and b["tokens_per_step"] == 512
        assert b["tokens_per_s"] > 0 and b["mfu"] is None  # no peak FLOP/s on a CPU
        assert b["peak_rss_gib"] > 0 and len(b["grad_norms"]) == 1
        # common/memplan.py's prediction for the same config, beside no CUDA peak (the rehearsal's: with why)
        plan = b["memory_plan"]
        assert plan["plan_bytes"] > 0 and plan["terms"]["parameters"] > 0 and plan["cuda"] is False, plan
        assert plan["peak_bytes"] is None and plan["within_tolerance"] is None and "CPU rehearsal" in plan["why"]
        assert fig["memory_plan"]["within"][f"7b-4l {name} @320"] is None
        prof = b["profile"]
        assert prof["clock"] == "CPU self time" and prof["total_s"] > 0
        parts = prof["attention_s"] + prof["head_s"] + prof["optimizer_s"] + prof["body_s"]
        assert abs(parts - prof["total_s"]) <= 1e-3
        # The untied stand-in's input embedding (397 x 64) is a lookup: not in the FLOP count.
        assert rec["n_params"] - rec["n_flop_params"] == 397 * 64
    assert v["sdpa-chunked"]["budgets"][0]["speedup"] == 1.0
    assert v["sdpa-fused"]["budgets"][0]["speedup"] > 0
    assert "covrl/head" in v["sdpa-fused"]["budgets"][0]["profile"]["labels_seen"]  # the fused head's range
    # fp32 on both sides, the same weights and batch: the first step agrees to rounding.
    ag = v["sdpa-fused"]["agreement"]
    assert ag["flagged"] == [] and ag["tolerance"] == 1e-3, ag
    assert max(ag["first_step_rel_diff"].values()) < 1e-5 and ag["hidden_rel_diff"] < 1e-5


def test_the_profile_split_counts_a_backward_where_its_forward_ran():
    """The learner stage's time split (hardware/learner_bench.py): the backward of an op run under covrl/attention
    counts as attention although the backward runs outside that range, and so does torch's sdpa op, forward and
    backward, where no range is around it; the rest is body; the parts add up."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from hardware.learner_bench import labeller, time_split

    x, w = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("covrl/attention"):
            y = (x @ w).tanh()  # tanh only here
        q = (y @ w).exp()  # exp only here
        # torch's attention op outside every range (an sdpa path without the label) is attention too
        a = torch.nn.functional.scaled_dot_product_attention(q[None], q[None], q[None], is_causal=True)[0]
        a.sum().backward()  # sum only here, and the backward outside every range
        with record_function("covrl/optimizer"), torch.no_grad():
            w.sub_(0.1 * w.grad)
    cpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.time_range.start)
    label = labeller(cpu)
    by_name = {}
    for e in cpu:
        by_name.setdefault(e.name, set()).add(label(e))
    backward = "autograd::engine::evaluate_function: "
    assert by_name[backward + "TanhBackward0"] == {"covrl/attention"}
    assert by_name[backward + "ExpBackward0"] == {"body"} and by_name[backward + "SumBackward0"] == {"body"}
    assert by_name["aten::tanh_backward"] == {"covrl/attention"} and by_name["aten::tanh"] == {"covrl/attention"}
    assert by_name["aten::sub_"] == {"covrl/optimizer"}
    # its backward: one fused node, or (torch's math path on a CPU) the nodes of its parts, softmax among them
    sdpa_backward = [n for n in by_name if n.startswith(backward) and ("Attention" in n or "Softmax" in n)]
    assert sdpa_backward and all(by_name[n] == {"covrl/attention"} for n in sdpa_backward), sdpa_backward
    split = time_split(prof.events(), device=False)
    assert split["labels_seen"] == ["covrl/attention", "covrl/optimizer"] and split["head_s"] == 0
    assert split["attention_ops_seen"] == ["aten::scaled_dot_product_attention"]
    assert split["attention_s"] > 0 and split["optimizer_s"] > 0 and split["body_s"] > 0
    parts = split["attention_s"] + split["head_s"] + split["optimizer_s"] + split["body_s"]
    assert abs(parts - split["total_s"]) <= 1e-3


def test_the_first_lease_command_runs_its_plan_then_the_tests_within_its_budget(tmp_path):
    """`make gpu-first-lease`, rehearsed: the Makefile's clock, the learner stage's plan in FIRST_LEASE_PLAN's
    order (the 7b-4l stand-in only, for time), the items a CPU cannot run skipped, then the GPU tests (all skipped
    here); the command's budget, its start and its preflight recorded."""
    out = tmp_path / "out"
    run = subprocess.run(["make", "-s", "gpu-first-lease", f"GPU_PY={sys.executable}",
                          "GPU_PROOF_ARGS=--rehearse-cpu --learner-shapes 7b-4l:320 --learner-steps 1,1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": str(out), "GPU_PROOF_WORK": str(tmp_path / "work")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    doc = json.loads((out / "gpu_proof.json").read_text())
    assert list(doc["stages"]) == ["learner", "tests"] and all(st["passed"] for st in doc["stages"].values())
    head = doc["first_lease"]
    assert head["budget_s"] == 480 and 0 <= head["before_proof_s"] < 30 and head["preflight_s"] > 0
    assert head["schedule_estimate"]["started"][0]["item"] == "0.5b sdpa-chunked"
    fig = doc["stages"]["learner"]["figures"]
    assert fig["plan"] == [f"7b-4l {v}" for s, v in FIRST_LEASE_PLAN if s == "7b-4l"]
    assert fig["budget_s"] <= 480 - FIRST_LEASE_TESTS_S
    v = fig["shapes"]["7b-4l"]["variants"]
    assert v["sdpa-chunked"]["status"] == v["sdpa-fused"]["status"] == "measured"
    assert v["varlen-triton"]["status"] == "skipped"
    assert doc["total_seconds"] < 480
