"""The weight channel's wire: how learner rank 0 sends each new policy version to a generator.

One two-member torch.distributed gloo group per generator incarnation (`pair_prefix`), built on learner
rank 0's TCPStore: rank 0 is learner rank 0, rank 1 the generator. One publish = one header broadcast
`[version, numel, layout_hash, flags]` then the parameters as flat fp32 buckets in the order of `layout()`,
cut at parameter boundaries by `bucket_plan` (at most BUCKET_NUMEL elements, or one larger parameter), so a
ZeRO-3 learner can gather, send and free one bucket at a time and never hold the whole model. Both sides derive
the layout from the same architecture, and the header's layout hash catches a generator built from another
model before it loads garbage.

This module is the wire and the receiving end; the sending end, the one publish path, is the learner's
(`learner/publisher.py`: `ModelPublisher` over `WeightPublisher`). Receivers block inside the collective in a
thread of their own (`actors/actor.py`), so the learner never waits for a generator to finish a batch; the
generator swaps the staged weights in between decode steps and stamps later tokens with the new version.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

FLAG_STOP = 1
# The buckets of this version do not follow on this gloo channel: the learner broadcasts them over the
# generator's own NCCL group straight into its vLLM workers (common/vllm_weights.py); the header still
# comes here, so versions, layout checks and dead-peer detection stay on one channel.
FLAG_DIRECT = 2
BUCKET_NUMEL = 32 << 20  # 128 MiB of fp32 per broadcast call
# The two members of a generator incarnation's own channel (`pair_prefix`): learner rank 0 sends, the generator
# receives.
LEARNER_RANK, GENERATOR_RANK, PAIR_WORLD = 0, 1, 2


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
    """Trainable tensors in registration order; tied weights appear once. Under ZeRO-3 a parameter's own
    shape is its local shard; DeepSpeed keeps the full shape in `ds_shape`."""
    named = list(model.named_parameters())
    return Layout(tuple(n for n, _ in named), tuple(tuple(getattr(p, "ds_shape", p.shape)) for _, p in named))


def bucket_plan(lay: Layout, bucket_numel: int = 0) -> list[tuple[int, int, int, int]]:
    """(first param, end param, first element, end element) of each bucket: whole parameters, in layout order,
    at most `bucket_numel` (default BUCKET_NUMEL) elements unless one parameter alone is larger."""
    limit = bucket_numel or BUCKET_NUMEL
    plan, first, start, offset = [], 0, 0, 0
    for i, shape in enumerate(lay.shapes):
        n = _prod(shape)
        if offset > start and offset + n - start > limit:
            plan.append((first, i, start, offset))
            first, start = i, offset
        offset += n
    if offset > start:
        plan.append((first, len(lay.shapes), start, offset))
    return plan


def shaped(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Consecutive views of a flat vector, one per shape."""
    return [part.view(s) for part, s in zip(flat.split([_prod(s) for s in shapes]), shapes, strict=True)]


def bucket_views(lay: Layout, first: int, end: int, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view shaped as the parameter) for parameters first..end-1 of a flat bucket."""
    return list(zip(lay.names[first:end], shaped(bucket, lay.shapes[first:end]), strict=True))


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


class Checksum:
    """A cheap order-sensitive fingerprint of a flat parameter vector, fed bucket by bucket.

    At most ~1M evenly strided elements are read, so fingerprinting a 7B model every step
    costs milliseconds; small models are read whole. Sender and receivers feed the same
    buckets in the same order, so their float64 sums agree to the bit.
    """

    def __init__(self, numel: int):
        self.stride = max(1, numel // CHECKSUM_SAMPLES)
        self.total = 0.0

    def add(self, bucket: torch.Tensor, start: int) -> None:
        first = -start % self.stride  # first element of this bucket on the global stride
        sample = bucket[first :: self.stride]
        s0 = (start + first) // self.stride  # index of that element among all samples
        w = torch.arange(s0 + 1, s0 + 1 + sample.numel(), dtype=torch.float64).remainder_(1013.0).add_(1.0)
        self.total += float((sample.double() * w).sum())


def checksum(flat: torch.Tensor, lay: Layout | None = None) -> float:
    """The Checksum of a whole flat vector, fed by `lay`'s bucket plan (one bucket without a layout)."""
    acc = Checksum(flat.numel())
    plan = bucket_plan(lay) if lay is not None else [(0, 0, 0, flat.numel())]
    for _, _, start, end in plan:
        acc.add(flat[start:end], start)
    return acc.total


