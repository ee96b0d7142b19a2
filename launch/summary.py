"""What a finished (or stopped) run prints: its summary from RUN_DIR/metrics.jsonl and where its plots are."""

from __future__ import annotations

import os
import sys

from common.checkpoint_dirs import CheckpointError, choose, earlier_usable, read_load_failure
from common.metrics import read_metrics, read_progress


def summary(run_dir: str, cfg, elapsed: float, resume_flags: str = "", start: int = 0) -> str:
    """The launch in a few lines: the steps it trained (from `start`, the checkpoint it resumed from, to the step
    progress.json last recorded: prepare_resume removes the dead run's), reward and entropy first quarter to last,
    held-out accuracy, staleness, where its files are, and the command that continues the run when one can.
    `resume_flags` (e.g. " --ray"): what that command needs besides RUN_DIR."""
    progress = read_progress(run_dir)
    end = progress["step"] if progress else start
    # Rows past `end` are an earlier launch's, after the checkpoint this one resumed from: its learner had not
    # purged them yet. They are not this run's history.
    rows = [r for r in read_metrics(run_dir) if r["step"] <= end]
    train = [r for r in rows if r.get("critic/score/mean") is not None]
    trained = (f"{end - start} steps in this launch (steps {start + 1}-{end}) in {elapsed:.0f}s" if end > start else
               f"no step trained in this launch ({elapsed:.0f}s)")
    lines = [f"covrl: {trained}; the run is at step {end} of {cfg.run.steps} -> {run_dir}"]
    if train:
        q = max(1, len(train) // 4)
        avg = lambda rs, k: sum(r.get(k) or 0.0 for r in rs) / len(rs)  # noqa: E731
        lines += [f"  reward (critic/score/mean): first quarter {avg(train[:q], 'critic/score/mean'):.3f} -> last "
                  f"quarter {avg(train[-q:], 'critic/score/mean'):.3f}",
                  f"  entropy (actor/entropy):    first quarter {avg(train[:q], 'actor/entropy'):.3f} -> last quarter "
                  f"{avg(train[-q:], 'actor/entropy'):.3f}"]
        lines += eval_lines(rows, cfg)
        lines.append(f"  staleness max {max(r.get('staleness/max') or 0 for r in train):.0f} "
                     f"(bound {cfg.rollout.max_staleness_steps})")
    lines.append(f"  metrics: {run_dir}/metrics.jsonl  tensorboard: {run_dir}/tb")
    lines.append("  " + checkpoint_line(run_dir, cfg, resume_flags))
    return "\n".join(lines)


def eval_lines(rows: list[dict], cfg) -> list[str]:
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    sources = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.endswith("/acc")})
    lines = []
    for ds in sources:
        pts = [r for r in evals if r.get(f"eval/{ds}/acc") is not None]
        first, end = pts[0], pts[-1]
        lines.append(f"  eval {ds}: acc (avg@{cfg.eval.k}) {first[f'eval/{ds}/acc']:.3f} at step {first['step']} -> "
                     f"{end[f'eval/{ds}/acc']:.3f} at step {end['step']}; pass@k {first[f'eval/{ds}/pass@k']:.3f} -> "
                     f"{end[f'eval/{ds}/pass@k']:.3f}")
    return lines


def checkpoint_line(run_dir: str, cfg, flags: str) -> str:
    """The checkpoint a resume would take (sizes checked against its manifest) and whether resuming can help: no
    "continue with" when none verifies, or when a learner of this launch could not load that very one
    (RUN_DIR/load_failed.json, learner/checkpoint.py)."""
    try:
        choice = choose(run_dir, checksums=False)
    except CheckpointError:
        return f"checkpoint: none verifies, so a resume cannot start; `covrl verify {run_dir}` says what is damaged"
    if choice is None:
        return "checkpoint: none"
    line = f"checkpoint: {choice.path}"
    if choice.skipped:
        line += f" (newer, damaged: {', '.join(c.name for c in choice.skipped)})"
    if choice.step >= cfg.run.steps:
        return line
    if read_load_failure(run_dir).get("checkpoint") in (choice.check.name, "?"):
        earlier = earlier_usable(run_dir, choice.step)
        other = (f"; or resume from an earlier one: covrl resume {run_dir}{flags} --from step_{earlier}"
                 if earlier is not None else "")
        return (line + f"; this launch could not load it: resuming from it fails the same way until the cause "
                       f"above is fixed{other}")
    return line + f" (continue with covrl resume {run_dir}{flags})"


def print_plots(run_dir: str) -> None:
    """Draw the run's plots and say where they are; a picture must not cost the user the summary or the exit
    status, so a failure is one line on stderr."""
    if not read_metrics(run_dir):
        return
    try:
        from study.plots import run_plots

        print(f"  plots: {os.path.dirname(run_plots(run_dir)[0])}/ (reward, entropy, response length, "
              f"held-out accuracy vs step; accuracy vs entropy with the law's fit)")
    except Exception as e:
        print(f"  plots could not be drawn ({type(e).__name__}: {e}); `covrl plots {run_dir}` draws them "
              f"later", file=sys.stderr)
