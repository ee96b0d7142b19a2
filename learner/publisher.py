"""Learner rank 0's side of the weight channels: one two-member gloo channel per generator incarnation.

A generator joins when the hub welcomes it (first start or restart): a join thread builds the pair
channel (a rendezvous under the store prefix `W.pair_prefix(gen_id, incarnation)`), sends it the
latest published version at once, and adds it to the broadcast list. So a restarted generator catches
up before it generates, and it never trusts a version number it has not received (it starts from the
base model, version 0, and waits for the version its work names). `publish` sends each bucket to every
live channel and keeps a CPU copy of the latest version for late joiners (the model's size in host
memory on rank 0). A channel whose peer is gone fails fast (its TCP connection is closed) and is dropped
(`weights/dropped_channels`); the hub re-issues that generator's work. A generator the hub drained (the run was
scaled down) leaves on purpose: `leave` marks its incarnation at once and a leave thread sends it the stop header
and drops its channel (`weights/left_channels`); whoever finds such a channel gone (a publish, a join thread that
was still in its rendezvous) counts it as left, never as a failure.

Every bucket is copied into `latest` (a host vector, pinned on a CUDA learner) and the gloo channels send
that copy, never the caller's tensor: a CUDA learner's buckets are on its GPU, and the caller reuses one
bucket buffer for the next bucket as soon as it is asked for.

A vLLM generator with the nccl transport announces its NCCL receiver in the pair channel's store before the
rendezvous (`common/vllm_weights.py`). Its join thread only records that; the NCCL group itself (this rank's GPU
+ the generator's tp workers) is built by the trainer thread at the start of the next `publish`, on the
learner's device and between train steps, so it never races DeepSpeed's own collectives. Headers still go over
gloo, flagged `W.FLAG_DIRECT`, and each bucket is broadcast over NCCL in the generator's dtype straight into its
workers, on the sender's own stream and with a deadline (`NcclSender`): a generator that dies mid-transfer
is dropped after `transport.weight_sync_timeout_s` instead of hanging the learner (`learner/nccl.py`).

`ModelPublisher` (below) is the one publish path of every learner rank: it walks the module's buckets (a
collective under ZeRO-3) and, on rank 0, hands them to this class.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from common import vllm_weights as VW
from common import weights as W
from common.transport import free_port
from learner import nccl as N
from learner.params import param_buckets, scratch_for

log = logging.getLogger("covrl.publisher")


class WeightPublisher:
    def __init__(self, host: str, port: int, timeout_s: float, device: torch.device | str = "cpu"):
        """`device`: the learner's (rank 0's) device; NCCL senders to vLLM generators are built on it."""
        self.host, self.port, self.timeout_s, self.device = host, port, timeout_s, torch.device(device)
        self.store = dist.TCPStore(host, port, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.lock = threading.Lock()  # channels, latest copy, and every send
        # gen_id -> (incarnation, gloo channel, (NCCL sender, dtype) for a direct vLLM receiver or None)
        self.channels: dict[int, tuple[str, W.WeightChannel, tuple[N.NcclSender, torch.dtype] | None]] = {}
        # Direct (NCCL) receivers whose gloo rendezvous is done; the trainer thread builds their NCCL group.
        self.pending_direct: list[tuple[int, str, W.WeightChannel, dist.Store]] = []
        self.latest: torch.Tensor | None = None
        self.latest_version = 0
        self.lay: W.Layout | None = None
        self.counters: collections.Counter[str] = collections.Counter()
        self._stopped = False
        # Incarnations that left on purpose (`leave`). Their own lock, never held while waiting for anything, so the
        # hub thread can mark one while a publish holds `lock`.
        self.left: set[tuple[int, str]] = set()
        self.left_lock = threading.Lock()

    # ---- called from the hub thread --------------------------------------------------

    def join(self, gen_id: int, incarnation: str) -> None:
        """Start building this incarnation's channel; never blocks the caller (the rendezvous waits for the peer)."""
        threading.Thread(target=self._join, args=(gen_id, incarnation), name=f"join-gen{gen_id}", daemon=True).start()

    def _join(self, gen_id: int, incarnation: str) -> None:
        try:
            prefix = W.pair_prefix(gen_id, incarnation)
            ch = W.WeightChannel(self.host, self.port, 0, 2, self.timeout_s, prefix=prefix, store=self.store)
            store = dist.PrefixStore(prefix, self.store)
            # The announcement precedes the gloo rendezvous that just completed, so `check` cannot miss it.
            direct = store.check([VW.ANNOUNCE_KEY])
        except Exception:  # noqa: BLE001 - a generator that died before its rendezvous: count, log, carry on
            if self._has_left(gen_id, incarnation):
                log.info("generator %d (%s) was drained before its weight channel was built", gen_id, incarnation)
                return
            log.exception("generator %d (%s) never completed its weight-channel rendezvous", gen_id, incarnation)
            with self.lock:
                self.counters["weights/join_failures"] += 1
            return
        with self.lock:
            if self._stopped:
                self._try(ch.stop)
                return
            if self._has_left(gen_id, incarnation):  # drained while this thread waited in the rendezvous
                self._close(ch, None)
                self.counters["weights/left_channels"] += 1
                return
            if direct:
                self.pending_direct.append((gen_id, incarnation, ch, store))
                log.info("generator %d (%s) announced an NCCL receiver: its group is built at the next publish",
                         gen_id, incarnation)
                return
            self._admit(gen_id, incarnation, ch, None)

    def leave(self, gen_id: int, incarnation: str) -> None:
        """This incarnation leaves on purpose (the hub drained it): stop its channel and drop it without counting a
        failure. Never blocks the caller (a publish may hold the lock): the mark is taken here, the close on a
        thread."""
        with self.left_lock:
            self.left.add((gen_id, incarnation))
        threading.Thread(target=self._leave, args=(gen_id, incarnation), name=f"leave-gen{gen_id}", daemon=True).start()

    def _leave(self, gen_id: int, incarnation: str) -> None:
        with self.lock:
            entry = self.channels.get(gen_id)
            if entry is not None and entry[0] == incarnation:
                del self.channels[gen_id]
                self._close(entry[1], entry[2])
                self.counters["weights/left_channels"] += 1
                log.info("generator %d (%s) left: its weight channel is closed", gen_id, incarnation)
            for waiting in [p for p in self.pending_direct if p[:2] == (gen_id, incarnation)]:
                self.pending_direct.remove(waiting)
                self._close(waiting[2], None)
                self.counters["weights/left_channels"] += 1

    def _has_left(self, gen_id: int, incarnation: str) -> bool:
        with self.left_lock:
            return (gen_id, incarnation) in self.left

    def _admit(self, gen_id: int, incarnation: str, ch: W.WeightChannel, direct) -> None:
        """Catch a new channel up on the latest version and add it to the broadcast list (lock held)."""
        if self.latest is not None:  # catch up: the version everyone else holds
            try:
                self._send_latest(ch, direct)
            except RuntimeError:
                log.warning("generator %d (%s) left during its catch-up", gen_id, incarnation)
                self.counters["weights/left_channels" if self._has_left(gen_id, incarnation) else
                              "weights/dropped_channels"] += 1
                return
        self.channels[gen_id] = (incarnation, ch, direct)
        self.counters["weights/direct_channels"] += direct is not None
        self.counters["weights/joins"] += 1
        log.info("generator %d (%s) joined the weight channels at version %d", gen_id, incarnation, self.latest_version)

    def _connect_direct(self) -> None:
        """Build the NCCL group of every generator that announced one (trainer thread, lock held)."""
        pending, self.pending_direct = self.pending_direct, []
        for gen_id, incarnation, ch, store in pending:
            if self._has_left(gen_id, incarnation):  # drained before its NCCL group was built (the leave thread waits)
                self._close(ch, None)
                self.counters["weights/left_channels"] += 1
                continue
            try:
                port = free_port(self.host)
                world, dtype = VW.offer_address(store, self.host, port, self.timeout_s)
                sender = N.NcclSender(self.host, port, world, self.device, self.timeout_s)  # waits for the workers
            except Exception:  # noqa: BLE001 - a generator that died before its NCCL rendezvous: count, log, carry on
                log.exception("generator %d (%s) never completed its NCCL rendezvous", gen_id, incarnation)
                self.counters["weights/join_failures"] += 1
                continue
            self._admit(gen_id, incarnation, ch, (sender, dtype))

    # ---- called from the trainer (main) thread ------------------------------------------

    def publish(self, version: int, lay: W.Layout, buckets) -> tuple[float, int, float]:
        """Send a version to every live channel. Returns (seconds, bytes sent to each, checksum)."""
        t0 = time.perf_counter()
        acc = W.Checksum(lay.numel)
        with self.lock:
            self._connect_direct()  # before `latest` exists on the first publish: nothing to catch up on yet
            if self.latest is None:  # pinned on a CUDA learner: device-to-host copies run at full speed
                self.latest = torch.empty(lay.numel, dtype=torch.float32, pin_memory=self.device.type == "cuda")
                self.lay = lay
            live = dict(self.channels)
            # Headers first, so a dead peer is found before the buckets.
            dead = {g for g, (_, ch, direct) in live.items()
                    if not self._try(lambda: ch.send_header(version, lay, W.FLAG_DIRECT if direct else 0))}
            for (first, end, _, _), (start, bucket) in zip(W.bucket_plan(lay), W.checked_buckets(lay, buckets)):
                host = self.latest[start:start + bucket.numel()]
                host.copy_(bucket)  # from the learner's device; gloo sends this host copy
                acc.add(host, start)
                for gen_id, (_, ch, direct) in live.items():
                    source = host if direct is None else bucket  # NCCL sends straight from the learner's GPU
                    if gen_id not in dead and not self._try(lambda: self._send_bucket(ch, direct, lay, first, end, source)):
                        dead.add(gen_id)
            for gen_id in dead:
                if self.channels.get(gen_id) == live[gen_id]:
                    del self.channels[gen_id]
                if live[gen_id][2] is not None:  # its NCCL communicator too (vLLM's destroy aborts it)
                    self._try(live[gen_id][2][0].close)
                if self._has_left(gen_id, live[gen_id][0]):  # drained and gone before its leave thread got here
                    self.counters["weights/left_channels"] += 1
                    continue
                self.counters["weights/dropped_channels"] += 1
                log.warning("weight channel to generator %d failed: dropped (it rejoins when it restarts)", gen_id)
            self.latest_version = version
        return time.perf_counter() - t0, lay.numel * 4, acc.total

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            for _, ch, direct in self.channels.values():
                self._close(ch, direct)
            self.channels.clear()
            for _, _, ch, _ in self.pending_direct:
                self._try(ch.stop)
            self.pending_direct.clear()

    def counter_values(self) -> dict[str, float]:
        """A copy of the counters (the join threads update them)."""
        with self.lock:
            return dict(self.counters)

    # ---- helpers (lock held) -----------------------------------------------------------------

    def _close(self, ch: W.WeightChannel, direct) -> None:
        """Tell the receiver to stop (it may be gone already) and close the NCCL sender, if any."""
        self._try(ch.stop)
        if direct is not None:
            self._try(direct[0].close)

    @staticmethod
    def _send_bucket(ch: W.WeightChannel, direct, lay: W.Layout, first: int, end: int, bucket: torch.Tensor) -> None:
        if direct is None:
            ch.send_bucket(bucket)
        else:
            direct[0].send_bucket(lay, first, end, bucket, direct[1])

    def _send_latest(self, ch: W.WeightChannel, direct=None) -> None:
        ch.send_header(self.latest_version, self.lay, W.FLAG_DIRECT if direct else 0)
        for first, end, start, stop in W.bucket_plan(self.lay):
            self._send_bucket(ch, direct, self.lay, first, end, self.latest[start:stop])

    @staticmethod
    def _try(op) -> bool:
        try:
            op()
            return True
        except RuntimeError:  # gloo: the peer closed the connection; NCCL: N.NcclTimeout
            return False


class ModelPublisher:
    """The one publish path of a learner rank: its model's parameters, bucket by bucket, to the generators.

    Every rank builds one and calls `publish(version)` at the same point of each step: under ZeRO-3 the
    parameters are shards and each bucket's gather is a collective, so every rank walks the buckets; only
    rank 0 has a `channel` (`WeightPublisher`) and sends them. One scratch bucket on the parameters' device
    is reused by every publish.
    """

    def __init__(self, module: torch.nn.Module, *, zero3: bool, channel: WeightPublisher | None):
        self.module, self.zero3, self.channel = module, zero3, channel
        self.layout = W.layout(module)
        self.scratch = scratch_for(module, self.layout)

    def publish(self, version: int) -> tuple[float, int, float] | None:
        """Rank 0: send `version`, return (seconds, bytes sent to each generator, checksum). Other ranks: None."""
        buckets = param_buckets(self.module, self.layout, self.zero3, self.scratch)
        if self.channel is not None:
            return self.channel.publish(version, self.layout, buckets)
        if self.zero3:
            for _ in buckets:  # this rank's shards join each bucket's gather
                pass
        return None

    def counter_values(self) -> dict[str, float]:
        return self.channel.counter_values()

    def stop(self) -> None:
        self.channel.stop()
