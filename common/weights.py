"""The weight channel: learner rank 0 broadcasts each new policy version to every generator.

A dedicated torch.distributed gloo group (NCCL on GPUs) built on its own
TCPStore, apart from the learners' default group: rank 0 is learner rank 0,
ranks 1..G are generators. One publish = one header broadcast
`[version, numel, layout_hash, flags]` then the parameters as flat buckets of
at most `bucket_numel` elements, in the order of `layout()`. Both sides derive
the layout from the same architecture, and the header's layout hash catches a
generator built from another model before it loads garbage.

Receivers block inside the collective in a thread of their own, so the learner
never waits for a generator to finish a batch; the generator swaps the staged
weights in between decode steps and stamps later tokens with the new version.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

FLAG_STOP = 1
BUCKET_NUMEL = 32 << 20  # 128 MiB of fp32 per broadcast call


@dataclass(frozen=True)
class Layout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(_prod(s) for s in self.shapes)

    @property
    def digest(self) -> int:
        text = ";".join(f"{n}:{'x'.join(map(str, s))}" for n, s in zip(self.names, self.shapes))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def layout(model: torch.nn.Module) -> Layout:
    """Trainable tensors in registration order; tied weights appear once."""
    named = list(model.named_parameters())
    return Layout(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))


def flatten(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).float() for _, p in model.named_parameters()])


def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for _, p in model.named_parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


CHECKSUM_SAMPLES = 1 << 20


def checksum(flat: torch.Tensor) -> float:
    """A cheap order-sensitive fingerprint of a flat parameter vector.

    At most ~1M evenly strided elements are read, so fingerprinting a 7B model
    every step costs milliseconds, not seconds; small models are read whole.
    """
    sample = flat[:: max(1, flat.numel() // CHECKSUM_SAMPLES)]
    w = torch.arange(1, sample.numel() + 1, dtype=torch.float64).remainder_(1013.0).add_(1.0)
    return float((sample.double() * w).sum())


class WeightChannel:
    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank = rank
        self.world = world

    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def publish(self, version: int, flat: torch.Tensor, lay: Layout) -> tuple[float, int]:
        """Root side. Returns (seconds, bytes sent to each receiver)."""
        t0 = time.perf_counter()
        self._bcast(torch.tensor([version, flat.numel(), lay.digest, 0], dtype=torch.int64))
        for start in range(0, flat.numel(), BUCKET_NUMEL):
            self._bcast(flat[start : start + BUCKET_NUMEL])  # a 1-D slice is contiguous
        return time.perf_counter() - t0, flat.numel() * flat.element_size()

    def stop(self) -> None:
        self._bcast(torch.tensor([-1, 0, 0, FLAG_STOP], dtype=torch.int64))

    def receive(self, lay: Layout) -> tuple[int, torch.Tensor] | None:
        """Receiver side: block for the next version; None when the learner says stop."""
        header = torch.zeros(4, dtype=torch.int64)
        self._bcast(header)
        version, numel, digest, flags = header.tolist()
        if flags & FLAG_STOP:
            return None
        if numel != lay.numel or digest != lay.digest:
            raise RuntimeError(
                f"weight channel: the learner sends a model of {numel} parameters (layout {digest:x}) but this "
                f"generator holds {lay.numel} (layout {lay.digest:x}); start generators from the learner's model "
                f"(model.path) so both build the same architecture"
            )
        flat = torch.empty(numel, dtype=torch.float32)
        for start in range(0, numel, BUCKET_NUMEL):
            self._bcast(flat[start : start + BUCKET_NUMEL])
        return version, flat
