"""Tests for common/rewards.py: the grading table, boxed extraction, and the pool's invariant
(one result per answer, in order, within timeout_s + overhead, surviving adversarial answers and
killed workers).

Expected rewards in the table are what math-verify 0.9.0 returns; where that differs from what a
careful human grader would say, the case stays in the table with a "math-verify:" comment, so an
upgrade that changes the behaviour shows up here.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from common.rewards import (
    MAX_ANSWER_CHARS,
    RewardPool,
    ScoreResult,
    _fast_verdict,
    _math_verify,
    extract_answer,
    extract_boxed,
    score,
)

TIMEOUT_S = 3.0
SLACK_S = 2.0  # "within timeout_s + small overhead": what we allow on a shared 2-core machine
POWER_TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"


def boxed(answer: str) -> str:
    return f"Some reasoning first.\n\nThe final answer is $\\boxed{{{answer}}}$."


# (completion, ground truth, expected reward)
CASES = [
    # integers (fast path)
    pytest.param(boxed("81"), "81", 1.0, id="int"),
    pytest.param(boxed("80"), "81", 0.0, id="int-wrong"),
    pytest.param(boxed("-7"), "-7", 1.0, id="negative"),
    pytest.param(boxed("7"), "-7", 0.0, id="sign-dropped"),
    pytest.param(boxed("081"), "81", 1.0, id="leading-zero"),
    pytest.param(boxed("+3"), "3", 1.0, id="explicit-plus"),
    pytest.param(boxed("0"), "-0", 1.0, id="minus-zero"),
    pytest.param("\\boxed{ 81 }", "81", 1.0, id="whitespace-in-box"),
    pytest.param(boxed("9.0"), "9", 1.0, id="int-as-decimal"),
    pytest.param(boxed("1,000"), "1000", 1.0, id="thousands-comma"),
    pytest.param(boxed("1000"), "1,000", 1.0, id="thousands-comma-gold"),
    # math-verify: reads "1 000" as something other than 1000; a human would accept the thin-space
    # thousands separator. Models rarely write it inside a box, so we keep math-verify's verdict.
    pytest.param(boxed("1 000"), "1000", 0.0, id="thousands-space"),
    # math-verify parses "1 2" as 3 (not 12): the reason the fast path collapses whitespace rather
    # than deleting it. 0.0 is also what a grader wants for an ambiguous answer.
    pytest.param(boxed("1 2"), "12", 0.0, id="spaced-digits"),
    pytest.param(boxed("10^{3}"), "1000", 1.0, id="power-of-ten"),
    # math-verify: scientific "e" notation is not read as 10^3; a human would accept it.
    pytest.param(boxed("1e3"), "1000", 0.0, id="e-notation"),
    # fractions and decimals
    pytest.param(boxed("0.5"), "\\frac{1}{2}", 1.0, id="decimal-vs-frac"),
    pytest.param(boxed("\\frac{1}{2}"), "0.5", 1.0, id="frac-vs-decimal"),
    pytest.param(boxed("1/2"), "\\frac{1}{2}", 1.0, id="slash-vs-frac"),
    pytest.param(boxed("\\dfrac{3}{4}"), "\\frac{3}{4}", 1.0, id="dfrac"),
    pytest.param(boxed("\\tfrac34"), "0.75", 1.0, id="tfrac-no-braces"),
    pytest.param(boxed("\\frac12"), "\\frac{1}{2}", 1.0, id="frac-no-braces"),
    pytest.param(boxed("1.50"), "1.5", 1.0, id="trailing-zero"),
    pytest.param(boxed("3\\frac{1}{2}"), "\\frac{7}{2}", 1.0, id="mixed-number"),
    pytest.param(boxed("\\frac{1}{\\sqrt{4}}"), "\\frac{1}{2}", 1.0, id="nested-braces"),
    pytest.param(boxed("0.3333333"), "\\frac{1}{3}", 1.0, id="decimal-7-digits"),
    # math-verify: rounds to 6 decimals, so 0.333 is not 1/3. Correct for an exact-answer task.
    pytest.param(boxed("0.333"), "\\frac{1}{3}", 0.0, id="decimal-3-digits"),
    # percentages
    pytest.param(boxed("50\\%"), "50", 1.0, id="percent-vs-number"),
    pytest.param(boxed("50\\%"), "0.5", 1.0, id="percent-vs-fraction"),
    # math-verify: accepts both 50 and 0.5 for a gold of 50% (and 1 for 100%). Lenient but defensible.
    pytest.param(boxed("0.5"), "50\\%", 1.0, id="fraction-vs-percent-gold"),
    pytest.param(boxed("1"), "100\\%", 1.0, id="one-vs-100-percent"),
    # units and decorations
    pytest.param(boxed("5\\text{ cm}"), "5", 1.0, id="unit-text"),
    pytest.param(boxed("5 \\mathrm{cm}"), "5", 1.0, id="unit-mathrm"),
    pytest.param(boxed("5"), "5\\text{ cm}", 1.0, id="unit-in-gold"),
    pytest.param(boxed("\\$5"), "5", 1.0, id="dollar-sign"),
    pytest.param(boxed("30^\\circ"), "30", 1.0, id="degrees"),
    # math-verify: drops the degree sign instead of converting, so pi/6 != 30 degrees.
    pytest.param(boxed("\\frac{\\pi}{6}"), "30^\\circ", 0.0, id="radians-vs-degrees"),
    pytest.param(boxed("\\text{two}"), "2", 0.0, id="number-in-words"),
    # radicals, constants, expressions
    pytest.param(boxed("\\sqrt{2}"), "\\sqrt{2}", 1.0, id="sqrt"),
    pytest.param(boxed("\\sqrt2"), "\\sqrt{2}", 1.0, id="sqrt-no-braces"),
    pytest.param(boxed("\\sqrt{8}"), "2\\sqrt{2}", 1.0, id="sqrt-simplified"),
    pytest.param(boxed("\\frac{\\sqrt{2}}{2}"), "\\frac{1}{\\sqrt{2}}", 1.0, id="rationalised"),
    pytest.param(boxed("\\pi"), "\\pi", 1.0, id="pi"),
    pytest.param(boxed("2\\pi"), "\\pi \\cdot 2", 1.0, id="pi-commuted"),
    pytest.param(boxed("3.14"), "\\pi", 0.0, id="pi-approx"),
    pytest.param(boxed("2.718281828"), "e", 1.0, id="e-numeric"),
    # math-verify: does not identify i with sqrt(-1).
    pytest.param(boxed("i"), "\\sqrt{-1}", 0.0, id="imaginary-unit"),
    pytest.param(boxed("\\infty"), "\\infty", 1.0, id="infinity"),
    pytest.param(boxed("-\\infty"), "\\infty", 0.0, id="minus-infinity"),
    pytest.param(boxed("2(x+1)"), "2x+2", 1.0, id="expanded"),
    pytest.param(boxed("x^2-1"), "(x-1)(x+1)", 1.0, id="factored"),
    pytest.param(boxed("x^2+1"), "(x-1)(x+1)", 0.0, id="factored-wrong"),
    pytest.param(boxed("a+b"), "b+a", 1.0, id="commuted"),
    pytest.param(boxed("x"), "y", 0.0, id="different-symbol"),
    pytest.param(boxed("y=2x+1"), "2x+1", 1.0, id="equation-rhs"),
    pytest.param(boxed("x=3"), "3", 1.0, id="assignment"),
    # sets, tuples, intervals
    pytest.param(boxed("\\{1,2\\}"), "\\{2,1\\}", 1.0, id="set-order"),
    pytest.param(boxed("\\{1,2,3\\}"), "\\{1,2\\}", 0.0, id="set-extra"),
    pytest.param(boxed("3,2"), "2,3", 1.0, id="bare-list-unordered"),
    pytest.param(boxed("(0,1]"), "(0,1]", 1.0, id="interval"),
    pytest.param(boxed("[0,1]"), "(0,1]", 0.0, id="interval-closed"),
    pytest.param(boxed("(0,1)"), "(0,1]", 0.0, id="interval-open"),
    pytest.param(boxed("(2,1)"), "(1,2)", 0.0, id="pair-order"),
    # math-verify: "(1,2)" is read as the open interval and still compared equal to the finite set
    # {1,2}. A careful grader would give 0.0 (an interval is not a two-element set).
    pytest.param(boxed("\\{1,2\\}"), "(1,2)", 1.0, id="set-vs-interval"),
    pytest.param(boxed("(2,\\infty)"), "x>2", 1.0, id="interval-vs-inequality"),
    # math-verify: not symmetric. An inequality answer against an interval gold is rejected
    # (allow_set_relation_comp=False only converts when the prediction is the set).
    pytest.param(boxed("x>2"), "(2,\\infty)", 0.0, id="inequality-vs-interval"),
    pytest.param(
        boxed("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0, id="matrix"
    ),
    # multiple choice
    pytest.param(boxed("\\text{A}"), "A", 1.0, id="choice-text"),
    pytest.param(boxed("B"), "A", 0.0, id="choice-wrong"),
    # extraction
    pytest.param("\\boxed{1} wait, no: \\boxed{2}", "2", 1.0, id="last-box-wins"),
    pytest.param("\\boxed{1} wait, no: \\boxed{2}", "1", 0.0, id="earlier-box-ignored"),
    pytest.param("So the answer is \\boxed{2", "2", 0.0, id="unclosed-box"),
    pytest.param("The answer is 2.", "2", 0.0, id="no-box"),
    pytest.param("\\boxed{}", "0", 0.0, id="empty-box"),
    pytest.param("\\fbox{12}", "12", 1.0, id="fbox"),
    pytest.param("\\boxed{\\boxed{7}}", "7", 1.0, id="box-in-box"),
    pytest.param(boxed("1" * (MAX_ANSWER_CHARS + 1)), "1" * (MAX_ANSWER_CHARS + 1), 0.0, id="answer-too-long"),
]


@pytest.mark.parametrize("completion, ground_truth, expected", CASES)
def test_score_table(completion: str, ground_truth: str, expected: float) -> None:
    assert score(completion, ground_truth) == expected


@pytest.mark.parametrize(
    "answer, ground_truth",
    [("81", "81"), ("081", "81"), ("-0", "0"), ("80", "81"), ("1 2", "12"), (" 5 ", "5"), ("+3", "-3")],
)
def test_fast_path_agrees_with_math_verify(answer: str, ground_truth: str) -> None:
    verdict = _fast_verdict(answer, ground_truth)
    assert verdict in (None, _math_verify(answer, ground_truth, soft_timeouts=True))


def test_score_off_the_main_thread() -> None:
    # math-verify's SIGALRM timeouts raise ValueError off the main thread; score() must not use them there.
    out: list[object] = []

    def run() -> None:
        try:
            out.append(score(boxed("0.5"), "\\frac{1}{2}"))
        except Exception as exc:  # recorded so the assert below shows it
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert out == [1.0]


def test_score_rejects_bad_ground_truth() -> None:
    with pytest.raises(ValueError, match="ground_truth is empty"):
        score(boxed("1"), "  ")
    with pytest.raises(TypeError, match="str"):
        score(boxed("1"), 1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# extract_boxed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{42}", "42"),
        ("a \\boxed{1} b \\boxed{2} c", "2"),
        ("\\boxed{1} then \\fbox{3}", "3"),
        ("\\fbox{3} then \\boxed{1}", "1"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{x^{2^{3}}} tail", "x^{2^{3}}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces are content
        ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),  # unbalanced escaped brace
        ("\\boxed{a\\\\}", "a\\\\"),  # \\ is a line break, the } after it closes the box
        ("\\boxed{}", ""),
        ("\\boxed{ 81 }", " 81 "),
        ("\\boxed{\\boxed{7}}", "7"),  # the last opening is the inner box
        ("no box here", None),
        ("", None),
        ("\\boxed{2", None),
        ("\\boxed{1} and finally \\boxed{2", None),  # last box unclosed: truncated, not the earlier one
        ("\\boxed{{1}", None),
        ("\\boxed {5}", None),  # like math-verify: no space before the brace
        ("\\boxed5", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_boxed_max_chars() -> None:
    assert extract_boxed("\\boxed{12345}", max_chars=5) == "12345"
    assert extract_boxed("\\boxed{123456}", max_chars=5) is None


def test_extract_boxed_is_cheap_on_1mb() -> None:
    filler = "blah " * 200_000
    start = time.perf_counter()
    assert extract_boxed(filler + "\\boxed{7}") == "7"
    assert extract_boxed(filler) is None
    assert extract_boxed("\\boxed{" + "{" * 1_000_000, max_chars=MAX_ANSWER_CHARS) is None
    assert extract_boxed("\\boxed{" + "\\" * 1_000_000 + "}", max_chars=MAX_ANSWER_CHARS) is None
    # Each is one rfind plus at most MAX_ANSWER_CHARS tokens: far under a millisecond per call on an
    # idle core; 0.5 s only fails if something became linear in Python over the megabyte.
    assert time.perf_counter() - start < 0.5


# --------------------------------------------------------------------------------------------------
# RewardPool
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with RewardPool(2, TIMEOUT_S, extract="boxed", format_score=0.0) as p:
        yield p


def test_pool_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="workers >= 1"):
        RewardPool(0, TIMEOUT_S, extract="boxed", format_score=0.0)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RewardPool(1, 0, extract="boxed", format_score=0.0)


def test_pool_matches_table_in_order(pool: RewardPool) -> None:
    pairs = [(p.values[0], p.values[1]) for p in CASES]
    scored_before = pool.scored
    results = pool.score_batch(pairs)
    assert [r.reward for r in results] == [p.values[2] for p in CASES]
    assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"]
    assert pool.scored == scored_before + len(CASES)


@pytest.mark.parametrize("text, mode, expected", [
    ("x \\boxed{3} Answer: 4", "boxed_or_answer_line", "3"),  # a box wins over an answer line
    ("so the total is 12.\nAnswer: 12", "boxed_or_answer_line", "12"),
    ("Answer: 1\nwait...\nAnswer: $\\frac{1}{2}$.", "boxed_or_answer_line", "\\frac{1}{2}"),  # the last line, $ and . stripped
    ("Answer: 12", "boxed", None),  # not in boxed mode
    ("no answer at all", "boxed_or_answer_line", None),
    ("Answer: " + "9" * (MAX_ANSWER_CHARS + 1), "boxed_or_answer_line", None),
])
def test_extract_answer_modes(text: str, mode: str, expected: str | None) -> None:
    assert extract_answer(text, mode) == expected


def test_answer_line_scoring_and_format_score() -> None:
    with pytest.raises(ValueError, match="extract"):
        RewardPool(1, TIMEOUT_S, extract="last_number", format_score=0.0)
    with pytest.raises(ValueError, match="format_score"):
        RewardPool(1, TIMEOUT_S, extract="boxed", format_score=1.0)
    with RewardPool(1, TIMEOUT_S, extract="boxed_or_answer_line", format_score=0.1) as p:
        got = p.score_batch([("Answer: 5", "5"), ("Answer: 6", "5"), ("I give up", "5"), ("\\boxed{\\frac{10}{2}}", "5")])
    # correct; wrong but well-formed (format score); no answer at all (0); correct through math-verify.
    assert [r.reward for r in got] == [1.0, 0.1, 0.0, 1.0] and all(r.status == "ok" for r in got)


def test_pool_empty_batch(pool: RewardPool) -> None:
    assert pool.score_batch([]) == []


def test_pool_errors_are_results(pool: RewardPool) -> None:
    errors_before, scored_before = pool.errors, pool.scored
    results = pool.score_batch(
        [
            (boxed("1"), ""),  # empty gold: rejected in the caller
            (boxed("5"), "$"),  # gold math-verify cannot parse: raised inside the worker
            (boxed("0.5"), "\\frac{1}{2}"),
        ]
    )
    assert results[0].status == "error" and "ground_truth is empty" in results[0].error
    assert results[1].status == "error" and "could not parse ground truth" in results[1].error
    assert results[2] == ScoreResult(1.0, "ok")
    assert pool.errors == errors_before + 2
    assert pool.scored == scored_before + 3


def _assert_bounded(result: ScoreResult, elapsed_s: float) -> None:
    assert elapsed_s < TIMEOUT_S + SLACK_S, f"took {elapsed_s:.1f} s, limit is {TIMEOUT_S} + {SLACK_S}"
    assert result.status == "timeout" or result == ScoreResult(0.0, "ok"), result


def test_pool_power_tower_times_out_and_pool_recovers(pool: RewardPool) -> None:
    timeouts_before = pool.timeouts
    start = time.perf_counter()
    results = pool.score_batch([(POWER_TOWER, "1"), (boxed("0.5"), "\\frac{1}{2}")])
    _assert_bounded(results[0], time.perf_counter() - start)
    assert results[1] == ScoreResult(1.0, "ok")
    # Observed: sympy never finishes this comparison, so the worker is killed at timeout_s.
    assert pool.timeouts == timeouts_before + (results[0].status == "timeout")
    # Two slow-path answers at once so the replacement worker takes part too.
    after = pool.score_batch([(boxed("\\frac{2}{4}"), "0.5"), (boxed("\\sqrt{8}"), "2\\sqrt{2}")])
    assert after == [ScoreResult(1.0, "ok"), ScoreResult(1.0, "ok")]


@pytest.mark.parametrize(
    "completion, ground_truth, expected",
    [
        pytest.param("x" * 1_000_000 + "\\boxed{81}", "81", 1.0, id="filler-then-box"),
        pytest.param("y" * 1_000_000 + "\\boxed{\\frac{1}{2}}", "0.5", 1.0, id="filler-then-slow-path"),
        pytest.param("\\boxed{" + "9" * 1_000_000 + "}", "1", 0.0, id="1mb-box"),
        pytest.param("\\boxed{" + "{" * 1_000_000, "1", 0.0, id="1mb-unclosed"),
        pytest.param("\\boxed{1}" + "\\" * 1_000_000, "1", 1.0, id="1mb-backslashes-after"),
    ],
)
def test_pool_1mb_completion(pool: RewardPool, completion: str, ground_truth: str, expected: float) -> None:
    start = time.perf_counter()
    [result] = pool.score_batch([(completion, ground_truth)])
    assert time.perf_counter() - start < TIMEOUT_S + SLACK_S
    assert result == ScoreResult(expected, "ok")
    assert pool.score_batch([(boxed("1/3"), "\\frac{1}{3}")]) == [ScoreResult(1.0, "ok")]


def _wait_for_exit(pid: int, timeout_s: float = 5.0) -> None:
    """Until `pid` is a zombie or gone (we must not reap it: the pool owns it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still running {timeout_s} s after SIGKILL")


def test_pool_replaces_worker_killed_while_idle(pool: RewardPool) -> None:
    pool.score_batch([(boxed("0.5"), "\\frac{1}{2}")] * 2)  # both workers started and ready
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    _wait_for_exit(victim)
    errors_before = pool.errors
    pairs = [(boxed(f"\\frac{{{k}}}{{{2 * k}}}"), "0.5") for k in range(1, 7)]
    assert pool.score_batch(pairs) == [ScoreResult(1.0, "ok")] * len(pairs)
    assert pool.errors == errors_before  # no answer was in flight, so none is lost or failed
    assert victim not in pool.worker_pids()


def test_pool_reports_error_when_worker_dies_mid_answer(pool: RewardPool) -> None:
    pool.score_batch([(boxed("0.5"), "\\frac{1}{2}")] * 2)  # both workers ready, so dispatch is instant
    errors_before = pool.errors
    out: list[list[ScoreResult]] = []
    thread = threading.Thread(target=lambda: out.append(pool.score_batch([(POWER_TOWER, "1")])))
    thread.start()
    time.sleep(0.5)  # the tower is now being worked on, and would be until TIMEOUT_S
    victims = pool.worker_pids()
    for pid in victims:  # the busy worker and the idle one
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=TIMEOUT_S + SLACK_S)
    assert not thread.is_alive(), "score_batch hung after its worker was killed"
    [[result]] = out
    assert result.status == "error" and "died" in result.error, result
    assert pool.errors == errors_before + 1
    assert pool.score_batch([(boxed("2x+2"), "2(x+1)")] * 2) == [ScoreResult(1.0, "ok")] * 2
    # Checked only now: the idle victim's death is noticed when the pool next looks at it (this
    # batch), not necessarily before the batch above returned.
    assert not set(victims) & set(pool.worker_pids())


def test_pool_closed_rejects_batches() -> None:
    p = RewardPool(1, TIMEOUT_S, extract="boxed", format_score=0.0)
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        p.score_batch([(boxed("1"), "1")])
