"""`chain`: the study task with headroom -- sums of single digits, solved step by step or guessed.

    What is 7 - 3 + 8 + 1 - 6?      worked: "7 - 3 = 4. 4 + 8 = 12. 12 + 1 = 13. 13 - 6 = 7. The answer is \\boxed{7}."
                                    direct: "The answer is \\boxed{7}."

Why a second task: on `arith` RL moves held-out accuracy by a few points (docs/study-arith), because the
built-in model cannot *execute* most of what it attempts, so no choice of strategy helps much. Here every
worked step is one fact `x +/- d` with a single digit d and -36 <= x <= 45 -- about 1 600 facts that the warm
start sees many times, so the worked strategy is reliable on questions it has never seen. The warm start's
corpus answers most questions directly, and its direct answers are *guesses* (`guess`): right half the time,
otherwise off by 1..3, as a pretrained model that answers without working is often close but wrong. So the base
model prefers a strategy that often fails and samples its answer from a wide distribution: RL has tens of points
to gain, by working things out or by sharpening its guesses, and the sampling entropy of the strategy choice and
of the guessed answers is what falls as it does (Cui et al. 2025's mechanism). Without the guesses a 1 M-parameter
model learns to add six digits in one token (84 % direct accuracy measured) and leaves RL little to do.

Levels are the operand count (2..6). Held-out: `chain_short` (3-4 operands) and `chain_long` (5-6), drawn
first from their own RNG stream; the train stream rejects any question in them. Every draw goes through a
`random.Random` seeded from `seed`. Answers may be negative.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from random import Random

from common.arith import Problem, _evaluate, train_problems, unique_problems

DATA_SOURCE = "chain"
LEVELS = (2, 3, 4, 5, 6)  # operand counts
EVAL_SETS = {"chain_short": (3, 4), "chain_long": (5, 6)}
RL_LEVELS = (3, 4, 5, 6)  # two-operand questions are solved either way: no reward spread to learn from
GUESS_ACCURACY = 0.5  # share of the warm start's direct answers that are right; the rest are off by 1..3


def make_problem(rng: Random, operands: int) -> Problem:
    """One question with `operands` single-digit operands joined by + or -."""
    if operands not in LEVELS:
        raise ValueError(f"chain questions have {LEVELS[0]}..{LEVELS[-1]} operands, got {operands}")
    numbers = [rng.randint(0, 9) for _ in range(operands)]
    ops = [rng.choice("+-") for _ in range(operands - 1)]
    expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(ops, numbers[1:])])
    return Problem(f"What is {expression}?", str(_evaluate(numbers, ops)), DATA_SOURCE, operands)


def guess(p: Problem, key: str, accuracy: float = GUESS_ACCURACY) -> str:
    """A direct solution written as a guess: the right answer with probability `accuracy`, else off by 1..3 either
    way (seeded by `key`). The warm start's corpus answers directly this way, as a pretrained model that answers
    without working is often close but wrong; its worked solutions are always right."""
    rng = Random(f"chain/guess/{key}")
    value = int(p.answer)
    if rng.random() >= accuracy:
        value += rng.choice((-1, 1)) * rng.randint(1, 3)
    return f"The answer is \\boxed{{{value}}}."


class ChainTask:
    """Deterministic held-out sets and a train stream for a given seed (same interface as ArithTask)."""

    def __init__(self, seed: int = 0, train_size: int = 4096, eval_size: int = 128, levels: tuple[int, ...] = LEVELS):
        if train_size < 0 or eval_size < 0:
            raise ValueError(f"sizes must be >= 0, got train_size={train_size} eval_size={eval_size}")
        bad = [n for n in levels if n not in LEVELS]
        if bad or not levels:
            raise ValueError(f"chain levels are operand counts in {list(LEVELS)}, got {list(levels)}")
        if eval_size > 4000:  # 3-operand questions: 10^3 operand choices x 4 operator pairs; a bigger set never fills
            raise ValueError(f"eval_size {eval_size} is more than the chain task's held-out sets can hold (4000)")
        eval_rng = Random(f"chain/{seed}/eval")
        self._eval = {name: [replace(p, data_source=name)  # tagged by the set: chain_short / chain_long
                             for p in unique_problems(eval_rng, make_problem, lv, eval_size)]
                      for name, lv in EVAL_SETS.items()}
        held_out = {p.question for problems in self._eval.values() for p in problems}
        rng = Random(f"chain/{seed}/train/{','.join(map(str, levels))}")
        self._train = train_problems(rng, make_problem, levels, train_size, held_out)

    def train(self) -> list[Problem]:
        return list(self._train)

    def eval_sets(self) -> dict[str, list[Problem]]:
        return {name: list(problems) for name, problems in self._eval.items()}


def write_jsonl(problems: list[Problem], path: Path) -> None:
    """Rows in covrl's file layout (common/datasets.py): prompt, reward_model.ground_truth, data_source."""
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            row = {"prompt": p.question, "reward_model": {"ground_truth": p.answer}, "data_source": p.data_source,
                   "level": p.level}
            f.write(json.dumps(row, sort_keys=True) + "\n")
