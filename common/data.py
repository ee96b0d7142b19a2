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
from collections import Counter
from dataclasses import dataclass

from common.check_cache import input_key, recalled, record
from common.config import Config, ConfigError, is_hub_id
from common.datasets import DatasetError, Record, fit_prompt, read_records, render_prompt_text, template_mode

log = logging.getLogger("covrl.data")

Records = dict[str, list[Record]] | None  # rows already read and checked, by file path

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


def _fit(tokenizer, text: str, chat: bool, cfg: Config, where: str, lengths: Counter) -> list[int] | None:
    """The prompt's ids within data.max_prompt_tokens (None: dropped), counted in `lengths`."""
    ids = encode_prompt(tokenizer, text, chat)
    fitted = fit_prompt(ids, cfg.data.max_prompt_tokens, cfg.data.truncation, where)
    lengths["kept"] += fitted is not None
    lengths["dropped"] += fitted is None
    lengths["truncated"] += fitted is not None and len(fitted) < len(ids)
    return fitted


def _arith_problems(cfg: Config, tokenizer, problems, data_source: str | None, lengths: Counter) -> list[Prompt]:
    from common.templates import render_prompt

    out = []
    for i, p in enumerate(problems):
        text = render_prompt(p.question, cfg.data.instruction)
        if (ids := _fit(tokenizer, text, False, cfg, f"arith problem {i}", lengths)) is not None:
            out.append(Prompt(text, p.answer, data_source or p.data_source, tuple(ids)))
    return out


def _file_prompts(cfg: Config, tokenizer, paths, lengths: Counter, records: Records = None) -> list[Prompt]:
    """Every usable row of `paths` (their records if already read), rendered and tokenised; over-long prompts
    handled by data.truncation."""
    d = cfg.data
    chat = template_mode(tokenizer, d.template) == "chat"
    out = []
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        for i, rec in enumerate(records[path] if records and path in records else read_records(path)):
            try:
                text = render_prompt_text(rec, tokenizer, template=d.template, instruction=d.instruction,
                                          system_prompt=d.system_prompt)
            except DatasetError as e:
                raise DatasetError(f"{path}: row {i}: {e}") from None
            _check_ground_truth(cfg, rec.answer, f"{path}: row {i}")
            if (ids := _fit(tokenizer, text, chat, cfg, f"{path}: row {i}", lengths)) is not None:
                source = stem if d.data_source_from == "file" else rec.data_source
                out.append(Prompt(text, rec.answer, source, tuple(ids)))
    if lengths["dropped"]:
        log.warning(length_note(cfg, lengths))
    return out


def _check_ground_truth(cfg: Config, answer: str, where: str) -> None:
    """With reward.verifier = "grid_path" every row must be gradable as a walk: checked when the data loads, before
    any run, not as a stream of scoring errors later."""
    if cfg.reward.verifier != "grid_path":
        return
    from common.gridpath import parse_ground_truth

    try:
        parse_ground_truth(answer)
    except ValueError as e:
        raise DatasetError(f"{where}: {e} (reward.verifier = \"grid_path\")") from None


def length_note(cfg: Config, lengths: Counter) -> str:
    """What data.max_prompt_tokens did to a set of prompts, in words ("" when it touched none)."""
    n, limit = lengths["kept"] + lengths["dropped"], cfg.data.max_prompt_tokens
    if lengths["dropped"]:
        return f"dropped {lengths['dropped']} of {n} prompts longer than data.max_prompt_tokens={limit}"
    if lengths["truncated"]:
        return f"cut {lengths['truncated']} of {n} prompts to their last data.max_prompt_tokens={limit} tokens"
    return ""


def eval_sets(cfg: Config, tokenizer, lengths: Counter | None = None,
              records: Records = None) -> dict[str, list[Prompt]]:
    """The held-out sets by data_source, in file (or built-in) order: `data.eval_files` if given, else the
    built-in arith_easy / arith_hard for the arith task, else none."""
    lengths = Counter() if lengths is None else lengths
    if cfg.data.eval_files:
        sets: dict[str, list[Prompt]] = {}
        for p in _file_prompts(cfg, tokenizer, cfg.data.eval_files, lengths, records):
            sets.setdefault(p.data_source, []).append(p)
        return sets
    if cfg.data.task != "arith":
        return {}
    from common.arith import ArithTask

    task = ArithTask(seed=cfg.run.seed, train_size=0, eval_size=cfg.data.eval_size)
    return {name: _arith_problems(cfg, tokenizer, problems, name, lengths) for name, problems in task.eval_sets().items()}


