"""Weights from the learner into vLLM: parameter names, per-bucket metadata, and the learner's NCCL sender.

The weight channel's wire order (`common/weights.py`: `layout()` names, `bucket_plan` buckets) is the same
for every engine. A vLLM generator loads each bucket through vLLM's `model.load_weights`, which takes
Hugging Face checkpoint names and does the tensor-parallel split and the fusing itself (Qwen2: q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`). So the name map is the identity on the HF names a plain
`named_parameters()` gives; `vllm_name` only strips the prefixes that wrappers add (DeepSpeed or DDP
`module.`, torch.compile `_orig_mod.`, activation-checkpoint and FSDP wrappers). `vllm_target` says
which vLLM parameter (and shard of it) a name lands in; a contract test checks it against the installed
vLLM's own Qwen2 mapper.

Both sides derive the per-bucket metadata (`bucket_meta`) from the same layout, so the receiver knows
every tensor's name, dtype and shape before the broadcast starts, and the learner sends each
parameter of a bucket as one NCCL broadcast in that order (vLLM's unpacked NCCL protocol).

NCCL puts each rank on its own GPU: a learner and a generator sharing one GPU cannot share an NCCL
group, and use the gloo channel plus an RPC into the vLLM workers instead (`actors/vllm_engine.py`).

Nothing here imports vLLM or touches CUDA at import time; the learner needs vLLM installed only to
build an `NcclSender`.
"""

from __future__ import annotations

import json
import time

import torch

from common import weights as W

# Path segments that wrappers insert into parameter names; never part of a checkpoint name.
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module")
_LEADING_WRAPPERS = ("module.",)  # DeepSpeedEngine / DistributedDataParallel

# vLLM's Qwen2 (and Llama-family) fusing: HF projection -> (fused vLLM parameter, shard id).
STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}

# The parameter the GPU self-check fingerprints on both sides: not fused, not split by tensor parallelism.
FINGERPRINT_PARAM = "model.norm.weight"

ANNOUNCE_KEY = "vllm/receiver"  # store key: the generator's {"tp", "dtype"} (its NCCL group is 1 + tp ranks)
ADDR_KEY = "vllm/nccl_addr"  # store key: the learner's NCCL rendezvous {"host", "port", "world_size"}


def vllm_name(name: str) -> str:
    """The checkpoint name vLLM's `load_weights` expects for a learner parameter name."""
    for prefix in _LEADING_WRAPPERS:
        while name.startswith(prefix):
            name = name[len(prefix):]
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def vllm_target(name: str) -> tuple[str, str | int | None]:
    """(vLLM parameter, shard id or None) that a learner parameter is loaded into."""
    name = vllm_name(name)
    for hf, (fused, shard) in STACKED.items():
        if hf in name:
            return name.replace(hf, fused), shard
    return name, None


def bucket_meta(lay: W.Layout, first: int, end: int, dtype: torch.dtype) -> dict:
    """`update_info` of one bucket (parameters first..end-1 of `lay`), as vLLM's NCCL receiver reads it."""
    return {
        "names": [vllm_name(n) for n in lay.names[first:end]],
        "dtype_names": [str(dtype).removeprefix("torch.")] * (end - first),
        "shapes": [list(s) for s in lay.shapes[first:end]],
    }


