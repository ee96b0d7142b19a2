"""Learner options a CPU can run: gradient checkpointing and DeepSpeed optimizer offload change
memory and where the optimizer runs, not the updates."""

import os

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from tests.helpers.paths import BASE_MODEL
from tests.helpers.runs import SMALL, launch

pytestmark = pytest.mark.slow


def test_gradient_checkpointing_and_optimizer_offload_train_the_same_weights(tmp_path):
    sets = [*SMALL, "--set", "rollout.max_staleness_steps=0", "--set", "learner.filter.dynamic_sampling=false"]
    weights = {}
    for name, extra in {"plain": [], "ckpt_offload": ["--set", "learner.gradient_checkpointing=true",
                                                       "--set", "learner.offload_optimizer=true"]}.items():
        run = tmp_path / name
        launch(run, "--gens", "1", "--learners", "1", "--steps", "3", *sets, *extra)
        weights[name] = load_file(str(run / "checkpoints" / "step_3" / "model.safetensors"))
    log = (tmp_path / "ckpt_offload" / "logs" / "learner0.log").read_text()
    assert "optimizer offload True, bf16 False, attention sdpa, gradient checkpointing True" in log, log[-2000:]
    a, b = weights["plain"], weights["ckpt_offload"]
    base = load_file(os.path.join(BASE_MODEL, "model.safetensors"))
    assert a.keys() == b.keys() == base.keys()
    assert any(not torch.equal(b[k], base[k]) for k in base), "nothing trained"
    for k in a:
        assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
