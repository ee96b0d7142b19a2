"""Ray nodes a test owns: `ray start --block` in a session of its own, waited for, stopped with its whole session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers.paths import REPO

RAY = os.path.join(os.path.dirname(sys.executable), "ray")  # the venv's Ray command line


def start_node(argv: list[str], log_path) -> subprocess.Popen:
    """`ray start ... --block` in a session of its own: every Ray process of the node (GCS, raylet, agents, and
    the workers, which get process groups of their own) stays in that session."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_started(p: subprocess.Popen, log_path, what: str, timeout_s: float = 120) -> None:
    """Block until the node's log says it started; fails the test if it exits first or takes over `timeout_s`."""
    deadline = time.time() + timeout_s
    while "Ray runtime started" not in log_path.read_text(errors="replace"):
        assert p.poll() is None, f"{what} exited {p.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}"
        assert time.time() < deadline, f"{what} did not start in {timeout_s:.0f}s:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.5)


def _session(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except ProcessLookupError:
                pass
    return pids


def stop_node(p: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` alone: it drains the node and stops its processes in order (a second or
    two; SIGTERM to its whole group kills the GCS under the drain, which then waits 30 s for it). Then SIGKILL
    whatever is left in its session."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    for _ in range(20):
        left = _session(p.pid)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.poll()  # reap the leader if it was SIGKILLed here
        time.sleep(0.5)
