"""Weights through GPU memory for a learner and a vLLM generator on one GPU (the `ipc` weight transport): the wire
both ends share, the generator's end, and the two slot backends.

Learner rank 0 keeps K staging slots (default 2) on its GPU, each the size of the largest bucket of
`weights.bucket_plan`, in the dtype the generator announced. It exports their handles once per generator channel;
the generator's vLLM worker maps them once (`map_slots`) and keeps them for the channel's life. Per bucket the learner
waits until the slot is free, copies the bucket in (cast to the generator's dtype), waits for that copy and signals
"bucket seq is in slot s"; the generator hands views of the slot to vLLM's `load_weights`, which copies them into
vLLM's own parameters, waits for that copy on the GPU (`load_slot`) and acknowledges. A parameter larger than the
bucket bound, which the publisher sends in pieces (`weights.wire_plan`), is assembled in its slot. No byte crosses
the host: today's `rpc` path (fp32 host copy, loopback gloo, bytes through collective_rpc) costs an estimated
1.5-3.5 s per publish at 0.5B parameters (../shared/notes/gpu-speed.md section 6).

Contract:
- Placement: CUDA IPC maps another process's allocation of the same physical device, so the generator announces its
  GPU's UUID and the learner refuses any other before it allocates anything (`same_gpu`).
- Ordering: the learner never writes slot `seq % K` before it holds the acknowledgement of bucket `seq - K`, and the
  generator acknowledges a bucket only once vLLM's copy out of the slot has finished on the GPU. A version ends
  with every bucket acknowledged, so between versions every slot is free and the pair channel is idle.
- Signals ride the generator's gloo pair channel (`weights.WeightChannel`) as two-member broadcasts, each with a
  deadline of its own: [seq, slot, first, end] from the learner (root 0), [seq] back from the generator (root 1).
  Gloo matches collectives by the order they are issued, so both ends issue them in one order: the signals of the
  first K buckets, then for each bucket its acknowledgement and the signal K buckets later (`IpcReceiver`).
  Gloo rather than the TCPStore: the channel exists already and carries the version header in the same order; a
  bucket's two messages cost about 1 ms on loopback (a busy 2-core machine; a 0.5B model has ~8-16 buckets); a
  pending operation can be polled, so the hub's verdict ends a wait at once; and a generator that dies fails it
  within milliseconds (its socket closes). A store wait can be neither cut short
  nor tell a dead generator from a slow one, and every bucket would leave keys behind to delete.
- Handles are plain data (JSON, the CUDA handle's bytes in hex), never pickles: the store is unauthenticated and a
  pickle is code; and plain data crosses vLLM's collective_rpc without VLLM_ALLOW_INSECURE_SERIALIZATION, which
  vLLM's own ipc backend needs because its handles carry a callable.
- Lifetime: CUDA IPC requires the exporter to keep an allocation alive until every importer has closed its mapping
  (freeing it first is undefined behaviour). torch counts importers in a shared-memory counter and parks a block
  freed too early in its "limbo" until the counter drops. The learner lets go of its slots only once the generator
  said it unmapped them (UNMAPPED_KEY) or the process that mapped them is gone (`consumer_gone`: pid and start
  time); for a dead importer it drops that importer's count itself (`CudaExport.release`), or the block would stay
  in limbo for the learner's life.
- Backends: `cuda` (torch's reduce_tensor / rebuild_cuda_tensor) and `shm` (files in /dev/shm mapped MAP_SHARED by
  both processes): the CPU tests run the whole protocol between two real processes over `shm`, with the same
  ordering and acknowledgement code.

The learner's end is `learner/ipc.py` (`IpcSender`). Nothing here imports vLLM or touches CUDA at import time.
"""

from __future__ import annotations

import collections
import datetime
import inspect
import json
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from common import weights
from common.vllm_weights import torch_dtype, vllm_name

