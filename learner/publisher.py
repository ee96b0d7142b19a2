"""Learner rank 0's side of the weight channels: one two-member gloo channel per generator incarnation.

A generator joins when the hub welcomes it (first start or restart): a join thread builds the pair
channel (a rendezvous under the store prefix `W.pair_prefix(gen_id, incarnation)`), sends it the
latest published version at once, and adds it to the broadcast list. So a restarted generator catches
up before it generates, and it never trusts a version number it has not received (it starts from the
base model, version 0, and waits for the version its work names). `publish` sends each bucket to every
live channel and keeps a CPU copy of the latest version for late joiners (the model's size in host
memory on rank 0). A channel whose peer is gone fails fast (its TCP connection is closed) and is dropped
(`weights/dropped_channels`); the hub re-issues that generator's work.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from common import weights as W

log = logging.getLogger("covrl.publisher")


class WeightPublisher:
    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.store = dist.TCPStore(host, port, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.lock = threading.Lock()  # channels, latest copy, and every send
        self.channels: dict[int, tuple[str, W.WeightChannel]] = {}
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
            ch = W.WeightChannel(self.host, self.port, 0, 2, self.timeout_s, prefix=W.pair_prefix(gen_id, incarnation),
                                 store=self.store)
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
                    self._send_latest(ch)
                except RuntimeError:
                    log.warning("generator %d (%s) left during its catch-up", gen_id, incarnation)
                    self.counters["weights/dropped_channels"] += 1
                    return
            self.channels[gen_id] = (incarnation, ch)
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
            dead = {g for g, (_, ch) in live.items() if not self._try(lambda: ch.send_header(version, lay))}
            for start, bucket in W.checked_buckets(lay, buckets):
                self.latest[start:start + bucket.numel()].copy_(bucket)
                acc.add(bucket, start)
                for gen_id, (_, ch) in live.items():
                    if gen_id not in dead and not self._try(lambda: ch._bcast(bucket)):
                        dead.add(gen_id)
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
            for _, ch in self.channels.values():
                self._try(ch.stop)
            self.channels.clear()

    def counter_values(self) -> dict[str, float]:
        """A copy of the counters (the join threads update them)."""
        with self.lock:
            return dict(self.counters)

    # ---- helpers (lock held) -----------------------------------------------------------------

    def _send_latest(self, ch: W.WeightChannel) -> None:
        ch.send_header(self.latest_version, self.lay)
        for _, _, start, end in W.bucket_plan(self.lay):
            ch._bcast(self.latest[start:end])

    @staticmethod
    def _try(op) -> bool:
        try:
            op()
            return True
        except RuntimeError:  # gloo: the peer closed the connection
            return False
