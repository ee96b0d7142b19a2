"""`arith`: the built-in synthetic task, small enough for a 2 M-parameter model.

Why a synthetic task: the framework must be testable offline, on CPU, in
minutes. Integer arithmetic has exact, cheap-to-check answers, a difficulty
knob, and a tiny vocabulary, so a tiny base model can be *partially* competent
at it -- the regime where RL has something to improve.

Difficulty levels partition the question space, so a question's level can be
read back from the question alone (the unit tests do exactly that):

  level 1: two 1-digit operands, + or -                       "7 - 9"
  level 2: two operands with a 2-digit one, + or -;            "23 + 58"
           or three 1-digit operands                           "4 + 8 - 6"
  level 3: three operands up to 2 digits with a 2-digit one;   "23 + 58 - 7"
           or a 2-digit number times a single digit            "37 * 6"
  level 4: four operands up to 3 digits with a 3-digit one;    "512 - 48 + 7 - 90"
           or (2-digit * single digit) +/- a number            "37 * 6 - 205"

Some 2-operand items (levels 1-3) are phrased as word problems. Operands are
non-negative; expression answers may be negative; word problems never are.
`*` only ever appears as the first operator, so left-to-right evaluation (what
the worked solution shows) agrees with the usual precedence.

Solutions come in two styles, as a pretrained model's answers do: `worked`
(one step per operator, then the boxed answer) and `direct` (the boxed answer
alone). The warm start learns both, so the base model *chooses* a strategy at
its first token; direct answers to multi-operand questions are often wrong, so
RL has a strategy to discover, and the choice is where entropy can collapse.

Held-out evaluation: `arith_easy` (levels 1-2) and `arith_hard` (levels 3-4)
are drawn first from their own RNG stream; the train set rejects any question
string that appears in either eval set. Every random draw goes through a
`random.Random` seeded from `seed`; the global RNG is never touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from random import Random

from common.config import DataConfig, RunConfig

_DATA, _RUN = DataConfig(), RunConfig()  # every default lives in common/config.py

DATA_SOURCE = "arith"
SOLUTION_STYLES = ("worked", "direct")

_NAMES = (("Tom", "he"), ("Ann", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"), ("Eva", "she"))
_ITEMS = ("apples", "pens", "cards", "books", "marbles", "stickers")

# Word-problem templates: (text, operator, key phrase). The key phrase is unique
# to its template so `solution()` can recover the operator from the question.
# Numbers appear in the text in the order they are combined.
_WORD_TEMPLATES = {
    "+": "{name} has {a} {item} and buys {b} more. How many {item} does {pron} have now?",
    "-": "{name} has {a} {item} and gives away {b}. How many {item} are left?",
    "*": "{name} buys {a} boxes with {b} {item} in each. How many {item} is that?",
}
_WORD_KEYS = {"+": " more. ", "-": " gives away ", "*": " boxes with "}
_WORD_PROBABILITY = 0.3
_EXPRESSION = re.compile(r"^What is (\d+(?: [-+*] \d+)+)\?$")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # exact integer, e.g. "-12"
    data_source: str
    level: int  # 1 (easy) .. 4 (hard)


def _apply(left: int, op: str, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"arith knows the operators + - *, not {op!r}")


def _evaluate(numbers: list[int], ops: list[str]) -> int:
    """Left to right; correct because `*` is only ever the first operator."""
    total = numbers[0]
    for op, n in zip(ops, numbers[1:]):
        total = _apply(total, op, n)
    return total


def _digits(rng: Random, low_digits: int, high_digits: int) -> int:
    """A number whose digit count is uniform in [low_digits, high_digits]."""
    d = rng.randint(low_digits, high_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _plus_minus(rng: Random, count: int) -> list[str]:
    return [rng.choice("+-") for _ in range(count)]


def _draw_terms(rng: Random, level: int) -> tuple[list[int], list[str]]:
    """Operands and operators for one problem of `level` (see module docstring)."""
    if level == 1:
        return [rng.randint(0, 9), rng.randint(0, 9)], _plus_minus(rng, 1)
    if level == 2:
        if rng.random() < 0.5:
            numbers = [rng.randint(10, 99), _digits(rng, 1, 2)]
            rng.shuffle(numbers)
            return numbers, _plus_minus(rng, 1)
        return [rng.randint(0, 9) for _ in range(3)], _plus_minus(rng, 2)
    if level == 3:
        if rng.random() < 0.6:
            numbers = [rng.randint(10, 99)] + [_digits(rng, 1, 2) for _ in range(2)]
            rng.shuffle(numbers)
            return numbers, _plus_minus(rng, 2)
        return [rng.randint(10, 99), rng.randint(2, 9)], ["*"]
    if level == 4:
        if rng.random() < 0.6:
            numbers = [rng.randint(100, 999)] + [_digits(rng, 1, 3) for _ in range(3)]
            rng.shuffle(numbers)
            return numbers, _plus_minus(rng, 3)
        return [rng.randint(10, 99), rng.randint(2, 9), _digits(rng, 2, 3)], ["*", rng.choice("+-")]
    raise ValueError(f"arith levels are 1..4, got {level}")


def _word_question(rng: Random, numbers: list[int], op: str) -> tuple[str, list[int]]:
    """Phrase a 2-operand problem as a story; returns the text and the numbers in text order."""
    a, b = numbers
    if op == "-" and a < b:  # nobody gives away more than they have
        a, b = b, a
    if op == "*":  # "buys 6 boxes with 37 pens": count of boxes first
        a, b = b, a
    name, pron = rng.choice(_NAMES)
    text = _WORD_TEMPLATES[op].format(name=name, pron=pron, item=rng.choice(_ITEMS), a=a, b=b)
    return text, [a, b]


def _make_problem(rng: Random, level: int) -> Problem:
    numbers, ops = _draw_terms(rng, level)
    word_ok = len(numbers) == 2 and min(numbers) >= 2  # "has 1 pens" / "has 0 apples" read oddly
    if word_ok and rng.random() < _WORD_PROBABILITY:
        question, numbers = _word_question(rng, numbers, ops[0])
    else:
        expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(ops, numbers[1:])])
        question = f"What is {expression}?"
    return Problem(question, str(_evaluate(numbers, ops)), DATA_SOURCE, level)


def _parse(question: str) -> tuple[list[int], list[str]]:
    """Recover operands and operators from a question this module wrote."""
    match = _EXPRESSION.match(question)
    if match:
        tokens = match.group(1).split(" ")
        return [int(t) for t in tokens[0::2]], tokens[1::2]
    for op, key in _WORD_KEYS.items():
        if key in question:
            return [int(n) for n in re.findall(r"\d+", question)], [op]
    raise ValueError(
        f"not an arith question: {question!r}. ArithTask.solution only understands questions "
        "that ArithTask generated ('What is <expr>?' or one of its word-problem templates)."
    )


def unique_problems(rng: Random, make, levels: tuple[int, ...], size: int) -> list[Problem]:
    """`size` distinct questions from `make(rng, level)`, levels in equal shares (round robin): a held-out set."""
    seen: set[str] = set()
    problems: list[Problem] = []
    while len(problems) < size:
        p = make(rng, levels[len(problems) % len(levels)])
        if p.question not in seen:
            seen.add(p.question)
            problems.append(p)
    return problems


def train_problems(rng: Random, make, levels: tuple[int, ...], size: int, held_out: set[str]) -> list[Problem]:
    """`size` questions from `make(rng, level)`, levels in equal shares, none of them in `held_out`, shuffled."""
    problems: list[Problem] = []
    while len(problems) < size:
        p = make(rng, levels[len(problems) % len(levels)])
        if p.question not in held_out:
            problems.append(p)
    rng.shuffle(problems)
    return problems


class ArithTask:
    """Deterministic train and held-out eval sets for a given seed."""

    def __init__(self, seed: int = _RUN.seed, train_size: int = _DATA.train_size, eval_size: int = _DATA.eval_size):
        if train_size < 0 or eval_size < 0:
            raise ValueError(f"sizes must be >= 0, got train_size={train_size} eval_size={eval_size}")
        self.seed = seed
        self.train_size = train_size
        self.eval_size = eval_size
        # String seeds are hashed with SHA-512 by `random`, so they are stable across processes.
        eval_rng = Random(f"arith/{seed}/eval")
        self._eval = {
            "arith_easy": self._unique_set(eval_rng, (1, 2)),
            "arith_hard": self._unique_set(eval_rng, (3, 4)),
        }
        held_out = {p.question for problems in self._eval.values() for p in problems}
        self._train = self._train_set(Random(f"arith/{seed}/train"), held_out)

    def _unique_set(self, rng: Random, levels: tuple[int, ...]) -> list[Problem]:
        return unique_problems(rng, _make_problem, levels, self.eval_size)

    def _train_set(self, rng: Random, held_out: set[str]) -> list[Problem]:
        """All four levels; repeats are allowed: level 1 has only a few hundred distinct questions."""
        return train_problems(rng, _make_problem, (1, 2, 3, 4), self.train_size, held_out)

    def train(self) -> list[Problem]:
        return list(self._train)

    def eval_sets(self) -> dict[str, list[Problem]]:
        return {name: list(problems) for name, problems in self._eval.items()}

    @staticmethod
    def solution(p: Problem, style: str = "worked") -> str:
        """A solution ending in \\boxed{answer}: `worked` (one step per operator) or `direct`.

        Worked steps write intermediate results out because a tiny model cannot
        add four numbers "in its head"; it can chain two-operand steps.
        """
        if style not in SOLUTION_STYLES:
            raise ValueError(f"solution style {style!r} is not one of {SOLUTION_STYLES}")
        numbers, ops = _parse(p.question)
        steps, total = [], numbers[0]
        for op, n in zip(ops, numbers[1:]):
            result = _apply(total, op, n)
            steps.append(f"{total} {op} {n} = {result}.")
            total = result
        if str(total) != p.answer:
            raise ValueError(
                f"problem answer {p.answer!r} disagrees with the question {p.question!r} (= {total}); "
                "Problem objects must come from ArithTask, whose answers are computed from the question"
            )
        final = f"The answer is \\boxed{{{total}}}."
        return final if style == "direct" else " ".join(steps) + " " + final
