"""What a finished (or stopped) run prints: its summary from RUN_DIR/metrics.jsonl and where its plots are."""

from __future__ import annotations

import os
import sys

from common.checkpoint_dirs import complete_checkpoints
from common.metrics import read_metrics


def summary(run_dir: str, cfg, elapsed: float, resume_flags: str = "") -> str:
    """The run in a few lines: steps, reward and entropy first quarter to last, held-out accuracy, staleness, where
    its files are; `resume_flags` (e.g. " --ray"): what the resume command it prints needs besides RUN_DIR."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("critic/score/mean") is not None]
    if not train:
        return f"no steps recorded in {run_dir}/metrics.jsonl"
    q = max(1, len(train) // 4)
    avg = lambda rs, k: sum(r.get(k) or 0.0 for r in rs) / len(rs)  # noqa: E731
    last = complete_checkpoints(run_dir)
    lines = [
        f"covrl: {len(train)} steps in {elapsed:.0f}s -> {run_dir}",
        f"  reward (critic/score/mean): first quarter {avg(train[:q], 'critic/score/mean'):.3f} -> last quarter {avg(train[-q:], 'critic/score/mean'):.3f}",
        f"  entropy (actor/entropy):    first quarter {avg(train[:q], 'actor/entropy'):.3f} -> last quarter {avg(train[-q:], 'actor/entropy'):.3f}",
    ]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    sources = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.endswith("/acc")})
    for ds in sources:
        pts = [r for r in evals if r.get(f"eval/{ds}/acc") is not None]
        first, end = pts[0], pts[-1]
        lines.append(f"  eval {ds}: acc (avg@{cfg.eval.k}) {first[f'eval/{ds}/acc']:.3f} at step {first['step']} -> "
                     f"{end[f'eval/{ds}/acc']:.3f} at step {end['step']}; pass@k {first[f'eval/{ds}/pass@k']:.3f} -> "
                     f"{end[f'eval/{ds}/pass@k']:.3f}")
    lines += [
        f"  staleness max {max(r.get('staleness/max') or 0 for r in train):.0f} (bound {cfg.rollout.max_staleness_steps})",
        f"  metrics: {run_dir}/metrics.jsonl  tensorboard: {run_dir}/tb",
        f"  checkpoint: {last[-1][1] if last else 'none'}" + (f" (continue with covrl resume {run_dir}{resume_flags})" if last and
                                                               last[-1][0] < cfg.run.steps else ""),
    ]
    return "\n".join(lines)


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
