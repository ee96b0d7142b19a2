"""Inputs the launcher has checked already: a launch whose inputs passed `common.data.check_inputs` before, byte for
byte, is not checked through the tokenizer again.

Why: the check builds every prompt through the model's tokenizer, and `transformers.AutoTokenizer` alone imports
torch and most of transformers (about 5 s of a launch's start on a 2-core CPU, before any role starts, in every
launch, scale-up tests and restarted runs included). What the check concludes depends only on what it reads, so it is
recorded under a SHA-256 of all of that:

- the bytes of the code that builds prompts (`common/{data,datasets,arith,templates,config}.py`) and the installed
  versions of transformers, tokenizers and jinja2 (chat templates);
- every file at the top of the model directory except weights (the tokenizer files, config.json, chat templates);
- the bytes of every data file the check reads;
- the config sections it reads (`data`, `eval`, `model`) and `run.seed`.

Only a check that passed is recorded, with the banner lines it returned; a failing input fails again, in full, each
time. The rows of every data file are still read on each launch (a bad row is reported before any cache is looked
at). Entries live in `$COVRL_CACHE_DIR/checks` (default `$XDG_CACHE_HOME/covrl`, else `~/.cache/covrl`), one small
JSON file each, the oldest pruned past `MAX_ENTRIES`; `COVRL_CACHE_DIR=off` turns the record off. A cache that
cannot be read or written is not an error: the launch checks in full, as without one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from importlib import metadata

import msgspec

from common.config import Config

MAX_ENTRIES = 256
CODE = ("data.py", "datasets.py", "arith.py", "templates.py", "config.py")  # common/: the code that builds prompts
PACKAGES = ("transformers", "tokenizers", "jinja2")
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx", ".index.json")


def cache_dir() -> str | None:
    """Where checked inputs are recorded; None when the record is turned off (`COVRL_CACHE_DIR=off`)."""
    chosen = os.environ.get("COVRL_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else os.path.join(chosen, "checks")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "covrl", "checks")


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def input_key(cfg: Config, model_path: str, files: list[str]) -> str:
    """SHA-256 over everything `check_inputs` reads for `cfg` (module docstring); `files` are the data files."""
    here = os.path.dirname(os.path.abspath(__file__))
    model = sorted(n for n in os.listdir(model_path)
                   if os.path.isfile(os.path.join(model_path, n)) and not n.endswith(WEIGHTS))
    parts = {
        "code": {n: _sha(os.path.join(here, n)) for n in CODE},
        "packages": {p: _version(p) for p in PACKAGES},
        "model": {n: _sha(os.path.join(model_path, n)) for n in model},
        "data": [[os.path.abspath(f), _sha(f)] for f in files],
        "config": [msgspec.to_builtins(s) for s in (cfg.data, cfg.eval, cfg.model)] + [cfg.run.seed],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def recalled(key: str) -> list[str] | None:
    """The banner lines of a passed check recorded under `key`, or None (not recorded, or no readable cache)."""
    if (where := cache_dir()) is None:
        return None
    path = os.path.join(where, key + ".json")
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
        os.utime(path)  # recently used: pruned last
    except (OSError, ValueError):  # not there, or a damaged entry: the check runs in full and records it anew
        return None
    notes = entry.get("notes") if isinstance(entry, dict) else None
    return notes if isinstance(notes, list) and all(isinstance(n, str) for n in notes) else None


def record(key: str, notes: list[str]) -> bool:
    """Record a passed check (atomically); False where the cache cannot be written (the next launch checks in full)."""
    if (where := cache_dir()) is None:
        return False
    tmp = os.path.join(where, f".{key}.{os.getpid()}.tmp")
    try:
        os.makedirs(where, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"notes": notes, "recorded": time.time()}, f)
        os.replace(tmp, os.path.join(where, key + ".json"))
        _prune(where)
    except OSError:
        return False
    return True


def _prune(where: str) -> None:
    entries = [os.path.join(where, n) for n in os.listdir(where) if n.endswith(".json")]
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=os.path.getmtime)
    for path in entries[: len(entries) - MAX_ENTRIES]:
        try:
            os.remove(path)
        except FileNotFoundError:  # another launch pruned it first
            pass
