"""Learner rank 0's end of the `ipc` weight transport: staging slots on its GPU that one colocated vLLM generator maps.

The protocol, its reasons and the generator's end are in `common/ipc_weights.py`; this is the sender, built like
`learner/nccl.NcclSender` (once per generator channel, on the learner's device, by the trainer thread) and driven
the same way by `learner/publisher.py`: `send_bucket` for each bucket of a version, in plan order, then `close`.

Slots: K (default 2: the learner stages bucket n + 1 while the generator loads bucket n; more buys nothing while
each bucket's load takes about as long as its copy), each the size of the plan's largest bucket (one parameter larger
than `weights.BUCKET_NUMEL`, such as an embedding, sets it), in the generator's dtype. On a 0.5B model in bf16 that is
2 x 272 MB (the embedding alone), taken from the learner's share of the GPU once per channel.

Every wait has a deadline (`timeout_s`, transport.weight_sync_timeout_s: the first acknowledgements of a version wait
for the generator's drain) and ends at once when `cancelled()` says the hub declared the generator lost; a generator
that dies fails the pending gloo operation within milliseconds. After any failure the sender refuses further buckets
(the publisher drops the channel). Nothing here imports vLLM or touches CUDA at import time.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from common import ipc_weights
from common import weights
from common.ipc_weights import IpcError
from learner.nccl import wait_until

log = logging.getLogger("covrl.ipc")


class IpcPlacementError(ValueError):
    """The generator's worker is not on learner rank 0's GPU (`ipc_weights.same_gpu`'s text)."""


class IpcSender:
    """K staging slots on learner rank 0's device that one generator's vLLM worker maps, and the per-bucket signals
    (CUDA IPC on a GPU; on the CPU, as in the tests, shared-memory files).

    The constructor reads the generator's announcement from the pair channel's `store`, refuses another GPU before it
    allocates anything, allocates and exports the slots once, offers them in the store and waits until the
    generator's worker has mapped them; each wait at most `setup_timeout_s` (default `timeout_s`;
    transport.weight_send_timeout_s in the publisher). `timeout_s` bounds each `send_bucket`
    (transport.weight_sync_timeout_s: a version's first acknowledgements wait for the generator's drain). `channel` is
    the generator's gloo pair channel: the signals go over it, in order with its version headers, each with a deadline
    of its own, whatever the channel's timeout.
    """

    def __init__(self, store, channel: weights.WeightChannel, lay: weights.Layout, device, timeout_s: float, *,
                 setup_timeout_s: float | None = None, slots: int = ipc_weights.DEFAULT_SLOTS, bucket_numel: int = 0,
                 linger_s: float = 3600.0):
        if slots < 1:
            raise ValueError(f"ipc weights need at least one staging slot, not {slots}")
        self.store, self.channel, self.timeout_s, self.linger_s = store, channel, timeout_s, linger_s
        self.device, self.count = torch.device(device), slots
        setup_s = timeout_s if setup_timeout_s is None else setup_timeout_s
        self.announced = ipc_weights.read_announcement(store, timeout_s=setup_s)
        refusal = ipc_weights.same_gpu(ipc_weights.device_uuid(self.device), self.announced.uuid)
        if refusal is not None:
            raise IpcPlacementError(refusal)
        limit = bucket_numel or weights.BUCKET_NUMEL  # the bound the publisher's plan uses
        plan = weights.bucket_plan(lay, limit)
        self.plan = [(first, end, stop - start) for first, end, start, stop in plan]
        numel = max(n for _, _, n in self.plan)  # the largest bucket (a parameter alone, whole): one slot's size
        self.dtype = self.announced.dtype
        self.export = ipc_weights.exporter(self.device, self.announced.backend, slots, numel, self.dtype)
        self.seq = self.acked = 0  # buckets signalled and acknowledged on this channel
        self.index = self.filled = 0  # the next bucket's place in the plan; its elements staged so far
        self.failed: str | None = None
        self.released = threading.Event()  # set once the slots are let go of (`close`)
        self._claims = itertools.count()  # the first claim releases: `close` and its lingering thread never both do
        ipc_weights.offer_slots(store, ipc_weights.slot_handles(self.export, limit))
        try:
            ipc_weights.wait_mapped(store, timeout_s=setup_s)
        except (RuntimeError, ValueError) as e:  # IpcError, or the store's deadline: the worker never mapped them
            self.failed = f"the generator did not map the ipc slots: {str(e)[:200]}"
            self.close()
            raise

    # ---- per bucket ----------------------------------------------------------------------------------------------

    def send_bucket(self, lay: weights.Layout, first: int, end: int, bucket: torch.Tensor, dtype: torch.dtype,
                    cancelled: Callable[[], bool] | None = None, *, offset: int = 0, last: bool = True) -> int:
        """Stage one bucket of `weights.bucket_plan` (parameters first..end-1, flat, on any device) in the next slot
        and signal it: wait until that slot's previous bucket is acknowledged, copy (cast to `dtype`, the
        generator's) and wait for the copy, signal. A parameter larger than the bound may come in consecutive pieces
        (`weights.wire_plan`: `offset` elements into the bucket, `last` on the final one): the slot is waited for at
        the first piece, each piece copied to its place, and the whole bucket signalled with the last, so the slot
        is also the assembly buffer. The plan's last bucket also waits for every acknowledgement, so a version
        returns loaded and every slot free. Each call within `timeout_s`, or until `cancelled()`. Returns the bytes
        staged; on return the caller may overwrite `bucket`. IpcError on any failure, after which the sender takes
        no more buckets."""
        self._check(first, end, bucket, dtype, offset, last)
        cancelled = cancelled or _never  # the signals are polled, so a verdict can end a wait
        deadline = time.monotonic() + self.timeout_s
        seq, slot = self.seq, self.seq % self.count
        try:
            if offset == 0:
                self._acks(seq - self.count + 1, deadline, cancelled)  # the slot is free
            if not wait_until(self.export.stage(slot, bucket, offset), self._left(deadline), 2e-5, cancelled):
                lost = " (the hub declared the generator lost)" if cancelled() else ""
                raise IpcError(f"the copy of bucket {seq} into ipc slot {slot} did not finish within "
                               f"{self.timeout_s:.0f}s{lost}")
            self.filled = offset + bucket.numel()
            if last:
                self._signal(seq, slot, first, end, deadline, cancelled)
        except IpcError as e:
            self._fail(e)
            raise
        return bucket.numel() * self.export.slots[slot].element_size()

    def _check(self, first: int, end: int, bucket: torch.Tensor, dtype: torch.dtype, offset: int, last: bool) -> None:
        if self.failed is not None:
            raise IpcError(f"this ipc channel takes no more buckets: {self.failed}")
        if dtype != self.dtype:
            raise ValueError(f"ipc weights in {dtype}, but the generator announced {self.dtype}")
        want_first, want_end, numel = self.plan[self.index]
        fits = bucket.dim() == 1 and offset + bucket.numel() <= numel and (not last or offset + bucket.numel() == numel)
        if (first, end, offset) != (want_first, want_end, self.filled) or not fits:
            raise ValueError(f"ipc weights: {bucket.numel()} elements of parameters {first}..{end} at offset {offset}"
                             f"{' (last)' if last else ''}, where the plan's next bucket is parameters {want_first}.."
                             f"{want_end}, {numel} elements, {self.filled} staged: send the buckets of "
                             "`weights.bucket_plan` (or the pieces of `weights.wire_plan`) flat and in order")

    def _signal(self, seq: int, slot: int, first: int, end: int, deadline: float, cancelled) -> None:
        """Tell the generator bucket `seq` is in `slot`; after the plan's last bucket, wait until all are loaded."""
        t = torch.tensor([seq, slot, first, end], dtype=torch.int64)
        work = ipc_weights.start_signal(self.channel.pg, t, weights.LEARNER_RANK, self._left(deadline))
        ipc_weights.settle(work, self._left(deadline), cancelled, what=f"the signal of bucket {seq}")
        self.seq, self.index, self.filled = seq + 1, (self.index + 1) % len(self.plan), 0
        if self.index == 0:  # the version's last bucket: wait until it is loaded whole
            self._acks(self.seq, deadline, cancelled)

    def _acks(self, upto: int, deadline: float, cancelled) -> None:
        """Take the generator's acknowledgements, in order, until `upto` buckets are acknowledged."""
        while self.acked < upto:
            t = torch.full((1,), -1, dtype=torch.int64)
            work = ipc_weights.start_signal(self.channel.pg, t, weights.GENERATOR_RANK, self._left(deadline))
            ipc_weights.settle(work, self._left(deadline), cancelled,
                               what=f"the generator's acknowledgement of bucket {self.acked}")
            if int(t[0]) != self.acked:
                raise IpcError(f"ipc weights: the generator acknowledged bucket {int(t[0])} where bucket "
                               f"{self.acked} was due: the two ends disagree on the plan")
            self.acked += 1

    def _left(self, deadline: float) -> float:
        return max(deadline - time.monotonic(), 1e-3)

    def _fail(self, e: IpcError) -> None:
        self.failed = str(e)[:300]
        if e.pending is not None:  # it fails by itself at its own deadline; the channel must outlive it
            threading.Thread(target=_hold, args=(self.channel, e.pending, self.timeout_s), name="ipc-abandoned",
                             daemon=True).start()

    # ---- lifetime ------------------------------------------------------------------------------------------------

    def close(self) -> bool:
        """Let go of the slots, never while the generator's worker may still map them. CUDA IPC requires the exporter
        to keep an allocation alive until every importer has closed its mapping (freeing it first is undefined
        behaviour). So the slots are freed now only if the generator said it unmapped them, or the process that
        mapped them is gone (then its importer count is dropped for it, or torch would keep the blocks in limbo);
        otherwise a thread checks again every half second for `linger_s`, and past that keeps them for the
        learner's life (a warning says so). Never blocks; True when released now (`released` tells later)."""
        if self.failed is None:
            self.failed = "the channel was closed"
        why = self._releasable()
        if why is not None:
            return self._release(why)
        threading.Thread(target=self._linger, name="ipc-linger", daemon=True).start()
        return False

    def _releasable(self) -> str | None:
        try:
            if ipc_weights.unmapped(self.store):
                return "unmapped"
        except RuntimeError:  # the store cannot be asked: only the process's death can free the slots then
            pass
        if ipc_weights.consumer_gone(self.announced.pid, self.announced.started):
            return "gone"
        return None

    def _release(self, why: str) -> bool:
        if next(self._claims):
            return False  # released already
        self.export.release(consumer_gone=why == "gone")
        self.released.set()
        return True

    def _linger(self) -> None:
        deadline = time.monotonic() + self.linger_s
        while time.monotonic() < deadline:
            why = self._releasable()
            if why is not None:
                self._release(why)
                return
            time.sleep(0.5)
        log.warning("the ipc weight slots of a closed channel stay allocated: the generator's worker (pid %s) still "
                    "maps them after %.0fs and never said it unmapped them", self.announced.pid, self.linger_s)


def _never() -> bool:
    return False


def _hold(channel: weights.WeightChannel, work: dist.Work, timeout_s: float) -> None:
    """Keep `channel` (and its process group) alive until an abandoned operation has failed by itself: a process
    group with an operation pending cannot be freed without waiting for it, which must not happen in the caller."""
    try:
        work.wait(datetime.timedelta(seconds=timeout_s + 5))  # its own deadline is at most timeout_s
    except RuntimeError:
        pass  # expected: the generator was given up on; why was recorded when it failed
    del channel
