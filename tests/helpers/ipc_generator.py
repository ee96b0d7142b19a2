"""A generator process for the ipc weight tests (`python -m tests.helpers.ipc_generator JOB.json`).

It plays both the generator process and its vLLM worker, as `actors/vllm_engine.py` will with the ipc transport:
announce its device before the pair channel's rendezvous, join the channel, map the learner's slots once, then for
each version header receive every bucket through `ipc_weights.IpcReceiver`, "loading" each from a view of its slot
into parameters of its own with `ipc_weights.load_slot` (vLLM's load_weights copies the same way). After the stop
header it holds its mapping `hold_s`, unmaps, says so, and stays alive `linger_s` more.

The job (JSON): port, prefix, names, shapes, dtype, timeout_s, out, and its behaviour: slow_s (sleep before reading
each slot: a slow load), die_at / freeze_at (the bucket seq at which it exits or stops itself with SIGSTOP), device
("cpu": the shm backend; "cuda:0": CUDA IPC). It writes to `out` (torch.save): each version's parameters as one flat
vector in the slots' dtype (unless `keep` is false) and their `digest`, the slots' data pointers after each version,
each version's receive time and how many times it mapped slots.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from common import ipc_weights
from common import weights
from common.vllm_weights import torch_dtype

HOST = "127.0.0.1"


def digest(flat: torch.Tensor) -> int:
    """An exact, order-sensitive fingerprint of a flat vector's bits (integer sums, on its own device): for versions
    too large to ship back whole."""
    bits = flat.contiguous().view(torch.int16 if flat.element_size() == 2 else torch.int32).to(torch.int64)
    w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64).remainder_(1009).add_(1)
    return int((bits * w).sum())


def _join(job: dict, lay: weights.Layout, dtype: torch.dtype, device: str):
    """Announce, rendezvous, map: what the vLLM engine's rendezvous hooks will do."""
    timeout = datetime.timedelta(seconds=job["timeout_s"])
    store = dist.TCPStore(HOST, job["port"], None, is_master=False, timeout=timeout)
    pair = dist.PrefixStore(job["prefix"], store)
    ident = ipc_weights.worker_identity(device)
    backend = "cuda" if device.startswith("cuda") else "shm"
    ipc_weights.announce_ipc(pair, job.get("uuid", ident["uuid"]), dtype, pid=ident["pid"], started=ident["started"],
                             backend=backend)
    ch = weights.WeightChannel(HOST, job["port"], weights.GENERATOR_RANK, weights.PAIR_WORLD, job["timeout_s"],
                               prefix=job["prefix"], store=store)
    handles = ipc_weights.read_slots(pair, job["timeout_s"])
    mapped = ipc_weights.map_slots(handles, device)
    ipc_weights.say_mapped(pair)
    return pair, ch, mapped, ipc_weights.IpcReceiver(ch, lay, handles)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    lay = weights.Layout(tuple(job["names"]), tuple(tuple(s) for s in job["shapes"]))
    dtype, device = torch_dtype(job["dtype"]), job.get("device", "cpu")
    pair, ch, mapped, receiver = _join(job, lay, dtype, device)
    params = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in zip(lay.names, lay.shapes)}

    def load_weights(named):
        for name, view in named:
            params[name].copy_(view)

    def load(bucket: ipc_weights.StagedBucket) -> None:
        if bucket.seq == job.get("die_at", -1):
            os._exit(3)
        if bucket.seq == job.get("freeze_at", -1):
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(job.get("slow_s", 0.0))  # the learner must not overwrite this slot meanwhile
        ipc_weights.load_slot(mapped, bucket.slot, bucket.names, bucket.shapes, load_weights)

    out = {"versions": {}, "digests": {}, "ptrs": [], "load_s": []}
    while (got := ch.receive_header(lay)) is not None:
        t0 = time.perf_counter()
        receiver.receive_version(load, job["timeout_s"])
        out["load_s"].append(time.perf_counter() - t0)
        flat = torch.cat([params[n].reshape(-1) for n in lay.names])
        out["digests"][got[0]] = digest(flat)
        if job.get("keep", True):
            out["versions"][got[0]] = flat.cpu()
        out["ptrs"].append([s.data_ptr() for s in mapped.slots])
    out["maps"] = dict(ipc_weights.MAPS)
    torch.save(out, job["out"])
    print("stopped", flush=True)
    time.sleep(job.get("hold_s", 0.0))  # still mapped: the learner must keep its slots
    ipc_weights.unmap_slots(mapped)
    ipc_weights.say_unmapped(pair)
    print("unmapped", flush=True)
    time.sleep(job.get("linger_s", 0.0))  # alive but unmapped: the learner may free its slots now
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
