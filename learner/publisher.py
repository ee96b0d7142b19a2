"""Learner rank 0's side of the weight channels: one two-member gloo channel per generator incarnation.

A generator joins when the hub welcomes it (first start or restart): a join thread builds the pair
channel (a rendezvous under the store prefix `W.pair_prefix(gen_id, incarnation)`), sends it the
latest published version at once, and adds it to the broadcast list. So a restarted generator catches
up before it generates, and it never trusts a version number it has not received (it starts from the
base model, version 0, and waits for the version its work names). `publish` sends each bucket to every
live channel at once and keeps a CPU copy of the latest version for late joiners (the model's size in host
memory on rank 0).

Nothing here waits on a generator without a deadline (`Sends`): the rendezvous, every header and every gloo
bucket get `transport.weight_send_timeout_s` (a healthy generator's weight thread takes them at once), an NCCL
bucket `transport.weight_sync_timeout_s` (its vLLM workers drain first). A channel that fails or misses its
deadline is dropped (`weights/dropped_channels`) and reported to the hub (`report`, wired to `Hub.lose`), the one
owner of the decision that a generator is gone: the hub re-issues its work and tells the launcher to stop and
restart its process. The hub's own verdicts (a generator silent or stuck) come back through `drop`, which takes
effect at once, even in the middle of a publish: the learner stops waiting for that generator and goes on
publishing to the others. A generator the hub drained (the run was scaled down) leaves on purpose: `leave` marks
its incarnation at once and a leave thread sends it the stop header and drops its channel
(`weights/left_channels`); whoever finds such a channel gone (a publish, a join thread that was still in its
rendezvous) counts it as left, never as a failure.

Every bucket is copied into `latest` (a host vector, pinned on a CUDA learner) and the gloo channels send
that copy, never the caller's tensor: a CUDA learner's buckets are on its GPU, and the caller reuses one
bucket buffer for the next bucket as soon as it is asked for.

A vLLM generator with the nccl transport announces its NCCL receiver in the pair channel's store before the
rendezvous (`common/vllm_weights.py`). Its join thread only records that; the NCCL group itself (this rank's GPU
+ the generator's tp workers) is built by the trainer thread at the start of the next `publish`, on the
learner's device and between train steps, so it never races DeepSpeed's own collectives. Headers still go over
gloo, flagged `W.FLAG_DIRECT`, and each bucket is broadcast over NCCL in the generator's dtype straight into its
workers, on the sender's own stream and with a deadline (`NcclSender`), cut short when the hub declares the
generator lost (`learner/nccl.py`).

`ModelPublisher` (below) is the one publish path of every learner rank: it walks the module's buckets (a
collective under ZeRO-3) and, on rank 0, hands them to this class.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from common import vllm_weights as VW
from common import weights as W
from common.transport import free_port
from learner import nccl as N
from learner.params import param_buckets, scratch_for

log = logging.getLogger("covrl.publisher")

LEFT, LOST = "left", "lost"  # why an incarnation is gone: drained on purpose, or declared lost by the hub


class Sends:
    """Gloo operations in flight to several generators at once, waited for together: each until it completes, its
    deadline passes (`timeout_s`, the channel's own, so gloo fails it by itself too) or the hub declares its
    generator lost (`gone`). An operation given up on is left to fail by itself on a thread of its own, which holds
    the channel until then: a process group with an operation pending cannot be freed without waiting for it."""

    def __init__(self, timeout_s: float, gone: Callable[[int], bool]):
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s, self.gone = timeout_s, gone
        self.ops: dict[int, tuple[W.WeightChannel, dist.Work]] = {}

    def add(self, gen_id: int, ch: W.WeightChannel, start: Callable[[], dist.Work]) -> str | None:
        """Begin one operation; the failure's description if it could not even begin."""
        try:
            self.ops[gen_id] = (ch, start())
            return None
        except RuntimeError as e:  # gloo: the pair is closed already
            return f"weight channel failed: {e}"

    def wait(self) -> dict[int, str]:
        """Wait for every operation; returns {gen_id: why} for those that failed, missed the deadline or were
        given up on."""
        failed: dict[int, str] = {}
        pending, pause = dict(self.ops), 2e-4
        while pending:
            for gen_id, (ch, work) in list(pending.items()):
                if work.is_completed():
                    del pending[gen_id]
                    try:
                        work.wait()
                    except RuntimeError as e:  # gloo: the peer closed the connection, or the deadline passed
                        failed[gen_id] = f"weight channel failed: {str(e)[:200]}"
                elif self.gone(gen_id):
                    del pending[gen_id]
                    failed[gen_id] = LOST
                    _abandon(ch, work)
                elif time.monotonic() >= self.deadline:
                    del pending[gen_id]
                    failed[gen_id] = (f"a weight send was not taken within {self.timeout_s:.0f}s "
                                      f"(transport.weight_send_timeout_s)")
                    _abandon(ch, work)
            if pending:
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)
        return failed