def bucket_tensors(lay: W.Layout, first: int, end: int, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(vLLM name, view shaped as the parameter) for each parameter of a flat bucket."""
    return [(vllm_name(n), p) for n, p in W.bucket_views(lay, first, end, bucket)]


def fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """`W.Checksum` of one tensor after rounding it to `dtype` (the generator's), so the learner's fp32
    copy and the bf16 copy inside vLLM give the same number exactly when the weights arrived."""
    flat = t.detach().reshape(-1)
    if dtype is not None:
        flat = flat.to(dtype)
    acc = W.Checksum(flat.numel())
    acc.add(flat.float().cpu(), 0)
    return acc.total


def torch_dtype(name: str) -> torch.dtype:
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in dtypes:
        raise ValueError(f"dtype {name!r}: the weight channel sends one of {sorted(dtypes)}")
    return dtypes[name]


# ---- rendezvous through the weight channel's store --------------------------------------------


def announce(store, tp: int, dtype: torch.dtype) -> None:
    """Generator side: how many vLLM workers will join the NCCL group, and the dtype they hold."""
    store.set(ANNOUNCE_KEY, json.dumps({"tp": int(tp), "dtype": str(dtype).removeprefix("torch.")}))


def offer_address(store, host: str, port: int, timeout_s: float) -> tuple[int, torch.dtype]:
    """Learner side: wait for the generator's announcement, publish where to meet.
    Returns (NCCL world size, the dtype to send)."""
    store.wait([ANNOUNCE_KEY], _timedelta(timeout_s))
    got = json.loads(store.get(ANNOUNCE_KEY))
    world = 1 + int(got["tp"])
    store.set(ADDR_KEY, json.dumps({"host": host, "port": port, "world_size": world}))
    return world, torch_dtype(got["dtype"])


def read_address(store, timeout_s: float) -> dict:
    """Generator side: the learner's NCCL rendezvous, once offered."""
    store.wait([ADDR_KEY], _timedelta(timeout_s))
    return json.loads(store.get(ADDR_KEY))


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


# ---- the learner's end of the NCCL group ----------------------------------------------------


def wait_until(done, timeout_s: float, poll_s: float = 5e-4) -> bool:
    """Poll `done()` until it is true (True) or `timeout_s` has passed (False). NCCL calls have no timeout of
    their own: the sender waits on a CUDA event this way instead of blocking in `synchronize()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class NcclTimeout(RuntimeError):
    """A broadcast into a generator's workers did not complete in time: the generator is presumed dead."""


class NcclSender:
    """Rank 0 of an NCCL group whose other ranks are one generator's vLLM workers (1 + tp ranks).

    Built by the learner's trainer thread, between train steps, on the learner's own device (`device`): never
    from a helper thread, whose current device would be cuda:0, and never while DeepSpeed's collectives run.
    The constructor blocks until every worker has joined (the generator calls vLLM's
    `init_weight_transfer_engine`, or the worker extension's `covrl_init_nccl`, at the same time). Uses vLLM's own
    trainer-side helper, so both ends build the group the same way.

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
        self.timeout_s = timeout_s
        with torch.cuda.device(self.device):
            self.comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})
            self.stream = torch.cuda.Stream(self.device)

    def send_bucket(self, lay: W.Layout, first: int, end: int, bucket: torch.Tensor, dtype: torch.dtype) -> int:
        """Broadcast one bucket (parameters first..end-1, flat, on any device) parameter by parameter in `dtype`,
        and wait until it has landed (at most `timeout_s`); returns bytes. The receiver reads the same parameters
        from `bucket_meta(lay, first, end, dtype)`. On return the caller may overwrite `bucket`."""
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
        if not wait_until(done.query, self.timeout_s):
            self.abort()
            raise NcclTimeout(f"an NCCL broadcast of {sent} bytes into a generator's vLLM workers did not complete "
                              f"within {self.timeout_s:.0f}s (transport.weight_sync_timeout_s): the generator is "
                              f"presumed dead and its channel is dropped")
        return sent

    def send(self, lay: W.Layout, buckets, dtype: torch.dtype) -> tuple[float, int, float]:
        """Broadcast `buckets` (fp32, `W.bucket_plan(lay)` order, e.g. `param_buckets`) cast to the generator's
        dtype. Returns (seconds, bytes sent, fp32 checksum as `WeightChannel.publish`)."""
        t0 = time.perf_counter()
        acc = W.Checksum(lay.numel)
        sent = 0
        for (first, end, _, _), (start, bucket) in zip(W.bucket_plan(lay), W.checked_buckets(lay, buckets), strict=True):
            acc.add(bucket.cpu(), start)
            sent += self.send_bucket(lay, first, end, bucket, dtype)
        return time.perf_counter() - t0, sent, acc.total

    def abort(self) -> None:
        """Release a broadcast stuck on a dead peer: `ncclCommAbort` through vLLM's wrapper, where it has one."""
        nccl, comm = getattr(self.comm, "nccl", None), getattr(self.comm, "comm", None)
        if nccl is not None and comm is not None and hasattr(nccl, "ncclCommAbort"):
            nccl.ncclCommAbort(comm)

    def close(self) -> None:
        self.comm.destroy()
