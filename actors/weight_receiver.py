"""The generator's side of the weight channel: the weight thread that receives every published version.

One room for what a generator does with weights: the thread here joins its pair channel through the engine
(`actors/engine.py`: `join_weights`, `receive_weights`; a vLLM engine with the nccl transport loads each version
itself, `actors/vllm_engine.py`), stages each received host vector (in the wire dtype the learner's header names:
the learner's model dtype, so bf16 from a bf16 learner) for the main thread, and reports what has arrived, with the
version's `weights.Checksum`. The wire it reads is `common/weights.py`; the sending end is learner rank 0's
`learner/publisher.py`. The engine owns the version it holds (see `actors/actor.py`); this thread only labels
vectors in transit.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import torch

from common import messages
from common import weights

log = logging.getLogger("covrl.actor")


class WeightReceiver(threading.Thread):
    """Receives every published version through the engine's weight interface (`actors/engine.py`: `Engine`);
    hands the newest host vector to the main thread, or lets the engine load it directly."""

    def __init__(self, welcome: messages.Welcome, engine, timeout_s: float, log_path: str | None, prefix: str):
        super().__init__(name="weights", daemon=True)
        self.welcome, self.engine, self.timeout_s, self.log_path, self.prefix = welcome, engine, timeout_s, log_path, prefix
        self.lay = weights.layout(engine.model)
        self.cv = threading.Condition()
        # Vectors in transit, with the version each carries (the engine owns the version it holds; see above):
        # the newest received and not yet swapped in, and the one the main thread is swapping in now.
        self.staged: tuple[int, torch.Tensor] | None = None
        self.applying: int | None = None
        # A received vector nobody uses any more (applied, or replaced by a newer one before it was): the next
        # version is received into it instead of into fresh memory (when it has that version's wire dtype).
        self.spare: torch.Tensor | None = None
        self.finished = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            ch = self.engine.join_weights(self.welcome.weight_addr, self.prefix, self.timeout_s)
            while (got := ch.receive_header(self.lay)) is not None:
                self._receive(ch, *got)
        except BaseException as e:
            log.exception("weight receiver failed")
            self.error = e
        finally:
            with self.cv:
                self.finished = True
                self.cv.notify_all()

    def _receive(self, ch: weights.WeightChannel, version: int, flags: int) -> None:
        """The buckets of one version: staged for the main thread, or loaded by the engine itself."""
        with self.cv:
            buf, self.spare = self.spare, None
        # The host vector, or None when the engine has loaded the version itself (vLLM, nccl transport).
        received = self.engine.receive_weights(ch, self.lay, version, flags, out=buf)
        staged, weights_sum = (None, None) if received is None else ((version, received[0]), received[1])
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"version": version, "checksum": weights_sum, "t": time.time(),
                                    "channel": self.prefix, "direct": staged is None}) + "\n")
        with self.cv:
            if staged is None:  # the engine holds `version` already
                self.spare = buf  # not received into
            else:
                if self.staged is not None:  # never applied: its vector is free
                    self.spare = self.staged[1]
                self.staged = staged
            self.cv.notify_all()

    @property
    def received(self) -> int:
        """The newest version that has arrived: staged, being swapped in, or else the engine's own."""
        with self.cv:
            return self._received()

    def _received(self) -> int:  # cv held
        if self.staged is not None:
            return self.staged[0]
        return self.applying if self.applying is not None else self.engine.version

    def apply(self) -> None:
        """Swap in the newest staged weights, if any (called between forwards, from the main thread only)."""
        with self.cv:
            staged, self.staged = self.staged, None
            self.applying = None if staged is None else staged[0]
        if staged is not None:
            self.engine.load_flat(staged[1], staged[0])  # the engine's version is staged[0] from here
            with self.cv:
                self.applying = None
                self.spare = staged[1]  # load_flat copied it into the model (Engine.load_flat keeps no reference)

    def wait_for(self, version: int, timeout_s: float) -> None:
        """Block until `version` (or a newer one) has arrived, then swap in the newest."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while self._received() < version and not self.finished:
                if not self.cv.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise TimeoutError(f"weights of version {version} did not arrive within {timeout_s:.0f}s")
        if self.error is not None:
            raise RuntimeError("weight receiver failed") from self.error
        self.apply()
