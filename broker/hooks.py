"""What the hub tells the rest of learner rank 0 about generator incarnations: joined, left, lost.

The hub calls these from its own thread (join, leave) or from whichever thread declared the incarnation lost,
always with its lock held, so none of them may block: they mark, start a thread or append one line to a file.
Learner rank 0 wires them to its weight publisher and the launcher's lost-generator file (`learner/__main__.py`);
this module is here, beside the hub, so that the broker never imports the learner.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class GeneratorHooks(Protocol):
    def join(self, gen_id: int, incarnation: str) -> None:
        """The hub welcomed this incarnation: build its weight channel (never blocks)."""

    def leave(self, gen_id: int, incarnation: str) -> None:
        """The hub drained this incarnation (the run was scaled down): close its channel, not a failure."""

    def lost(self, gen_id: int, incarnation: str, pid: int, why: str, detail: str) -> None:
        """The hub declared this incarnation lost (`Hub._lose`): drop its channel at once, tell the launcher."""
