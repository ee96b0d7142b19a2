"""Verifiable math rewards: grade the last ``\\boxed{...}`` of a completion against a ground truth.

Invariant: ``RewardPool.score_batch(pairs)`` returns exactly one ``ScoreResult`` per pair, in input
order, and no answer occupies a worker for more than ``timeout_s`` (plus the few milliseconds it takes
to SIGKILL the worker). A timeout, an exception or a dead worker turns into a result
(``"timeout"`` / ``"error"``, reward 0.0); nothing is dropped, nothing hangs. Batch wall time is
bounded by ``ceil(n / workers) * timeout_s`` plus the start-up time of replacement workers.

Why worker processes and not threads or math-verify's own timeouts:
  * math-verify bounds parse/verify with SIGALRM, which raises ValueError off the main thread, and
    our actors score from threads next to ZeroMQ sockets.
  * SIGALRM cannot interrupt C code: ``\\boxed{9^{9^{9^{9^{9}}}}}`` can spend minutes inside sympy /
    big-integer arithmetic without returning to the interpreter. Only killing the process bounds it,
    so each worker is a process we may SIGKILL (its own pid only) and replace.

Why ``subprocess`` running this file rather than ``multiprocessing`` (spawn or forkserver):
both multiprocessing start methods re-import the caller's ``__main__`` in the child to unpickle the
target; for an actor script that means importing torch (seconds and hundreds of MB) in every reward
worker, and again after every timeout kill. ``python -P common/rewards.py --worker`` imports only the
stdlib, msgspec and math_verify. It is not a fork either: the child execs at once, so the caller's
threads and ZeroMQ sockets are never duplicated. Consequence: this file is also the worker's entry
script, so its module-level imports must stay stdlib + msgspec (math_verify is imported lazily).

Departures from "just call math_verify":
  * Fast path: if the boxed answer equals the ground truth after whitespace normalisation, or both
    are plain integers, the verdict is decided in the caller without math-verify or a round trip
    (the built-in arithmetic task is all integers, so this is the common case and takes microseconds).
  * Only the last box is graded, and only if its content is at most ``MAX_ANSWER_CHARS`` long, so a
    1 MB completion costs one ``rfind`` plus a bounded brace scan.
  * Inside workers math-verify's SIGALRM timeouts are switched off: the pool's hard limit is the one
    authority, so a slow answer is reported as ``"timeout"`` rather than as a silent 0.0.
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

# Longest box content we grade. Real final answers (even matrices) are a few hundred characters;
# anything longer is wrong in practice and is what makes latex parsing slow. Longer -> reward 0.0.
MAX_ANSWER_CHARS = 1000

# A worker must import math_verify and warm it up within this time. Generous because the machine
# may be busy (2 shared cores); exceeding it means the environment is broken, not that it is slow.
_WORKER_START_TIMEOUT_S = 60.0
KILL_REAP_S = 30.0  # a SIGKILLed worker is reaped within this (subprocess.TimeoutExpired past it: a bug to see)
# Consecutive worker deaths before "ready" after which we stop respawning and raise instead.
_MAX_START_FAILURES = 3

ScoreStatus = Literal["ok", "timeout", "error"]


@dataclass(frozen=True)
class ScoreResult:
    reward: float
    status: ScoreStatus  # "ok" | "timeout" | "error"
    error: str = ""


# --------------------------------------------------------------------------------------------------
# Extraction and in-process scoring
# --------------------------------------------------------------------------------------------------

# One token per match: an escaped character (``\{``, ``\}``, ``\\``) or a bare brace. Consuming
# ``\\`` as a pair means ``\\{`` is a line break followed by a real group opening.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_INTEGER = re.compile(r"[+-]?[0-9]+")


def extract_boxed(text: str, *, max_chars: int | None = None) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``, braces matched.

    Returns None if there is no box, if the last box is never closed (a truncated completion), or if
    its content is longer than ``max_chars``. Escaped braces (``\\{1,2\\}``) are content, not
    nesting. Like math-verify, ``\\boxed {x}`` (space before the brace) is not recognised.
    """
    start = -1
    for opener in _BOX_OPENERS:
        at = text.rfind(opener)
        if at >= 0:
            start = max(start, at + len(opener))
    if start < 0:
        return None
    stop = len(text) if max_chars is None else min(len(text), start + max_chars + 1)
    depth = 1
    for match in _BRACE_TOKEN.finditer(text, start, stop):
        token = match.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return text[start : match.start()]
    return None


_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+?)\s*$", re.MULTILINE)


