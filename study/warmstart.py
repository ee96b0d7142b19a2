"""Build the tiny, partially competent `arith` base model that RL starts from.

    covrl warmstart [--task arith|chain] [--out assets/<task>-base] [--seed 0] [--steps N]
                                                                     (or: python -m study.warmstart ...)

Steps: train a byte-level BPE on arith texts; random-init a tiny Qwen2; SFT it
on worked solutions with the loss on the response only; measure sampled
accuracy at temperature 1; save model + tokenizer + warmstart.json atomically.
`--task chain` builds the entropy study's base model instead (study/chain.py): SFT on 100 000 drawn chain
questions (--sft-problems), most answered by a guess, and writes the run's train.jsonl / eval.jsonl beside it.

Why two solution styles (`ArithTask.solution(p, style)`): a pretrained model
answers some questions straight away and works others out. The SFT data mixes
`worked` and `direct` solutions (DIRECT_FRACTION), so the base model picks a
strategy at its first response token -- real sampling entropy with a reward
behind it: direct answers to multi-operand questions are mostly wrong. The
report measures how often each style is sampled and how accurate each is.

Why *partial* competence: RL needs reward variance within a group. A model that
solves 95 % (or 0 %) of problems gives GRPO-style advantages of ~0 everywhere,
so the default step count stops SFT early, around 20-60 % sampled accuracy,
with easy levels solved more often than hard ones and real sampling entropy.

Invariant shared with RL: a sequence is `tok(render_prompt(q)).input_ids +
tok(response).input_ids + [eos]`, prompt and response tokenised SEPARATELY.
RL generation continues from `tok(render_prompt(q)).input_ids`, so this is the
exact boundary the base model must be good at.

SFT packs whole examples into fixed-length rows with position ids restarting
per example (block-diagonal attention), so each example is trained exactly as
if alone -- the same logits as unpacked, checked in a one-off comparison --
without padding waste.

Determinism: one CPU thread, seeded torch/python RNGs, a deterministic BPE and
no timestamps in any written file, so the same command writes the same bytes.
Imports only `common/` and the study's own modules, never `actors/` or
`learner/`: the asset must not depend on the code it is used to test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from random import Random

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from common.arith import SOLUTION_STYLES, ArithTask, Problem
from study.chain import GUESS_ACCURACY, RL_LEVELS, ChainTask, guess, write_jsonl
from common.templates import render_prompt
from study.tokenizer import train_bpe_tokenizer

VOCAB_SIZE = 512  # requested; the narrow arith corpus stops merging near 400
MAX_PARAMS = 2_500_000  # keeps the fp32 safetensors file < 10 MB
MAX_POSITIONS = 256
MAX_NEW_TOKENS = 96  # the longest level-4 worked solution is ~50 tokens
# Measured with both styles: 1200 steps give 29 % sampled train accuracy (700: 16 %) in 7 min 42 s on
# one thread of this 2-core machine.
DEFAULT_STEPS = 1200
ROW_TOKENS = 192  # packed row length; every example is <= 90 tokens
ROWS_PER_STEP = 16  # ~3k tokens, ~60 examples per step
PEAK_LR = 2e-3  # 3e-3 learned slightly worse and 6e-3 much worse in 600-step runs
WARMUP_STEPS = 20
EVAL_TRAIN_PROBLEMS = 256
DIRECT_FRACTION = 0.5  # share of SFT solutions written in the `direct` style
# --task chain (study/chain.py): the study's base model. 100 000 draws (about 62 000 distinct questions; only the
# short chains repeat), so the model learns the x +/- d facts rather than the questions; most solutions are direct
# guesses, so the base model prefers the strategy that fails and RL has a strategy to discover.
CHAIN_SFT_PROBLEMS = 100_000
CHAIN_DIRECT_FRACTION = 0.7
CHAIN_DEFAULT_STEPS = 1500
CHAIN_RL_TRAIN_SIZE = 4096  # train.jsonl: the RL prompts (3..6 operands), none of them held out
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def build_tokenizer(task: ArithTask | ChainTask) -> PreTrainedTokenizerFast:
    """Prompts and solutions are fed as separate texts because they are tokenised separately."""
    problems = task.train()
    texts = [render_prompt(p.question) for p in problems] + [ArithTask.solution(p, s) for p in problems for s in SOLUTION_STYLES]
    return train_bpe_tokenizer(texts, VOCAB_SIZE)


def build_model(vocab_size: int, eos_id: int, seed: int) -> Qwen2ForCausalLM:
    """~1 M parameters: small enough to SFT in minutes on one CPU thread."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Sampling defaults that match RL's: plain temperature-1 sampling, no top-k/top-p truncation.
    model.generation_config.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS)
    n = count_params(model)
    if n > MAX_PARAMS:
        raise ValueError(f"model has {n} parameters > {MAX_PARAMS}; the asset must stay < 10 MB, shrink the config")
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings are counted once