def _abandon(ch: W.WeightChannel, work: dist.Work) -> None:
    def hold(ch: W.WeightChannel, work: dist.Work) -> None:
        try:
            work.wait()  # fails at the channel's own deadline
        except RuntimeError:
            pass  # expected: the peer was given up on; what failed was logged when it was dropped
        del ch  # the last reference: its process group is freed here, with nothing pending, not in the caller

    threading.Thread(target=hold, args=(ch, work), name="abandoned-send", daemon=True).start()


class WeightPublisher:
    def __init__(self, host: str, port: int, timeout_s: float, device: torch.device | str = "cpu", *,
                 send_timeout_s: float | None = None):
        """`timeout_s`: transport.weight_sync_timeout_s (the store, NCCL buckets); `send_timeout_s`:
        transport.weight_send_timeout_s (each generator's rendezvous, headers and gloo buckets; default
        `timeout_s`). `device`: the learner's (rank 0's) device; NCCL senders to vLLM generators are built on it."""
        self.host, self.port, self.timeout_s, self.device = host, port, timeout_s, torch.device(device)
        self.send_timeout_s = timeout_s if send_timeout_s is None else send_timeout_s
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
        # (gen_id, incarnation) -> LEFT or LOST: incarnations gone for good (`leave`, `drop`). Their own lock, never
        # held while waiting for anything, so the hub thread can mark one while a publish holds `lock`.
        self.gone: dict[tuple[int, str], str] = {}
        self.gone_lock = threading.Lock()
        # (gen_id, incarnation, why): a channel that failed or missed its deadline. Wired to `Hub.lose`, which
        # decides; called with `lock` held, so it must not block (the hub answers through `drop`).
        self.report: Callable[[int, str, str], None] | None = None

    # ---- called from the hub thread --------------------------------------------------

    def join(self, gen_id: int, incarnation: str) -> None:
        """Start building this incarnation's channel; never blocks the caller (the rendezvous waits for the peer)."""
        threading.Thread(target=self._join, args=(gen_id, incarnation), name=f"join-gen{gen_id}", daemon=True).start()

    def _join(self, gen_id: int, incarnation: str) -> None:
        try:
            prefix = W.pair_prefix(gen_id, incarnation)
            # A client of our own store with the send deadline, so this rendezvous waits no longer than that.
            client = dist.TCPStore(self.host, self.port, None, is_master=False,
                                   timeout=datetime.timedelta(seconds=self.send_timeout_s))
            ch = W.WeightChannel(self.host, self.port, W.LEARNER_RANK, W.PAIR_WORLD, self.send_timeout_s, prefix=prefix,
                                 store=client)
            store = dist.PrefixStore(prefix, client)
            # The announcement precedes the gloo rendezvous that just completed, so `check` cannot miss it.
            direct = store.check([VW.ANNOUNCE_KEY])
        except Exception as e:  # noqa: BLE001 - a generator that died or hangs before its rendezvous: count, report
            if self._gone(gen_id, incarnation) == LEFT:
                log.info("generator %d (%s) was drained before its weight channel was built", gen_id, incarnation)
                return
            log.warning("generator %d (%s) did not complete its weight-channel rendezvous within %.0fs: %s",
                        gen_id, incarnation, self.send_timeout_s, str(e)[:200])
            with self.lock:
                self.counters["weights/join_failures"] += 1
                self._report(gen_id, incarnation, f"its weight-channel rendezvous failed within "
                                                   f"{self.send_timeout_s:.0f}s (transport.weight_send_timeout_s)")
            return
        with self.lock:
            if self._stopped:
                self._try(ch.stop)
                return
            if (why := self._gone(gen_id, incarnation)) is not None:  # drained or lost while in the rendezvous
                self._retire(gen_id, (incarnation, ch, None), why)
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
        self._mark(gen_id, incarnation, LEFT)
        threading.Thread(target=self._remove, args=(gen_id, incarnation, LEFT), name=f"leave-gen{gen_id}",
                         daemon=True).start()

    def drop(self, gen_id: int, incarnation: str) -> None:
        """The hub declared this incarnation lost: stop waiting for it at once (a publish in progress gives up on it
        within milliseconds) and drop its channel. Never blocks the caller."""
        self._mark(gen_id, incarnation, LOST)
        threading.Thread(target=self._remove, args=(gen_id, incarnation, LOST), name=f"drop-gen{gen_id}",
                         daemon=True).start()

    def _mark(self, gen_id: int, incarnation: str, why: str) -> None:
        with self.gone_lock:
            self.gone.setdefault((gen_id, incarnation), why)

    def _remove(self, gen_id: int, incarnation: str, why: str) -> None:
        with self.lock:
            entry = self.channels.get(gen_id)
            if entry is not None and entry[0] == incarnation:
                del self.channels[gen_id]
                self._retire(gen_id, entry, why)
            for waiting in [p for p in self.pending_direct if p[:2] == (gen_id, incarnation)]:
                self.pending_direct.remove(waiting)
                self._retire(gen_id, (incarnation, waiting[2], None), why)

    def _retire(self, gen_id: int, entry, why: str) -> None:
        """A channel removed from the lists (lock held): a leaving generator is told to stop (on its own thread,
        with the send deadline); a lost one is not waited for at all."""
        incarnation, ch, direct = entry
        if why == LEFT:
            self._close(ch, direct)
            self.counters["weights/left_channels"] += 1
            log.info("generator %d (%s) left: its weight channel is closed", gen_id, incarnation)
            return
        if direct is not None:
            self._try(direct[0].close)  # its NCCL communicator (vLLM's destroy aborts it)
        self.counters["weights/dropped_channels"] += 1
        log.warning("generator %d (%s): weight channel dropped (%s)", gen_id, incarnation,
                    "declared lost by the hub" if why == LOST else why)

    def _gone(self, gen_id: int, incarnation: str) -> str | None:
        with self.gone_lock:
            return self.gone.get((gen_id, incarnation))

    def _report(self, gen_id: int, incarnation: str, why: str) -> None:
        if self.report is not None and self._gone(gen_id, incarnation) is None:
            self.report(gen_id, incarnation, why)

    def _admit(self, gen_id: int, incarnation: str, ch: W.WeightChannel, direct) -> None:
        """Catch a new channel up on the latest version and add it to the broadcast list (lock held)."""
        if self.latest is not None:  # catch up: the version everyone else holds
            failed = self._send({gen_id: (incarnation, ch, direct)}, self.latest_version, self.lay,
                                ((self.latest[start:stop], self.latest[start:stop]) for *_, start, stop
                                 in W.bucket_plan(self.lay)))
            if failed:
                self._fail(gen_id, (incarnation, ch, direct), failed[gen_id], "during its catch-up")
                return
        self.channels[gen_id] = (incarnation, ch, direct)
        self.counters["weights/direct_channels"] += direct is not None
        self.counters["weights/joins"] += 1
        log.info("generator %d (%s) joined the weight channels at version %d", gen_id, incarnation, self.latest_version)

    def _connect_direct(self) -> None:
        """Build the NCCL group of every generator that announced one (trainer thread, lock held)."""
        pending, self.pending_direct = self.pending_direct, []
        for gen_id, incarnation, ch, store in pending:
            if (why := self._gone(gen_id, incarnation)) is not None:  # gone before its NCCL group was built
                self._retire(gen_id, (incarnation, ch, None), why)
                continue
            try:
                port = free_port(self.host)
                world, dtype = VW.offer_address(store, self.host, port, self.send_timeout_s)
                sender = N.NcclSender(self.host, port, world, self.device, self.send_timeout_s)  # waits for the workers
            except Exception as e:  # noqa: BLE001 - a generator that died before its NCCL rendezvous: count, report
                log.exception("generator %d (%s) never completed its NCCL rendezvous", gen_id, incarnation)
                self.counters["weights/join_failures"] += 1
                self._report(gen_id, incarnation, f"its NCCL rendezvous failed: {str(e)[:200]}")
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
            live = {g: e for g, e in self.channels.items() if self._gone(g, e[0]) is None}

            def copies():
                for start, bucket in W.checked_buckets(lay, buckets):
                    host = self.latest[start:start + bucket.numel()]
                    host.copy_(bucket)  # from the learner's device; gloo sends this host copy
                    acc.add(host, start)
                    yield host, bucket  # NCCL sends straight from the learner's GPU

            failed = self._send(live, version, lay, copies())
            for gen_id, why in failed.items():
                if self.channels.get(gen_id) == live[gen_id]:
                    del self.channels[gen_id]
                self._fail(gen_id, live[gen_id], why, f"at version {version}")
            self.latest_version = version
        return time.perf_counter() - t0, lay.numel * 4, acc.total

    def _send(self, live: dict, version: int, lay: W.Layout, buckets) -> dict[int, str]:
        """One version to every channel in `live`, at once: the headers, then each (host, device) bucket pair of the
        plan. Returns {gen_id: why} for the channels that failed (lock held)."""
        failed: dict[int, str] = {}

        def gone(gen_id: int) -> bool:
            return self._gone(gen_id, live[gen_id][0]) is not None

        sends = Sends(self.send_timeout_s, gone)
        for gen_id, (_, ch, direct) in live.items():
            if why := sends.add(gen_id, ch, lambda: ch.start_header(version, lay, W.FLAG_DIRECT if direct else 0)):
                failed[gen_id] = why
        failed.update(sends.wait())  # headers first, so a dead peer is found before the buckets
        for (first, end, _, _), (host, bucket) in zip(W.bucket_plan(lay), buckets, strict=True):
            sends = Sends(self.send_timeout_s, gone)
            for gen_id, (_, ch, direct) in live.items():
                if gen_id not in failed and direct is None and (why := sends.add(gen_id, ch,
                                                                                lambda: ch.start_bucket(host))):
                    failed[gen_id] = why
            for gen_id, (_, ch, direct) in live.items():  # NCCL senders one at a time, each with its deadline
                if gen_id not in failed and direct is not None:
                    try:
                        direct[0].send_bucket(lay, first, end, bucket, direct[1], cancelled=lambda: gone(gen_id))
                    except RuntimeError as e:  # N.NcclTimeout, or the hub's verdict
                        failed[gen_id] = LOST if gone(gen_id) else str(e)[:300]
            failed.update(sends.wait())
        return failed

    def _fail(self, gen_id: int, entry, why: str, when: str) -> None:
        """A channel that failed, missed a deadline or was given up on (lock held): retired, and reported to the hub
        unless the hub decided it (LOST) or it was leaving anyway (LEFT)."""
        incarnation = entry[0]
        gone = self._gone(gen_id, incarnation)
        if gone == LEFT or why == LOST:
            self._retire(gen_id, entry, gone or LOST)
            return
        self._retire(gen_id, entry, why)
        if gone is None:
            self._report(gen_id, incarnation, f"{why} ({when})")

    def stop(self) -> None:
        """The run is over: every channel gets the stop header, at once, each with the send deadline."""
        with self.lock:
            self._stopped = True
            entries = [(g, e[1], e[2]) for g, e in self.channels.items()]
            entries += [(g, ch, None) for g, _, ch, _ in self.pending_direct]
            sends = Sends(self.send_timeout_s, lambda g: False)
            for gen_id, ch, _ in entries:
                sends.add(gen_id, ch, ch.start_stop)
            sends.wait()
            for _, _, direct in entries:
                if direct is not None:
                    self._try(direct[0].close)
            self.channels.clear()
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
    def _try(op) -> bool:
        try:
            op()
            return True
        except RuntimeError:  # gloo: the peer closed the connection or the deadline passed; NCCL: N.NcclTimeout
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