def extract_answer(text: str, extract: str = "boxed") -> str | None:
    """The graded answer: the last box (``extract="boxed"``); with ``"boxed_or_answer_line"`` a completion
    without a box falls back to its last ``Answer: ...`` line (DAPO-Math-17k's format), with a trailing
    period and ``$...$`` stripped. None when there is no answer (or it is over MAX_ANSWER_CHARS)."""
    if extract not in ("boxed", "boxed_or_answer_line"):
        raise ValueError(f"extract={extract!r}: use \"boxed\" or \"boxed_or_answer_line\"")
    boxed = extract_boxed(text, max_chars=MAX_ANSWER_CHARS)
    if boxed is not None or extract == "boxed":
        return boxed
    # Only the tail can hold the last line: a bounded regex scan even for a 1 MB completion.
    lines = _ANSWER_LINE.findall(text[-4 * MAX_ANSWER_CHARS:])
    if not lines:
        return None
    answer = lines[-1].rstrip(".").strip().strip("$").strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def _canonical_integer(s: str) -> str:
    digits = s.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if s.startswith("-") and digits != "0" else digits


def _fast_verdict(answer: str, ground_truth: str) -> float | None:
    """1.0 / 0.0 when the answer can be decided without math-verify, else None.

    Whitespace runs are collapsed, not removed: math-verify reads ``1 2`` as 3, not 12, so deleting
    spaces would make the fast path disagree with the slow one.
    """
    a = " ".join(answer.split())
    g = " ".join(ground_truth.split())
    if not a:
        return 0.0
    if a == g:
        return 1.0
    # Integers compare as canonical digit strings (not int(): a 5000-digit answer would raise).
    if _INTEGER.fullmatch(a) and _INTEGER.fullmatch(g):
        return 1.0 if _canonical_integer(a) == _canonical_integer(g) else 0.0
    return None


def _prepare(completion: str, ground_truth: str, extract: str = "boxed") -> tuple[str | None, float | None]:
    """(answer or None if there is none, verdict or None if math-verify must decide); runs in the caller."""
    if not isinstance(completion, str) or not isinstance(ground_truth, str):
        raise TypeError(
            f"score() takes (completion: str, ground_truth: str), got "
            f"({type(completion).__name__}, {type(ground_truth).__name__}); "
            f"convert the dataset answer with str() when the task is built"
        )
    if not ground_truth.strip():
        raise ValueError(
            "ground_truth is empty, so every completion would score 0.0; "
            "drop or fix this example in the dataset"
        )
    answer = extract_answer(completion, extract)
    if answer is None:
        return None, 0.0
    return answer, _fast_verdict(answer, ground_truth)


def _math_verify(answer: str, ground_truth: str, *, soft_timeouts: bool) -> float:
    """math-verify's verdict on a boxed answer. Both sides are wrapped in ``\\boxed{}`` because
    math-verify only parses latex it can find (a bare ``\\sqrt{2}`` is otherwise not extracted)."""
    from math_verify import parse, verify

    # math-verify's timeouts are SIGALRM based: usable on the main thread only, and then only a
    # soft bound (they cannot interrupt C code). None disables them.
    limit_s = 5 if soft_timeouts else None
    gold = parse("\\boxed{" + ground_truth + "}", parsing_timeout=limit_s)
    if not gold:
        raise ValueError(
            f"math-verify could not parse ground truth {ground_truth[:80]!r}; every completion "
            f"would score 0.0, so fix this dataset entry (write it as latex, e.g. \\frac{{1}}{{2}})"
        )
    pred = parse("\\boxed{" + answer + "}", parsing_timeout=limit_s)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit_s) else 0.0


def score(completion: str, ground_truth: str, *, extract: str = "boxed") -> float:
    """1.0 if the last boxed answer of ``completion`` equals ``ground_truth``, else 0.0. In-process.

    No hard time limit: an adversarial answer can block the caller for minutes. Use ``RewardPool``
    for untrusted completions. On the main thread math-verify's SIGALRM soft timeouts (5 s) apply.
    """
    answer, verdict = _prepare(completion, ground_truth, extract)
    if verdict is not None:
        return verdict
    on_main_thread = threading.current_thread() is threading.main_thread()
    return _math_verify(answer, ground_truth, soft_timeouts=on_main_thread)


# --------------------------------------------------------------------------------------------------
# Parent <-> worker protocol: 4-byte big-endian length, then a msgpack-encoded Struct.
# Replies stay far below PIPE_BUF (error text is capped), so each arrives in one atomic write.
# --------------------------------------------------------------------------------------------------


class _Job(msgspec.Struct, array_like=True, gc=False):
    answer: str  # content of the last box, at most MAX_ANSWER_CHARS
    ground_truth: str


class _Reply(msgspec.Struct, array_like=True, gc=False):
    status: str  # "ready" | "ok" | "error" | "fatal" (could not start)
    reward: float = 0.0
    error: str = ""


_HEADER = struct.Struct(">I")
_ERROR_CHARS = 1000


def _write_frame(fd: int, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def _read_frame(fd: int) -> bytes | None:
    """One frame, or None at end of file (the other side exited or closed the pipe)."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    return _read_exact(fd, _HEADER.unpack(header)[0])


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, remaining = [], n
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------------------------------
# Worker process (runs this file as a script)
# --------------------------------------------------------------------------------------------------


def _limit_cpu(cpu_limit_s: int) -> None:
    """Let the kernel kill this worker after ``cpu_limit_s`` more CPU seconds (SIGXCPU).

    The parent's wall-clock kill always comes first while the parent lives (CPU time <= wall time);
    this only matters if the parent is SIGKILLed mid-answer, when nobody else would stop a worker
    spinning on a huge power for hours.
    """
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime) + cpu_limit_s
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


# One of each comparison kind math-verify has a slow first call for (see _worker_main).
_WARM_UP = (
    ("\\frac{1}{2}", "0.5"),
    ("2(x+1)", "2x+2"),
    ("x^2-1", "(x-1)(x+1)"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("(0,1]", "[0,1]"),
    ("(2,\\infty)", "x>2"),
)


def _worker_main(cpu_limit_s: int) -> int:
    import signal

    # Frames go to a private copy of stdout; fd 1 is pointed at stderr so that stray prints from
    # sympy / antlr cannot corrupt the protocol.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    in_fd = 0
    # Ctrl-C reaches the whole process group; the parent decides when workers stop (stdin EOF).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # We disable math-verify's timeouts on purpose; its one-time warning about that is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(_Job)
    try:
        # Warm up before reporting ready: the first parse compiles math-verify's regexes and loads the
        # latex grammar, and the first symbolic / set / interval comparison fills sympy's caches and
        # lazy imports (0.1-0.4 s each, seconds on a busy machine). Paid here, off the clock, a fresh
        # replacement worker does not time out on an ordinary answer.
        for answer, ground_truth in _WARM_UP:
            _math_verify(answer, ground_truth, soft_timeouts=False)
    except Exception:  # reported to the parent, which raises with this traceback
        _write_frame(out_fd, encoder.encode(_Reply("fatal", error=traceback.format_exc()[-_ERROR_CHARS:])))
        return 1
    _write_frame(out_fd, encoder.encode(_Reply("ready")))
    while True:
        frame = _read_frame(in_fd)
        if frame is None:  # parent closed stdin (close()) or died: shut down quietly
            return 0
        job = decoder.decode(frame)
        _limit_cpu(cpu_limit_s)
        try:
            reply = _Reply("ok", _math_verify(job.answer, job.ground_truth, soft_timeouts=False))
        except Exception as exc:  # becomes ScoreResult(0.0, "error", repr) in the parent
            reply = _Reply("error", 0.0, repr(exc)[:_ERROR_CHARS])
        _write_frame(out_fd, encoder.encode(reply))


# --------------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------------


class _Worker:
    """One worker process and the answer it is scoring, if any."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.ready = False
        self.start_deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        self.job: int | None = None  # index into the current batch
        self.job_deadline = float("inf")

    @property
    def in_fd(self) -> int:
        return self.proc.stdin.fileno()

    @property
    def out_fd(self) -> int:
        return self.proc.stdout.fileno()

    def deadline(self) -> float:
        if self.job is not None:
            return self.job_deadline
        return float("inf") if self.ready else self.start_deadline

    def kill(self) -> int:
        """SIGKILL this worker's own pid (no-op if it already exited), reap it, return the exit code."""
        self.proc.kill()
        code = self.proc.wait(timeout=KILL_REAP_S)  # SIGKILL cannot be caught: only a dead kernel would miss this
        self.proc.stdin.close()
        self.proc.stdout.close()
        return code


class RewardPool:
    """``workers`` persistent scoring processes with a hard wall-clock limit per answer.

    ``score_batch`` is serialised by a lock (safe to call from several threads, one batch at a
    time). Counters are cumulative ints: ``scored`` (results returned, fast path included),
    ``timeouts`` and ``errors`` -- log them as ``reward/timeouts`` and ``reward/errors``.
    """

    @classmethod
    def from_config(cls, reward) -> "RewardPool":
        """The pool a run's `reward` config section asks for (common/config.py RewardConfig holds the defaults;
        this file runs standalone as the worker script, so it does not import the config)."""
        return cls(reward.workers, reward.timeout_s, extract=reward.extract, format_score=reward.format_score,
                   verifier=reward.verifier)

    def __init__(self, workers: int, timeout_s: float, *, extract: str, format_score: float,
                 verifier: str = "math") -> None:
        """``extract``: see ``extract_answer``. ``format_score``: the reward of a wrong answer that was found
        (a well-formed attempt), in [0, 1); a missing answer, a timeout or an error stay 0.0. ``verifier``:
        ``"math"`` grades the extracted answer (fast path, else math-verify in a worker); ``"grid_path"`` grades
        the whole completion as a walk (common/gridpath.py) in the caller, so no answer ever reaches a worker."""
        if workers < 1:
            raise ValueError(f"RewardPool needs workers >= 1, got {workers}; use score() to grade in-process")
        if not timeout_s > 0:
            raise ValueError(
                f"RewardPool needs timeout_s > 0, got {timeout_s}; without a limit one adversarial "
                f"answer (e.g. \\boxed{{9^{{9^{{9^{{9^{{9}}}}}}}}}}) blocks a worker forever"
            )
        if not 0.0 <= format_score < 1.0:
            raise ValueError(f"format_score={format_score} must be in [0, 1): a full 1.0 is reserved for correct answers")
        extract_answer("", extract)  # validates the mode now, not at the first batch
        if verifier not in ("math", "grid_path"):
            raise ValueError(f"verifier={verifier!r}: use \"math\" or \"grid_path\"")
        self._walk_score = None
        if verifier == "grid_path":  # imported here, never in the worker script (stdlib + msgspec only)
            from common.gridpath import walk_score
            self._walk_score = walk_score
        self.extract, self.format_score, self.verifier = extract, float(format_score), verifier
        self.timeout_s = float(timeout_s)
        self.scored = 0
        self.timeouts = 0
        self.errors = 0
        # The CPU limit is only an orphan guard (see _limit_cpu): well above what timeout_s allows.
        cpu_limit_s = int(2 * self.timeout_s) + 5
        # -P: do not put common/ on sys.path, so its modules cannot shadow stdlib or package names.
        self._argv = [sys.executable, "-P", os.path.abspath(__file__), "--worker", str(cpu_limit_s)]
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._start_failures = 0
        self._closed = False
        # grid_path grades every completion in the caller (_triage), so no answer can reach a worker: start none
        self._workers = [] if verifier == "grid_path" else [_Worker(self._argv) for _ in range(workers)]

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """Current worker pids (they change when a worker is replaced)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers: idle ones exit on stdin EOF, anything still running is killed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                w.proc.stdin.close()
            for w in self._workers:
                try:
                    w.proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass  # still busy or still importing: killed just below
                w.kill()

    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[ScoreResult]:
        """One ScoreResult per (completion, ground_truth) pair, in input order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool.score_batch after close(); create a new RewardPool")
            results: list[ScoreResult | None] = [None] * len(pairs)
            todo, found = self._triage(pairs, results)
            try:
                while todo or any(w.job is not None for w in self._workers):
                    self._dispatch(todo)
                    self._wait(results)
            finally:
                self._replace_busy_workers()
            if self.format_score:
                results = [ScoreResult(self.format_score, "ok") if r.status == "ok" and r.reward == 0.0 and f else r
                           for r, f in zip(results, found)]
            return results  # type: ignore[return-value]  # every slot was filled by the loop above

    # -- event loop helpers (called with the lock held) --

    def _replace_busy_workers(self) -> None:
        """Workers with an answer in flight are killed and replaced. Only reached with answers in flight if
        score_batch is raising (start failure, Ctrl-C): their late replies would be misattributed to the next
        batch."""
        for k, w in enumerate(self._workers):
            if w.job is not None:
                w.kill()
                self._workers[k] = _Worker(self._argv)

    def _triage(self, pairs: Sequence[tuple[str, str]], results: list[ScoreResult | None]
                ) -> tuple[deque[tuple[int, _Job]], list[bool]]:
        """Score at once what needs no worker (no answer found, a bad row); queue the rest. Returns the queue and,
        per pair, whether an answer was found (for format_score)."""
        todo: deque[tuple[int, _Job]] = deque()
        found = [False] * len(pairs)
        for i, (completion, ground_truth) in enumerate(pairs):
            try:
                if self._walk_score is not None:
                    found[i], verdict = self._walk_score(completion, ground_truth)
                    self._finish(results, i, ScoreResult(verdict, "ok"))
                    continue
                answer, verdict = _prepare(completion, ground_truth, self.extract)
            except (TypeError, ValueError) as exc:  # a bad dataset row scores as an error, not a crash
                self._finish(results, i, ScoreResult(0.0, "error", repr(exc)))
                continue
            found[i] = answer is not None
            if verdict is None:
                todo.append((i, _Job(answer, ground_truth)))
            else:
                self._finish(results, i, ScoreResult(verdict, "ok"))
        return todo, found

    def _finish(self, results: list[ScoreResult | None], index: int, result: ScoreResult) -> None:
        results[index] = result
        self.scored += 1
        self.timeouts += result.status == "timeout"
        self.errors += result.status == "error"

    def _dispatch(self, todo: deque[tuple[int, _Job]]) -> None:
        for k, w in enumerate(self._workers):
            if not todo:
                return
            if not w.ready or w.job is not None:
                continue
            index, job = todo[0]
            try:
                _write_frame(w.in_fd, self._encoder.encode(job))
            except OSError:  # BrokenPipeError: it died while idle; the answer stays queued
                w.kill()
                self._workers[k] = _Worker(self._argv)
                continue
            todo.popleft()
            w.job, w.job_deadline = index, time.monotonic() + self.timeout_s

    def _wait(self, results: list[ScoreResult | None]) -> None:
        """Block until a reply, a worker death or the nearest deadline, then handle whichever came."""
        nearest = min(w.deadline() for w in self._workers)
        # Every worker idle and ready cannot happen here (the caller would have dispatched or
        # stopped); the 1 s poll only keeps a future bug from turning into an infinite block.
        timeout = 1.0 if nearest == float("inf") else max(0.0, nearest - time.monotonic())
        with selectors.DefaultSelector() as selector:
            for k, w in enumerate(self._workers):
                selector.register(w.out_fd, selectors.EVENT_READ, k)
            events = selector.select(timeout)
        for key, _ in events:
            self._on_readable(key.data, results)
        now = time.monotonic()
        for k, w in enumerate(self._workers):
            if w.job is not None and now >= w.job_deadline:
                pid = w.proc.pid
                w.kill()
                self._finish(
                    results,
                    w.job,
                    ScoreResult(0.0, "timeout", f"exceeded timeout_s={self.timeout_s}; worker pid {pid} killed"),
                )
                self._workers[k] = _Worker(self._argv)
            elif not w.ready and now >= w.start_deadline:
                w.kill()
                raise RuntimeError(
                    f"reward worker pid {w.proc.pid} did not become ready within {_WORKER_START_TIMEOUT_S} s; "
                    f"check that `{sys.executable} -c 'import math_verify'` works and that the machine "
                    f"is not swapping"
                )

    def _on_readable(self, k: int, results: list[ScoreResult | None]) -> None:
        w = self._workers[k]
        frame = _read_frame(w.out_fd)
        if frame is None:  # EOF: the worker exited (crash, OOM killer, or killed from outside)
            pid, code = w.proc.pid, w.kill()
            if w.job is not None:
                self._finish(
                    results,
                    w.job,
                    ScoreResult(0.0, "error", f"reward worker pid {pid} died (exit code {code}) while scoring"),
                )
            elif not w.ready:
                self._start_failures += 1
                if self._start_failures >= _MAX_START_FAILURES:
                    raise RuntimeError(
                        f"{self._start_failures} reward workers in a row died while starting (last: pid "
                        f"{pid}, exit code {code}); their stderr is above. Run `{' '.join(self._argv)}` "
                        f"by hand to see why"
                    )
            self._workers[k] = _Worker(self._argv)
            return
        reply = msgspec.msgpack.decode(frame, type=_Reply)
        if reply.status == "ready":
            w.ready = True
            self._start_failures = 0
        elif reply.status == "fatal":
            w.kill()
            raise RuntimeError(
                f"reward worker could not import or warm up math_verify with {sys.executable}; "
                f"install math-verify in that environment. Worker traceback:\n{reply.error}"
            )
        elif w.job is None:
            raise RuntimeError(f"reward worker pid {w.proc.pid} sent {reply!r} with no answer assigned (protocol bug)")
        else:
            self._finish(results, w.job, ScoreResult(reply.reward, reply.status, reply.error))  # type: ignore[arg-type]
            w.job, w.job_deadline = None, float("inf")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit(f"usage: {sys.executable} -P {sys.argv[0]} --worker CPU_LIMIT_S (started by RewardPool, not by hand)")
    sys.exit(_worker_main(int(sys.argv[2])))
