"""Checkpoints: everything a run needs to continue after a crash, written atomically.

`RUN_DIR/checkpoints/step_N/`:
- `model.safetensors`, `config.json`, tokenizer files: the policy as a Hugging Face model
  directory (for evaluation, users, and `model.path` of a new run);
- `deepspeed/`: every rank's engine state (`engine.save_checkpoint`): parameters, AdamW
  moments and step counts, sharded as the ZeRO stage shards them;
- `rng/rank_R.pt`: each rank's torch, numpy and python RNG states;
- `hub.msgpack`: the hub (broker/state.py `HubState`): ledger, data position, admission
  counters, and the rollouts already generated for later steps;
- `covrl_state.json`: the step, PAR state and held metric rows;
- `manifest.json`: every file's size and CRC-32 (common/checkpoint_dirs.py). Written last.

Every rank writes into `step_N.tmp/`; after a barrier, ranks 1.. checksum their own shards (the last rank rank 0's
engine files too) while rank 0 writes the model export and the state, then rank 0 writes the manifest and renames
the directory to `step_N/`. A crash mid-write leaves a `.tmp` directory that no resume takes, so the previous
checkpoint stays the one a resume uses; a file damaged afterwards fails `verify` against the manifest, and a resume
passes that checkpoint over. A disk that fills mid-write is said in one line (`DiskFullError`, common/diskspace.py):
the step directory, the space it needs, the space free, and that the previous checkpoint is intact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from common.checkpoint_dirs import (DS_TAG, GOOD, LOAD_FAILED, STATE_FILE, UNVERIFIED, checkpoint_bytes, choose,
                                    complete_checkpoints, earlier_usable, set_aside, verify, write_manifest,
                                    write_rank_part, write_synced)
from common.diskspace import (DiskFullError, disk_full_error, free_bytes, is_disk_full, resume_advice,
                              tree_bytes)

log = logging.getLogger("covrl.checkpoint")

HUB_FILE = "hub.msgpack"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: str, step: int, engine, *, rank: int, tokenizer=None, state: dict | None = None,
                    hub_state: bytes | None = None, state_dict: dict | None = None, keep_last: int = 0) -> str:
    """A collective: every rank calls it. Rank 0 passes the tokenizer, `state` (JSON-able) and `hub_state`.

    `state_dict`: the full parameters when the module holds only shards (ZeRO-3, learner/params.py).
    `keep_last` > 0: delete all but the newest `keep_last` complete checkpoints afterwards.
    """
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    try:  # everything that writes into tmp; nothing after the rename
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
            write_synced(os.path.join(tmp, HUB_FILE), hub_state or b"")
            write_synced(os.path.join(tmp, STATE_FILE), json.dumps({"step": step, **(state or {})}, indent=1).encode())
        else:
            write_rank_part(tmp, rank, dist.get_world_size())  # checksummed while rank 0 writes the export
        dist.barrier()  # every file and every rank's share of the manifest is written
        if rank == 0:
            write_manifest(tmp, dist.get_world_size())
    except Exception as e:  # one line on a full disk; any other failure passes unchanged
        if (full := disk_full(e, run_dir, final, engine)) is None:
            raise
        raise full from e
    if rank == 0:
        if os.path.exists(final):  # a run resumed from an earlier checkpoint reached this step again
            log.warning("checkpoint step_%d already exists (from before the resume this run took); kept as %s",
                        step, set_aside(final, "superseded"))
        os.replace(tmp, final)
        if keep_last:
            for old, path in complete_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(path)
                log.info("removed checkpoint step_%d (run.keep_checkpoints=%d)", old, keep_last)
    dist.barrier()
    return final


def disk_full(e: Exception, run_dir: str, final: str, engine) -> DiskFullError | None:
    """The one-line error for `e`, raised while this rank wrote checkpoint `final` (into `final`.tmp), when the disk
    is full; None otherwise. The rank that hit the full disk says it; the others time out on their barrier, as they
    do for any rank's failure there (or, reaching the same full disk, say the same)."""
    tmp = final + ".tmp"
    total, written = checkpoint_need(run_dir, engine), tree_bytes(tmp)
    need = max(total, written)
    if not is_disk_full(e, free_bytes(run_dir), total - written):  # free space now vs what remained to write
        return None
    # The failed write's frames hold torch's open file (its writer object): dropped, so that removing the file
    # below frees its space now rather than at exit. The chain's types and texts stay in the log.
    cause, seen = e, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        cause.__traceback__, cause = None, cause.__cause__ or cause.__context__
    # The partial directory goes: it holds space that the logs, metrics and summary need now (and the resume's
    # next checkpoint, though that one clears its own `.tmp` first), and no resume ever takes a `.tmp` (nor is one
    # renamed while a rank is missing from the barrier before the rename). A rank still writing into it then fails
    # on the missing directory rather than at its barrier: it stops either way. Only this `.tmp` path goes:
    # complete checkpoints are never touched.
    shutil.rmtree(tmp, ignore_errors=True)
    done = complete_checkpoints(run_dir)
    intact = (f"the previous checkpoint, step_{done[-1][0]}, is intact" if done else
              "the run has no earlier checkpoint, so it starts again from step 0")
    return disk_full_error(final, free_bytes(run_dir), resume_advice(run_dir, intact), need,
                           note=f"; its partial {os.path.basename(tmp)} was removed")