ANNOUNCE_KEY = "ipc/receiver"  # generator: {"uuid", "dtype", "pid", "started", "backend"}, before the rendezvous
SLOTS_KEY = "ipc/slots"  # learner: the exported slots (`slot_handles`)
MAPPED_KEY = "ipc/mapped"  # generator: {"error": null or why its worker could not map them}
UNMAPPED_KEY = "ipc/unmapped"  # generator: its worker holds no mapping any more; the learner may free the slots
DEFAULT_SLOTS = 2  # double buffering: the learner stages bucket n + 1 while the generator loads bucket n
SHM_DIR = "/dev/shm"
_EXPANDABLE = "expandable_segments:true"


class IpcError(RuntimeError):
    """A signal or acknowledgement failed, missed its deadline or was given up on. `pending`: the gloo operation
    left in flight (it fails by itself at its own deadline; whoever holds the channel must keep it until then)."""

    def __init__(self, why: str, pending: dist.Work | None = None):
        super().__init__(why)
        self.pending = pending


# ---- placement ------------------------------------------------------------------------------------------------


def device_uuid(device) -> str:
    """The physical identity of `device`: a GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES
    numbers it), or for the CPU this boot of this host (the `shm` backend's slots are this host's files)."""
    device = torch.device(device)
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "host-" + f.read().strip()
    except OSError:
        return "host-" + socket.gethostname()


def _plain_uuid(uuid: str) -> str:
    return str(uuid).strip().lower().removeprefix("gpu-")


def same_gpu(learner_uuid: str, generator_uuid: str) -> str | None:
    """None when learner rank 0 and the generator's worker are on one physical GPU; else the one-line refusal."""
    if _plain_uuid(learner_uuid) and _plain_uuid(learner_uuid) == _plain_uuid(generator_uuid):
        return None
    return (f"generator.weight_transport = \"ipc\" maps learner rank 0's GPU memory into the generator's vLLM worker, "
            f"which CUDA IPC allows only on one physical GPU, but the learner is on {learner_uuid or '?'} and the "
            f"generator on {generator_uuid or '?'}: set generator.weight_transport = \"rpc\" or \"nccl\", or place "
            f"both roles on one GPU (colocated, --tp 1)")


# ---- the rendezvous through the pair channel's store -----------------------------------------------------------


@dataclass(frozen=True)
class Announcement:
    """What a generator tells the learner before its channel's rendezvous."""

    uuid: str  # `device_uuid` of the device its worker maps the slots on
    dtype: torch.dtype  # the slots' dtype: its vLLM parameters'
    pid: int | None  # the process that will map the slots (vLLM's worker), for `consumer_gone`
    started: str | None  # that process's start time (`process_start`), so a reused pid is not taken for it
    backend: str  # "cuda" | "shm"


def announce_ipc(store, device_uuid: str, dtype: torch.dtype, *, pid: int | None = None, started: str | None = None,
                 backend: str = "cuda") -> None:
    """Generator side, before the pair channel's rendezvous: where its worker maps the slots, and in which dtype."""
    if backend not in _MAPPERS:
        raise ValueError(f"ipc backend {backend!r}: one of {sorted(_MAPPERS)}")
    store.set(ANNOUNCE_KEY, json.dumps({"uuid": device_uuid, "dtype": str(dtype).removeprefix("torch."), "pid": pid,
                                        "started": started, "backend": backend}))


def read_announcement(store, timeout_s: float) -> Announcement:
    """Learner side: the generator's announcement, waited for at most `timeout_s`."""
    store.wait([ANNOUNCE_KEY], _td(timeout_s))
    got = json.loads(store.get(ANNOUNCE_KEY))
    return Announcement(got["uuid"], torch_dtype(got["dtype"]), got.get("pid"), got.get("started"), got["backend"])


def offer_slots(store, handles: bytes) -> None:
    """Learner side: the exported slots, once per channel."""
    store.set(SLOTS_KEY, handles)


def read_slots(store, timeout_s: float) -> bytes:
    """Generator side, after the rendezvous: the learner's slot handles, once offered."""
    store.wait([SLOTS_KEY], _td(timeout_s))
    return bytes(store.get(SLOTS_KEY))


def say_mapped(store, error: str | None = None) -> None:
    """Generator side: its worker mapped the slots, or could not (`error`; then it holds nothing, so the learner may
    free them at once)."""
    if error is not None:
        store.set(UNMAPPED_KEY, "1")
    store.set(MAPPED_KEY, json.dumps({"error": error}))


