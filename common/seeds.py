"""Every seed a run derives from `run.seed`, in one place: pure functions, the same numbers on every process and
every resume, so a re-issued prompt, an evaluated version or a step's random token choice is reproducible.

(The engines turn these into per-sample noise: actors/engine.py `row_seeds`, actors/vllm_engine.py `request_seed`.)
"""

from __future__ import annotations

import zlib


def prompt_seed(run_seed: int, epoch: int, prompt_id: int) -> int:
    """Sampling seed of one training prompt in one data epoch: a re-issue samples the same responses."""
    return zlib.crc32(f"{run_seed}:{epoch}:{prompt_id}".encode()) & 0x7FFFFFFF


def eval_seed(run_seed: int, data_source: str, index: int) -> int:
    """Sampling seed of one eval prompt: the same at every evaluated version (common random
    numbers, so accuracy differences between versions are not sampling noise)."""
    return zlib.crc32(f"{run_seed}:eval:{data_source}:{index}".encode()) & 0x7FFFFFFF


def step_seed(run_seed: int, step: int) -> int:
    """Seed of a step's random token choices (Clip-Cov): the same for every run with this seed."""
    return run_seed * 100_003 + step
