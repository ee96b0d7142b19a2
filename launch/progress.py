"""The launcher's live progress line.

It reads RUN_DIR/progress.json (the learner's last trained step, a few of its metrics, the policy versions whose
evaluation is still running and the newest held-out accuracies; `common.metrics.MetricsWriter.progress`), and
shows

    step 25/100 | evaluating step 25 | reward 0.412 | entropy 0.381 | gen 812 tok/s | staleness 0.50 (max 1, bound 1)
    | 1.92 s/step | gens 2 (autoscale step 20: up 1->2) | elapsed 48s | ETA 2m24s | eval acc arith_easy 0.613 ...

On a terminal it is one line rewritten in place (cut to the terminal's width, the rest of the line cleared, so
nothing is left behind); when stdout is a file or a pipe, a plain line every `every_s` seconds instead.
The ETA is the mean time per step since this launch began, times the steps left.
"""

from __future__ import annotations

import shutil
import sys
import time

from common.metrics import read_progress


def clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(p: dict, steps: int, k: int, elapsed: float, eta: float | None, evals: dict[str, float]) -> str:
    parts = [f"step {p['step']}/{steps}"]
    if p.get("evaluating"):
        parts.append("evaluating step " + ", ".join(str(v) for v in p["evaluating"]))
    if "critic/score/mean" in p:
        parts += [f"reward {p['critic/score/mean']:.3f}", f"entropy {p.get('actor/entropy', 0):.3f}",
                  f"gen {p.get('perf/gen_tokens_per_s', 0):.0f} tok/s",
                  f"staleness {p.get('staleness/mean', 0):.2f} (max {p.get('staleness/max', 0):.0f}, bound {k})",
                  f"{p.get('timing_s/step', 0):.2f} s/step"]
    if "cluster/generators" in p:
        live, target = p["cluster/generators"], p.get("cluster/generators_target", p["cluster/generators"])
        parts.append(f"gens {live:.0f}" + (f" (target {target:.0f})" if target != live else "")
                     + (f" ({p['autoscale']})" if p.get("autoscale") else ""))
    parts.append(f"elapsed {clock(elapsed)}")
    if eta is not None:
        parts.append(f"ETA {clock(eta)}")
    if evals:
        parts.append("eval acc " + " ".join(f"{ds} {v:.3f}" for ds, v in sorted(evals.items())))
    return " | ".join(parts)


class Progress:
    def __init__(self, run_dir: str, steps: int, k: int, *, quiet: bool = False, every_s: float = 10.0,
                 stream=None):
        self.run_dir, self.steps, self.k, self.quiet, self.every_s = run_dir, steps, k, quiet, every_s
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.first: tuple[float, int] | None = None  # (time, step) of the first progress seen: the ETA's origin
        self.shown, self.last_print, self.open_line = "", float("-inf"), False

    def line(self) -> str | None:
        p = read_progress(self.run_dir)
        if p is None:
            return None
        now = time.monotonic()
        if self.first is None:
            self.first = (now, p["step"])
        t, s = self.first
        eta = (now - t) / (p["step"] - s) * (self.steps - p["step"]) if p["step"] > s else None
        return progress_line(p, self.steps, self.k, now - self.t0, eta, p.get("evals", {}))

    def update(self) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not self.tty and now - self.last_print < self.every_s:
            return
        line = self.line()
        if line is None:
            return
        if self.tty:
            width = shutil.get_terminal_size((200, 24)).columns - 1
            line = line[:width]
            if line != self.shown:
                self.stream.write("\r" + line + "\x1b[K")
                self.stream.flush()
                self.open_line = True
        else:
            self.stream.write(line + "\n")
            self.stream.flush()
        self.shown, self.last_print = line, now

    def interrupt(self) -> None:
        """Before another message: end the open progress line so the message starts on a line of its own."""
        if self.open_line:
            self.stream.write("\n")
            self.stream.flush()
            self.open_line, self.shown = False, ""

    def finish(self) -> None:
        """The last state as a final line (also off a terminal), then a clean line end."""
        if self.quiet:
            return
        self.last_print = float("-inf")
        if not self.tty and (line := self.line()) is not None and line != self.shown:
            self.stream.write(line + "\n")
        elif self.tty:
            self.update()
            self.interrupt()
        self.stream.flush()

