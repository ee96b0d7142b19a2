"""A run outlives its faults (issue 49), on local processes, in the short forms `make test` can afford (the long
soak is tests/bench/test_bench_soak.py):
- a generator that keeps failing (tests/faults/sitecustomize.py, crash.json) is set aside after
  cluster.generator_max_failures failures within the window, and the run trains every step with the others;
- when every generator is set aside, the launcher stops the run as a graceful stop does: the learners first write a
  checkpoint of their last trained step;
- a learner rank frozen with SIGSTOP ends the run by itself within transport.learner_timeout_s plus a minute, in one
  line naming the rank, and `covrl resume` then trains every step once.
Each test prints its times (`pytest -s`), the figures of docs/reliability.md's table."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from common.checkpoint_dirs import GOOD, complete_checkpoints, verify
from common.metrics import read_metrics
from common.runfiles import LAUNCHER_FILE, read_learner_beat
from tests.helpers.paths import REPO
from tests.helpers.runs import SMALL, launch, stop_gracefully

pytestmark = pytest.mark.slow


def crash_env(tmp_path, gen_id: int, after: int, then: int) -> dict[str, str]:
    """PYTHONPATH with the crash fault armed: generator `gen_id` crashes on its (after + 1)th generate, and every
    later incarnation on its (then + 1)th."""
    faults = tmp_path / "faults"
    faults.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "faults", "sitecustomize.py"), faults)
    (faults / "crash.json").write_text(json.dumps({"gen_id": gen_id, "after": after, "then": then,
                                                   "claim_dir": str(tmp_path)}))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(faults), os.environ.get("PYTHONPATH")]))}


def launcher_lines(run) -> list[dict]:
    with open(os.path.join(run, LAUNCHER_FILE)) as f:
        return [json.loads(line) for line in f]


def check_ledger(rows: list[dict]) -> None:
    assert all(r["hub/lost_prompts"] == 0 and r["hub/duplicate_trained_prompts"] == 0 for r in rows)


def test_a_generator_that_keeps_failing_is_set_aside_and_the_run_trains_every_step(tmp_path):
    run, steps = tmp_path / "run", 20
    t0 = time.monotonic()
    p = launch(run, "--gens", "2", "--steps", str(steps), *SMALL, "--set", "cluster.generator_max_failures=1",
               "--set", "cluster.generator_retry_after_s=3600", env=crash_env(tmp_path, gen_id=1, after=0, then=-1))
    took = time.monotonic() - t0
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "every step, each once"
    check_ledger(rows)
    assert p.stderr.count("gen1 set aside: failed 2 times within 10m00s (cluster.generator_max_failures=1)") == 1, p.stderr
    assert "the run goes on with 1 generator(s)" in p.stderr and "gen0 exited" not in p.stderr
    aside = [v for v in launcher_lines(str(run)) if v["why"] == "set_aside"]
    assert [v["gen_id"] for v in aside] == [1]
    assert rows[-1]["cluster/generators_set_aside"] == 1 and rows[0]["cluster/generators_set_aside"] <= 1
    with open(tmp_path / "gen1.crashed") as f:
        assert len(f.read().split()) == 2, "two incarnations of gen1 crashed, no third was started"
    print(f"\nset aside: {steps} steps in {took:.0f}s with gen1 set aside after its 2nd crash")


def test_a_run_whose_generators_all_fail_stops_with_a_checkpoint_of_its_last_trained_step(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, **crash_env(tmp_path, gen_id=0, after=3, then=0)}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run), "--quiet",
                        "--gens", "1", "--steps", "40", *SMALL, "--set", "cluster.generator_max_failures=1"],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    took = time.monotonic() - t0
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "gen0 set aside: failed 2 times" in p.stderr and "no generator can serve: all 1 set aside" in p.stderr
    assert "the learners write a checkpoint of their last step" in p.stderr
    rows = read_metrics(str(run))
    last = rows[-1]["step"]
    assert last >= 1 and [r["step"] for r in rows] == list(range(1, last + 1))
    check_ledger(rows)
    newest, path = complete_checkpoints(str(run))[-1]
    assert newest == last, f"the checkpoint is of step {newest}, the last trained step is {last}"
    assert verify(path, checksums=True).state == GOOD
    with open(run / "logs" / "learner0.log") as f:
        assert f"checkpoint of step {last} written" in f.read()
    print(f"\nno generator left: stopped after {took:.0f}s with step_{last} written")


def test_a_frozen_learner_rank_ends_the_run_within_its_deadline_and_resume_finishes_it(tmp_path):
    run, steps, deadline_s = tmp_path / "run", 8, 35
    args = ["--gens", "1", "--learners", "2", "--steps", str(steps), *SMALL, "--set", "run.checkpoint_every_steps=2",
            "--set", f"transport.learner_timeout_s={deadline_s}", "--set", "transport.batch_timeout_s=25",
            "--set", "transport.weight_send_timeout_s=5"]
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run), "--quiet",
                          *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen = None
    try:
        t_end = time.time() + 240
        while not os.path.isdir(run / "checkpoints" / "step_2") and p.poll() is None and time.time() < t_end:
            time.sleep(0.1)
        beat = read_learner_beat(str(run), 1)
        assert beat is not None and p.poll() is None, f"the run never reached the step-2 checkpoint ({p.poll()})"
        frozen = beat.pid
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, err = p.communicate(timeout=deadline_s + 60)
        ended = time.monotonic() - frozen_at
    finally:
        if p.poll() is None:
            stop_gracefully(p)
        if frozen is not None and psutil.pid_exists(frozen):
            try:
                os.kill(frozen, signal.SIGKILL)  # a stopped process would outlive the test otherwise
            except ProcessLookupError:
                pass
    assert p.returncode not in (0, None), f"exit {p.returncode}\n{out}\n{err}"
    assert ended <= deadline_s + 60
    named = [ln for ln in err.splitlines() if f"learner1 (pid {frozen})" in ln and "stopping the run" in ln]
    assert len(named) == 1, err
    t0 = time.monotonic()
    launch(run, "--resume", str(run), timeout=300)
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "every step once, after the resume"
    check_ledger(rows)
    print(f"\nfrozen learner rank: run ended {ended:.0f}s after the freeze (deadline {deadline_s}s): {named[0]}; "
          f"resume to step {steps} in {time.monotonic() - t0:.0f}s")
