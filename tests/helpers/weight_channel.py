"""`receive`: a weight channel's receiving side in one call, for tests and benchmarks that play the generator."""

from __future__ import annotations

import torch

from common import weights


def receive(ch: weights.WeightChannel, lay: weights.Layout, out: torch.Tensor | None = None):
    """A receiver's whole step, for tests: block for the next version -> (version, flat, checksum); None when the
    learner says stop. (The generator's weight thread does the same in two calls, `actors/weight_receiver.py`.)"""
    got = ch.receive_header(lay)
    if got is None:
        return None
    version, flags = got
    weights.refuse_direct(flags, "this test receiver")
    flat, total = ch.receive_buckets(lay, out)
    return version, flat, total
