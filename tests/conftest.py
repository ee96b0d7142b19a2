"""Shared fixtures: tiny offline models, free ports, one torch thread (determinism)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
import torch

from tests.helpers.paths import BASE_MODEL, HUB_OLD, HUB_SHA, REPO

sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
# The launcher's record of checked inputs (common/check_cache.py): one per test session, never the user's ~/.cache.
_CHECKS = None if "COVRL_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="covrl-test-cache-")
if _CHECKS:
    os.environ["COVRL_CACHE_DIR"] = _CHECKS


def pytest_unconfigure(config):
    if _CHECKS:
        shutil.rmtree(_CHECKS, ignore_errors=True)


@pytest.fixture
def hub_cache(tmp_path):
    """A Hugging Face Hub cache (HF_HUB_CACHE) holding acme/arith-base, the built-in model, in the Hub's layout:
    refs/main -> HUB_SHA, and an older snapshot HUB_OLD. Built offline; nothing reaches a network."""
    import shutil

    repo = tmp_path / "hub" / "models--acme--arith-base"
    for sha in (HUB_SHA, HUB_OLD):
        shutil.copytree(BASE_MODEL, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_SHA)
    return tmp_path / "hub"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init 2-layer Qwen2 with the project's byte-level BPE tokenizer (built offline)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.arith import ArithTask
    from common.templates import render_prompt
    from study.tokenizer import train_bpe_tokenizer

    out = str(tmp_path_factory.mktemp("tiny"))
    task = ArithTask(seed=0, train_size=256, eval_size=8)
    tok = train_bpe_tokenizer([render_prompt(p.question) + ArithTask.solution(p) for p in task.train()], 320, out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out
