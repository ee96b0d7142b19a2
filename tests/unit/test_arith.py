"""The arith task: deterministic, held out, and right -- checked against an independent evaluator."""

from __future__ import annotations

import ast
import operator
import re

import pytest

from common.arith import ArithTask, Problem
from common.templates import BOXED_INSTRUCTION, render_prompt

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
# Word problems, parsed independently of common/arith.py's own tables.
_WORD = [
    (re.compile(r"^\w+ has (\d+) \w+ and buys (\d+) more\. How many \w+ does (?:he|she) have now\?$"), operator.add),
    (re.compile(r"^\w+ has (\d+) \w+ and gives away (\d+)\. How many \w+ are left\?$"), operator.sub),
    (re.compile(r"^\w+ buys (\d+) boxes with (\d+) \w+ in each\. How many \w+ is that\?$"), operator.mul),
]


def _eval_node(node: ast.AST) -> int:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise AssertionError(f"unexpected syntax {ast.dump(node)}")


def independent_answer_and_level(question: str) -> tuple[int, int]:
    """Evaluate with Python's own precedence and classify by the module docstring's rules."""
    match = re.fullmatch(r"What is ([0-9+\-* ]+)\?", question)
    if match is None:
        for pattern, fn in _WORD:
            word = pattern.fullmatch(question)
            if word:
                a, b = int(word.group(1)), int(word.group(2))
                level = 3 if fn is operator.mul else (1 if max(a, b) <= 9 else 2)
                return fn(a, b), level
        raise AssertionError(f"question matches no known phrasing: {question!r}")
    expression = match.group(1)
    numbers = [int(n) for n in re.findall(r"\d+", expression)]
    has_mul = "*" in expression
    if has_mul:
        level = 3 if len(numbers) == 2 else 4
    elif len(numbers) == 4:
        level = 4
    elif len(numbers) == 3:
        level = 2 if max(numbers) <= 9 else 3
    else:
        level = 1 if max(numbers) <= 9 else 2
    return _eval_node(ast.parse(expression, mode="eval").body), level


@pytest.fixture(scope="module")
def task() -> ArithTask:
    return ArithTask(seed=0)


def test_same_seed_same_problems_other_seed_different():
    assert ArithTask(seed=3, train_size=200, eval_size=20).train() == ArithTask(seed=3, train_size=200, eval_size=20).train()
    assert ArithTask(seed=3, train_size=200, eval_size=20).eval_sets() == ArithTask(seed=3, train_size=200, eval_size=20).eval_sets()
    assert ArithTask(seed=3, train_size=200).train() != ArithTask(seed=4, train_size=200).train()


def test_eval_sets_are_held_out_unique_and_split_by_level(task):
    train_questions = {p.question for p in task.train()}
    sets = task.eval_sets()
    assert set(sets) == {"arith_easy", "arith_hard"}
    for name, levels in (("arith_easy", {1, 2}), ("arith_hard", {3, 4})):
        problems = sets[name]
        assert len(problems) == 128
        assert {p.level for p in problems} == levels
        assert len({p.question for p in problems}) == len(problems), f"{name} repeats a question"
        leaked = [p.question for p in problems if p.question in train_questions]
        assert not leaked, f"{name} questions also in train: {leaked[:3]}"


def test_train_mixes_all_levels_equally(task):
    train = task.train()
    assert len(train) == 4096
    assert [sum(p.level == lvl for p in train) for lvl in (1, 2, 3, 4)] == [1024] * 4


def test_answers_and_levels_match_an_independent_evaluator(task):
    problems = task.train() + [p for ps in task.eval_sets().values() for p in ps]
    for p in problems:
        answer, level = independent_answer_and_level(p.question)
        assert p.answer == str(answer), p
        assert p.level == level, p
        assert p.data_source == "arith"


def test_mix_has_word_problems_multiplication_and_negative_answers(task):
    train = task.train()
    assert sum(not p.question.startswith("What is") for p in train) > 200
    assert sum("*" in p.question or "boxes" in p.question for p in train) > 200
    assert sum(p.answer.startswith("-") for p in train) > 200
    assert all(int(p.answer) >= 0 for p in train if not p.question.startswith("What is")), "stories never go negative"
    assert max(len(p.question) for p in train) < 100, "questions must stay short for a 256-token context"


def test_solution_worked_by_hand():
    p = Problem("What is 23 + 58 - 7?", "74", "arith", 3)
    # 23 + 58 = 81, then 81 - 7 = 74.
    assert ArithTask.solution(p) == "23 + 58 = 81. 81 - 7 = 74. The answer is \\boxed{74}."
    p = Problem("What is 5 - 12 + 3?", "-4", "arith", 3)
    assert ArithTask.solution(p) == "5 - 12 = -7. -7 + 3 = -4. The answer is \\boxed{-4}."
    p = Problem("Mia buys 6 boxes with 37 pens in each. How many pens is that?", "222", "arith", 3)
    assert ArithTask.solution(p) == "6 * 37 = 222. The answer is \\boxed{222}."
    # The direct style is the final sentence alone: the answer without the working.
    assert ArithTask.solution(p, "direct") == "The answer is \\boxed{222}."
    with pytest.raises(ValueError, match="style"):
        ArithTask.solution(p, "chatty")


def test_every_solution_steps_are_right_and_end_in_the_boxed_answer(task):
    for p in task.train()[:1000] + task.eval_sets()["arith_hard"]:
        solution = ArithTask.solution(p)
        assert solution.endswith(f"\\boxed{{{p.answer}}}."), solution
        steps = re.findall(r"(-?\d+) ([-+*]) (\d+) = (-?\d+)\.", solution)
        n_ops = len(re.findall(r" [-+*] ", p.question)) or 1  # word problems have one operation
        assert len(steps) == n_ops, solution
        for left, op, right, result in steps:
            assert _OPS[{"+": ast.Add, "-": ast.Sub, "*": ast.Mult}[op]](int(left), int(right)) == int(result), solution
        assert steps[-1][3] == p.answer


def test_solution_refuses_a_wrong_answer():
    with pytest.raises(ValueError, match="disagrees"):
        ArithTask.solution(Problem("What is 2 + 2?", "5", "arith", 1))
    with pytest.raises(ValueError, match="not an arith question"):
        ArithTask.solution(Problem("What is two plus two?", "4", "arith", 1))


def test_prompt_is_plain_and_asks_for_boxed():
    prompt = render_prompt("What is 2 + 2?")
    assert prompt == "Question: What is 2 + 2?\nPut the final answer in \\boxed{}.\nAnswer:"
    assert BOXED_INSTRUCTION in prompt
