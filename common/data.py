"""Prompt sources and model locations shared by the hub, generators and tools.

A `PromptSource` is an indexable list of prompts with a seeded order per
epoch; the hub walks that order and owns which prompt goes where. Prompts are
rendered (the built-in `\\boxed{}` template, or a dataset's rows through the
tokenizer's chat template) and tokenised once, when the source is built on the
hub, so every generator sees identical token ids and the length limit is
applied before the first step (`data.truncation`).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

from common.config import Config

log = logging.getLogger("covrl.data")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN_MODEL = os.path.join(REPO_ROOT, "assets", "arith-base")


@dataclass(frozen=True)
class Prompt:
    text: str  # rendered prompt
    answer: str  # ground truth for the verifier
    data_source: str
    ids: tuple[int, ...]  # token ids of `text`, within data.max_prompt_tokens


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a rendered prompt. A chat template writes its special tokens into the text; a plain
    prompt gets whatever the tokenizer adds by itself (a BOS for Llama-family base models, nothing for Qwen)."""
    return tokenizer(text, add_special_tokens=not chat).input_ids


def _arith_problems(cfg: Config, tokenizer, problems, data_source: str | None) -> list[Prompt]:
    from common.datasets import fit_prompt
    from common.templates import render_prompt

    out = []
    for i, p in enumerate(problems):
        text = render_prompt(p.question, cfg.data.instruction)
        ids = fit_prompt(encode_prompt(tokenizer, text, chat=False), cfg.data.max_prompt_tokens, cfg.data.truncation,
                         f"arith problem {i}")
        if ids is not None:
            out.append(Prompt(text, p.answer, data_source or p.data_source, tuple(ids)))
    return out


def _file_prompts(cfg: Config, tokenizer, paths) -> list[Prompt]:
    """Every usable row of `paths`, rendered and tokenised; over-long prompts handled by data.truncation."""
    from common.datasets import fit_prompt, read_records, render_prompt_text, template_mode

    d = cfg.data
    chat = template_mode(tokenizer, d.template) == "chat"
    out, dropped = [], 0
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        for i, rec in enumerate(read_records(path)):
            text = render_prompt_text(rec, tokenizer, template=d.template, instruction=d.instruction,
                                      system_prompt=d.system_prompt)
            ids = fit_prompt(encode_prompt(tokenizer, text, chat), d.max_prompt_tokens, d.truncation, f"{path}: row {i}")
            if ids is None:
                dropped += 1
                continue
            source = stem if d.data_source_from == "file" else rec.data_source
            out.append(Prompt(text, rec.answer, source, tuple(ids)))
    if dropped:
        log.warning("dropped %d of %d prompts longer than data.max_prompt_tokens=%d (data.truncation = \"drop\")",
                    dropped, dropped + len(out), d.max_prompt_tokens)
    return out


def eval_sets(cfg: Config, tokenizer) -> dict[str, list[Prompt]]:
    """The held-out sets by data_source, in file (or built-in) order: `data.eval_files` if given, else the
    built-in arith_easy / arith_hard for the arith task, else none."""
    if cfg.data.eval_files:
        sets: dict[str, list[Prompt]] = {}
        for p in _file_prompts(cfg, tokenizer, cfg.data.eval_files):
            sets.setdefault(p.data_source, []).append(p)
        return sets
    if cfg.data.task != "arith":
        return {}
    from common.arith import ArithTask

    task = ArithTask(seed=cfg.run.seed, train_size=0, eval_size=cfg.data.eval_size)
    return {name: _arith_problems(cfg, tokenizer, problems, name) for name, problems in task.eval_sets().items()}


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


class PromptSource:
    """The training prompts of the configured task, in a seeded order per epoch."""

    def __init__(self, cfg: Config, tokenizer):
        if cfg.data.task == "files":
            self.prompts = _file_prompts(cfg, tokenizer, cfg.data.train_files)
            if not self.prompts:
                raise ValueError(f"no training prompts left in {list(cfg.data.train_files)} after the length limit "
                                 f"(data.max_prompt_tokens={cfg.data.max_prompt_tokens}); raise it")
        else:
            from common.arith import ArithTask

            task = ArithTask(seed=cfg.run.seed, train_size=cfg.data.train_size, eval_size=cfg.data.eval_size)
            keep = set(cfg.data.levels)
            self.prompts = _arith_problems(cfg, tokenizer, [p for p in task.train() if p.level in keep], None)
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
