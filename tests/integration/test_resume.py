"""Learner death and resume, a crash inside a checkpoint write, graceful stop, numerical faults.

Every run here is deterministic (`run.deterministic`, the default), so a resumed run must write exactly
the rows an uninterrupted run writes, wall-clock figures and the restart's own bookkeeping aside.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from common.checkpoint_dirs import complete_checkpoints
from common.metrics import read_metrics
from tests.conftest import REPO
from tests.integration.test_cluster import EVAL, VOLATILE, launch, start

pytestmark = pytest.mark.slow

RUN = ["--gens", "1", "--learners", "2", "--steps", "6", *EVAL, "--set", "run.checkpoint_every_steps=2"]
# What a restart changes by itself: the prompts it re-issues, the generators that join again.
RESTART_KEYS = ("hub/reissued_prompts", "weights/joins", "weights/dropped_channels", "hub/generator_lost/")


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE + RESTART_KEYS)}


def wait_for_checkpoint(run_dir, step: int, p: subprocess.Popen, timeout_s: float = 300) -> None:
    import time

    deadline = time.time() + timeout_s
    while not any(s >= step for s, _ in complete_checkpoints(str(run_dir))):
        assert p.poll() is None, f"the run ended before checkpoint {step}: {p.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"no checkpoint {step} after {timeout_s}s"
        time.sleep(0.2)


def learner0(p: subprocess.Popen) -> psutil.Process:
    (proc,) = [c for c in psutil.Process(p.pid).children() if c.cmdline()[1:3] == ["-m", "learner"]
               and c.environ().get("RANK") == "0"]
    return proc


def test_resume_after_sigkill_and_after_a_crash_mid_checkpoint_equals_the_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    launch(whole, *RUN)
    expected = read_metrics(str(whole))
    assert [r["step"] for r in expected] == list(range(7))

    # 1. SIGKILL learner rank 0 (and nothing else) once the step-2 checkpoint is on disk: the launcher stops the run.
    run = tmp_path / "killed"
    p = start(run, *RUN)
    try:
        wait_for_checkpoint(run, 2, p)
        os.killpg(learner0(p).pid, signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1 and "learner0 exited with code -9" in err, err[-2000:]
    assert f"step_2 (continue with covrl resume {run})" in out, out  # the summary says how to continue
    # 2. Resume; die inside the step-4 checkpoint write (after the model files, before the rename).
    env = {**os.environ, "COVRL_FAULT_CRASH_IN_CHECKPOINT": "4"}
    crashed = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--resume", str(run), "--quiet"],
                             cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    assert (run / "checkpoints" / "step_4.tmp").is_dir(), "the fault did not hit the checkpoint write"
    assert [s for s, _ in complete_checkpoints(str(run))] == [2], "a half-written checkpoint was taken as complete"
    # 3. Resume again: from step 2, since step 4 never completed; then to the end.
    launch(run, "--resume", str(run))
    got = read_metrics(str(run))
    assert [r["step"] for r in got] == list(range(7)), "rows lost or written twice"
    for want, have in zip(expected, got):
        assert comparable(have) == comparable(want), f"step {want['step']} differs after resuming"
    assert got[-1]["hub/lost_prompts"] == 0 and got[-1]["hub/duplicate_trained_prompts"] == 0
    a = load_file(str(whole / "checkpoints" / "step_6" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_6" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's final weights differ"


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_non_finite_steps_are_skipped_and_too_many_in_a_row_stop_with_a_checkpoint(tmp_path, zero_stage):
    """Step 3's loss is NaN: that update is skipped and the weights stay those of step 2. Steps 5 and 6 too:
    two in a row (learner.max_consecutive_skipped_steps=2) stop the run with a checkpoint and a clear message.
    ZeRO-1 skips inside DeepSpeed (the grad norm is not finite); stage 0 is our own check."""
    from tests.integration.test_cluster import SMALL

    run = tmp_path / "nan"
    env = {**os.environ, "COVRL_FAULT_NONFINITE_STEPS": "3,5-6"}
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run), "--quiet",
                        "--steps", "8", *SMALL, "--set", "learner.max_consecutive_skipped_steps=2",
                        "--set", f"learner.zero_stage={zero_stage}"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 1 and "learner0 exited with code 3" in p.stderr, p.stderr[-3000:]
    assert "non-finite loss or gradient" in p.stderr and "learner.max_consecutive_skipped_steps=2" in p.stderr
    rows = {r["step"]: r for r in read_metrics(str(run))}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert [rows[s]["actor/skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 0, 1, 1]
    checksum = {s: rows[s]["weights/checksum"] for s in rows}
    assert checksum[3] == checksum[2] and checksum[4] != checksum[3], "a skipped step changed the weights"
    assert checksum[6] == checksum[5] == checksum[4]
    assert rows[3]["actor/grad_norm"] is None  # no applied optimizer step to report (NaN is written as null)
    assert [s for s, _ in complete_checkpoints(str(run))] == [6]
    saved = load_file(str(run / "checkpoints" / "step_6" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in saved.values())
