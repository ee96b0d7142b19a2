"""Fit R = -a exp(H) + b on a run: `python launch/fit_law.py RUN_DIR [--reward KEY] [--entropy KEY]`.

Reads RUN_DIR/metrics.jsonl, prints a, b, R^2, the ceiling b - a and the early-prediction check
(fit on the first 15 % of steps, RMSE on the rest), and writes RUN_DIR/law_fit.json.
R defaults to the training reward (critic/score/mean) until in-training evaluation exists;
pass --reward eval/<data_source>/acc to fit on held-out accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.lawfit import early_prediction, fit_law  # noqa: E402
from common.metrics import read_metrics  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python launch/fit_law.py")
    ap.add_argument("run_dir")
    ap.add_argument("--reward", default="critic/score/mean")
    ap.add_argument("--entropy", default="actor/entropy")
    args = ap.parse_args(argv)
    rows = [r for r in read_metrics(args.run_dir) if r.get(args.reward) is not None and r.get(args.entropy) is not None]
    if len(rows) < 3:
        print(f"error: {args.run_dir}/metrics.jsonl has {len(rows)} steps with both {args.reward} and {args.entropy}; "
              f"need at least 3", file=sys.stderr)
        return 2
    H = [r[args.entropy] for r in rows]
    R = [r[args.reward] for r in rows]
    fit = fit_law(H, R)
    early, rmse = early_prediction(H, R)
    out = {"reward_key": args.reward, "entropy_key": args.entropy, "a": fit.a, "b": fit.b, "r2": fit.r2,
           "ceiling": fit.ceiling, "points": fit.n, "early_fit": {"a": early.a, "b": early.b, "points": early.n},
           "early_rmse_on_rest": rmse}
    with open(os.path.join(args.run_dir, "law_fit.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"R = -{fit.a:.4f} exp(H) + {fit.b:.4f}   R^2 {fit.r2:.3f}   ceiling (H=0) {fit.ceiling:.4f}   "
          f"({fit.n} steps; {args.reward} on {args.entropy})")
    print(f"early prediction: fit on the first {early.n} steps, RMSE {rmse:.4f} on the other {fit.n - early.n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
