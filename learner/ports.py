"""What learner rank 0 needs from the rollout broker: the port `learner/loop.py` and the weight publisher use.

The learner never imports `broker/` (only its composition root, `learner/__main__.py`, builds the real `Hub`);
it talks to whatever it is handed through these protocols, and the test stand-ins are checked against them
(tests/unit/test_learner_loop.py), so a change on either side fails a test instead of a run.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import numpy as np

from common import messages


class ShapedGroup(Protocol):
    """One group of a batch, with the rewards the broker's rules shaped for it (advantages are computed from
    these, never from the raw scores)."""

    group: messages.RolloutGroup
    rewards: np.ndarray  # [n] float64: the scores plus the overlong shaping


class HubStats(Protocol):
    """The hub's running totals since the run began (`broker/hub.py`: `BrokerStats`)."""

    filtered_groups: int
    gen_tokens: int
    counters: dict[str, float]
    gen_busy_s: float


@runtime_checkable
class HubPort(Protocol):
    """The hub as learner rank 0 uses it. Every call takes the hub's lock; none waits on the publisher."""

    def start(self) -> None: ...

    def take_batch(self, version: int, timeout_s: float, stop: threading.Event | None = None) -> list[ShapedGroup]:
        """Block until the batch for the step that starts at `version` is ready; an InterruptedError once `stop` is
        set."""

    def set_version(self, version: int) -> None:
        """The policy version generators are now given work at (see `learner/loop.py`: `Lead.publish`)."""

    def wait_version_done(self, version: int, timeout_s: float, stop: threading.Event | None = None) -> float:
        """Block until the generation pinned to `version` is in; returns the seconds waited. An InterruptedError once
        `stop` is set."""

    def take_eval(self, version: int) -> tuple[dict[str, float], list]:
        """Eval metrics of `version` and its results that carry response texts."""

    def stats(self) -> HubStats: ...

    def snapshot(self) -> bytes: ...

    def restore(self, blob: bytes) -> None: ...

    def lose(self, gen_id: int, incarnation: str, detail: str) -> None:
        """The weight channel to this incarnation failed: the hub decides it is lost."""

    def stop(self) -> None: ...
