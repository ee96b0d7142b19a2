"""Which engine a generator runs, and building it: the one place that knows every engine.

`generator.engine` = "vllm" (actors/vllm_engine.py, the fast GPU engine), "torch" (actors/engine.py's sampler, on this
process's GPU when the launcher gave it one, else the CPU) or "auto" (vLLM when the launcher gave this generator GPUs).
The engines import nothing of each other's beyond the shared `Completion` and `hash32`; only this module imports both.
"""

from __future__ import annotations

import logging
import os

import torch

from actors.continuous import StreamingTorchEngine
from actors.engine import stop_token_ids
from common.config import dtype_on
from common.runfiles import apply_memory_fraction

log = logging.getLogger("covrl.engine")


def choose_engine(requested: str, environ=os.environ) -> str:
    """"torch" or "vllm". auto: vLLM when this process was given CUDA devices (the launcher sets
    CUDA_VISIBLE_DEVICES per generator, "" for CPU-only roles), else the torch sampler."""
    if requested in ("torch", "vllm"):
        return requested
    if requested != "auto":
        raise ValueError(f"generator.engine={requested!r}: use \"auto\", \"torch\" or \"vllm\"")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return "vllm" if visible.strip() else "torch"
    import glob

    return "vllm" if glob.glob("/dev/nvidia[0-9]*") else "torch"


def load_engine(cfg, model_path: str):
    """(engine, tokenizer) for a local Hugging Face model directory, as the config asks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stops = stop_token_ids(tokenizer, model_path)
    # generator.engine picks vLLM or the torch sampler (auto: vLLM when the launcher gave this generator GPUs).
    from actors.vllm_engine import VllmEngine  # imports neither vllm nor CUDA

    if choose_engine(cfg.generator.engine) == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError("generator.engine selects vLLM (this generator has GPUs) but vllm is not installed: "
                             "see docs/gpu.md \"GPU install\", or set generator.engine = \"torch\"")
        engine = VllmEngine.from_config(cfg, model_path, stop_ids=stops)
        st = engine.settings
        log.info("generator engine: vllm %s on cuda, tp %d, %s, weight update %s (%s), weights over %s",
                 engine.api.version, engine.tp, st.dtype, st.weight_update,
                 "covrl drains before each update" if engine.drain else "per-token version labels", st.transport)
        return engine, tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    # This process's GPU when the launcher gave it one (CUDA_VISIBLE_DEVICES per generator; "" hides them all),
    # else the CPU, in model.dtype on either (bf16 on the CPU too): the run's, as the launcher resolved it for the
    # learner ranks, so both sides run one dtype; "auto" only outside a run (covrl evaluate), resolved for `device`.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_on(cfg.model.dtype, device)]
    fraction = apply_memory_fraction(device)  # before the model takes any GPU memory
    log.info("generator engine: torch on %s, %s%s", device, str(dtype).removeprefix("torch."),
             f", allocator capped at {fraction:g} of the GPU" if fraction else "")
    if device == "cuda" and torch.cuda.device_count() > 1:
        log.warning("the torch engine runs on one GPU (cuda:0) of the %d this generator was given; the others stay "
                    "idle (use vLLM for tensor parallelism, or --tp 1)", torch.cuda.device_count())
    return StreamingTorchEngine(model_path, eos_token_id=stops, pad_token_id=pad, dtype=dtype, device=device,
                       max_num_seqs=cfg.generator.max_num_seqs), tokenizer