def wait_mapped(store, timeout_s: float) -> None:
    """Learner side: until the generator's worker has mapped the slots; IpcError with its reason if it could not."""
    store.wait([MAPPED_KEY], _td(timeout_s))
    error = json.loads(store.get(MAPPED_KEY))["error"]
    if error is not None:
        raise IpcError(f"the generator's vLLM worker could not map learner rank 0's weight slots: {error}")


def say_unmapped(store) -> None:
    """Generator side: its worker dropped its mapping (`unmap_slots`), or never held one."""
    store.set(UNMAPPED_KEY, "1")


def unmapped(store) -> bool:
    """Learner side, without waiting: has the generator said it holds no mapping?"""
    return bool(store.check([UNMAPPED_KEY]))


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1e-3))


# ---- the process holding a mapping -------------------------------------------------------------------------------


def process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def consumer_gone(pid: int | None, started: str | None) -> bool:
    """Whether the process that mapped the slots is gone: no such process, a zombie, or another process under a
    reused pid. An unknown pid is never taken as gone (only the generator's own UNMAPPED_KEY frees the slots)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here: ask the kernel whether the pid exists
        return not _pid_exists(pid)
    return fields[0] in ("Z", "X") or (started is not None and fields[19] != started)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker_identity(device) -> dict:
    """What a vLLM worker reports for `announce_ipc` (through collective_rpc): its GPU, its pid and start time, and
    the backend its device maps slots with ("cuda"; "shm" for a CPU device, as in the tests)."""
    pid = os.getpid()
    backend = "cuda" if torch.device(device).type == "cuda" else "shm"
    return {"uuid": device_uuid(device), "pid": pid, "started": process_start(pid), "backend": backend}


# ---- backends: exported on the learner, mapped in the generator's worker ----------------------------------------


class ShmExport:
    """The CPU backend's exporter: each slot a file in /dev/shm that both processes map MAP_SHARED
    (`torch.from_file(shared=True)`). A write is visible to the other process once `copy_` returns, and the signal
    that follows goes through a socket (a system call: a full memory barrier)."""

    name = "shm"

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"the shm ipc backend stages on the CPU, not {device}")
        folder = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
        base = os.path.join(folder, f"covrl-ipc-{os.getpid()}-{secrets.token_hex(6)}")
        self.paths = [f"{base}-{i}" for i in range(count)]
        self.slots = [_shared_file(p, numel, dtype) for p in self.paths]

    def handles(self) -> list[dict]:
        return [{"path": p} for p in self.paths]

    def stage(self, slot: int, bucket: torch.Tensor, offset: int = 0) -> Callable[[], bool]:
        """Copy `bucket` into the slot at `offset` (cast to its dtype); the returned callable says when the copy is
        done."""
        self.slots[slot][offset:offset + bucket.numel()].copy_(bucket)
        return lambda: True

    def release(self, consumer_gone: bool) -> None:
        """Drop the slots and their files (a mapping made earlier would survive the unlink; the caller waits for
        none to remain anyway, the rule CUDA imposes)."""
        self.slots = []
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def _shared_file(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    with open(path, "xb") as f:  # exclusive: never another run's slot
        f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def _map_shm(handle: dict, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if not os.path.isfile(handle["path"]):  # from_file would make a fresh file: a slot nobody writes
        raise FileNotFoundError(f"ipc slot {handle['path']} is gone (the learner let go of it, or /dev/shm is not "
                                "shared between the two processes)")
    return torch.from_file(handle["path"], shared=True, size=numel, dtype=dtype)


# reduce_tensor's arguments for rebuild_cuda_tensor (torch 2.x), past (tensor class): the fields sent, in order.
_CUDA_FIELDS = ("size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_bytes",
                "storage_offset", "requires_grad", "ref_handle", "ref_offset", "event_handle", "event_sync")
_HEX = ("handle", "ref_handle", "event_handle")


class CudaExport:
    """The CUDA backend's exporter: K slots from the learner's caching allocator, each exported once with torch's
    `reduce_tensor` (a cudaIpcMemHandle of the block holding it, its offset, torch's ref counter). Each bucket is
    copied on this exporter's own stream after the trainer's stream, and the sender waits for that copy before it
    signals, so the importer's reads see it. Needs torch's expandable segments off (their blocks are not
    cudaIpcMemHandles)."""

    name = "cuda"

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device):
        conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", ""))
        if _EXPANDABLE in conf.replace(" ", "").lower():
            raise ValueError("the ipc weight transport exports the learner's CUDA blocks, which torch's expandable "
                             "segments do not allow: unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF on the "
                             "learner, or set generator.weight_transport = \"rpc\"")
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.slots = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(count)]
            self.stream = torch.cuda.Stream(self.device)
        self.exported: list[tuple] = []

    def handles(self) -> list[dict]:
        """Export every slot (once: each export raises torch's importer count by one) as plain fields."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        out = []
        for slot in self.slots:
            fn, args = reduce_tensor(slot)
            if fn is not rebuild_cuda_tensor or len(args) != 1 + len(_CUDA_FIELDS):
                raise RuntimeError(f"torch {torch.__version__}'s reduce_tensor returns {getattr(fn, '__name__', fn)} "
                                   f"with {len(args)} arguments; covrl's ipc handles know torch 2.x's "
                                   f"rebuild_cuda_tensor with {1 + len(_CUDA_FIELDS)}: use "
                                   "generator.weight_transport = \"rpc\"")
            self.exported.append(args)
            out.append(encode_cuda_args(args))
        return out

    def stage(self, slot: int, bucket: torch.Tensor, offset: int = 0) -> Callable[[], bool]:
        dst = self.slots[slot][offset:offset + bucket.numel()]
        ready = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_stream(ready)  # the bucket was assembled on the trainer's stream
            dst.copy_(bucket, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done.query

    def release(self, consumer_gone: bool) -> None:
        """Drop the slots. An importer that unmapped has dropped its count already; for one that is gone, drop the
        count it would have dropped (one per export), so torch frees the blocks instead of keeping them in limbo."""
        if consumer_gone:
            for args in self.exported:
                torch.UntypedStorage._release_ipc_counter_cuda(args[11], args[12])  # ref counter handle, offset
        self.slots, self.exported = [], []
        torch.cuda.ipc_collect()


def encode_cuda_args(args: tuple) -> dict:
    """reduce_tensor's arguments for rebuild_cuda_tensor as JSON-able fields (the tensor and storage classes are
    always torch.Tensor and TypedStorage here; bytes as hex)."""
    out = dict(zip(_CUDA_FIELDS, args[1:], strict=True))
    out["size"], out["stride"] = list(out["size"]), list(out["stride"])
    out["dtype"] = str(out["dtype"]).removeprefix("torch.")
    out["storage_cls"] = None
    for key in _HEX:
        out[key] = None if out[key] is None else bytes(out[key]).hex()
    return out


def decode_cuda_args(fields: dict, device_index: int) -> tuple:
    """rebuild_cuda_tensor's arguments from `encode_cuda_args`, on the importer's own index of the same GPU (the
    exporter's may differ: each process numbers the GPUs it sees)."""
    f = dict(fields)
    for key in _HEX:
        f[key] = None if f[key] is None else bytes.fromhex(f[key])
    f.update(size=torch.Size(f["size"]), stride=tuple(f["stride"]), storage_cls=torch.storage.TypedStorage,
             dtype=torch_dtype(f["dtype"]), device=device_index, requires_grad=False)
    return (torch.Tensor, *(f[k] for k in _CUDA_FIELDS))


def _map_cuda(handle: dict, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(inspect.signature(rebuild_cuda_tensor).parameters) != 1 + len(_CUDA_FIELDS):
        raise RuntimeError(f"torch {torch.__version__}'s rebuild_cuda_tensor takes other arguments than covrl's ipc "
                           "handles carry (torch 2.x's): use generator.weight_transport = \"rpc\"")
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    t = rebuild_cuda_tensor(*decode_cuda_args(handle, index))
    if t.numel() != numel or t.dtype != dtype:
        raise RuntimeError(f"an ipc slot mapped as {t.numel()} {t.dtype} elements; the learner offered {numel} {dtype}")
    return t


_EXPORTERS = {"cpu": ShmExport, "cuda": CudaExport}  # by the learner's device type
_MAPPERS = {"shm": _map_shm, "cuda": _map_cuda}  # by the announced backend


def exporter(device, backend: str, count: int, numel: int, dtype: torch.dtype):
    """The learner's slots on `device`, of the backend the generator announced (which must be its device's)."""
    kind = torch.device(device).type
    if kind not in _EXPORTERS or _EXPORTERS[kind].name != backend:
        raise ValueError(f"the generator maps {backend!r} ipc slots but learner rank 0 is on {device}: the ipc weight "
                         "transport needs both on one GPU; set generator.weight_transport = \"rpc\"")
    return _EXPORTERS[kind](count, numel, dtype, device)


def slot_handles(export, bucket_numel: int) -> bytes:
    """What the learner offers (SLOTS_KEY): the backend, the slots' dtype and size, the bucket bound the learner cuts
    versions with (so both ends walk one plan) and each slot's handle."""
    slots = export.slots
    return json.dumps({"backend": export.name, "dtype": str(slots[0].dtype).removeprefix("torch."),
                       "numel": slots[0].numel(), "bucket_numel": bucket_numel,
                       "slots": export.handles()}).encode()


# ---- the generator's worker: map once, load from a slot, unmap ----------------------------------------------------


@dataclass
class MappedSlots:
    """The learner's slots as this worker maps them, kept for the channel's life."""

    backend: str
    slots: list[torch.Tensor]
    dtype: torch.dtype
    device: torch.device


MAPS = collections.Counter()  # map_slots calls in this process, by backend: one per channel


def map_slots(handles: bytes, device="cpu") -> MappedSlots:
    """Worker side, once per channel: rebuild the learner's slots on `device` (a vLLM worker's `self.device`)."""
    info = json.loads(handles)
    dtype, numel = torch_dtype(info["dtype"]), int(info["numel"])
    mapper = _MAPPERS[info["backend"]]
    slots = [mapper(h, numel, dtype, device) for h in info["slots"]]
    MAPS[info["backend"]] += 1
    return MappedSlots(info["backend"], slots, dtype, torch.device(device))


def load_slot(mapped: MappedSlots, slot: int, names: list[str], shapes: list[list[int]], load_weights) -> int:
    """Worker side, per bucket: hand (name, view of the slot) pairs to `load_weights` (vLLM's model.load_weights,
    which copies them into its own parameters), then wait until those copies are done on the GPU, so the slot may
    be acknowledged and overwritten. Returns the elements loaded."""
    sizes = [tuple(s) for s in shapes]
    numel = sum(math.prod(s) for s in sizes)
    load_weights(list(zip(names, weights.shaped(mapped.slots[slot][:numel], sizes), strict=True)))
    if mapped.device.type == "cuda":
        torch.cuda.synchronize(mapped.device)  # every stream of this worker: vLLM's copies out of the slot
    return numel


def unmap_slots(mapped: MappedSlots | None) -> None:
    """Worker side: drop the mapping (torch's importer count drops with the last reference); then the generator
    says so (`say_unmapped`)."""
    if mapped is not None:
        mapped.slots.clear()


# ---- the per-bucket signals on the pair channel ------------------------------------------------------------------


def start_signal(pg, t: torch.Tensor, root: int, timeout_s: float) -> dist.Work:
    """Begin one broadcast on the pair channel: a signal [seq, slot, first, end] from the learner (`root`
    weights.LEARNER_RANK) or an acknowledgement [seq] from the generator (weights.GENERATOR_RANK). It fails by itself
    past `timeout_s`, whatever the channel's own timeout."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.timeout = _td(timeout_s)
    return pg.broadcast([t], opts)


def settle(work: dist.Work, timeout_s: float, cancelled: Callable[[], bool] | None = None, what: str = "") -> None:
    """Wait for `work` at most `timeout_s`; its error, or the deadline, raised as IpcError. With `cancelled` (the
    learner: the hub's verdict) the operation is polled, and given up on once `cancelled()` is true or the deadline
    passes (the IpcError then carries the operation left pending); without it (the generator) the wait blocks, which
    wakes at once on completion."""
    if cancelled is not None:
        _poll(work, timeout_s, cancelled, what)
    try:
        work.wait(_td(timeout_s))  # returns at once after _poll; else blocks until done or failed at its deadline
    except RuntimeError as e:  # gloo: the peer closed the connection, or the operation's own deadline passed
        if "timed out" in str(e).lower():  # gloo's timer is this deadline too, and may fire before _poll looks
            raise IpcError(f"{what} did not complete within {timeout_s:.1f}s ({str(e)[:200]})") from None
        raise IpcError(f"{what} failed: {str(e)[:200]}") from None


def _poll(work: dist.Work, timeout_s: float, cancelled: Callable[[], bool], what: str) -> None:
    deadline, pause = time.monotonic() + timeout_s, 2e-5
    while not work.is_completed():
        if cancelled():
            raise IpcError(f"{what} was abandoned: the hub declared the generator lost", pending=work)
        if time.monotonic() >= deadline:
            raise IpcError(f"{what} did not complete within {timeout_s:.1f}s", pending=work)
        time.sleep(pause)
        pause = min(pause * 2, 5e-4)


@dataclass(frozen=True)
class StagedBucket:
    """One bucket as the generator sees it: in which slot, which parameters, and how to name them for vLLM."""

    seq: int  # this channel's bucket count so far
    slot: int
    first: int
    end: int
    names: list[str]  # vLLM's names (`vllm_weights.vllm_name`)
    shapes: list[list[int]]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


class IpcReceiver:
    """The generator process's end of the per-bucket signals, one per channel (it counts the channel's buckets).

    `handles`: the learner's offer (`read_slots`), for the slot count and the bucket bound, so both ends walk one
    plan. The slots themselves are mapped in the vLLM worker (`map_slots`), not here."""

    def __init__(self, ch: weights.WeightChannel, lay: weights.Layout, handles: bytes):
        info = json.loads(handles)
        self.pg, self.lay, self.count = ch.pg, lay, len(info["slots"])
        self.plan = weights.bucket_plan(lay, int(info["bucket_numel"]))
        self.names = [vllm_name(n) for n in lay.names]
        self.seq = 0

    def receive_version(self, load: Callable[[StagedBucket], None], timeout_s: float) -> int:
        """After a header flagged for ipc: for each bucket of the plan wait for its signal (at most `timeout_s`),
        `load(bucket)` (which returns once the slot's content is copied out), acknowledge. Returns the buckets."""
        posted = collections.deque(self._post(timeout_s) for _ in range(min(self.count, len(self.plan))))
        for n, (first, end, _, _) in enumerate(self.plan):
            t, work = posted.popleft()
            settle(work, timeout_s, what=f"the learner's signal of bucket {self.seq + n}")
            bucket = self._staged(t, n, first, end)
            load(bucket)
            ack = start_signal(self.pg, torch.tensor([bucket.seq]), weights.GENERATOR_RANK, timeout_s)
            settle(ack, timeout_s, what=f"the acknowledgement of bucket {bucket.seq}")
            if n + self.count < len(self.plan):
                posted.append(self._post(timeout_s))
        self.seq += len(self.plan)
        return len(self.plan)

    def _post(self, timeout_s: float) -> tuple[torch.Tensor, dist.Work]:
        t = torch.zeros(4, dtype=torch.int64)
        return t, start_signal(self.pg, t, weights.LEARNER_RANK, timeout_s)

    def _staged(self, t: torch.Tensor, n: int, first: int, end: int) -> StagedBucket:
        seq, slot, got_first, got_end = t.tolist()
        if (seq, slot, got_first, got_end) != (self.seq + n, (self.seq + n) % self.count, first, end):
            raise IpcError(f"ipc weights: the learner signalled bucket {seq} (parameters {got_first}..{got_end}) in "
                           f"slot {slot}; this generator expected bucket {self.seq + n} (parameters {first}..{end}) "
                           f"in slot {(self.seq + n) % self.count}: the two ends disagree on the plan")
        shapes = [list(s) for s in self.lay.shapes[first:end]]
        return StagedBucket(seq, slot, first, end, self.names[first:end], shapes)
