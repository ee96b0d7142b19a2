"""Count the host copies a weight publisher makes (`learner/publisher.py` `HostCopy`): what the tests of a run
without gloo peers check stays empty."""

from __future__ import annotations


def record_host_copies(monkeypatch) -> list[int]:
    """Patch `publisher.HostCopy` so that every copy made appends its size (elements) to the returned list."""
    from learner import publisher

    made: list[int] = []

    class Recorded(publisher.HostCopy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.flat.numel())

    monkeypatch.setattr(publisher, "HostCopy", Recorded)
    return made
