"""The launcher's record of checked inputs (common/check_cache.py): the same inputs skip the tokenizer, any changed
byte or setting does not, a failure is never recorded, and a cache that cannot be used changes nothing but speed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.paths import BASE_MODEL, REPO

# Checks `cfg` in a fresh interpreter and says whether transformers was imported: the only way to see the skip.
_CHECK = """
import json, sys
from common.config import load_config
from common.data import check_inputs
try:
    notes = check_inputs(load_config(None, json.loads(sys.argv[1])))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
else:
    print(json.dumps({"notes": notes, "transformers": "transformers" in sys.modules}))
"""


def check(overrides: list[str], cache: str) -> dict:
    env = {**os.environ, "COVRL_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", _CHECK, json.dumps(overrides)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def inputs(tmp_path):
    """A copy of the built-in model and a JSONL training file: (overrides, model dir, data file)."""
    model = tmp_path / "model"
    shutil.copytree(BASE_MODEL, model)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(6)))
    return [f'model.path="{model}"', 'data.task="files"', f'data.train_files=["{data}"]'], model, data


def test_the_same_inputs_skip_the_tokenizer_and_give_the_same_banner(tmp_path, inputs):
    overrides, _, _ = inputs
    cache = str(tmp_path / "cache")
    first, second = check(overrides, cache), check(overrides, cache)
    assert first == {"notes": ["data: 6 training prompts"], "transformers": True}
    assert second == {"notes": first["notes"], "transformers": False}  # recalled: transformers never imported
    assert len(os.listdir(os.path.join(cache, "checks"))) == 1


def checked_in_process(overrides: list[str], monkeypatch) -> tuple[list[str], int]:
    """check_inputs here, with the cache of the test's environment: (banner lines, tokenizer loads it made)."""
    from common import data
    from common.config import load_config

    loads, real = [], data.load_tokenizer
    monkeypatch.setattr(data, "load_tokenizer", lambda *a, **k: loads.append(a) or real(*a, **k))
    return data.check_inputs(load_config(None, overrides)), len(loads)


@pytest.mark.parametrize("change", ["data byte", "tokenizer file", "setting", "new model file"])
def test_any_changed_input_is_checked_in_full(tmp_path, inputs, change, monkeypatch):
    overrides, model, data = inputs
    monkeypatch.setenv("COVRL_CACHE_DIR", str(tmp_path / "cache"))
    assert checked_in_process(overrides, monkeypatch) == (["data: 6 training prompts"], 1)
    assert checked_in_process(overrides, monkeypatch) == (["data: 6 training prompts"], 0)  # recalled
    if change == "data byte":
        data.write_text(data.read_text().replace("What is 5", "What is 7"))
    elif change == "tokenizer file":
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    elif change == "setting":
        overrides = [*overrides, "data.max_prompt_tokens=8", 'data.truncation="left"']
    else:
        (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    notes, loads = checked_in_process(overrides, monkeypatch)
    assert loads == 1, change  # not recalled
    if change == "setting":  # and what the check says is its own, not the recorded line
        assert notes == ["data: 6 training prompts (cut 6 of 6 prompts to their last data.max_prompt_tokens=8 tokens)"]


def test_a_failed_check_is_never_recorded(tmp_path, inputs, monkeypatch):
    from common.datasets import DatasetError

    overrides, _, _ = inputs
    monkeypatch.setenv("COVRL_CACHE_DIR", str(tmp_path / "cache"))
    refused = [*overrides, "data.max_prompt_tokens=4", 'data.truncation="error"']
    for _ in range(2):  # the second time too: checked in full, refused again
        with pytest.raises(DatasetError, match="prompt has 20 tokens > data.max_prompt_tokens=4"):
            checked_in_process(refused, monkeypatch)
    assert not (tmp_path / "cache" / "checks").exists() or not list((tmp_path / "cache" / "checks").iterdir())


def test_a_damaged_entry_or_an_unwritable_cache_only_costs_the_full_check(tmp_path, inputs, monkeypatch):
    overrides, _, _ = inputs
    cache, full = tmp_path / "cache", (["data: 6 training prompts"], 1)
    monkeypatch.setenv("COVRL_CACHE_DIR", str(cache))
    assert checked_in_process(overrides, monkeypatch) == full
    (entry,) = (cache / "checks").iterdir()
    entry.write_text("{not json")
    assert checked_in_process(overrides, monkeypatch) == full
    assert checked_in_process(overrides, monkeypatch) == (full[0], 0)  # recorded anew
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")  # a file where the cache directory would go: nothing can be written under it
    monkeypatch.setenv("COVRL_CACHE_DIR", str(blocked))
    assert [checked_in_process(overrides, monkeypatch) for _ in range(2)] == [full, full]
    monkeypatch.setenv("COVRL_CACHE_DIR", "off")  # no record at all
    assert [checked_in_process(overrides, monkeypatch) for _ in range(2)] == [full, full]


def test_the_oldest_entries_are_pruned_past_the_limit(tmp_path, monkeypatch):
    from common import check_cache

    monkeypatch.setenv("COVRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(check_cache, "MAX_ENTRIES", 3)
    for i in range(5):
        assert check_cache.record(f"k{i}", [f"line {i}"])
        os.utime(tmp_path / "checks" / f"k{i}.json", (1000 + i, 1000 + i))
    assert check_cache.recalled("k0") is None and check_cache.recalled("k1") is None
    assert [check_cache.recalled(f"k{i}") for i in (2, 3, 4)] == [["line 2"], ["line 3"], ["line 4"]]