def checkpoint_need(run_dir: str, engine) -> int:
    """About what a checkpoint of this run takes on disk: the newest complete one's size (its manifest), else
    from the parameters: the export and the engine's copy at their dtype, plus AdamW's fp32 master copy and two
    moments (12 bytes a parameter)."""
    done = complete_checkpoints(run_dir)
    if done:
        return checkpoint_bytes(done[-1][1])
    return sum(getattr(p, "ds_numel", p.numel()) * (2 * p.element_size() + 12) for p in engine.module.parameters())


def resume_point(run_dir: str, rank: int) -> tuple[int, str] | None:
    """The checkpoint every rank resumes from: rank 0 picks it with `choose` (sizes only: the launcher checksummed
    the candidates and set aside what failed) and sends its step to the others (a CPU tensor: gloo, as for every
    bookkeeping collective), so no two ranks load different ones. None: no checkpoint, the run starts from step 0."""
    step, error = NONE, None
    if rank == 0:
        try:
            choice = choose(run_dir, checksums=False)
        except Exception as e:  # raised below, once the other ranks are told not to wait for a step
            choice, step, error = None, REFUSED, e
        for c in choice.skipped if choice else []:
            log.warning("%s is damaged (%s): passed over", c.name, c.why())
        if choice is not None and choice.check.state == UNVERIFIED:
            log.warning("%s has no manifest (written before covrl verified its checkpoints): loading it unverified",
                        choice.path)
        step = choice.step if choice else step
    sent = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(sent, src=0)
    step = int(sent.item())
    if step == REFUSED:
        raise error or RuntimeError("learner rank 0 found no checkpoint to resume from (its log says why)")
    return None if step == NONE else (step, os.path.join(run_dir, "checkpoints", f"step_{step}"))


NONE, REFUSED = -1, -2  # resume_point's broadcast: no checkpoint (start from step 0) / none usable (stop)


class WorldMismatch(RuntimeError):
    """The checkpoint was written by another number of learner ranks: the run's shape, not damage."""


@contextlib.contextmanager
def restoring(path: str, rank: int):
    """Around everything that reads a checkpoint back (the engine here, the hub and PAR in learner/__main__.py): a
    failure says what to do, in one line, and leaves RUN_DIR/load_failed.json, from which the launcher's summary
    knows not to offer the same resume again."""
    try:
        yield
    except WorldMismatch:
        raise
    except Exception as e:  # re-raised with the checkpoint's state and the way out
        cause = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        record_load_failure(path, rank, cause)
        raise RuntimeError(f"{os.path.basename(path)} could not be loaded by learner rank {rank}: "
                           f"{load_advice(path)} ({cause})") from e


def record_load_failure(path: str, rank: int, cause: str) -> None:
    """RUN_DIR/load_failed.json, whole (each rank writes its own file and renames it into place)."""
    run_dir = os.path.dirname(os.path.dirname(path))
    mine = os.path.join(run_dir, f"{LOAD_FAILED}.rank_{rank}")
    try:
        write_synced(mine, json.dumps({"checkpoint": os.path.basename(path), "rank": rank, "error": cause}).encode())
        os.replace(mine, os.path.join(run_dir, LOAD_FAILED))
    except OSError as e:  # the advice still goes out; the summary then cannot tell this failure from others
        log.error("could not write %s/%s (%s)", run_dir, LOAD_FAILED, e)


def load_checkpoint(path: str, engine, *, rank: int) -> dict:
    """Restore this rank's engine (parameters, optimizer, step counts) and RNG states; returns the run state
    (`covrl_state.json`) and, on rank 0, the hub state bytes under "hub"."""
    with restoring(path, rank):
        return _load(path, engine, rank)


def load_advice(path: str) -> str:
    """What a user can do about a checkpoint that did not load, from what its manifest says of it (sizes only:
    every failing rank asks, and the files may be large)."""
    run_dir = os.path.dirname(os.path.dirname(path))
    check = verify(path, checksums=False)
    earlier = earlier_usable(run_dir, check.step)
    way = (f"resume from an earlier one: covrl resume {run_dir} --from step_{earlier}" if earlier is not None else
           f"no earlier checkpoint: start a new run (covrl run --config {run_dir}/config.toml)")
    if check.state == GOOD:
        return f"its files have their manifest's sizes (`covrl verify {run_dir}` reads their checksums too); or {way}"
    return f"it is {check.summary()}; {way}"


def _load(path: str, engine, rank: int) -> dict:
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    world = dist.get_world_size()
    if state["learners"] != world:
        raise WorldMismatch(f"{path} was written by {state['learners']} learner ranks and this run has {world}: "
                            f"the optimizer state is sharded per rank; resume with --learners {state['learners']}")
    load_path, _ = engine.load_checkpoint(path, tag=DS_TAG, load_module_strict=True, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state in {path}/{DS_TAG}")
    rng = os.path.join(path, "rng", f"rank_{rank}.pt")
    set_rng_state(torch.load(rng, weights_only=False))  # our own file: numpy's state is a tuple with an array
    if rank == 0:
        with open(os.path.join(path, HUB_FILE), "rb") as f:
            state["hub"] = f.read()
    state["path"] = path  # for `restoring` around what rank 0 restores from it later (hub, PAR, held rows)
    return state
