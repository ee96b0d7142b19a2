"""Learner rank 0's end of an NCCL group into one vLLM generator's workers (the `nccl` weight transport).

Only the learner sends over NCCL, so the sender lives here; what both ends share (parameter names, per-bucket
metadata, the rendezvous through the weight channel's store) stays in `common/vllm_weights.py`. The receiving
end is `actors/vllm_engine.py` (vLLM's weight-transfer API, or covrl's worker extension on an older vLLM).
`learner/publisher.py` builds one `NcclSender` per direct generator and sends each bucket through it.

What goes through a sender is always whole parameters, one `weights.bucket_plan` bucket per `send_bucket`: the
receiver allocates one tensor per name and shape of `bucket_meta` and hands them to vLLM's `load_weights`, which
takes whole tensors. A parameter that `weights.wire_plan` splits (larger than BUCKET_NUMEL elements) is put together
from its pieces by the publisher (`NcclPeer`) before it is sent here.

Nothing here imports vLLM or touches CUDA at import time; the learner needs vLLM installed only to build a sender.
"""

from __future__ import annotations

import threading
import time

import torch

from common import weights
from common.vllm_weights import bucket_tensors


def wait_until(done, timeout_s: float, poll_s: float = 5e-4, cancelled=None) -> bool:
    """Poll `done()` until it is true (True), or `timeout_s` has passed or `cancelled()` is true (False). NCCL
    calls have no timeout of their own: the sender waits on a CUDA event this way instead of blocking in
    `synchronize()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline or (cancelled is not None and cancelled()):
            return False
        time.sleep(poll_s)
    return True


class NcclTimeout(RuntimeError):
    """A broadcast into a generator's workers did not complete in time: the generator is presumed dead."""


class NcclSender:
    """Rank 0 of an NCCL group whose other ranks are one generator's vLLM workers (1 + tp ranks).

    Built by the learner's trainer thread, between train steps, on the learner's own device (`device`): the set-up
    runs on a helper thread with that device current, which the trainer thread waits for with a deadline
    (`_within`), never while DeepSpeed's collectives run. The constructor blocks until every worker has joined (the
    generator calls vLLM's `init_weight_transfer_engine`, or the worker extension's `covrl_init_nccl`, at the same
    time). Uses vLLM's own trainer-side helper, so both ends build the group the same way.

    Each bucket is broadcast on this sender's own CUDA stream and waited for with a deadline (`timeout_s`):
    a generator that dies mid-transfer makes `send_bucket` raise `NcclTimeout` (the communicator is aborted
    where vLLM's NCCL wrapper offers `ncclCommAbort`) instead of hanging the learner in `synchronize()`.
    """

    def __init__(self, host: str, port: int, world_size: int, device: torch.device | str | int, timeout_s: float):
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as e:
            raise RuntimeError(f"the NCCL weight channel into vLLM needs vllm on the learner too ({e}); "
                               "pip install vllm==0.33.0 beside the learner, or set generator.weight_transport = \"rpc\"") from None
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"NcclSender on {self.device}: the NCCL weight channel sends from the learner's GPU; "
                             "a CPU learner uses the gloo channel (generator.weight_transport = \"rpc\")")
        self.timeout_s, self.aborted = timeout_s, False
        self.comm = _within(timeout_s, self.device, lambda: trainer_init(
            {"master_address": host, "master_port": port, "world_size": world_size}))
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)

    def send_bucket(self, lay: weights.Layout, first: int, end: int, bucket: torch.Tensor, dtype: torch.dtype,
                    cancelled=None) -> int:
        """Broadcast one `bucket_plan` bucket (whole parameters first..end-1, flat, on any device, in any wire dtype;
        cast here when it is not the generator's) parameter by parameter in `dtype`,
        and wait until it has landed (at most `timeout_s`, or until `cancelled()`: the hub declared the generator
        lost); returns bytes. The receiver reads the same parameters from `bucket_meta(lay, first, end, dtype)`. On
        return the caller may overwrite `bucket`."""
        ready = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_stream(ready)  # the bucket was assembled on the trainer's stream
            on_gpu = bucket.to(self.device, dtype, non_blocking=True)
            sent = 0
            for _, t in bucket_tensors(lay, first, end, on_gpu):
                self.comm.broadcast(t, src=0, stream=self.stream)  # a split of a 1-D tensor is contiguous
                sent += t.numel() * t.element_size()
            done = torch.cuda.Event()
            done.record(self.stream)
        if not wait_until(done.query, self.timeout_s, cancelled=cancelled):
            self.abort()
            if cancelled is not None and cancelled():
                raise NcclTimeout("an NCCL broadcast into a generator's vLLM workers was abandoned: the hub declared "
                                  "the generator lost")
            raise NcclTimeout(f"an NCCL broadcast of {sent} bytes into a generator's vLLM workers did not complete "
                              f"within {self.timeout_s:.0f}s (transport.weight_sync_timeout_s): the generator is "
                              f"presumed dead and its channel is dropped")
        return sent

    def abort(self) -> None:
        """Release a broadcast stuck on a dead peer: `ncclCommAbort` through vLLM's wrapper, where it has one."""
        self.aborted = True
        nccl, comm = getattr(self.comm, "nccl", None), getattr(self.comm, "comm", None)
        if nccl is not None and comm is not None and hasattr(nccl, "ncclCommAbort"):
            nccl.ncclCommAbort(comm)

    def close(self) -> None:
        """Destroy the communicator, unless a broadcast on it timed out: destroying that one could wait for ever on
        the dead peer, so it is aborted (above) and dropped instead."""
        if not self.aborted:
            _within(self.timeout_s, self.device, self.comm.destroy)


def _within(timeout_s: float, device: torch.device, op):
    """`op()` on a helper thread with `device` current, waited for at most `timeout_s` (NCCL's set-up and teardown
    have no deadline of their own). The caller's thread is blocked meanwhile, so nothing else runs on the learner's
    device; past the deadline the helper is abandoned (it holds only this group) and `NcclTimeout` raised."""
    box: dict = {}

    def run() -> None:
        try:
            with torch.cuda.device(device):
                box["value"] = op()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="nccl-setup", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise NcclTimeout(f"NCCL set-up or teardown with a generator's vLLM workers did not finish within "
                          f"{timeout_s:.0f}s: the generator is presumed stuck and its channel is dropped")
    if "error" in box:
        raise box["error"]
    return box.get("value")
