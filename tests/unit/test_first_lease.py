"""The first lease's command (`make gpu-first-lease`, hardware/proof.py --first-lease): its plan and time budget by
the stage's own estimates, the worker's decision to start an item, and the arguments it refuses. The command
itself is rehearsed on the CPU in tests/integration/test_gpu_proof.py."""

import argparse
import time

import pytest

from hardware import learner_bench, proof


def test_the_plan_fits_480_s_with_the_mfu_items_first_and_room_for_the_tests():
    sched = proof.first_lease_schedule()
    assert sched["budget_s"] == proof.FIRST_LEASE_S == 480
    started = [x["item"] for x in sched["started"]]
    # Today's path and the new one on both shapes: what the MFU goals compare, before anything else.
    assert started[:4] == ["0.5b sdpa-chunked", "0.5b varlen-triton", "7b-4l sdpa-chunked", "7b-4l varlen-triton"]
    # Each item ends before the stage stops starting items; the tests get at least what the stage reserves.
    assert all(x["end_s"] <= sched["learner_stops_starting_s"] for x in sched["started"])
    assert sched["learner_ends_s"] <= proof.FIRST_LEASE_S - proof.FIRST_LEASE_TESTS_S
    assert sched["tests_s"] >= proof.FIRST_LEASE_TESTS_MIN_S
    # The unpack and the preflight come first: the first item starts after them and the worker's start.
    assert sched["started"][0]["start_s"] == (proof.FIRST_LEASE_UNPACK_S + proof.FIRST_LEASE_PREFLIGHT_S
                                              + learner_bench.WORKER_START_S)
    # Every item of the plan is either started or said not to be, in the plan's order.
    assert sorted(started + sched["not_started"]) == sorted(f"{s} {v}" for s, v in proof.FIRST_LEASE_PLAN)
    # The compiled head and today's fused head are measured beside the Triton head on the 0.5B shape at least.
    assert {"0.5b varlen-inductor", "0.5b varlen-fused"} <= set(started)


def test_a_shorter_budget_cuts_from_the_end_of_the_plan():
    short = proof.first_lease_schedule(budget_s=300)
    started = [x["item"] for x in short["started"]]
    assert started[:2] == ["0.5b sdpa-chunked", "0.5b varlen-triton"]
    assert short["learner_ends_s"] <= 300 - proof.FIRST_LEASE_TESTS_S
    assert len(started) < len(proof.first_lease_schedule()["started"])
    only = proof.first_lease_schedule(shapes={"0.5b"})
    assert all(x["item"].startswith("0.5b ") for x in only["started"])


def test_estimates_count_the_model_and_each_compile_once_per_shape():
    triton = proof.learner_variant("varlen-triton")
    first = learner_bench.estimate_s("0.5b", triton, True, set())
    assert first == (learner_bench.VARIANT_S["0.5b"] + learner_bench.FIRST_USE_S["triton"]
                     + learner_bench.MODEL_BUILD_S["0.5b"])
    paid = learner_bench.first_uses("0.5b", triton)
    assert learner_bench.estimate_s("0.5b", triton, False, paid) == learner_bench.VARIANT_S["0.5b"]
    # Paid on one shape is not paid on the other (the kernels specialize on the vocabulary).
    assert learner_bench.estimate_s("7b-4l", triton, False, paid) > learner_bench.VARIANT_S["7b-4l"]
    gc = learner_bench.estimate_s("0.5b", proof.learner_variant("sdpa-chunked-gc"), False, set())
    assert gc == pytest.approx(learner_bench.VARIANT_S["0.5b"] * learner_bench.GC_FACTOR)
    compile_ = learner_bench.estimate_s("0.5b", proof.learner_variant("varlen-fused-compile"), False, set())
    assert compile_ == learner_bench.VARIANT_S["0.5b"] + learner_bench.FIRST_USE_S["compile"]


def test_the_worker_starts_an_item_only_if_its_estimate_fits():
    spec = {"deadline_unix": time.time() + 100}
    assert learner_bench.over_budget(spec, 90) is None
    why = learner_bench.over_budget(spec, 130)
    assert why is not None and "needs about 130s" in why and "\n" not in why
    assert learner_bench.over_budget({}, 1e9) is None  # no deadline: everything runs


def test_the_learner_stage_stops_before_the_tests_and_kills_its_worker_in_time():
    args = argparse.Namespace(first_lease=True)
    now = time.monotonic()
    ctx = proof.Ctx(args=args, scale=proof.GPU, facts={}, deadline=now + 400)
    stop, kill = proof.learner_deadlines(ctx)
    assert stop == pytest.approx(now + 400 - proof.FIRST_LEASE_TESTS_S)
    assert kill == pytest.approx(now + 400 - proof.FIRST_LEASE_TESTS_MIN_S)
    assert proof.FIRST_LEASE_TESTS_MIN_S >= 60 + 10  # run_proof starts no stage with less than a minute left
    # Without --first-lease: the stage's budget and its grace, both within the command's deadline.
    ctx = proof.Ctx(args=argparse.Namespace(first_lease=False), scale=proof.GPU, facts={}, deadline=now + 200)
    stop, kill = proof.learner_deadlines(ctx)
    assert stop <= now + 200 - 10 and kill <= now + 200 - 10


def test_first_lease_arguments(capsys):
    args = proof.parse_args(["--first-lease", "--out", "/tmp/x"])
    assert args.stages == ["learner", "tests"] and args.deadline_s == 480
    assert proof.learner_plan(args, proof.LEARNER_SHAPES) == list(proof.FIRST_LEASE_PLAN)
    t0 = time.time() - 30
    args = proof.parse_args(["--first-lease", "--command-start-unix", str(t0), "--deadline-s", "470"])
    assert args.command_start_unix == t0 and args.deadline_s == 470
    for bad, said in ((["--first-lease", "--stages", "learner"], "leave out --stages"),
                      (["--learner-inject-oom", "sdpa-fused"], "--rehearse-cpu"),
                      (["--command-start-unix", str(time.time() - 7200)], "within the hour")):
        with pytest.raises(SystemExit):
            proof.parse_args(bad)
        assert said in capsys.readouterr().err
    plain = proof.parse_args([])
    assert plain.stages == list(proof.STAGES)
    assert proof.learner_plan(plain, {"0.5b": {}}) == [("0.5b", v) for v in proof.LEARNER_VARIANTS]


def test_every_plan_item_is_a_variant_the_stage_knows():
    for shape, name in proof.FIRST_LEASE_PLAN:
        assert shape in proof.LEARNER_SHAPES
        over = proof.learner_variant(name)
        assert over["learner.logprob_head"] in proof.LEARNER_HEADS
    assert len(set(proof.FIRST_LEASE_PLAN)) == len(proof.FIRST_LEASE_PLAN)
    with pytest.raises(ValueError, match="HEAD one of chunked, fused, triton, inductor"):
        proof.learner_variant("varlen-flash")
