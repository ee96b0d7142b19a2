"""Learner rank 0's side of the weight channels: one two-member gloo channel per generator incarnation.

A generator joins when the hub welcomes it (first start or restart): a join thread builds the pair
channel (a rendezvous under the store prefix `W.pair_prefix(gen_id, incarnation)`), sends it the
latest published version at once, and adds it to the broadcast list. So a restarted generator catches
up before it generates, and it never trusts a version number it has not received (it starts from the
base model, version 0, and waits for the version its work names). `publish` sends each bucket to every
live channel and keeps a CPU copy of the latest version for late joiners (the model's size in host
memory on rank 0). A channel whose peer is gone fails fast (its TCP connection is closed) and is dropped
(`weights/dropped_channels`); the hub re-issues that generator's work.

A vLLM generator with the nccl transport announces its NCCL receiver in the pair channel's store before the
rendezvous (`common/vllm_weights.py`). Its channel then also gets an NCCL group (this rank's GPU + its tp
workers): headers still go over gloo, flagged `W.FLAG_DIRECT`, and each bucket is broadcast over NCCL in
the generator's dtype straight into its workers. NCCL has no timeout here: a generator that dies between
a header and its last bucket can hang the publish (gloo detects a peer dead before the header).
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

log = logging.getLogger("covrl.publisher")


class WeightPublisher:
    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.store = dist.TCPStore(host, port, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.lock = threading.Lock()  # channels, latest copy, and every send
        # gen_id -> (incarnation, gloo channel, (NCCL sender, dtype) for a direct vLLM receiver or None)
        self.channels: dict[int, tuple[str, W.WeightChannel, tuple[VW.NcclSender, torch.dtype] | None]] = {}
        self.latest: torch.Tensor | None = None
        self.latest_version = 0
        self.lay: W.Layout | None = None
        self.counters: collections.Counter[str] = collections.Counter()
        self._stopped = False

    # ---- called from the hub thread --------------------------------------------------

    def join(self, gen_id: int, incarnation: str) -> None:
        """Start building this incarnation's channel; never blocks the caller (the rendezvous waits for the peer)."""
        threading.Thread(target=self._join, args=(gen_id, incarnation), name=f"join-gen{gen_id}", daemon=True).start()

    def _join(self, gen_id: int, incarnation: str) -> None:
        try:
            prefix = W.pair_prefix(gen_id, incarnation)
            ch = W.WeightChannel(self.host, self.port, 0, 2, self.timeout_s, prefix=prefix, store=self.store)
            direct = self._direct_receiver(dist.PrefixStore(prefix, self.store))
        except Exception:  # noqa: BLE001 - a generator that died before its rendezvous: count, log, carry on
            log.exception("generator %d (%s) never completed its weight-channel rendezvous", gen_id, incarnation)
            with self.lock:
                self.counters["weights/join_failures"] += 1
            return
        with self.lock:
            if self._stopped:
                self._try(ch.stop)
                return
            if self.latest is not None:  # catch up: the version everyone else holds
                try:
                    self._send_latest(ch, direct)
                except RuntimeError:
                    log.warning("generator %d (%s) left during its catch-up", gen_id, incarnation)
                    self.counters["weights/dropped_channels"] += 1
                    return
            self.channels[gen_id] = (incarnation, ch, direct)
            self.counters["weights/direct_channels"] += direct is not None
            self.counters["weights/joins"] += 1
        log.info("generator %d (%s) joined the weight channels at version %d", gen_id, incarnation, self.latest_version)

    # ---- called from the trainer (main) thread ------------------------------------------

    def publish(self, version: int, lay: W.Layout, buckets) -> tuple[float, int, float]:
        """Send a version to every live channel. Returns (seconds, bytes sent to each, checksum)."""
        t0 = time.perf_counter()
        acc = W.Checksum(lay.numel)
        with self.lock:
            if self.latest is None:
                self.latest, self.lay = torch.empty(lay.numel, dtype=torch.float32), lay
            live = dict(self.channels)
            # Headers first, so a dead peer is found before the buckets.
            dead = {g for g, (_, ch, direct) in live.items()
                    if not self._try(lambda: ch.send_header(version, lay, W.FLAG_DIRECT if direct else 0))}
            for (first, end, _, _), (start, bucket) in zip(W.bucket_plan(lay), W.checked_buckets(lay, buckets)):
                self.latest[start:start + bucket.numel()].copy_(bucket)
                acc.add(bucket, start)
                for gen_id, (_, ch, direct) in live.items():
                    if gen_id not in dead and not self._try(lambda: self._send_bucket(ch, direct, lay, first, end, bucket)):
                        dead.add(gen_id)
            if any(direct for g, (_, _, direct) in live.items() if g not in dead):
                torch.cuda.current_stream().synchronize()  # every NCCL broadcast of this version has landed
            for gen_id in dead:
                if self.channels.get(gen_id) == live[gen_id]:
                    del self.channels[gen_id]
                self.counters["weights/dropped_channels"] += 1
                log.warning("weight channel to generator %d failed: dropped (it rejoins when it restarts)", gen_id)
            self.latest_version = version
        return time.perf_counter() - t0, lay.numel * 4, acc.total

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            for _, ch, direct in self.channels.values():
                self._try(ch.stop)
                if direct is not None:
                    self._try(direct[0].close)
            self.channels.clear()

    def counter_values(self) -> dict[str, float]:
        """A copy of the counters (the join threads update them)."""
        with self.lock:
            return dict(self.counters)

    # ---- helpers (lock held) -----------------------------------------------------------------

    def _direct_receiver(self, store: dist.Store) -> tuple[VW.NcclSender, torch.dtype] | None:
        """The NCCL group to a generator that announced a direct (vLLM, nccl transport) receiver, else None.
        The announcement precedes the gloo rendezvous that just completed, so `check` cannot miss it."""
        if not store.check([VW.ANNOUNCE_KEY]):
            return None
        port = free_port(self.host)
        world, dtype = VW.offer_address(store, self.host, port, self.timeout_s)
        return VW.NcclSender(self.host, port, world), dtype  # blocks until the generator's workers join

    @staticmethod
    def _send_bucket(ch: W.WeightChannel, direct, lay: W.Layout, first: int, end: int, bucket: torch.Tensor) -> None:
        if direct is None:
            ch._bcast(bucket)
        else:
            direct[0].send_bucket(lay, first, end, bucket, direct[1])

    def _send_latest(self, ch: W.WeightChannel, direct=None) -> None:
        ch.send_header(self.latest_version, self.lay, W.FLAG_DIRECT if direct else 0)
        for first, end, start, stop in W.bucket_plan(self.lay):
            self._send_bucket(ch, direct, self.lay, first, end, self.latest[start:stop])
        if direct is not None:
            torch.cuda.current_stream().synchronize()

    @staticmethod
    def _try(op) -> bool:
        try:
            op()
            return True
        except RuntimeError:  # gloo: the peer closed the connection
            return False
