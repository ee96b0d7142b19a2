"""`covrl warmstart --task grid`: the grid study's base model (study/grid.py), by study/warmstart.py's recipe.

The same tiny Qwen2, tokenizer pipeline, packed SFT and atomic save as the other tasks; what differs is the data
(GRID_SFT_EXAMPLES walks drawn from the train walks, flawed with study/grid.py's flaw_probability of their shape:
none for base model v4), the prompt (no answer-format instruction: `data.instruction = ""` in the study's preset,
here `render_prompt(q, "")`) and what is measured: the rate of one sample (train and held-out) that is a shortest
walk turning on no ice, pass@8 on the held-out walks, the share of samples that are nothing but moves, the mean
response length and the mean token entropy of the sampled moves (nats), which the study's premise gates read at its
first step. The model never sees the ice: its walks are drawn without it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from random import Random

import torch

from common.gridpath import walk_score
from common.templates import render_prompt
from study.grid import (DATA_SOURCE, FLAW_FRACTION, ICE, ICE_DENSITY, SWITCH_COUPLING, GridTask, Walk, render, sft_text,
                        write_walks)
from study.tokenizer import train_bpe_tokenizer
from study.warmstart import (PEAK_LR, ROW_TOKENS, ROWS_PER_STEP, VOCAB_SIZE, build_model, count_params, sample_responses,
                             save_atomic, sft)

GRID_SFT_EXAMPLES = 150_000
GRID_DEFAULT_STEPS = 1500
PASS_K = 8
INSTRUCTION = ""  # the prompt is the question alone: "Question: Walk from (3,7) to (9,1).\nAnswer:"


def prompt(walk: Walk) -> str:
    return render_prompt(walk.question, INSTRUCTION)


def encode(tok, walks: list[Walk], seed: int, flaw_fraction: float, coupling: float) -> list[tuple[list[int], int]]:
    """Each example as (ids, prompt_len); ids = prompt + response + [eos], tokenised separately."""
    examples = []
    for i, w in enumerate(walks):
        ids = tok(prompt(w)).input_ids
        response = tok(sft_text(w, seed, i, flaw_fraction, coupling)).input_ids + [tok.eos_token_id]
        examples.append((ids + response, len(ids)))
    return examples


@torch.no_grad()
def token_entropy(model, tok, walks: list[Walk], responses: list[list[int]]) -> float:
    """Mean entropy (nats) of the distributions the response tokens were drawn from, eos included."""
    total, count = 0.0, 0
    for w, r in zip(walks, responses):
        ids = tok(prompt(w)).input_ids
        logits = model(input_ids=torch.tensor([ids + r])).logits[0, len(ids) - 1 : len(ids) + len(r) - 1]  # [R, V]
        logp = torch.log_softmax(logits.double(), dim=-1)
        total += float(-(logp.exp() * logp).sum(-1).sum())
        count += len(r)
    return total / max(count, 1)


def measure(model, tok, walks: list[Walk], k: int = 1) -> dict:
    """Shortest-walk rate (avg@k), pass@k, well-formed share, mean response tokens (eos included), token entropy."""
    repeated = [w for w in walks for _ in range(k)]
    responses = sample_responses(model, tok, [w.question for w in repeated], instruction=INSTRUCTION)
    scored = [walk_score(tok.decode(r, skip_special_tokens=True), w.answer) for w, r in zip(repeated, responses)]
    rewards = [reward for _, reward in scored]
    out = {"accuracy": round(sum(rewards) / len(rewards), 4),
           "well_formed": round(sum(f for f, _ in scored) / len(scored), 4),
           "mean_response_tokens": round(sum(map(len, responses)) / len(responses), 2),
           "token_entropy": round(token_entropy(model, tok, repeated[:256], responses[:256]), 4)}
    if k > 1:
        out[f"pass@{k}"] = round(sum(max(rewards[i:i + k]) for i in range(0, len(rewards), k)) / len(walks), 4)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="covrl warmstart --task grid", description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=("grid",), default="grid")
    ap.add_argument("--out", default="assets/grid-base")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=GRID_DEFAULT_STEPS, help=f"SFT steps (default {GRID_DEFAULT_STEPS})")
    ap.add_argument("--flaw-fraction", type=float, default=FLAW_FRACTION,
                    help=f"mean share of SFT walks with one or two wrong moves (default {FLAW_FRACTION})")
    ap.add_argument("--switch-coupling", type=float, default=SWITCH_COUPLING,
                    help=f"how much a walk's flaw chance grows with its switch ratio (default {SWITCH_COUPLING})")
    ap.add_argument("--eval-problems", type=int, help="cap on walks per measured set, for quick smoke runs only")
    args = ap.parse_args(argv)
    if args.steps < 0 or not 0 <= args.flaw_fraction <= 1 or (args.eval_problems is not None and args.eval_problems < 1):
        ap.error(f"need --steps >= 0, 0 <= --flaw-fraction <= 1 and --eval-problems >= 1, got {args.steps}, "
                 f"{args.flaw_fraction} and {args.eval_problems}")
    return args


def main(argv: list[str] | None = None) -> int:
    """`covrl warmstart --task grid ...` (study/warmstart_cli.py sends it here)."""
    args = parse_args(argv)
    out, steps, flaw, coupling = Path(args.out), args.steps, args.flaw_fraction, args.switch_coupling
    torch.set_num_threads(1)  # determinism, and the CI machine has 2 shared cores
    torch.use_deterministic_algorithms(True)
    started = time.time()
    task = GridTask(seed=args.seed)
    train = task.train()
    rng = Random(f"grid/{args.seed}/sft-draws")
    drawn = [train[rng.randrange(len(train))] for _ in range(GRID_SFT_EXAMPLES)]
    texts = [prompt(w) for w in train] + [sft_text(w, args.seed, i, flaw, coupling) for i, w in enumerate(drawn[:20_000])]
    tok = train_bpe_tokenizer(texts, VOCAB_SIZE)
    model = build_model(len(tok), tok.eos_token_id, args.seed)
    print(f"vocab {len(tok)}  params {count_params(model)}  moves tokenise as {tok(render(['R', 'U', 'R'])).input_ids}",
          flush=True)
    sft(model, encode(tok, drawn, args.seed, flaw, coupling), steps, tok.eos_token_id, args.seed)

    torch.manual_seed(args.seed + 1)  # the sampling stream, independent of how many SFT steps ran
    cap = args.eval_problems
    held_out = task.eval_sets()[DATA_SOURCE][:cap]
    results = {"train_sample": measure(model, tok, train[: cap or 256]),
               DATA_SOURCE: measure(model, tok, held_out, k=PASS_K)}
    for name, r in results.items():
        print(f"{name:13s} {r}", flush=True)
    report = {"task": "grid", "seed": args.seed, "steps": steps, "sft_examples": GRID_SFT_EXAMPLES,
              "flaw_fraction": flaw, "switch_coupling": coupling, "ice_density": ICE_DENSITY, "ice_cells": len(ICE),
              "packed_rows_per_step": ROWS_PER_STEP, "packed_row_tokens": ROW_TOKENS,
              "peak_lr": PEAK_LR, "param_count": count_params(model), "vocab_size": len(tok),
              "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, "measured": results}
    save_atomic(out, model, tok, report, {"train.parquet": train, "eval.parquet": task.eval_sets()[DATA_SOURCE]},
                write=write_walks)
    print(f"wrote {out} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