def solution_style(seed: int, index: int, direct_fraction: float = DIRECT_FRACTION) -> str:
    """The style of SFT example `index`: direct with probability `direct_fraction`, seeded."""
    return "direct" if Random(f"arith/{seed}/style/{index}").random() < direct_fraction else "worked"


def encode(tok: PreTrainedTokenizerFast, problems: list[Problem], seed: int,
           direct_fraction: float = DIRECT_FRACTION, guesses: bool = False) -> list[tuple[list[int], int]]:
    """Each example as (ids, prompt_len); ids = prompt + response + [eos], tokenised separately.
    `guesses`: direct solutions are study/chain.py's guesses, right only some of the time (the chain task)."""
    examples = []
    for i, p in enumerate(problems):
        prompt = tok(render_prompt(p.question)).input_ids
        style = solution_style(seed, i, direct_fraction)
        text = guess(p, f"{seed}/{i}") if guesses and style == "direct" else ArithTask.solution(p, style)
        response = tok(text).input_ids + [tok.eos_token_id]
        examples.append((prompt + response, len(prompt)))
    return examples


def example_stream(count: int, gen: torch.Generator) -> Iterator[int]:
    """Example indices, epoch after epoch, each epoch freshly shuffled."""
    while True:
        yield from torch.randperm(count, generator=gen).tolist()


def pack_step(stream: Iterator[int], pending: deque[int], lengths: list[int]) -> list[list[int]]:
    """Fill ROWS_PER_STEP rows of ROW_TOKENS with whole examples, first fit.

    Why pack: level-4 sequences are twice as long as level-1 ones, so padded
    random batches waste about a third of the compute. Why not sort batches
    by length instead: that makes each batch one difficulty level, and the
    alternating per-level updates learned far worse in a measured run.
    Examples that fit nowhere are carried to the front of the next step, so
    the level mix stays that of the shuffled stream.
    """
    rows: list[list[int]] = [[] for _ in range(ROWS_PER_STEP)]
    free = [ROW_TOKENS] * ROWS_PER_STEP
    carried: list[int] = []
    while len(carried) < 8:  # eight misses in a row means the rows are (nearly) full
        i = pending.popleft() if pending else next(stream)
        row = next((r for r in range(ROWS_PER_STEP) if free[r] >= lengths[i]), None)
        if row is None:
            carried.append(i)
            continue
        rows[row].append(i)
        free[row] -= lengths[i]
    pending.extendleft(reversed(carried))
    return rows


