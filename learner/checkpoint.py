"""Checkpoints: everything a run needs to continue after a crash, written atomically.

`RUN_DIR/checkpoints/step_N/`:
- `model.safetensors`, `config.json`, tokenizer files: the policy as a Hugging Face model
  directory (for evaluation, users, and `model.path` of a new run);
- `deepspeed/`: every rank's engine state (`engine.save_checkpoint`): parameters, AdamW
  moments and step counts, sharded as the ZeRO stage shards them;
- `rng/rank_R.pt`: each rank's torch, numpy and python RNG states;
- `hub.msgpack`: the hub (broker/state.py `HubState`): ledger, data position, admission
  counters, and the rollouts already generated for later steps;
- `covrl_state.json`: the step, PAR state and held metric rows. Written last.

Every rank writes into `step_N.tmp/`; after a barrier rank 0 renames it to `step_N/`. A crash
mid-write leaves a `.tmp` directory that `latest_checkpoint` ignores, so the previous
checkpoint stays the one a resume uses.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from common.checkpoint_dirs import DS_TAG, STATE_FILE, complete_checkpoints, latest_checkpoint  # noqa: F401 (re-exported)

log = logging.getLogger("covrl.checkpoint")

HUB_FILE = "hub.msgpack"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(run_dir: str, step: int, engine, *, rank: int, tokenizer=None, state: dict | None = None,
                    hub_state: bytes | None = None, state_dict: dict | None = None, keep_last: int = 0) -> str:
    """A collective: every rank calls it. Rank 0 passes the tokenizer, `state` (JSON-able) and `hub_state`.

    `state_dict`: the full parameters when the module holds only shards (ZeRO-3, learner/params.py).
    `keep_last` > 0: delete all but the newest `keep_last` complete checkpoints afterwards.
    """
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    engine.save_checkpoint(tmp, tag=DS_TAG, save_latest=False)
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        engine.module.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if os.environ.get("COVRL_FAULT_CRASH_IN_CHECKPOINT") == str(step):  # fault injection (tests): die mid-write
            log.error("COVRL_FAULT_CRASH_IN_CHECKPOINT=%d: exiting in the middle of the checkpoint write", step)
            os._exit(9)
        _write_synced(os.path.join(tmp, HUB_FILE), hub_state or b"")
        _write_synced(os.path.join(tmp, STATE_FILE), json.dumps({"step": step, **(state or {})}, indent=1).encode())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last:
            for old, path in complete_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(path)
                log.info("removed checkpoint step_%d (run.keep_checkpoints=%d)", old, keep_last)
    dist.barrier()
    return final


def load_checkpoint(path: str, engine, *, rank: int) -> dict:
    """Restore this rank's engine (parameters, optimizer, step counts) and RNG states; returns the
    run state (`covrl_state.json`) and, on rank 0, the hub state bytes under "hub"."""
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    world = dist.get_world_size()
    if state["learners"] != world:
        raise RuntimeError(f"{path} was written by {state['learners']} learner ranks and this run has {world}: "
                           f"the optimizer state is sharded per rank; resume with --learners {state['learners']}")
    load_path, _ = engine.load_checkpoint(path, tag=DS_TAG, load_module_strict=True, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state in {path}/{DS_TAG}; the checkpoint is damaged: "
                           f"delete {path} to resume from the one before it")
    rng = os.path.join(path, "rng", f"rank_{rank}.pt")
    if not os.path.exists(rng):
        raise RuntimeError(f"{rng} is missing: the checkpoint is damaged; delete {path} to resume from the one "
                           f"before it")
    set_rng_state(torch.load(rng, weights_only=False))  # our own file: numpy's state is a tuple with an array
    if rank == 0:
        with open(os.path.join(path, HUB_FILE), "rb") as f:
            state["hub"] = f.read()
    return state
