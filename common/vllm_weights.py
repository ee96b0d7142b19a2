"""Weights from the learner into vLLM: parameter names, per-bucket metadata, the NCCL rendezvous.

The weight channel's wire order (`common/weights.py`: `layout()` names, `wire_plan` buckets) is the same for every
engine. A vLLM generator loads each `bucket_plan` bucket (whole parameters) through vLLM's `model.load_weights`,
which takes whole tensors, so a parameter the wire splits into pieces is put together first: by the worker
extension from the rpc pieces (`actors/vllm_engine.py`), by the learner before an NCCL broadcast
(`learner/publisher.py`: `NcclPeer`). `load_weights` takes Hugging Face checkpoint names and does the
tensor-parallel split and the fusing itself (Qwen2: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`). So the
name map is the identity on the HF names a plain `named_parameters()` gives; `vllm_name` only strips the prefixes
that wrappers add (DeepSpeed or DDP `module.`, torch.compile `_orig_mod.`, activation-checkpoint and FSDP
wrappers). `vllm_target` says which vLLM parameter (and shard of it) a name lands in; a contract test checks it
against the installed vLLM's own Qwen2 mapper.

Both sides derive the per-bucket metadata (`bucket_meta`) from the same layout, so the receiver knows
every tensor's name, dtype and shape before the broadcast starts, and the learner sends each
parameter of a bucket as one NCCL broadcast in that order (vLLM's unpacked NCCL protocol).

NCCL puts each rank on its own GPU: a learner and a generator sharing one GPU cannot share an NCCL
group, and use the gloo channel plus an RPC into the vLLM workers instead (`actors/vllm_engine.py`).

Both ends use this module; only the learner sends, so its end of the NCCL group is `learner/nccl.py`.
Nothing here imports vLLM or touches CUDA.
"""

from __future__ import annotations

import json

import torch

from common import weights

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


def bucket_meta(lay: weights.Layout, first: int, end: int, dtype: torch.dtype) -> dict:
    """`update_info` of one `bucket_plan` bucket (whole parameters first..end-1 of `lay`), as vLLM's NCCL receiver
    reads it; the rpc path sends a split parameter's pieces under its one name and shape."""
    return {
        "names": [vllm_name(n) for n in lay.names[first:end]],
        "dtype_names": [str(dtype).removeprefix("torch.")] * (end - first),
        "shapes": [list(s) for s in lay.shapes[first:end]],
    }


def bucket_tensors(lay: weights.Layout, first: int, end: int, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(vLLM name, view shaped as the parameter) for each parameter of a flat bucket."""
    return [(vllm_name(n), p) for n, p in weights.bucket_views(lay, first, end, bucket)]


def fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """`weights.Checksum` of one tensor after rounding it to `dtype` (the generator's), so the learner's fp32
    copy and the bf16 copy inside vLLM give the same number exactly when the weights arrived."""
    flat = t.detach().reshape(-1)
    if dtype is not None:
        flat = flat.to(dtype)
    acc = weights.Checksum(flat.numel())
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
