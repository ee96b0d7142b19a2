"""Prompt sources and model locations shared by the hub, generators and tools.

A `PromptSource` is an indexable list of prompts with a seeded order per
epoch; the hub walks that order and owns which prompt goes where. Prompts are
rendered with the `\\boxed{}` template and tokenised once, on the hub, so every
generator sees identical token ids.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass

from common.config import Config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN_MODEL = os.path.join(REPO_ROOT, "assets", "arith-base")


@dataclass(frozen=True)
class Prompt:
    text: str  # rendered prompt, ready to tokenise
    answer: str  # ground truth for the verifier
    data_source: str


def encode_prompt(tokenizer, text: str, max_tokens: int) -> list[int]:
    """Token ids of a rendered prompt; over-long prompts keep their end, where the instruction is."""
    return tokenizer(text, add_special_tokens=False).input_ids[-max_tokens:]


def model_dir(cfg: Config) -> str:
    path = cfg.model.path or BUILTIN_MODEL
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = (
            "build the built-in base model with `python launch/warmstart.py`"
            if not cfg.model.path
            else "point model.path at a local Hugging Face model directory (config.json, *.safetensors, tokenizer)"
        )
        raise FileNotFoundError(f"model directory {path!r} has no config.json; {hint}")
    return path


def eval_sets(cfg: Config) -> dict[str, list[Prompt]]:
    """The held-out sets of the configured task, by data_source, in a fixed order."""
    from common.arith import ArithTask
    from common.templates import render_prompt

    task = ArithTask(seed=cfg.run.seed, train_size=0, eval_size=cfg.data.eval_size)
    return {name: [Prompt(render_prompt(p.question), p.answer, name) for p in problems]
            for name, problems in task.eval_sets().items()}


def eval_seed(run_seed: int, data_source: str, index: int) -> int:
    """Sampling seed of one eval prompt: the same at every evaluated version (common random
    numbers, so accuracy differences between versions are not sampling noise)."""
    return zlib.crc32(f"{run_seed}:eval:{data_source}:{index}".encode()) & 0x7FFFFFFF


class PromptSource:
    """The training prompts of the configured task, in a seeded order per epoch."""

    def __init__(self, cfg: Config):
        from common.arith import ArithTask
        from common.templates import render_prompt

        task = ArithTask(seed=cfg.run.seed, train_size=cfg.data.train_size, eval_size=cfg.data.eval_size)
        keep = set(cfg.data.levels)
        self.prompts = [Prompt(render_prompt(p.question), p.answer, p.data_source) for p in task.train() if p.level in keep]
        if not self.prompts:
            raise ValueError(f"data.levels={list(cfg.data.levels)} selects no arith problems; use levels from 1 to 4")
        self.seed = cfg.run.seed

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx
