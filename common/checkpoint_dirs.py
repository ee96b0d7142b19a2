"""Finding the checkpoints of a run (no torch: the launcher imports this).

learner/checkpoint.py writes them; see its docstring for the layout.
"""

from __future__ import annotations

import os
import re

STATE_FILE = "covrl_state.json"  # written last: a directory without it is not a checkpoint
DS_TAG = "deepspeed"  # the engine state's subdirectory
_STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first. `.tmp` directories (a write that
    never finished) and directories without the state file are not checkpoints."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)) and os.path.isdir(os.path.join(path, DS_TAG)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str) -> tuple[int, str] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None
