"""Fixtures several unit test modules take, and Triton's interpreter for the head kernels' tests."""

from __future__ import annotations

import os
import shutil

import pytest

# Triton reads TRITON_INTERPRET when it is first imported (its language functions are built then), so it is set
# before any test can import it: without a GPU, learner/head_kernels.py's Triton kernels then run on CPU tensors
# (tests/unit/test_head_kernels.py). A machine with nvidia-smi keeps the compiled kernels.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def hub(request, tiny_model_dir):
    """A started hub on loopback for scripted generators (run "run1", two generators, no learner: the weight
    address is a placeholder), stopped after the test. The test module sets it up with two names: KEY, the key
    its generators sign with, and HUB_SETTINGS, the config overrides (`--set` syntax)."""
    from transformers import AutoTokenizer

    from broker.hub import Hub
    from common.config import load_config
    from common.data import PromptSource

    module = request.module
    assert hasattr(module, "KEY") and hasattr(module, "HUB_SETTINGS"), (
        f"{module.__name__} takes the `hub` fixture (tests/unit/conftest.py), which builds the hub from the module's "
        "KEY and HUB_SETTINGS: define both there")
    cfg = load_config(None, list(module.HUB_SETTINGS))
    h = Hub(cfg, run_id="run1", key=module.KEY, host="127.0.0.1", port=0,
            source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)), weight_addr="127.0.0.1:1",
            generators=lambda: 2)
    h.start()
    yield h
    h.stop()