def collate_packed(rows: list[list[int]], examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Concatenate each row's examples; position ids restart at 0 for every example.

    With no attention mask, transformers reads the restarting position ids as
    packed sequences and masks attention block-diagonally, so each example
    sees only itself -- exactly what it sees at RL time. Labels are -100 on
    prompts and padding: the loss is on responses (and their eos) only.
    """
    input_ids = torch.full((len(rows), ROW_TOKENS), pad_id)  # [R, T]
    labels = torch.full((len(rows), ROW_TOKENS), -100)  # [R, T]
    position_ids = torch.zeros((len(rows), ROW_TOKENS), dtype=torch.long)  # [R, T]
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            ids, prompt_len = examples[i]
            input_ids[r, at : at + len(ids)] = torch.tensor(ids)
            labels[r, at + prompt_len : at + len(ids)] = torch.tensor(ids[prompt_len:])
            position_ids[r, at : at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        position_ids[r, at:] = torch.arange(ROW_TOKENS - at)  # padding: one more "sequence", unlabelled
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def lr_at(step: int, steps: int) -> float:
    """Linear warmup, cosine decay to 10 % of peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def sft(model: Qwen2ForCausalLM, examples: list[tuple[list[int], int]], steps: int, pad_id: int, seed: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
    stream = example_stream(len(examples), torch.Generator().manual_seed(seed))
    pending: deque[int] = deque()
    lengths = [len(ids) for ids, _ in examples]
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        batch = collate_packed(pack_step(stream, pending, lengths), examples, pad_id)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {lr_at(step, steps):.2e}", flush=True)


def last_boxed(text: str) -> str | None:
    """The last \\boxed{...} content: a response may restate the question's numbers before answering."""
    matches = _BOXED.findall(text)
    return matches[-1].strip() if matches else None


@torch.no_grad()
def sample_responses(model, tok, questions: list[str], batch_size: int = 64,
                     instruction: str | None = None) -> list[list[int]]:
    """Temperature-1 samples (no top-k/top-p), continuing from the separately tokenised prompt (rendered with
    `instruction`, None: the template's default)."""
    eos = tok.eos_token_id
    model.eval()
    responses = []
    render = render_prompt if instruction is None else (lambda q: render_prompt(q, instruction))
    for start in range(0, len(questions), batch_size):
        prompts = [tok(render(q)).input_ids for q in questions[start : start + batch_size]]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])  # left-padded [B, P]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=model.generation_config)
        for row in out[:, width:].tolist():  # [B, <=MAX_NEW_TOKENS]
            responses.append(row[: row.index(eos) + 1] if eos in row else row)
    return responses


def accuracy(model, tok, problems: list[Problem]) -> tuple[float, float, dict[int, float], dict[str, dict]]:
    """(accuracy, mean response tokens incl. eos, accuracy per level, {style: {share, accuracy}})
    by exact match of the last \\boxed{}; a response is `direct` when it starts with the final sentence."""
    responses = sample_responses(model, tok, [p.question for p in problems])
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    correct = [last_boxed(t) == p.answer for t, p in zip(texts, problems)]
    by_level: dict[int, list[bool]] = {}
    by_style: dict[str, list[bool]] = {s: [] for s in SOLUTION_STYLES}
    for ok, p, t in zip(correct, problems, texts):
        by_level.setdefault(p.level, []).append(ok)
        by_style["direct" if t.lstrip().startswith("The answer is") else "worked"].append(ok)
    per_level = {lvl: round(sum(v) / len(v), 4) for lvl, v in sorted(by_level.items())}
    per_style = {s: {"share": round(len(v) / len(texts), 4), "accuracy": round(sum(v) / len(v), 4) if v else None}
                 for s, v in by_style.items()}
    return sum(correct) / len(correct), sum(map(len, responses)) / len(responses), per_level, per_style


