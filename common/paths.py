"""Checks on the paths a command is given, made before anything starts. Standard library only: the GPU proof runs
them before it knows which of covrl's dependencies the machine has."""

from __future__ import annotations

import os


def unwritable(path: str) -> str | None:
    """Why the directory `path` (made if missing) cannot be written to, or None."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None