def model_dir(cfg: Config) -> str:
    path = cfg.model.path or BUILTIN_MODEL
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = (
            "build the built-in base model with `covrl warmstart`"
            if not cfg.model.path
            else "point model.path at a local Hugging Face model directory (config.json, *.safetensors, tokenizer)"
        )
        raise FileNotFoundError(f"model directory {path!r} has no config.json; {hint}")
    return path


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def resolve_model(path: str, what: str = "model.path") -> tuple[str, str | None]:
    """A local model directory for `path`: the directory itself, or, for a Hugging Face Hub id
    (`org/name` or `org/name@revision`, when no such local directory exists), its snapshot in the Hub cache,
    fetched on this host if it is missing and the Hub can be reached. Returns (local path, the id@commit it
    came from or None). Offline (`HF_HUB_OFFLINE=1`, or no network) only the cache is used."""
    if not path or os.path.exists(path) or not is_hub_id(path):
        return path, None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo, _, revision = path.partition("@")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    fetch = f"fetch it on a machine with network (`hf download {repo}" + (f" --revision {revision}" if revision else "") + \
        "`, into the same Hugging Face cache), or point " + what + " at a local model directory (there is no " + \
        f"local directory {path!r})"
    try:
        local = snapshot_download(repo, revision=revision or None, local_files_only=offline)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as e:
        raise ConfigError(f"{what} {path!r}: no local directory of that name, and the Hub has no such model or "
                          f"revision, or it is gated ({_first_line(e)}); check the path or id, or log in with "
                          f"`hf auth login`") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE=1" if offline else "the Hub cannot be reached"
        raise ConfigError(f"{what} {path!r} is not in the Hugging Face cache and {where}; {fetch}") from None
    except Exception as e:  # the network or a proxy failed mid-request (OSError, httpx errors, HTTP 401/5xx)
        raise ConfigError(f"{what} {path!r}: the Hub request failed ({type(e).__name__}: {_first_line(e)}); "
                          f"{fetch}") from None
    return local, f"{repo}@{os.path.basename(local)}"


def check_model_dir(path: str, what: str = "model.path"):
    """A Hugging Face model directory that the roles can load: config.json readable, a tokenizer. Returns the
    tokenizer; a ConfigError naming `what` and the fix otherwise."""
    check_model_files(path, what)
    return load_tokenizer(path, what)


def check_model_files(path: str, what: str = "model.path") -> None:
    """The model directory's files, without loading anything (no transformers import: a fraction of a second)."""
    import json

    if not os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is not a directory; give a local Hugging Face model directory "
                          f"(config.json, *.safetensors, tokenizer files)")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path!r} has no config.json, so it is not a Hugging Face model directory") from None
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{path}/config.json is not a JSON object ({str(e).splitlines()[0]}); restore it from the "
                          f"model's source") from None
    if not model_type:
        raise ConfigError(f"{path}/config.json names no model_type; restore it from the model's source")
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") or (n.startswith("pytorch_model") and n.endswith(".bin")) for n in names):
        from common.pinned import missing_hint

        raise ConfigError(f"{what} {path!r} has no weights (*.safetensors or pytorch_model*.bin); copy the whole model "
                          f"directory, or save it with model.save_pretrained{missing_hint(path)}")
    if not any(n in names for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")):
        raise ConfigError(f"{what} {path!r} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); save it "
                          f"there with tokenizer.save_pretrained")


def load_tokenizer(path: str, what: str = "model.path"):
    """The model directory's tokenizer; a ConfigError naming `what` and the fix if it does not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, TypeError... for a broken tokenizer
        raise ConfigError(f"{what} {path!r}: its tokenizer cannot be loaded ({_first_line(e)}); the directory needs "
                          f"tokenizer.json or the files of a slow tokenizer") from None


def check_inputs(cfg: Config) -> list[str]:
    """Everything the roles will read, read now in the launching process, before any process starts: the model
    directory and tokenizer, every train and eval row, the prompt lengths. Raises ConfigError / DatasetError
    naming the file, row and field; returns the start banner's lines about the data."""
    path = model_dir(cfg) if not cfg.model.path else cfg.model.path
    check_model_files(path)
    # Every row of every file first: a bad row is reported before the tokenizer (and transformers) loads.
    files = [*(cfg.data.train_files if cfg.data.task == "files" else ()),
             *(cfg.data.eval_files if cfg.eval.every_steps else ())]
    records = {f: read_records(f) for f in files}
    key = input_key(cfg, path, files)
    if (notes := recalled(key)) is not None:  # these very inputs passed before: no tokenizer (common/check_cache.py)
        return notes
    tokenizer = load_tokenizer(path)
    train = PromptSource(cfg, tokenizer, records)
    eval_lengths: Counter = Counter()
    evals = eval_sets(cfg, tokenizer, eval_lengths, records) if cfg.eval.every_steps else {}  # off: the hub reads none
    lines = [f"data: {len(train)} training prompts" + (f" ({note})" if (note := length_note(cfg, train.lengths)) else "")]
    if evals:
        sizes = ", ".join(f"{ds} {len(ps)}" for ds, ps in evals.items())
        lines.append(f"eval: {sizes}" + (f" ({note})" if (note := length_note(cfg, eval_lengths)) else ""))
    record(key, lines)
    return lines


class PromptSource:
    """The training prompts of the configured task, in a seeded order per epoch."""

    def __init__(self, cfg: Config, tokenizer, records: Records = None):
        self.lengths: Counter = Counter()  # kept / dropped / truncated by data.max_prompt_tokens
        if cfg.data.task == "files":
            self.prompts = _file_prompts(cfg, tokenizer, cfg.data.train_files, self.lengths, records)
            if not self.prompts:
                raise DatasetError(f"no training prompts left in {list(cfg.data.train_files)} after the length limit "
                                 f"(data.max_prompt_tokens={cfg.data.max_prompt_tokens}); raise it")
        else:
            from common.arith import ArithTask

            task = ArithTask(seed=cfg.run.seed, train_size=cfg.data.train_size, eval_size=cfg.data.eval_size)
            keep = set(cfg.data.levels)
            self.prompts = _arith_problems(cfg, tokenizer, [p for p in task.train() if p.level in keep], None,
                                           self.lengths)
            if not self.prompts:
                raise ConfigError(f"data.levels={list(cfg.data.levels)} selects no arith problems; use levels from 1 to 4")
        self.seed = cfg.run.seed

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx
