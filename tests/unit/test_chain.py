"""The chain task (the entropy study's regime): deterministic, held out, right, and readable as a run's files."""

from __future__ import annotations

import ast
import re

import pytest

from common.arith import ArithTask
from study.chain import EVAL_SETS, LEVELS, RL_LEVELS, ChainTask, make_problem, write_jsonl
from common.datasets import read_records


def _python_answer(question: str) -> int:
    expression = re.fullmatch(r"What is ([0-9+\- ]+)\?", question).group(1)
    return eval(compile(ast.parse(expression, mode="eval"), "<q>", "eval"))  # digits, + and - only (matched above)


@pytest.fixture(scope="module")
def task() -> ChainTask:
    return ChainTask(seed=0, train_size=3000, eval_size=64)


def test_answers_and_levels_agree_with_python(task):
    for p in task.train() + [p for ps in task.eval_sets().values() for p in ps]:
        assert int(p.answer) == _python_answer(p.question)
        numbers = re.findall(r"\d+", p.question)
        assert len(numbers) == p.level and all(len(n) == 1 for n in numbers)


def test_held_out_sets_are_disjoint_from_training_and_split_by_operand_count(task):
    evals = task.eval_sets()
    assert set(evals) == set(EVAL_SETS)
    held = {p.question for ps in evals.values() for p in ps}
    assert not held & {p.question for p in task.train()}
    for name, problems in evals.items():
        assert len(problems) == 64 and len({p.question for p in problems}) == 64
        assert {p.level for p in problems} == set(EVAL_SETS[name]) and {p.data_source for p in problems} == {name}


def test_same_seed_same_sets_other_seed_other_sets():
    a, b = ChainTask(seed=3, train_size=200, eval_size=16), ChainTask(seed=3, train_size=200, eval_size=16)
    assert a.train() == b.train() and a.eval_sets() == b.eval_sets()
    assert a.train() != ChainTask(seed=4, train_size=200, eval_size=16).train()


def test_levels_select_the_training_operand_counts():
    problems = ChainTask(seed=0, train_size=400, eval_size=8, levels=RL_LEVELS).train()
    assert {p.level for p in problems} == set(RL_LEVELS)
    with pytest.raises(ValueError, match="operand counts"):
        ChainTask(seed=0, levels=(7,))
    with pytest.raises(ValueError, match="operands"):
        from random import Random

        make_problem(Random(0), 1)


def test_worked_solution_steps_are_single_digit_facts(task):
    for p in task.train()[:200]:
        worked = ArithTask.solution(p, "worked")
        steps = re.findall(r"(-?\d+) ([+-]) (\d+) = (-?\d+)\.", worked)
        assert len(steps) == p.level - 1 and all(len(d) == 1 for _, _, d, _ in steps)
        assert worked.endswith(f"\\boxed{{{p.answer}}}.") and ArithTask.solution(p, "direct").startswith("The answer")
        assert all(-36 <= int(x) <= 45 for x, _, _, _ in steps)  # about 1 600 facts in all (x, op, digit)
    assert max(LEVELS) == 6


def test_written_rows_load_as_a_run_reads_them(task, tmp_path):
    problems = task.eval_sets()["chain_long"][:5]
    write_jsonl(problems, tmp_path / "eval.jsonl")
    records = read_records(str(tmp_path / "eval.jsonl"))
    assert [(r.text, r.answer, r.data_source) for r in records] == \
        [(p.question, p.answer, "chain_long") for p in problems]


def test_guesses_are_right_at_the_set_rate_and_otherwise_close(task):
    from study.chain import GUESS_ACCURACY, guess

    problems = task.train()[:2000]
    values = [int(re.search(r"\\boxed\{(-?\d+)\}", guess(p, str(i))).group(1)) for i, p in enumerate(problems)]
    offsets = [v - int(p.answer) for v, p in zip(values, problems)]
    assert abs(sum(o == 0 for o in offsets) / len(offsets) - GUESS_ACCURACY) < 0.04
    assert {abs(o) for o in offsets} == {0, 1, 2, 3}
    assert guess(problems[0], "k") == guess(problems[0], "k")  # seeded by its key
