"""The byte-level BPE, and the warm-start directory it ships in.

The tokenizer must round-trip any (NFC) text, add no special tokens, keep the
prompt/response boundary stable, and reload from disk unchanged -- RL and the
learner tokenise with the *reloaded* copy, SFT used the in-memory one. Reloads
are checked both alone and beside a qwen2 config.json, because transformers
picks a different tokenizer class in the second case.
"""

from __future__ import annotations

import hashlib
import json
import random
import runpy
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from common.arith import ArithTask
from common.templates import render_prompt
from study.tokenizer import EOS_TOKEN, train_bpe_tokenizer

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "assets" / "arith-base"

torch.set_num_threads(1)


def _texts(train_size: int = 512) -> list[str]:
    task = ArithTask(seed=0, train_size=train_size, eval_size=8)
    return [render_prompt(p.question) for p in task.train()] + [ArithTask.solution(p) for p in task.train()]


def _random_unicode(seed: int, n: int = 200) -> str:
    rng = random.Random(seed)
    # Skip surrogates (U+D800..U+DFFF): they are not encodable as UTF-8 at all.
    return "".join(chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0x2FFFF)])) for _ in range(n))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(in-memory, reloaded alone, reloaded beside a qwen2 model config)."""
    alone, with_model = tmp_path_factory.mktemp("tok"), tmp_path_factory.mktemp("model")
    tok = train_bpe_tokenizer(_texts(), vocab_size=512, out_dir=str(alone))
    tok.save_pretrained(with_model)
    Qwen2Config(vocab_size=len(tok), hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(with_model)
    return tok, AutoTokenizer.from_pretrained(alone), AutoTokenizer.from_pretrained(with_model)


TEXTS = [
    _random_unicode(0),
    _random_unicode(1),
    "\\boxed{-12}",
    "a\n\n b\t\u00e9\U0001f600 ",
    render_prompt("What is 8 + 0?") + "8 + 0 = 8. The answer is \\boxed{8}.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_identical_after_reload(saved, text):
    tok = saved[0]
    ids = tok(text).input_ids
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    for reloaded in saved[1:]:
        assert reloaded(text).input_ids == ids, type(reloaded).__name__
        assert reloaded.decode(ids) == unicodedata.normalize("NFC", text)


def test_nfc_text_round_trips_exactly(saved):
    for seed in range(5):
        text = unicodedata.normalize("NFC", _random_unicode(seed))
        assert saved[0].decode(saved[0](text).input_ids) == text


def test_special_tokens_eos_is_pad_and_nothing_is_added(saved):
    for tok in saved:
        assert tok.eos_token == tok.pad_token == EOS_TOKEN
        assert tok.bos_token is None
        assert tok.eos_token_id == tok.pad_token_id == tok.convert_tokens_to_ids(EOS_TOKEN)
        assert tok("7 + 5").input_ids == tok("7 + 5", add_special_tokens=False).input_ids
        assert tok.eos_token_id not in tok("Question: 7 + 5").input_ids


def test_vocab_fits_the_warm_start_range_and_digits_are_single_tokens(saved):
    for tok in saved:
        assert 384 <= len(tok) <= 1024
        pieces = tok.convert_ids_to_tokens(tok(" 581 + 9037").input_ids)
        # "Ġ" is the byte-level space; Qwen2's regex isolates every digit, so it stands alone.
        assert pieces == ["Ġ", "5", "8", "1", "Ġ+", "Ġ", "9", "0", "3", "7"]


def test_prompt_and_response_tokenise_the_same_apart_as_together(saved):
    tok = saved[0]
    for p in ArithTask(seed=1, train_size=64, eval_size=4).train():
        prompt, response = render_prompt(p.question), ArithTask.solution(p)
        assert tok(prompt).input_ids + tok(response).input_ids == tok(prompt + response).input_ids


def test_training_is_deterministic(tmp_path):
    a = train_bpe_tokenizer(_texts(), 512, str(tmp_path / "a"))
    b = train_bpe_tokenizer(_texts(), 512, str(tmp_path / "b"))
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_too_small_vocab_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="raise vocab_size"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


# --- the warm start: study/warmstart.py writes a directory transformers can load ---


def _warmstart(out: Path, steps: int) -> dict[str, str]:
    """Run the script in-process (a subprocess would re-import transformers: ~5 s)."""
    argv, deterministic = sys.argv, torch.are_deterministic_algorithms_enabled()
    sys.argv = ["warmstart.py", "--out", str(out), "--steps", str(steps), "--eval-problems", "4"]
    try:
        runpy.run_module("study.warmstart", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
        torch.use_deterministic_algorithms(deterministic)
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())}


def test_tiny_warm_start_loads_is_byte_identical_on_rerun_and_replaces_old_output(tmp_path):
    first = _warmstart(tmp_path / "a", steps=2)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "stale.txt").write_text("from an older run")
    second = _warmstart(tmp_path / "b", steps=2)
    assert first == second, "same command must write the same bytes (and replace, not merge into, old output)"
    assert {"config.json", "model.safetensors", "tokenizer.json", "warmstart.json"} <= set(first)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left behind"

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    report = json.loads((tmp_path / "a" / "warmstart.json").read_text())
    assert report["steps"] == 2 and report["seed"] == 0
    assert report["param_count"] == sum(p.numel() for p in model.parameters()) <= 2_500_000
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings


@pytest.mark.skipif(not ASSET.exists(), reason="assets/arith-base not built yet: covrl warmstart")
def test_committed_base_model_is_small_loads_and_still_solves_easy_problems():
    model = AutoModelForCausalLM.from_pretrained(ASSET)
    tok = AutoTokenizer.from_pretrained(ASSET)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params <= 2_500_000
    assert (ASSET / "model.safetensors").stat().st_size < 10_000_000
    assert model.config.vocab_size == len(tok) and tok.eos_token == EOS_TOKEN
    report = json.loads((ASSET / "warmstart.json").read_text())
    assert report["param_count"] == n_params
    # Partially competent: RL needs both successes and failures to learn from.
    assert 0.2 <= report["accuracy"]["train_sample"] <= 0.6, report["accuracy"]
    assert report["accuracy"]["arith_easy"] > report["accuracy"]["arith_hard"], report["accuracy"]

    # The asset must work as *reloaded*: a tokenizer that drifted from the one SFT used
    # (or a stale asset after an arith change) drops this from ~40 % to ~0 %.
    problems = ArithTask(seed=report["seed"]).eval_sets()["arith_easy"][:64]
    prompts = [tok(render_prompt(p.question)).input_ids for p in problems]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])  # left-padded [B, P]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48)  # asset's defaults: T=1 sampling
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    solved = sum(f"\\boxed{{{p.answer}}}" in text for p, text in zip(problems, texts))
    assert solved >= 10, f"only {solved}/64 easy problems solved by the reloaded asset: {texts[:3]}"


def test_warmstart_direct_fraction_sets_the_share_of_direct_solutions():
    from study.warmstart import solution_style

    share = lambda f: sum(solution_style(0, i, f) == "direct" for i in range(2000)) / 2000  # noqa: E731
    assert share(0.0) == 0.0 and share(1.0) == 1.0 and abs(share(0.85) - 0.85) < 0.03
    assert [solution_style(0, i) for i in range(50)] == [solution_style(0, i, 0.5) for i in range(50)]  # the default


CHAIN_ASSET = REPO / "assets" / "chain-base"


def test_chain_warm_start_writes_the_runs_data_files_beside_the_model_the_same_bytes_twice(tmp_path):
    from study.chain import RL_LEVELS
    from common.datasets import read_records

    hashes = []
    for out in ("c", "d"):
        argv, deterministic = sys.argv, torch.are_deterministic_algorithms_enabled()
        sys.argv = ["warmstart.py", "--task", "chain", "--out", str(tmp_path / out), "--steps", "2",
                    "--eval-problems", "2", "--sft-problems", "500"]
        try:
            runpy.run_module("study.warmstart", run_name="__main__", alter_sys=True)
        finally:
            sys.argv = argv
            torch.use_deterministic_algorithms(deterministic)
        hashes.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((tmp_path / out).iterdir())})
    assert hashes[0] == hashes[1] and {"train.jsonl", "eval.jsonl", "model.safetensors"} <= set(hashes[0])
    report = json.loads((tmp_path / "c" / "warmstart.json").read_text())
    assert report["task"] == "chain" and report["direct_fraction"] == 0.7 and report["guess_accuracy"] == 0.5
    train, held = read_records(str(tmp_path / "c" / "train.jsonl")), read_records(str(tmp_path / "c" / "eval.jsonl"))
    assert len(train) == 4096 and {r.data_source for r in train} == {"chain"}
    assert {r.data_source for r in held} == {"chain_short", "chain_long"} and len(held) == 256
    assert not {r.text for r in train} & {r.text for r in held}
    assert {r.text.count(" ") // 2 for r in train} == set(RL_LEVELS)  # "What is a + b - c?": operand count


@pytest.mark.skipif(not CHAIN_ASSET.exists(), reason="assets/chain-base not built: covrl warmstart --task chain")
def test_committed_chain_model_prefers_the_strategy_that_fails():
    """The study's regime: most sampled answers are direct guesses, worked solutions are far more often right, and
    the reloaded asset, prompted from its own eval.jsonl as a run prompts it, still works problems out correctly."""
    from common.datasets import read_records

    report = json.loads((CHAIN_ASSET / "warmstart.json").read_text())
    for name in ("chain_short", "chain_long"):
        styles = report["styles"][name]
        assert styles["direct"]["share"] > 0.6 and styles["worked"]["accuracy"] > styles["direct"]["accuracy"] + 0.4
        assert 0.2 <= report["accuracy"][name] <= 0.5, report["accuracy"]
    assert (CHAIN_ASSET / "model.safetensors").stat().st_size < 10_000_000

    model = AutoModelForCausalLM.from_pretrained(CHAIN_ASSET)
    tok = AutoTokenizer.from_pretrained(CHAIN_ASSET)
    records = read_records(str(CHAIN_ASSET / "eval.jsonl"))[:64]
    prompts = [tok(render_prompt(r.text)).input_ids for r in records]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])  # left-padded [B, P]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    worked = [(r, t) for r, t in zip(records, texts) if not t.lstrip().startswith("The answer is")]
    right = sum(f"\\boxed{{{r.answer}}}" in t for r, t in worked)
    assert worked and right >= 0.5 * len(worked), f"{right}/{len(worked)} worked solutions right: {texts[:3]}"
