"""Runs of launch/cluster.py from a test: small settings, run to the end or started, waited for, stopped gracefully."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from common.metrics import CLOCK_KEYS, read_metrics
from tests.helpers.paths import REPO

SMALL = ["--set", "rollout.groups_per_step=8", "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=24",
         "--set", "data.train_size=256", "--set", "eval.every_steps=0"]
# Evaluation on: small held-out sets, two evaluated versions besides the base model.
EVAL = [*SMALL[:-2], "--set", "eval.every_steps=2", "--set", "data.eval_size=16", "--set", "eval.temperatures.arith_hard=0"]
VOLATILE = CLOCK_KEYS  # wall-clock measurements: the only keys allowed to differ between runs


def launch(run_dir, *args, timeout=600, env: dict[str, str] | None = None):
    """The launcher run to its end (with `env` over this process's environment); fails the test, with the tail of
    every role's log, unless it exits 0."""
    cmd = [sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run_dir), "--quiet", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env=None if env is None else {**os.environ, **env})
    assert p.returncode == 0, f"cluster exited {p.returncode}\n{p.stdout}\n{p.stderr}\n" + "".join(
        open(os.path.join(run_dir, "logs", f)).read()[-3000:] for f in sorted(os.listdir(os.path.join(run_dir, "logs"))))
    return p


def start(run_dir, *args) -> subprocess.Popen:
    """The launcher in the background, for tests that act on the run while it trains."""
    return subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run_dir),
                             "--quiet", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(run_dir, n: int, timeout_s: float = 240) -> None:
    """Block until RUN_DIR/metrics.jsonl holds `n` rows; fails the test after `timeout_s`."""
    import time

    deadline = time.time() + timeout_s
    while len(read_metrics(str(run_dir))) < n and time.time() < deadline:
        time.sleep(0.2)
    assert len(read_metrics(str(run_dir))) >= n, f"the run never reached step {n}"


def stop_gracefully(p: subprocess.Popen, timeout_s: float = 60) -> None:
    """A launcher still running when a test is done with it: SIGINT (the learners finish their step and checkpoint,
    then every role it started is stopped), SIGKILL if it has not ended within `timeout_s` (after SIGUSR1: its
    threads' stacks on its stderr, for the test's failure message)."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)  # the launcher prints every thread's stack (launch/cluster.py): where it hangs
        try:
            p.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            pass  # the stack is written by then; the kill below ends it
        p.kill()
        p.communicate()
