"""Fit R = -a exp(H) + b on a run: `covrl fit-law RUN_DIR [--on eval|train] [--plot PATH]`.

Reads RUN_DIR/metrics.jsonl, prints the fitted law, R^2, the ceiling b - a and the early-prediction check
(fit on the first 15 % of points: its prediction of the last point with a 95 % prediction interval, and its
RMSE on the rest; a warning when it rests on fewer than 5 points), writes RUN_DIR/law_fit_<source>.json and a
plot of the points with the fitted curve (default RUN_DIR/law_fit_<source>.png), one pair per point source.

Two point sources:
- eval: held-out accuracy of each evaluated policy version (mean over data sources of
  eval/<ds>/acc) paired with that version's entropy (see study.lawfit.eval_points). This is the
  paper's law. Default when the run has at least 3 such points.
- train: a per-step reward key (default critic/score/mean) paired with an entropy key of the same
  row (default actor/entropy); `--reward` / `--entropy` choose the keys. Used otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.cli import fail
from study.lawfit import FEW_EARLY_POINTS, early_prediction, eval_points, fit_law, prediction_interval, train_points
from study.lawfit import MIN_FIT_POINTS as MIN_POINTS
from common.metrics import read_metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="covrl fit-law")
    ap.add_argument("run_dir")
    ap.add_argument("--on", choices=["train", "eval"],
                    help=f"point source (default: eval if the run has >= {MIN_POINTS} eval points, else train)")
    ap.add_argument("--reward", help="train mode: reward key (default critic/score/mean)")
    ap.add_argument("--entropy", help="train mode: entropy key (default actor/entropy)")
    ap.add_argument("--plot", help="PNG path for the points and fitted curve (default RUN_DIR/law_fit_<source>.png)")
    args = ap.parse_args(argv)
    keys_given = args.reward is not None or args.entropy is not None
    if args.on == "eval" and keys_given:
        return fail("--reward/--entropy choose the keys of --on train; eval points always pair the mean "
                    "eval/<ds>/acc with the evaluated version's actor/entropy. Drop them or use --on train.")
    if not os.path.isfile(os.path.join(args.run_dir, "metrics.jsonl")):
        return fail(f"{args.run_dir} has no metrics.jsonl, so it is not a covrl run directory; give a RUN_DIR")
    rows = read_metrics(args.run_dir)
    reward_key, entropy_key = args.reward or "critic/score/mean", args.entropy or "actor/entropy"
    ev = eval_points(rows)
    source = args.on or ("train" if keys_given or len(ev) < MIN_POINTS else "eval")
    if source == "eval":
        points = ev
        reward_desc, entropy_desc = "mean eval/<ds>/acc", "entropy of the evaluated version"
    else:
        points = train_points(rows, reward_key, entropy_key)
        reward_desc, entropy_desc = reward_key, entropy_key
    if len(points) < MIN_POINTS:
        hint = ("; run with eval.every_steps set, or use --on train" if source == "eval"
                else "; check the keys with --reward/--entropy")
        return fail(f"{args.run_dir}/metrics.jsonl gives {len(points)} {source} points ({reward_desc} on "
                    f"{entropy_desc}); need at least {MIN_POINTS}{hint}")
    steps, H, R = (list(c) for c in zip(*points))
    try:
        fit = fit_law(H, R)
        early, rmse = early_prediction(H, R)
    except ValueError as e:
        return fail(e)
    half = prediction_interval(H[:early.n], R[:early.n], early, H[-1])
    plot_path = args.plot or os.path.join(args.run_dir, f"law_fit_{source}.png")
    from study.plots import plot_law_fit  # matplotlib only once there is something to draw

    out = {"source": source, "reward_key": reward_desc, "entropy_key": entropy_desc, "steps": steps,
           "a": fit.a, "b": fit.b, "r2": fit.r2, "ceiling": fit.ceiling, "points": fit.n,
           "early_fit": {"a": early.a, "b": early.b, "points": early.n}, "early_rmse_on_rest": rmse,
           "early_prediction": {"step": steps[-1], "predicted": early.predict(H[-1]), "measured": R[-1],
                                "interval_95": half},
           "plot": plot_path}
    try:
        plot_law_fit({f"{source} points": list(zip(H, R))}, {f"{source} points": fit}, plot_path,
                     ylabel=reward_desc, title=f"{os.path.basename(os.path.abspath(args.run_dir))}: R = -a exp(H) + b")
        with open(os.path.join(args.run_dir, f"law_fit_{source}.json"), "w") as f:
            json.dump(out, f, indent=1)
    except OSError as e:
        return fail(f"cannot write the fit's files ({e.strerror}: {e.filename}); pass a writable --plot, or fit a "
                    f"copy of the run directory")
    why = "chosen with --on" if args.on else ("default: the run has eval points" if source == "eval"
                                              else f"default: fewer than {MIN_POINTS} eval points" if not keys_given
                                              else "--reward/--entropy given")
    print(f"fitting on {source} points ({why})")
    print(f"{fit.formula()}   R^2 {fit.r2:.3f}   ceiling (H=0) {fit.ceiling:.4f}   "
          f"({fit.n} points; {reward_desc} on {entropy_desc})")
    band = f" ± {half:.4f} (95 %)" if half is not None else " (no interval: a line through 2 points has no error estimate)"
    print(f"early prediction: fit on the first {early.n} points predicts {early.predict(H[-1]):.4f}{band} at step "
          f"{steps[-1]} (measured {R[-1]:.4f}); RMSE {rmse:.4f} on the other {fit.n - early.n}")
    if early.n < FEW_EARLY_POINTS:
        print(f"warning: the early prediction rests on {early.n} points (15 % of {fit.n}); read it as a rough hint, not a "
              f"check of the law. More points: evaluate more often (eval.every_steps) or train longer", file=sys.stderr)
    print(f"fit: {os.path.join(args.run_dir, f'law_fit_{source}.json')}  plot: {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
