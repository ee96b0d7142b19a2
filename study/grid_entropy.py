"""Where a grid model's entropy sits (post hoc, after the pilots failed gates G3 and G4: not in the plan).

    python -m study.grid_entropy MODEL_DIR [MODEL_DIR ...] [--out FILE.json] [--samples 8]

Samples walks for the held-out prompts at temperature 1 and splits the sampled tokens by the state they were drawn
in: a *tie* (both coordinates still differ from the goal's: two moves are equally short), *forced* (one coordinate
done: one move is right), *at goal* (the walk should stop), or *off course* (after a wrong move). For each kind: its
share of the tokens, its mean entropy, the probability the model puts on the wrong moves, and, at ties, how evenly it
splits between the two right moves (the mean |p(x-move) - p(y-move)| over their sum: 0 is an even split, 1 a
collapsed one). Off course, "p_wrong" is the mass on moves that do not bring the walk closer to the goal (at the goal
cell, every move), a description of the state rather than an error. Deterministic (seeded, one thread).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.gridpath import MOVES, parse_ground_truth
from study.grid import DATA_SOURCE, GridTask
from study.grid_warmstart import prompt

KINDS = ("tie", "forced", "at goal", "off course")


def _right_moves(pos: tuple[int, int], goal: tuple[int, int]) -> list[str]:
    """The moves that bring `pos` one step closer to `goal`."""
    here = abs(goal[0] - pos[0]) + abs(goal[1] - pos[1])
    return [m for m, (dx, dy) in MOVES.items() if abs(goal[0] - pos[0] - dx) + abs(goal[1] - pos[1] - dy) < here]


def _record(s: dict, kind: str, p: torch.Tensor, logp: torch.Tensor, good: list[int]) -> None:
    """Add one drawn token's state to its kind's sums."""
    s["tokens"] += 1
    s["entropy"] += float(-(p * logp).sum())
    s["wrong"] += 1.0 - float(sum(p[i] for i in good))
    if kind == "tie":
        a, b = float(p[good[0]]), float(p[good[1]])
        s["skew"] += abs(a - b) / max(a + b, 1e-12)


@torch.no_grad()
def _walk(model, context: list[int], start, goal, ids: dict[str, int], eos: int, stats: dict) -> None:
    """Sample one walk token by token, recording the state each token was drawn in."""
    seq, (x, y), off = list(context), start, False
    for _ in range(32):
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].double(), dim=-1)
        p = logp.exp()
        right = _right_moves((x, y), goal)
        kind = "off course" if off else "at goal" if (x, y) == goal else "tie" if len(right) == 2 else "forced"
        _record(stats[kind], kind, p, logp, [eos] if kind == "at goal" else [ids[m] for m in right])
        nxt = int(torch.multinomial(p.float(), 1))
        seq.append(nxt)
        if nxt == eos:
            return
        move = next((m for m, i in ids.items() if i == nxt), None)
        off = off or move is None or kind == "at goal" or move not in right
        if move is not None:
            x, y = x + MOVES[move][0], y + MOVES[move][1]


def profile(model_dir: str, samples: int = 8, seed: int = 0, limit: int | None = None) -> dict:
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = {m: tok(" " + m).input_ids[0] for m in MOVES}
    stats = {k: {"tokens": 0, "entropy": 0.0, "wrong": 0.0, "skew": 0.0} for k in KINDS}
    for walk in GridTask(seed=0).eval_sets()[DATA_SOURCE][:limit]:
        start, goal, _, _ = parse_ground_truth(walk.answer)
        context = tok(prompt(walk)).input_ids
        for _ in range(samples):
            _walk(model, context, start, goal, ids, tok.eos_token_id, stats)
    total = sum(s["tokens"] for s in stats.values())
    out = {"model": model_dir, "samples_per_prompt": samples, "tokens": total,
           "entropy": round(sum(s["entropy"] for s in stats.values()) / total, 4)}
    for k, s in stats.items():
        n = max(s["tokens"], 1)
        out[k] = {"share": round(s["tokens"] / total, 4), "entropy": round(s["entropy"] / n, 4),
                  "p_wrong": round(s["wrong"] / n, 4)} | ({"skew": round(s["skew"] / n, 4)} if k == "tie" else {})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.grid_entropy", description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [profile(m, args.samples) for m in args.models]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
