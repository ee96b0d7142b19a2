"""Generators that size themselves: the autoscale policy (`cluster.autoscale`, `covrl run --autoscale MIN:MAX`).

Learner rank 0 shows every step's row to `Autoscaler.observe`, which may set a new generator target in
RUN_DIR/generators.json, the file `covrl scale` writes: the launcher starts or lets go of generators, the hub
welcomes or drains them, Ray places them, as for a change made by hand. Nothing here starts or stops a process.

The figures, each the median over `window_steps` steps at the current count (so one evaluation step's wait does not
move it; steps while the pool is short of its target, a generator restarting, are left out):
- the learner's wait share: (timing_s/batch_wait + timing_s/publish_wait) / timing_s/step, the share of its step it
  spent waiting for generation (`perf/learner_wait_share`);
- the generators' idle share: timing_s/gen_idle over the step's interval, the share of their time blocked by
  admission or waiting for weights (`perf/gen_idle_share`);
- trained samples per second (`perf/samples_per_s`), what each change is judged by; generation tokens/s per
  generator and the ready queue (`perf/ready_groups`) go into each decision's record.

The rule, with hysteresis between the thresholds (between down_wait and up_wait it holds):
- up: wait > up_wait. If generation scales with the count, G / (1 - wait) generators keep the learner busy; the new
  count is that, at least one more, at most max_factor x G, never above max or a ceiling in force;
- down: wait < down_wait and idle > down_idle. The busy share G x (1 - idle) is what is used; the new count leaves
  the generators idle about down_idle / 2, at least one fewer, at least G / max_factor, never below min or a floor;
- a change takes effect when the hub's live count equals the target; `settle_steps` later its window starts, and
  `cooldown_steps` after the decision at the earliest the next change can be made;
- each change is judged on its window: a scale-up whose samples/s rose by less than min_gain x the most it could give
  (min(new/old, 1/(1 - wait)) - 1) is undone, and no count above the old one is tried for `retry_after_steps` (a
  ceiling; doubled each time the same undo repeats, up to 8x): the bottleneck was elsewhere (CPU cores, the learner,
  a shared reward service, the batch's longest response), or the added generators were worth too little. A scale-down that cost
  more than max_loss of samples/s is undone likewise, with a floor. New generators that have not joined after
  `join_timeout_s` (no room for them) count as a scale-up that gave nothing.
- a target set by hand (`covrl scale`) is taken as the new count; the policy goes on from it.

Every decision (and every verdict on one, and every hold at a bound) is a line of RUN_DIR/autoscale.jsonl with its
reason and figures, a TensorBoard text (`cluster/autoscale`), the launcher's message and the progress line; each row
gets `cluster/autoscale/change`, `cluster/autoscale/undone`, `cluster/autoscale/ceiling` and `cluster/autoscale/floor`.
The policy's state is part of learner rank 0's checkpoint, so a resumed run keeps its ceilings.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from common.config import AutoscaleConfig
from common.runfiles import read_generator_target, write_generator_target

LOG_FILE = "autoscale.jsonl"
log = logging.getLogger("covrl.autoscale")


@dataclass(frozen=True)
class Figures:
    """One step's signals (from its metrics row)."""

    wait_share: float  # the learner's
    idle_share: float  # the generators'
    samples_per_s: float
    live: int  # generators connected and not draining
    gen_tokens_per_s: float = 0.0
    ready_groups: float = 0.0

    @classmethod
    def of(cls, row: dict[str, float]) -> Figures:
        return cls(row["perf/learner_wait_share"], row["perf/gen_idle_share"], row["perf/samples_per_s"],
                   int(row["cluster/generators"]), row.get("perf/gen_tokens_per_s", 0.0),
                   row.get("perf/ready_groups", 0.0))


def medians(window: list[Figures]) -> Figures:
    med = lambda name: float(np.median([getattr(f, name) for f in window]))  # noqa: E731
    return Figures(med("wait_share"), med("idle_share"), med("samples_per_s"), window[-1].live, med("gen_tokens_per_s"),
                   med("ready_groups"))


@dataclass(frozen=True)
class Decision:
    step: int
    kind: str  # up | down | undo | gave_up | kept | hold | by_hand
    before: int
    after: int
    reason: str
    figures: dict = field(default_factory=dict)

    def short(self) -> str:
        """For the progress line."""
        arrow = f"{self.before}->{self.after}" if self.after != self.before else f"{self.after}"
        return f"autoscale step {self.step}: {self.kind} {arrow}"


@dataclass
class Change:
    """A change in effect and not yet judged."""

    kind: str  # start | up | down | undo | gave_up | by_hand
    step: int
    t: float  # time.time() of the decision
    before: int
    after: int
    samples_per_s: float = 0.0  # the window's figures before it
    wait_share: float = 0.0
    joined: int = -1  # the step at which the live count reached `after` (-1: not yet)


class Policy:
    """Pure: steps' figures in, decisions out (`observe`); no file, no clock of its own."""

    def __init__(self, cfg: AutoscaleConfig, target: int, step: int = 0, now: float = 0.0):
        self.cfg, self.target = cfg, target
        self.window: list[Figures] = []
        self.change: Change | None = Change("start", step, now, target, target)
        self.last_change = step
        self.ceiling: tuple[int, int] | None = None  # (count, until step): no scale-up above count before then
        self.floor: tuple[int, int] | None = None  # (count, until step): no scale-down below count before then
        self.said_hold = ""  # the last hold's key: each hold is said once
        self.strikes: dict[tuple[str, int], int] = {}  # (direction, count gone back to) -> undos so far

    # ---- the bounds in force --------------------------------------------------------------------

    def highest(self, step: int) -> int:
        if self.ceiling is not None and step < self.ceiling[1]:
            return min(self.cfg.max, self.ceiling[0])
        return self.cfg.max

    def lowest(self, step: int) -> int:
        if self.floor is not None and step < self.floor[1]:
            return max(self.cfg.min, self.floor[0])
        return self.cfg.min

    # ---- one step ----------------------------------------------------------------------------------

    def observe(self, step: int, f: Figures, now: float) -> Decision | None:
        c = self.change
        if c is not None and c.joined < 0:
            if f.live == self.target:
                c.joined = step
            elif f.live < self.target and now - c.t > self.cfg.join_timeout_s:
                if c.kind in ("up", "undo"):
                    return self._give_up(step, f, now)
                return self._hold(step, f, "join", f"{self.target - f.live} of the {self.target} generators have "
                                  f"not joined after {self.cfg.join_timeout_s:.0f}s (no room for them? see the "
                                  f"launcher's messages); autoscaling waits for them")
            return None
        if c is not None and step <= c.joined + self.cfg.settle_steps:
            return None
        if f.live != self.target:  # a generator restarting: the pool is not what is being judged
            return None
        self.window = [*self.window, f][-self.cfg.window_steps:]
        if len(self.window) < self.cfg.window_steps:
            return None
        m = medians(self.window)
        if c is not None:
            self.change = None
            verdict = self._judge(step, c, m, now)
            if verdict is not None:
                return verdict
        if step - self.last_change < self.cfg.cooldown_steps:
            return None
        return self._decide(step, m, now)

    def adopt(self, step: int, target: int, now: float) -> Decision:
        """A target set by hand (`covrl scale`): the new count, taken as it is, not judged."""
        before, self.target = self.target, target
        self._changed(Change("by_hand", step, now, before, target))
        return Decision(step, "by_hand", before, target, f"the target was set to {target} by hand (covrl scale); "
                        f"autoscaling goes on from it, and its own changes stay within [{self.cfg.min}, "
                        f"{self.cfg.max}]")

    # ---- what it decides ---------------------------------------------------------------------------

    def _decide(self, step: int, m: Figures, now: float) -> Decision | None:
        a, g = self.cfg, self.target
        if m.wait_share > a.up_wait:
            top = self.highest(step)
            if g >= top:
                return self._hold(step, m, f"top {top}", f"the learner waits {m.wait_share:.0%} of each step, but {g} is "
                                  f"the most allowed now ({self._why_top(step)})")
            enough = g / max(1 - m.wait_share, 1e-3)  # if generation scales with the count
            new = min(top, max(g + 1, min(math.floor(g * a.max_factor), math.ceil(enough - 1e-9))))
            return self._go(step, "up", new, m, now, f"the learner waited {m.wait_share:.0%} of each step (median of "
                            f"{len(self.window)}; up_wait {a.up_wait:.0%}): generation is the bottleneck; at "
                            f"{enough:.1f} generators it would not wait")
        if m.wait_share < a.down_wait and m.idle_share > a.down_idle:
            bottom = self.lowest(step)
            if g <= bottom:
                return self._hold(step, m, f"bottom {bottom}", f"the generators are idle {m.idle_share:.0%} of the "
                                  f"time, but {g} is the fewest allowed now ({self._why_bottom(step)})")
            need = g * (1 - m.idle_share) / (1 - a.down_idle / 2)
            new = min(g - 1, max(bottom, math.ceil(g / a.max_factor - 1e-9), math.ceil(need - 1e-9)))
            return self._go(step, "down", new, m, now, f"the learner waited {m.wait_share:.0%} of each step (down_wait "
                            f"{a.down_wait:.0%}) and the generators were idle {m.idle_share:.0%} of the time (down_idle "
                            f"{a.down_idle:.0%}): the learner is the bottleneck; {need:.1f} generators' worth is used")
        self.said_hold = ""
        return None

    def _judge(self, step: int, c: Change, m: Figures, now: float) -> Decision | None:
        """A change's verdict from its first full window: undone, or kept (said either way)."""
        if c.kind not in ("up", "down") or c.samples_per_s <= 0:
            return None
        a, ratio = self.cfg, m.samples_per_s / c.samples_per_s
        said = (f"the {'scale-up' if c.kind == 'up' else 'scale-down'} {c.before}->{c.after} at step {c.step} took "
                f"samples/s from {c.samples_per_s:.3g} to {m.samples_per_s:.3g} ({ratio - 1:+.0%})")
        if c.kind == "up":
            could = min(c.after / c.before, 1 / max(1 - c.wait_share, 1e-9)) - 1
            if ratio - 1 >= a.min_gain * could:
                return Decision(step, "kept", c.after, c.after, f"{said}: kept", asdict(m))
            self.ceiling = (c.before, step + self._backoff(("up", c.before)))
            return self._go(step, "undo", c.before, m, now, f"{said}, less than {a.min_gain:.0%} of the "
                            f"{could:+.0%} it could give: the bottleneck is elsewhere; back to {c.before}, and no "
                            f"more than {c.before} until step {self.ceiling[1]}")
        if 1 - ratio <= a.max_loss:
            return Decision(step, "kept", c.after, c.after, f"{said}: kept", asdict(m))
        self.floor = (c.before, step + self._backoff(("down", c.before)))
        return self._go(step, "undo", c.before, m, now, f"{said}, a loss above max_loss {a.max_loss:.0%}: back to "
                        f"{c.before}, and no fewer until step {self.floor[1]}")

    def _give_up(self, step: int, f: Figures, now: float) -> Decision:
        c = self.change
        back = max(c.before, f.live, self.cfg.min)
        self.ceiling = (back, step + self._backoff(("up", back)))
        return self._go(step, "gave_up", self.ceiling[0], f, now, f"{c.after - f.live} new generator(s) of the "
                        f"scale-up {c.before}->{c.after} at step {c.step} had not joined after "
                        f"{self.cfg.join_timeout_s:.0f}s (no room for them? see the launcher's messages); back to "
                        f"{self.ceiling[0]}, and no more until step {self.ceiling[1]}")

    def _backoff(self, key: tuple[str, int]) -> int:
        """Steps before the same change is tried again: retry_after_steps, doubled for each repeat (at most 8x)."""
        self.strikes[key] = self.strikes.get(key, 0) + 1
        return self.cfg.retry_after_steps * 2 ** min(self.strikes[key] - 1, 3)

    def _go(self, step: int, kind: str, new: int, m: Figures, now: float, reason: str) -> Decision:
        before, self.target = self.target, new
        self._changed(Change(kind, step, now, before, new, m.samples_per_s, m.wait_share))
        return Decision(step, kind, before, new, reason, asdict(m))

    def _changed(self, c: Change) -> None:
        self.change, self.last_change, self.window, self.said_hold = c, c.step, [], ""

    def _hold(self, step: int, m: Figures, key: str, reason: str) -> Decision | None:
        if key == self.said_hold:  # said already (its figures move every step)
            return None
        self.said_hold = key
        return Decision(step, "hold", self.target, self.target, reason, asdict(m))

    def _why_top(self, step: int) -> str:
        if self.highest(step) < self.cfg.max:
            return f"a scale-up past it gave nothing; tried again from step {self.ceiling[1]}"
        return f"cluster.autoscale.max = {self.cfg.max}"

    def _why_bottom(self, step: int) -> str:
        if self.lowest(step) > self.cfg.min:
            return f"a scale-down below it cost samples/s; tried again from step {self.floor[1]}"
        return f"cluster.autoscale.min = {self.cfg.min}"

    # ---- checkpoint ---------------------------------------------------------------------------------

    def state(self) -> dict:
        """What a resumed run keeps: what it learnt (ceilings, floors, repeated undos) and when it last changed. The
        count is the launcher's (generators.json); a change in progress and its window start over with new processes."""
        return {"last_change": self.last_change, "ceiling": self.ceiling, "floor": self.floor,
                "strikes": [[d, n, k] for (d, n), k in self.strikes.items()]}

    def load_state(self, state: dict, step: int, now: float) -> None:
        self.ceiling = tuple(state["ceiling"]) if state["ceiling"] else None
        self.floor = tuple(state["floor"]) if state["floor"] else None
        self.strikes = {(d, n): k for d, n, k in state.get("strikes", [])}
        self._changed(Change("start", step, now, self.target, self.target))
        self.last_change = state["last_change"]


class Autoscaler:
    """The policy's hands on learner rank 0: reads RUN_DIR/generators.json (a change by hand), writes the target the
    policy decides and logs each decision (RUN_DIR/autoscale.jsonl, TensorBoard text). A file it cannot read or
    write is said once in the learner's log, and training goes on."""

    def __init__(self, cfg: AutoscaleConfig, run_dir: str, sink, step: int):
        self.run_dir, self.sink, self.warned = run_dir, sink, set()
        target = self.read()
        self.revision = target.revision if target else None
        self.policy = Policy(cfg, target.generators if target else cfg.min, step, time.time())
        self.last: Decision | None = None

    def observe(self, step: int, row: dict[str, float]) -> dict[str, float]:
        """The step's row seen; returns the `cluster/autoscale/*` metrics to add to it."""
        now = time.time()
        decisions = self.follow(step, now)
        if (d := self.policy.observe(step, Figures.of(row), now)) is not None:
            decisions.append(d)
        change, made = 0.0, []
        for d in decisions:
            moves = d.after != d.before and d.kind != "by_hand"
            if moves and not self.apply(d):  # not written (someone wrote since, or the file failed): the file stands
                made += self.follow(step, now, force=True)
                continue
            change += d.after - d.before if moves else 0
            made.append(d)
        for d in made:
            self.record(d)
        return {"cluster/autoscale/change": change,
                "cluster/autoscale/undone": float(any(d.kind in ("undo", "gave_up") for d in made)),
                "cluster/autoscale/ceiling": float(self.policy.highest(step)),
                "cluster/autoscale/floor": float(self.policy.lowest(step))}

    def follow(self, step: int, now: float, force: bool = False) -> list[Decision]:
        """A target written by someone else (a new revision; with `force`, whatever the file says) is the policy's
        new count."""
        target = self.read()
        if target is None or (target.revision == self.revision and not force):
            return []
        self.revision = target.revision
        if target.generators == self.policy.target:
            return []
        return [self.policy.adopt(step, target.generators, now)]

    def apply(self, d: Decision) -> bool:
        """Write the decided count, only over the revision it was decided on; False if that was not possible."""
        try:
            written = write_generator_target(self.run_dir, d.after, reason=f"autoscale: {d.reason}",
                                             expect=self.revision)
        except (OSError, TimeoutError) as e:
            self.warn(f"cannot write {self.run_dir}/generators.json ({e}); the decision at step {d.step} is not "
                      f"applied")
            written = None
        if written is not None:
            self.revision = written.revision
        return written is not None

    def read(self):
        try:
            return read_generator_target(self.run_dir)
        except (ValueError, OSError) as e:  # damaged by hand, or a shared filesystem hiccup: the next step retries
            self.warn(f"{e}; autoscaling keeps its count until it reads")
            return None

    def record(self, d: Decision) -> None:
        self.last = d
        try:
            with open(os.path.join(self.run_dir, LOG_FILE), "a") as f:
                f.write(json.dumps({"t": time.time(), **asdict(d)}) + "\n")
        except OSError as e:
            self.warn(f"cannot append to {self.run_dir}/{LOG_FILE} ({e}); decisions still go to TensorBoard")
        self.sink.text("cluster/autoscale", f"**{d.kind} {d.before} -> {d.after}**: {d.reason}", d.step)

    def warn(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            log.warning(message)


def read_decisions(run_dir: str) -> list[dict]:
    """RUN_DIR/autoscale.jsonl, oldest first (a torn last line is left out)."""
    try:
        with open(os.path.join(run_dir, LOG_FILE)) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]  # the last line of a writer killed while writing it
    return [json.loads(line) for line in lines]
