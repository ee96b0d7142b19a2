"""A role process that dies with the process that started it.

Each role runs in a process group of its own (so signals reach its reward workers too), as a child of the launcher
(`launch/local.py`) or of a Ray actor (`launch/ray_backend.py`), which sets `COVRL_LIFELINE_PID` to its own pid.
`watch_parent` ends the role's whole process group as soon as its parent is no longer that process: when Ray ends
an actor whose node was lost (it does not end the actor's child), or when the launcher is SIGKILLed. So a
generator never keeps talking to the hub as a ghost of an incarnation already restarted elsewhere, nor holds a
GPU after its launcher is gone.
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