def save_atomic(out: Path, model, tok, report: dict, data: dict[str, list] | None = None,
                write=write_jsonl) -> None:
    """Write beside `out`, then rename into place: readers never see a half-written model.
    `data`: {file name: problems} written beside it by `write` (the task's: jsonl, or parquet for grid)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "warmstart.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    for name, problems in (data or {}).items():
        write(problems, tmp / name)
    if out.exists():  # a non-empty directory cannot be replaced in one rename; move it aside first
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="covrl warmstart", description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("arith", "chain"), default="arith",
                        help="arith: the demo's base model; chain: the entropy study's (study/chain.py), which also "
                        "writes train.jsonl and eval.jsonl beside the model (grid: study/grid_warmstart.py, parquet, "
                        "through `covrl warmstart --task grid`)")
    parser.add_argument("--out", help="default assets/<task>-base")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-problems", type=int, default=CHAIN_SFT_PROBLEMS,
                        help=f"chain only: SFT questions drawn (default {CHAIN_SFT_PROBLEMS})")
    parser.add_argument("--steps", type=int,
                        help=f"SFT steps (default {DEFAULT_STEPS} for arith, {CHAIN_DEFAULT_STEPS} for chain)")
    parser.add_argument("--direct-fraction", type=float,
                        help=f"share of SFT solutions in the direct style (default {DIRECT_FRACTION} for arith, "
                        f"{CHAIN_DIRECT_FRACTION} for chain)")
    parser.add_argument(
        "--eval-problems",
        type=int,
        default=None,
        help=f"cap on problems per measured set (default: {EVAL_TRAIN_PROBLEMS} train, all of each eval set); "
        "for quick smoke runs only, the committed asset is measured on the full sets",
    )
    args = parser.parse_args(argv)
    chain = args.task == "chain"
    args.out = args.out or f"assets/{args.task}-base"
    args.steps = args.steps if args.steps is not None else (CHAIN_DEFAULT_STEPS if chain else DEFAULT_STEPS)
    if args.direct_fraction is None:
        args.direct_fraction = CHAIN_DIRECT_FRACTION if chain else DIRECT_FRACTION
    if args.sft_problems < 1:
        parser.error(f"--sft-problems must be at least 1, got {args.sft_problems}")
    if args.steps < 0 or (args.eval_problems is not None and args.eval_problems < 1) or \
            not 0 <= args.direct_fraction <= 1:
        parser.error(f"need --steps >= 0, --eval-problems >= 1 and 0 <= --direct-fraction <= 1, got {args.steps}, "
                     f"{args.eval_problems} and {args.direct_fraction}")
    torch.set_num_threads(1)  # determinism, and the CI machine has 2 shared cores
    torch.use_deterministic_algorithms(True)
    started = time.time()

    task = ChainTask(seed=args.seed, train_size=args.sft_problems) if chain else ArithTask(seed=args.seed)
    tok = build_tokenizer(task)
    model = build_model(len(tok), tok.eos_token_id, args.seed)
    print(f"vocab {len(tok)}  params {count_params(model)}", flush=True)
    sft(model, encode(tok, task.train(), args.seed, args.direct_fraction, guesses=chain), args.steps, tok.eos_token_id,
        args.seed)

    torch.manual_seed(args.seed + 1)  # the sampling stream, independent of how many SFT steps ran
    evals = {"train_sample": task.train()[:EVAL_TRAIN_PROBLEMS], **task.eval_sets()}
    evals = {name: problems[: args.eval_problems] for name, problems in evals.items()}
    results = {name: accuracy(model, tok, problems) for name, problems in evals.items()}
    for name, (acc, length, per_level, per_style) in results.items():
        print(f"{name:13s} accuracy {acc:.3f}  mean response tokens {length:.1f}  by level {per_level}  by style {per_style}")

    report = {
        "seed": args.seed,
        "steps": args.steps,
        "eval_problems": {name: len(problems) for name, problems in evals.items()},
        "packed_rows_per_step": ROWS_PER_STEP,
        "packed_row_tokens": ROW_TOKENS,
        "peak_lr": PEAK_LR,
        "direct_fraction": args.direct_fraction,
        "param_count": count_params(model),
        "vocab_size": len(tok),
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
        "accuracy": {name: round(r[0], 4) for name, r in results.items()},
        "accuracy_by_level": {name: r[2] for name, r in results.items()},
        "mean_response_tokens": {name: round(r[1], 2) for name, r in results.items()},
        "styles": {name: r[3] for name, r in results.items()},
    }
    data = {}
    if chain:  # the RL prompts and the held-out sets, in the file layout a run reads (data.task = "files")
        rl = ChainTask(seed=args.seed, train_size=CHAIN_RL_TRAIN_SIZE, levels=RL_LEVELS).train()
        data = {"train.jsonl": rl, "eval.jsonl": [p for ps in task.eval_sets().values() for p in ps]}
        report["task"] = "chain"  # (the arith report keeps its keys: the committed asset's bytes stay reproducible)
        report["sft_problems"] = args.sft_problems
        report["guess_accuracy"] = GUESS_ACCURACY
    save_atomic(Path(args.out), model, tok, report, data)
    print(f"wrote {args.out} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    main()  # 0 or an exception / argparse exit; no sys.exit(0), so tests can run this file in-process (runpy)
