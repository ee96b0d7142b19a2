"""Stopping what the launcher started: every role (and TensorBoard, and each GPU-proof stage) runs in a session of
its own, so its process group holds it and whatever it spawned (reward workers, engine workers), and nothing else.
These functions are the only place covrl signals such a group (a role ending its own group when its launcher is
gone, common/lifeline.py, is the one exception: common/ cannot import launch/).
"""

from __future__ import annotations

import os
import signal
import subprocess


def signal_group(pid: int, sig: int) -> bool:
    """Send `sig` to the process group led by `pid` (started with start_new_session=True, so its group id is its
    pid). False if the group is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_group(p: subprocess.Popen, steps: list[tuple[int, float]]) -> bool:
    """Stop the group `p` leads one step at a time: send each step's signal, then wait up to its seconds for `p`
    to exit; the next step only if it has not. True once `p` has exited."""
    for sig, wait_s in steps:
        if p.poll() is not None or not signal_group(p.pid, sig):
            break
        try:
            p.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return p.poll() is not None


def term_then_kill(grace_s: float) -> list[tuple[int, float]]:
    """The usual steps: SIGTERM, and SIGKILL after `grace_s`."""
    return [(signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)]