def checked_buckets(lay: Layout, buckets):
    """(first element, bucket) for each of `buckets`, checked against `bucket_plan(lay)`: the wire order."""
    for (_, _, start, end), bucket in zip(bucket_plan(lay), buckets, strict=True):
        if bucket.numel() != end - start or bucket.dtype != torch.float32:
            raise ValueError(f"weight bucket at element {start} has {bucket.numel()} {bucket.dtype} elements; "
                             f"the plan says {end - start} float32")
        yield start, bucket


def gloo_device(host: str, port: int):
    """The gloo device of a channel to the store at host:port: the local interface that routes there
    (GLOO_SOCKET_IFNAME, if set, wins). Gloo's default, the address the hostname resolves to, is wrong
    across hosts and network namespaces (e.g. 127.0.1.1 in /etc/hosts)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return dist.ProcessGroupGloo.create_device(hostname=s.getsockname()[0])


def pair_prefix(gen_id: int, incarnation: str) -> str:
    """The store prefix of one generator incarnation's own channel to the learner."""
    return f"gen{gen_id}/{incarnation}"


def refuse_direct(flags: int, receiver: str) -> None:
    """A receiver without an NCCL group (`receiver` names it) refuses a header flagged FLAG_DIRECT."""
    if flags & FLAG_DIRECT:
        raise RuntimeError(f"weight channel: the learner flagged this version as sent over NCCL into vLLM workers, but "
                           f"{receiver} announced no NCCL receiver (a learner bug: it must decide per channel from the "
                           f"generator's announcement, common/vllm_weights.py)")


class WeightChannel:
    """A gloo group whose rank 0 (learner rank 0) broadcasts versions to ranks 1.. (generators).

    The sending side is driven by `learner/publisher.py` (`start_header`, then each bucket, then `start_stop`); the
    receiving side by the generator's weight thread (`receive_header`, then `receive_buckets`).

    `prefix` names a group inside a shared store, so each generator incarnation can get a two-member
    channel of its own (`pair_prefix`) that is built when it joins and dropped when it dies, while the
    learner keeps one store master for all of them (`store`).
    """

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, *, prefix: str = "",
                 store: dist.Store | None = None):
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, None if prefix else world, is_master=rank == 0 and not prefix,
                                  timeout=timeout, wait_for_workers=False)
        self.store = store
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [gloo_device(host, port)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store) if prefix else store, rank, world, opts)
        self.rank = rank
        self.world = world

    def _start(self, t: torch.Tensor) -> dist.Work:
        """Begin a broadcast; it fails by itself once the channel's timeout has passed (gloo's own deadline, and
        after one the pair is closed, so later operations fail at once)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([t], opts)

    def _bcast(self, t: torch.Tensor) -> None:
        self._start(t).wait()

    # Root side. A `start_*` returns the operation without waiting, so learner rank 0 sends to every generator at
    # once and decides for each when to stop waiting (`learner/publisher.py`: `Sends`); the tensor must stay
    # untouched until the operation has completed or failed.

    def start_header(self, version: int, lay: Layout, flags: int = 0) -> dist.Work:
        return self._start(torch.tensor([version, lay.numel, lay.digest, flags], dtype=torch.int64))

    def start_bucket(self, bucket: torch.Tensor) -> dist.Work:
        """After a header without FLAG_DIRECT: one fp32 host bucket of `bucket_plan`, in order."""
        return self._start(bucket)

    def start_stop(self) -> dist.Work:
        """The stop header: the receiver's `receive_header` returns None and its weight thread ends."""
        return self._start(torch.tensor([-1, 0, 0, FLAG_STOP], dtype=torch.int64))

    def stop(self) -> None:
        self.start_stop().wait()

    def receive_header(self, lay: Layout) -> tuple[int, int] | None:
        """Receiver side: block for the next header -> (version, flags); None when the learner says stop."""
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
        return version, flags

    def receive_buckets(self, lay: Layout, out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """Receiver side, after a header without FLAG_DIRECT: the buckets -> (flat, checksum).

        `out`: a free fp32 vector of the model's size to receive into. Reusing one saves a fresh
        allocation per version, whose page faults cost as much as the copy itself."""
        flat = out if out is not None and out.numel() == lay.numel else torch.empty(lay.numel, dtype=torch.float32)
        acc = Checksum(lay.numel)
        for _, _, start, end in bucket_plan(lay):
            self._bcast(flat[start:end])  # a 1-D slice is contiguous
            acc.add(flat[start:end], start)
        return flat, acc.total
