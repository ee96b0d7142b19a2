"""Learner rank 0's side of the weight channels: one two-member gloo channel per generator incarnation.

A generator joins when the hub welcomes it (first start or restart): a join thread builds the pair
channel (a rendezvous under the store prefix `weights.pair_prefix(gen_id, incarnation)`), sends it the
latest published version at once (from the host copy, below), and adds it to the broadcast list. So a restarted
generator catches up before it generates, and it never trusts a version number it has not received (it starts from the
base model, version 0, and waits for the version its work names). `publish` sends each bucket to every
live channel at once, in the wire dtype (the model's: bf16 buckets from a bf16 learner, `weights.wire_dtype`).

Nothing here waits on a generator without a deadline (`Sends`): the rendezvous, every header and every gloo
bucket get `transport.weight_send_timeout_s` (a healthy generator's weight thread takes them at once), an NCCL or
ipc bucket `transport.weight_sync_timeout_s` (its vLLM workers drain first). A channel that fails or misses its
deadline is dropped (`weights/dropped_channels`) and reported to the hub (`report`, wired to `Hub.lose`), the one
owner of the decision that a generator is gone: the hub re-issues its work and tells the launcher to stop and
restart its process. The hub's own verdicts (a generator silent or stuck) come back through `drop`, which takes
effect at once, even in the middle of a publish: the learner stops waiting for that generator and goes on
publishing to the others. A generator the hub drained (the run was scaled down) leaves on purpose: `leave` marks
its incarnation at once and a leave thread sends it the stop header and drops its channel
(`weights/left_channels`); whoever finds such a channel gone (a publish, a join thread that was still in its
rendezvous) counts it as left, never as a failure.

Each admitted channel is a peer, its kind chosen once when it is admitted: a `GlooPeer` (buckets over the gloo
pair channel, all peers at once), an `NcclPeer` or an `IpcPeer` (below, the direct peers); the publisher calls their
`start_header`, `send_bucket`, `release` and `close` and never asks which kind it holds.

The host copy (`latest`, a `HostCopy`: the model's size in the wire dtype, pinned on a CUDA learner) is the latest
version for late joiners and the staging of every gloo send (the gloo channels send that copy, never the caller's
tensor: a CUDA learner's buckets are on its GPU, and the caller reuses one bucket buffer for the next bucket as soon
as it is asked for). It exists only while it can be needed, decided at each publish (`_host_copy`):

- A gloo peer has ever been admitted: keep it. A gloo peer joins (and rejoins, after a restart) on a join thread,
  which must send it the latest version at once, and that thread can rebuild nothing from the live parameters:
  under ZeRO-3 reading them is a collective of every learner rank, and even without ZeRO-3 it would race the
  optimizer step and label half-updated bits. So once a run has gloo generators, every publish refreshes the copy.
- No peer has been admitted yet (a resumed learner's first publish, before any generator joined): keep it; whoever
  joins next must be caught up, and its kind is not known yet.
- Otherwise (every peer so far a direct peer, NCCL or ipc): none, and a copy kept before is freed. A direct peer
  needs no catch-up: it is admitted by the trainer thread at the start of a publish (`_connect_direct`), which sends
  it that very version right after. A first gloo peer that joins such a run is admitted without a catch-up and
  receives the next publish (as a direct joiner does); from that publish on the copy is kept.

So a learner whose every generator is a direct peer holds no model-sized host memory (30 GB pinned for a 7B model in
fp32 before), and one with gloo peers holds half of it when the model is bf16. A publish that fails midway drops
the copy rather than leave a late joiner half-written bits under an old label.

A vLLM generator with the nccl transport announces its NCCL receiver in the pair channel's store before the
rendezvous (`common/vllm_weights.py`). Its join thread only records that; the NCCL group itself (this rank's GPU
+ the generator's tp workers) is built by the trainer thread at the start of the next `publish`, on the
learner's device and between train steps, so it never races DeepSpeed's own collectives. Headers still go over
gloo, flagged `weights.FLAG_DIRECT`, and each bucket is broadcast over NCCL in the generator's dtype straight into its
workers, on the sender's own stream and with a deadline (`NcclSender`), cut short when the hub declares the
generator lost (`learner/nccl.py`). The NCCL protocol moves whole tensors, so the wire pieces of a split parameter
are put together on the learner's device (`NcclPeer.assembling`, the one parameter in the generator's dtype) and the
parameter goes with its last piece: one `weights.bucket_plan` bucket per broadcast, as the receiver expects.

A vLLM generator with the ipc transport shares learner rank 0's GPU (colocated, tp 1; `common/runfiles.py` refuses
anything else before the run starts). It announces its worker's GPU, pid and dtype before the rendezvous
(`common/ipc_weights.py`); the trainer thread, at the next publish, allocates two staging slots on this rank's
device (each the size of the largest `bucket_plan` bucket, in the generator's dtype), exports them once and waits
until the generator's worker has mapped them (`learner/ipc.IpcSender`, set-up within
`transport.weight_send_timeout_s`). Headers go over gloo flagged `FLAG_DIRECT | FLAG_IPC`; each wire bucket is
copied into the next free slot (a split parameter's pieces at their offsets, so the slot is its assembly buffer),
signalled over the same gloo channel and acknowledged once vLLM has copied it out, every wait within
`transport.weight_sync_timeout_s` or cut short by the hub's verdict (`IpcPeer`). No byte of it crosses the host, and
no host copy is kept for it. Its slots are freed only once the generator says it unmapped them or its worker process
is gone (`IpcSender.close`, which never blocks).

`ModelPublisher` (below) is the one publish path of every learner rank: it walks the module's buckets (a
collective under ZeRO-3) and, on rank 0, hands them to this class.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from common import ipc_weights
from common import vllm_weights
from common import weights
from common.transport import free_port
from learner import ipc
from learner import nccl
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
        self.ops: dict[int, tuple[weights.WeightChannel, dist.Work]] = {}

    def add(self, gen_id: int, ch: weights.WeightChannel, start: Callable[[], dist.Work]) -> str | None:
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
                done, why = self._settled(gen_id, ch, work)
                if done:
                    del pending[gen_id]
                if why is not None:
                    failed[gen_id] = why
            if pending:
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)
        return failed

    def _settled(self, gen_id: int, ch: weights.WeightChannel, work: dist.Work) -> tuple[bool, str | None]:
        """(whether this operation is over, why it failed or None)."""
        if work.is_completed():
            try:
                work.wait()
            except RuntimeError as e:  # gloo: the peer closed the connection, or the deadline passed
                # gloo's own timer is this deadline too (started a moment later) and may fire before we look
                late = time.monotonic() >= self.deadline and "timed out" in str(e).lower()
                return True, f"{self._late() + '; ' if late else ''}weight channel failed: {str(e)[:200]}"
            return True, None
        if self.gone(gen_id):
            _abandon(ch, work)
            return True, LOST
        if time.monotonic() >= self.deadline:
            _abandon(ch, work)
            return True, self._late()
        return False, None

    def _late(self) -> str:
        return f"a weight send was not taken within {self.timeout_s:.0f}s (transport.weight_send_timeout_s)"


def _abandon(ch: weights.WeightChannel, work: dist.Work) -> None:
    def hold(ch: weights.WeightChannel, work: dist.Work) -> None:
        try:
            work.wait()  # fails at the channel's own deadline
        except RuntimeError:
            pass  # expected: the peer was given up on; what failed was logged when it was dropped
        del ch  # the last reference: its process group is freed here, with nothing pending, not in the caller

    threading.Thread(target=hold, args=(ch, work), name="abandoned-send", daemon=True).start()


@dataclass(eq=False)
class GlooPeer:
    """One generator incarnation's weight channel on learner rank 0, its buckets over the gloo pair channel.

    The kind of peer is chosen once, when the channel is admitted (`NcclPeer` or `IpcPeer` for a generator that
    announced an NCCL or ipc receiver); the publisher only calls these methods."""

    gen_id: int
    incarnation: str
    channel: weights.WeightChannel
    blocking = False  # a bucket send returns at once: all such sends are waited for together (`Sends`)
    flags = 0  # of each header: the buckets follow over this gloo channel

    def start_header(self, sends: "Sends", version: int, lay: weights.Layout, dtype: torch.dtype) -> str | None:
        return sends.add(self.gen_id, self.channel, lambda: self.channel.start_header(version, lay, self.flags, dtype))

    def send_bucket(self, sends: "Sends", lay: weights.Layout, b: weights.WireBucket, host: torch.Tensor | None,
                    bucket: torch.Tensor, cancelled: Callable[[], bool]) -> str | None:
        """Begin sending one wire bucket's host copy; the failure's description if it could not even begin."""
        if host is None:
            raise RuntimeError("weight publisher: a gloo peer is live but this publish kept no host copy to send from "
                               "(a bug in WeightPublisher._host_copy: a gloo peer must make it keep one)")
        return sends.add(self.gen_id, self.channel, lambda: self.channel.start_bucket(host))

    def release(self) -> None:
        """Free what this peer holds besides its gloo channel (nothing here)."""

    def close(self) -> None:
        """A generator that leaves: tell it to stop (with the send deadline; it may be gone already), then release."""
        _try(self.channel.stop)
        self.release()


@dataclass(eq=False)
class NcclPeer(GlooPeer):
    """A vLLM generator with the nccl transport: headers over gloo flagged FLAG_DIRECT, each bucket broadcast over
    its own NCCL group straight into its workers, in the dtype it announced, one generator at a time."""

    sender: nccl.NcclSender
    dtype: torch.dtype  # the generator's: each bucket is sent in it
    # A split parameter being put together from its wire pieces (the generator's dtype, on the bucket's device): the
    # NCCL protocol sends whole tensors (`vllm_weights.bucket_meta` names one per parameter of a `bucket_plan` bucket).
    assembling: torch.Tensor | None = None
    blocking = True  # a bucket send waits for its broadcast to land (with its own deadline)
    flags = weights.FLAG_DIRECT  # the buckets go over NCCL, straight into its vLLM workers

    def send_bucket(self, sends: "Sends", lay: weights.Layout, b: weights.WireBucket, host: torch.Tensor | None,
                    bucket: torch.Tensor, cancelled: Callable[[], bool]) -> str | None:
        """Broadcast a `bucket_plan` bucket once it is whole: a wire bucket of whole parameters at once; the pieces of
        a split parameter are copied into `assembling` (on the caller's stream, so before it reuses its buffer) and
        the whole parameter goes with its last piece."""
        if not b.whole:
            if b.offset == 0:
                self.assembling = torch.empty(_numel(lay.shapes[b.first]), dtype=self.dtype, device=bucket.device)
            self.assembling[b.offset:b.offset + bucket.numel()].copy_(bucket)
            if not b.last:
                return None
            bucket, self.assembling = self.assembling, None
        try:
            self.sender.send_bucket(lay, b.first, b.end, bucket, self.dtype, cancelled=cancelled)
            return None
        except RuntimeError as e:  # nccl.NcclTimeout, or the hub's verdict
            return LOST if cancelled() else str(e)[:300]

    def release(self) -> None:
        """Its NCCL communicator (vLLM's destroy aborts it) and any half-assembled parameter."""
        self.assembling = None
        _try(self.sender.close)


@dataclass(eq=False)
class IpcPeer(GlooPeer):
    """A vLLM generator on learner rank 0's own GPU with the ipc transport: headers over gloo flagged FLAG_DIRECT |
    FLAG_IPC, each wire bucket staged in a GPU slot its worker maps and signalled over this gloo channel
    (`learner/ipc.IpcSender`), in the dtype it announced.

    Unlike `NcclPeer` it assembles nothing: the sender takes the pieces of a split parameter itself (`offset`,
    `last`), staging each at its place in the slot and signalling the whole `bucket_plan` bucket with the last, so
    the slot is the assembly buffer and the learner holds no copy of the parameter."""

    sender: ipc.IpcSender
    blocking = True  # a bucket send waits for its slot, its copy and its signal (the version's last: every ack)
    flags = weights.FLAG_DIRECT | weights.FLAG_IPC  # the buckets go through the slots, straight into its vLLM worker

    def send_bucket(self, sends: "Sends", lay: weights.Layout, b: weights.WireBucket, host: torch.Tensor | None,
                    bucket: torch.Tensor, cancelled: Callable[[], bool]) -> str | None:
        """Stage one wire bucket (a piece of a split parameter at its offset) and signal it; the failure's
        description, or LOST when the hub gave up on the generator."""
        try:
            self.sender.send_bucket(lay, b.first, b.end, bucket, self.sender.dtype, cancelled, offset=b.offset,
                                    last=b.last)
            return None
        except RuntimeError as e:  # IpcError: a signal, acknowledgement or copy failed, missed its deadline or was cut
            return LOST if cancelled() else str(e)[:300]

    def release(self) -> None:
        """Its staging slots: freed now if the generator's worker unmapped them or is gone, else by a thread once it
        has (`IpcSender.close`, which never blocks)."""
        self.sender.close()


@dataclass
class Rendezvoused:
    """A channel whose gloo rendezvous is done: admitted at once as a `GlooPeer`, or, when its generator announced a
    direct receiver, held until the trainer thread builds its NCCL group or its ipc slots at the next publish
    (`_connect_direct`)."""

    gen_id: int
    incarnation: str
    channel: weights.WeightChannel
    store: dist.Store
    announced: str | None  # the direct receiver announced in the pair channel's store: "nccl", "ipc", or None (gloo)

    def as_gloo(self) -> GlooPeer:
        """What is retired if it goes before its NCCL group exists: its gloo channel alone."""
        return GlooPeer(self.gen_id, self.incarnation, self.channel)


@dataclass
class HostCopy:
    """The latest published version on learner rank 0's host, for late joiners: its bits and the version they are.
    Written only by `publish`, under the publisher's lock, so a catch-up never labels half-written bits. Kept only
    while a late joiner can need it (module docstring)."""

    flat: torch.Tensor  # the wire dtype, the model's size; pinned on a CUDA learner
    layout: weights.Layout
    version: int = 0

    def buckets(self):
        """(host, host) pairs of the wire plan: what a catch-up sends."""
        return ((self.flat[b.start:b.stop],) * 2 for b in weights.wire_plan(self.layout))


class WeightPublisher:
    def __init__(self, host: str, port: int, timeout_s: float, device: torch.device | str = "cpu", *,
                 send_timeout_s: float | None = None):
        """`timeout_s`: transport.weight_sync_timeout_s (the store, NCCL buckets); `send_timeout_s`:
        transport.weight_send_timeout_s (each generator's rendezvous, headers and gloo buckets; default
        `timeout_s`). `device`: the learner's (rank 0's) device; NCCL senders to vLLM generators, and the ipc
        staging slots, are built on it."""
        self.host, self.port, self.timeout_s, self.device = host, port, timeout_s, torch.device(device)
        self.send_timeout_s = timeout_s if send_timeout_s is None else send_timeout_s
        self.store = dist.TCPStore(host, port, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.lock = threading.Lock()  # channels, the host copy, and every send
        self.channels: dict[int, GlooPeer] = {}  # gen_id -> its admitted peer
        self.pending_direct: list[Rendezvoused] = []
        self.latest: HostCopy | None = None  # only while a late joiner can need it (`_host_copy`)
        self.version = 0  # the latest version published
        self.gloo_seen = False  # a gloo peer has been admitted: from the next publish on, the host copy is kept
        self.admitted = False  # any peer has been admitted
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
            joined = self._rendezvous(gen_id, incarnation)
        except Exception as e:  # noqa: BLE001 - a generator that died or hangs before its rendezvous: count, report
            self._join_failed(gen_id, incarnation, e)
            return
        with self.lock:
            if self._stopped:
                _try(joined.channel.stop)
                return
            if (why := self._gone(gen_id, incarnation)) is not None:  # drained or lost while in the rendezvous
                self._retire(joined.as_gloo(), why)
                return
            if joined.announced:
                self.pending_direct.append(joined)
                log.info("generator %d (%s) announced an %s receiver: its %s built at the next publish", gen_id,
                         incarnation, joined.announced, "NCCL group is" if joined.announced == "nccl" else
                         "staging slots are")
                return
            self._admit(joined.as_gloo(), catch_up=True)

    def _rendezvous(self, gen_id: int, incarnation: str) -> Rendezvoused:
        """The learner's end of this incarnation's pair channel, once the generator has joined it too."""
        prefix = weights.pair_prefix(gen_id, incarnation)
        # A client of our own store with the send deadline, so this rendezvous waits no longer than that.
        client = dist.TCPStore(self.host, self.port, None, is_master=False,
                               timeout=datetime.timedelta(seconds=self.send_timeout_s))
        ch = weights.WeightChannel(self.host, self.port, weights.LEARNER_RANK, weights.PAIR_WORLD, self.send_timeout_s,
                                   prefix=prefix, store=client)
        store = dist.PrefixStore(prefix, client)
        # The announcement precedes the gloo rendezvous that just completed, so `check` cannot miss it.
        return Rendezvoused(gen_id, incarnation, ch, store, _announced(store))

    def _join_failed(self, gen_id: int, incarnation: str, e: Exception) -> None:
        if self._gone(gen_id, incarnation) == LEFT:
            log.info("generator %d (%s) was drained before its weight channel was built", gen_id, incarnation)
            return
        log.warning("generator %d (%s) did not complete its weight-channel rendezvous within %.0fs: %s",
                    gen_id, incarnation, self.send_timeout_s, str(e)[:200])
        with self.lock:
            self.counters["weights/join_failures"] += 1
            self._report(gen_id, incarnation, f"its weight-channel rendezvous failed within "
                                               f"{self.send_timeout_s:.0f}s (transport.weight_send_timeout_s)")

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
            peer = self.channels.get(gen_id)
            if peer is not None and peer.incarnation == incarnation:
                del self.channels[gen_id]
                self._retire(peer, why)
            for waiting in [p for p in self.pending_direct if (p.gen_id, p.incarnation) == (gen_id, incarnation)]:
                self.pending_direct.remove(waiting)
                self._retire(waiting.as_gloo(), why)

    def _retire(self, peer: GlooPeer, why: str) -> None:
        """A channel removed from the lists (lock held): a leaving generator is told to stop (on its own thread,
        with the send deadline); a lost one is not waited for at all."""
        if why == LEFT:
            peer.close()
            self.counters["weights/left_channels"] += 1
            log.info("generator %d (%s) left: its weight channel is closed", peer.gen_id, peer.incarnation)
            return
        peer.release()
        self.counters["weights/dropped_channels"] += 1
        log.warning("generator %d (%s): weight channel dropped (%s)", peer.gen_id, peer.incarnation,
                    "declared lost by the hub" if why == LOST else why)

    def _gone(self, gen_id: int, incarnation: str) -> str | None:
        with self.gone_lock:
            return self.gone.get((gen_id, incarnation))

    def _report(self, gen_id: int, incarnation: str, why: str) -> None:
        if self.report is not None and self._gone(gen_id, incarnation) is None:
            self.report(gen_id, incarnation, why)

    def _admit(self, peer: GlooPeer, catch_up: bool) -> None:
        """Add a new channel to the broadcast list (lock held), first catching it up on the latest version when
        `catch_up` (a gloo peer, on its join thread; a direct peer, NCCL or ipc, is admitted by the publish that sends
        it the next version at once) and a host copy of it is kept (`_host_copy`)."""
        latest = self.latest if catch_up else None
        if latest is not None:  # catch up: the version everyone else holds
            failed = self._send([peer], latest.version, latest.layout, latest.flat.dtype, latest.buckets())
            if failed:
                self._fail(peer, failed[peer.gen_id], "during its catch-up")
                return
        self.channels[peer.gen_id] = peer
        self.admitted = True
        direct = bool(peer.flags & weights.FLAG_DIRECT)  # NCCL or ipc: never sent from the host copy
        self.gloo_seen |= not direct
        self.counters["weights/direct_channels"] += direct
        self.counters["weights/joins"] += 1
        if not catch_up:
            log.info("generator %d (%s) joined the weight channels over %s: the publish under way sends it its first "
                     "version", peer.gen_id, peer.incarnation, "CUDA IPC" if peer.flags & weights.FLAG_IPC else "NCCL")
        elif latest is None and self.version:
            log.info("generator %d (%s) joined the weight channels; no host copy was kept (every peer so far was a "
                     "direct peer): it gets the next published version, and the copy is kept from then on",
                     peer.gen_id, peer.incarnation)
        else:
            log.info("generator %d (%s) joined the weight channels at version %d", peer.gen_id, peer.incarnation,
                     0 if latest is None else latest.version)

    def _connect_direct(self, lay: weights.Layout) -> None:
        """Build the direct path of every generator that announced one (trainer thread, lock held): its NCCL group,
        or its ipc staging slots for `lay`, on this rank's device."""
        pending, self.pending_direct = self.pending_direct, []
        for joined in pending:
            if (why := self._gone(joined.gen_id, joined.incarnation)) is not None:  # gone before its path was built
                self._retire(joined.as_gloo(), why)
                continue
            try:
                peer = self._direct_peer(joined, lay)
            except Exception as e:  # noqa: BLE001 - a generator that died before its rendezvous, or another GPU
                log.exception("generator %d (%s) never completed its %s rendezvous", joined.gen_id,
                              joined.incarnation, joined.announced)
                self.counters["weights/join_failures"] += 1
                self._report(joined.gen_id, joined.incarnation,
                             f"its {joined.announced} rendezvous failed: {str(e)[:500]}")
                continue
            self._admit(peer, catch_up=False)

    def _direct_peer(self, joined: Rendezvoused, lay: weights.Layout) -> GlooPeer:
        """The NCCL group or the ipc slots of one announced generator; each wait within weight_send_timeout_s."""
        if joined.announced == "ipc":
            # Each bucket within weight_sync_timeout_s: a version's first acknowledgements wait for the drain.
            sender = ipc.IpcSender(joined.store, joined.channel, lay, self.device, self.timeout_s,
                                   setup_timeout_s=self.send_timeout_s)
            return IpcPeer(joined.gen_id, joined.incarnation, joined.channel, sender)
        port = free_port(self.host)
        world, dtype = vllm_weights.offer_address(joined.store, self.host, port, self.send_timeout_s)
        sender = nccl.NcclSender(self.host, port, world, self.device, self.send_timeout_s)  # waits for workers
        return NcclPeer(joined.gen_id, joined.incarnation, joined.channel, sender, dtype)

    # ---- called from the trainer (main) thread ------------------------------------------

    def publish(self, version: int, lay: weights.Layout, buckets) -> tuple[float, int, float]:
        """Send a version to every live channel: `buckets` in `weights.wire_plan(lay)` order, all of one wire dtype
        (the first bucket's, named in every header). Returns (seconds, bytes sent to each, checksum)."""
        t0 = time.perf_counter()
        acc = weights.Checksum(lay.numel)
        with self.lock:
            self._connect_direct(lay)  # a direct joiner is admitted here and gets this version below: no catch-up
            buckets = iter(buckets)
            head = next(buckets, None)  # its dtype goes in the headers, which leave before any bucket
            dtype = torch.float32 if head is None else head.dtype
            host = self._host_copy(lay, dtype)
            live = [p for p in self.channels.values() if self._gone(p.gen_id, p.incarnation) is None]

            def copies():
                for b, bucket in weights.checked_buckets(lay, itertools.chain([head], buckets), dtype):
                    staged = None if host is None else host.flat[b.start:b.stop].copy_(bucket)  # gloo sends this
                    acc.add(bucket if staged is None else staged, b.start, b.last)
                    yield staged, bucket  # NCCL and ipc send straight from the learner's GPU

            try:
                failed = self._send(live, version, lay, dtype, copies() if head is not None else iter(()))
            except BaseException:
                self.latest = None  # maybe half-written: never a catch-up's source
                raise
            self._fail_all(live, failed, version)
            self.version = version
            if host is not None:
                host.version = version
        return time.perf_counter() - t0, lay.numel * dtype.itemsize, acc.total

    def _host_copy(self, lay: weights.Layout, dtype: torch.dtype) -> HostCopy | None:
        """The host copy this publish writes, or None (lock held): kept once a gloo peer has been admitted, or while
        no peer has been (module docstring); else freed. In the wire dtype; pinned on a CUDA learner, so
        device-to-host copies run at full speed."""
        if self.admitted and not self.gloo_seen:
            self.latest = None
            return None
        if self.latest is None or self.latest.layout != lay or self.latest.flat.dtype != dtype:
            self.latest = None  # the old one goes before the new one is allocated
            flat = torch.empty(lay.numel, dtype=dtype, pin_memory=self.device.type == "cuda")
            self.latest = HostCopy(flat, lay, self.version)
        return self.latest

    def _fail_all(self, live: list[GlooPeer], failed: dict[int, str], version: int) -> None:
        """Retire (and report) the peers a publish failed to reach (lock held)."""
        by_id = {p.gen_id: p for p in live}
        for gen_id, why in failed.items():
            if self.channels.get(gen_id) is by_id[gen_id]:
                del self.channels[gen_id]
            self._fail(by_id[gen_id], why, f"at version {version}")

    def _send(self, live: list[GlooPeer], version: int, lay: weights.Layout, dtype: torch.dtype,
              buckets) -> dict[int, str]:
        """One version to every peer in `live`, at once: the headers, then each (host, device) pair of the wire
        plan, in `dtype`. Returns {gen_id: why} for the peers that failed (lock held)."""
        incarnation = {p.gen_id: p.incarnation for p in live}

        def gone(gen_id: int) -> bool:
            return self._gone(gen_id, incarnation[gen_id]) is not None

        sends = Sends(self.send_timeout_s, gone)
        failed = {p.gen_id: why for p in live if (why := p.start_header(sends, version, lay, dtype))}
        failed.update(sends.wait())  # headers first, so a dead peer is found before the buckets
        # Buckets that only start go first, so they travel while the blocking (NCCL, ipc) sends run one at a time.
        ordered = sorted(live, key=lambda p: p.blocking)
        for b, (host, bucket) in zip(weights.wire_plan(lay), buckets, strict=True):
            sends = Sends(self.send_timeout_s, gone)
            for peer in ordered:
                if peer.gen_id not in failed and (why := peer.send_bucket(
                        sends, lay, b, host, bucket, lambda g=peer.gen_id: gone(g))):
                    failed[peer.gen_id] = why
            failed.update(sends.wait())
        return failed

    def _fail(self, peer: GlooPeer, why: str, when: str) -> None:
        """A channel that failed, missed a deadline or was given up on (lock held): retired, and reported to the hub
        unless the hub decided it (LOST) or it was leaving anyway (LEFT)."""
        gone = self._gone(peer.gen_id, peer.incarnation)
        if gone == LEFT or why == LOST:
            self._retire(peer, gone or LOST)
            return
        self._retire(peer, why)
        if gone is None:
            self._report(peer.gen_id, peer.incarnation, f"{why} ({when})")

    def stop(self) -> None:
        """The run is over: every channel gets the stop header, at once, each with the send deadline."""
        with self.lock:
            self._stopped = True
            peers = [*self.channels.values(), *(joined.as_gloo() for joined in self.pending_direct)]
            sends = Sends(self.send_timeout_s, lambda g: False)
            for peer in peers:
                sends.add(peer.gen_id, peer.channel, peer.channel.start_stop)
            sends.wait()
            for peer in peers:
                peer.release()
            self.channels.clear()
            self.pending_direct.clear()

    def counter_values(self) -> dict[str, float]:
        """A copy of the counters (the join threads update them)."""
        with self.lock:
            return dict(self.counters)


def _announced(store: dist.Store) -> str | None:
    """The direct receiver a generator announced before its rendezvous (`Rendezvoused.announced`)."""
    if store.check([vllm_weights.ANNOUNCE_KEY]):
        return "nccl"
    if store.check([ipc_weights.ANNOUNCE_KEY]):
        return "ipc"
    return None


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _try(op) -> bool:
    try:
        op()
        return True
    except RuntimeError:  # gloo: the peer closed the connection or the deadline passed; NCCL: nccl.NcclTimeout
        return False


class ModelPublisher:
    """The one publish path of a learner rank: its model's parameters, bucket by bucket, to the generators.

    Every rank builds one and calls `publish(version)` at the same point of each step: under ZeRO-3 the
    parameters are shards and each bucket's gather is a collective, so every rank walks the buckets; only
    rank 0 has a `channel` (`WeightPublisher`) and sends them. One scratch bucket on the parameters' device
    (at most `weights.BUCKET_NUMEL` elements, in the wire dtype) is reused by every publish.
    """

    def __init__(self, module: torch.nn.Module, *, zero3: bool, channel: WeightPublisher | None):
        self.module, self.zero3, self.channel = module, zero3, channel
        self.layout = weights.layout(module)
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
