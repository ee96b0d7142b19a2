"""Checkpoints: a Hugging Face model directory plus the learner's and hub's state.

`RUN_DIR/checkpoints/step_N/` is written to `step_N.tmp/` and renamed into
place, so a reader (or a resume after a crash mid-write) sees either the whole
checkpoint or none of it.
"""

from __future__ import annotations

import json
import os
import shutil


def save_checkpoint(run_dir: str, step: int, module, tokenizer, state: dict, state_dict: dict | None = None) -> str:
    """`state_dict`: the full parameters when the module holds only shards (ZeRO-3, see learner/params.py)."""
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    module.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "covrl_state.json"), "w") as f:
        json.dump({"step": step, **state}, f, indent=1)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
