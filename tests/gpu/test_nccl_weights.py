"""The NCCL weight path: learner rank 0 (the learner role, GPU 0) broadcasts each bucket straight into the
vLLM workers of a generator on the next GPU(s), through vLLM's weight-transfer API or, as an older vLLM
would need, covrl's worker extension. Runs hardware/check.py: its learner role (`python -m hardware.check_learner`,
the learner's publish path) against its generator role.

NCCL puts each rank on its own GPU, so these need 2 GPUs (3 for tensor parallelism 2); skipped otherwise,
and without CUDA (tests/conftest.py) or vllm."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (the gpu extra)")

from hardware import check as gpu_check  # noqa: E402
from tests.helpers.paths import REPO

pytestmark = pytest.mark.gpu

MODEL = os.path.join(REPO, "assets", "arith-base")
MAX_DLOGP = 0.05


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check(r: dict) -> None:
    fp = r["fingerprint"]
    assert fp["generator"] and all(g == fp["learner"] for g in fp["generator"]), fp  # every worker got them
    assert r["versions"] == [1]
    assert r["mean_abs_dlogp"] <= MAX_DLOGP, r["mean_abs_dlogp"]
    assert r["bytes_sent"] > 0 and r["weight_sync_s"] > 0


@pytest.mark.skipif(_gpus() < 2, reason="NCCL needs the learner and the generator on different GPUs: 2 GPUs")
@pytest.mark.parametrize("impl", ["native", "extension"])
def test_nccl_update_reaches_the_workers(impl):
    r = gpu_check.run(MODEL, "nccl", prompts=8, n=2, nccl_impl=impl, timeout_s=600)
    _check(r)
    # the publish reports every parameter once as fp32 (`weights/bytes`); what arrived in bf16 is the fingerprint's check
    assert r["bytes_sent"] == 4 * sum(p.numel() for p in _hf_params())


@pytest.mark.skipif(_gpus() < 3, reason="tensor parallelism 2 plus the learner: 3 GPUs")
def test_nccl_update_reaches_every_tensor_parallel_worker():
    r = gpu_check.run(MODEL, "nccl", prompts=8, n=2, tp=2, timeout_s=600)
    _check(r)
    assert len(r["fingerprint"]["generator"]) == 2


def _hf_params():
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).parameters())
