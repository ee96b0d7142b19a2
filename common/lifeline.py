"""A role process that dies with the process that started it.

Under Ray (`launch/ray_backend.py`) each role runs as a child of a Ray actor, in a process group of its own so
that signals reach its reward workers too. When the actor's node is lost, Ray ends the actor, but not the child
it started; the launcher sets `COVRL_LIFELINE_PID` to the actor's pid, and `watch_parent` ends the role's whole
process group as soon as its parent is no longer that process. So a generator never outlives its actor and keeps
talking to the hub as a ghost of an incarnation that Ray has already restarted elsewhere.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

LIFELINE_ENV = "COVRL_LIFELINE_PID"

log = logging.getLogger("covrl.lifeline")


def watch_parent(environ=os.environ, period_s: float = 1.0) -> threading.Thread | None:
    """If `COVRL_LIFELINE_PID` is set, start a daemon thread that kills this process group once the parent
    process is gone (the child is re-parented, so `os.getppid()` changes). Returns the thread, or None."""
    text = environ.get(LIFELINE_ENV)
    if not text:
        return None
    try:
        parent = int(text)
    except ValueError:
        raise ValueError(f"{LIFELINE_ENV}={text!r}: the pid of the process this role must not outlive") from None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        log.error("parent process %d is gone: ending this role's process group", parent)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    if os.getppid() != parent:  # already orphaned before we looked
        watch()
    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread
