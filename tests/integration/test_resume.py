"""Learner death and resume, a crash inside a checkpoint write, damaged checkpoints, numerical faults.

Every run here is deterministic (`run.deterministic`, the default), so a resumed run must write exactly
the rows an uninterrupted run writes, wall-clock figures and the restart's own bookkeeping aside. One
uninterrupted run (`whole`, checkpoints at steps 2, 4 and 6) is the reference for every resume here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from common.checkpoint_dirs import MANIFEST, complete_checkpoints
from common.metrics import read_metrics
from tests.helpers.paths import REPO
from tests.helpers.runs import EVAL, SMALL, VOLATILE, launch, start

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


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: 6 steps, 2 learner ranks, checkpoints at 2, 4 and 6."""
    run = tmp_path_factory.mktemp("resume") / "whole"
    launch(run, *RUN)
    assert [r["step"] for r in read_metrics(str(run))] == list(range(7))
    assert [s for s, _ in complete_checkpoints(str(run))] == [2, 4, 6]
    return run


def test_resume_after_sigkill_and_after_a_crash_mid_checkpoint_equals_the_uninterrupted_run(tmp_path, whole):
    expected = read_metrics(str(whole))

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


# ---- damaged checkpoints: each damage a storage hiccup leaves, on a copy of `whole`

SHARD = "deepspeed/mp_rank_00_model_states.pt"
OPTIM = "deepspeed/zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def truncate(path: str, size: int = 1000) -> None:
    os.truncate(path, size)


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def resumed_like_whole(run, whole, *args) -> subprocess.CompletedProcess:
    """Resume `run` to step 6 (covrl resume, as a user types it); its rows and final weights must be `whole`'s."""
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "resume", str(run), "--quiet", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    got, expected = read_metrics(str(run)), read_metrics(str(whole))
    assert [r["step"] for r in got] == list(range(7)), "rows lost or written twice"
    for want, have in zip(expected, got):
        assert comparable(have) == comparable(want), f"step {want['step']} differs after resuming"
    a = load_file(str(whole / "checkpoints" / "step_6" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_6" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's final weights differ"
    return p


def damaged(whole, tmp_path, **damage) -> os.PathLike:
    """A copy of `whole` with `damage[step_N](checkpoint_dir)` done to each named checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    for name, do in damage.items():
        do(str(run / "checkpoints" / name))
    return run


def test_damaged_checkpoints_are_passed_over_and_the_resume_equals_the_uninterrupted_run(tmp_path, whole):
    """What storage does to files after the rename: a copy cut short (the DeepSpeed shard, the HF export), a flipped
    byte (the optimizer state: same size, caught by its checksum), a lost rank file (rank 1's optimizer state). Each
    resume says what is wrong with each checkpoint it passes over, sets it aside (kept), starts from step_2 and
    trains steps 3-6 exactly as `whole` did. In the second, step_2 has no manifest, as a checkpoint written before
    covrl wrote them: it still loads, said unverified."""
    run = damaged(whole, tmp_path / "a", step_6=lambda c: flip_byte(os.path.join(c, OPTIM.format(0))),
                  step_4=lambda c: truncate(os.path.join(c, SHARD)))
    p = resumed_like_whole(run, whole, "--steps", "6")
    assert f"step_6 is damaged ({OPTIM.format(0)} has CRC-32 " in p.stdout, p.stdout
    assert f"step_4 is damaged ({SHARD} is 1,000 bytes, expected " in p.stdout
    assert "resuming from step_2 (verified: 14 files" in p.stdout
    assert "covrl: 4 steps in this launch (steps 3-6)" in p.stdout, p.stdout
    assert sorted(os.listdir(run / "checkpoints")) == ["step_2", "step_4", "step_4.damaged", "step_6", "step_6.damaged"]

    run = damaged(whole, tmp_path / "b", step_6=lambda c: os.remove(os.path.join(c, OPTIM.format(1))),
                  step_4=lambda c: truncate(os.path.join(c, "model.safetensors")),
                  step_2=lambda c: os.remove(os.path.join(c, MANIFEST)))
    p = resumed_like_whole(run, whole, "--steps", "6")
    assert f"step_6 is damaged ({OPTIM.format(1)} is missing)" in p.stdout, p.stdout
    assert "step_4 is damaged (model.safetensors is 1,000 bytes, expected " in p.stdout
    assert "resuming from step_2 (unverified: it has no manifest" in p.stdout
    # --from: back to step_4 of this resumed run (steps 5-6 again); the newer good one is kept aside.
    p = resumed_like_whole(run, whole, "--from", "step_4")
    assert "step_6 is newer than --from step_4: set aside as checkpoints/step_6.superseded" in p.stdout, p.stdout
    assert "covrl: 2 steps in this launch (steps 5-6)" in p.stdout
    assert (run / "checkpoints" / "step_6.superseded").is_dir() and (run / "checkpoints" / "step_6.damaged").is_dir()


def test_an_old_checkpoint_that_does_not_load_stops_the_launch_and_names_the_one_before(tmp_path, whole):
    """The issue's storage hiccup on a checkpoint from before manifests: nothing can tell it is damaged until a
    learner loads it. The launch stops in one line; its summary counts no step and, instead of a resume that would
    fail the same way for ever, gives the --from of the checkpoint before."""
    def old_and_cut_short(c):
        os.remove(os.path.join(c, MANIFEST))
        truncate(os.path.join(c, SHARD))

    run = damaged(whole, tmp_path, step_6=old_and_cut_short)
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "resume", str(run), "--steps", "8", "--quiet"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "resuming from step_6 (unverified: it has no manifest" in p.stdout
    assert "step_6 could not be loaded by learner rank" in p.stderr and "--from step_4" in p.stderr, p.stderr
    assert "covrl: no step trained in this launch" in p.stdout and "continue with" not in p.stdout, p.stdout
    assert f"could not load it: resuming from it fails the same way until the cause above is fixed; or resume from an " \
           f"earlier one: covrl resume {run} --from step_4" in p.stdout
    assert [r["step"] for r in read_metrics(str(run))] == list(range(7)), "rows changed by a launch that trained none"


def test_with_no_good_checkpoint_a_resume_stops_in_one_line_and_moves_nothing(tmp_path, whole):
    run = damaged(whole, tmp_path, **{f"step_{s}": lambda c: truncate(os.path.join(c, "model.safetensors"))
                                      for s in (2, 4, 6)})
    before = sorted(os.listdir(run / "checkpoints"))
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "resume", str(run), "--steps", "8"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stdout + p.stderr
    assert p.stderr.startswith(f"error: {run}: no checkpoint verifies (step_6: model.safetensors is 1,000 bytes")
    assert f"covrl verify {run}" in p.stderr
    assert sorted(os.listdir(run / "checkpoints")) == before, "a damaged checkpoint was moved or deleted"
