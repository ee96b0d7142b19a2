"""`covrl scale RUN_DIR --gens N`: change the generator count of a running run.

Writes RUN_DIR/generators.json (`common.runfiles.GeneratorTarget`), which the run's launcher and hub follow, with
or without Ray:
- more generators: the launcher starts the missing ids; each joins the hub, is sent the latest weights and gets
  work like any other;
- fewer: the hub drains the ids >= N (no new work; what they hold is generated, scored and trained as usual),
  then stops them, and the launcher lets them go. Nothing is lost, and admission keeps the staleness bound.
The change shows in the metrics (`cluster/generators`) and in the launcher's progress line. `--wait` blocks
until the metrics show N live generators.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common.runfiles import read_cluster, read_generator_target, read_run_config, write_generator_target
from common.metrics import read_metrics


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="covrl scale", description="Change the number of generators of a running run.")
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (as given to covrl run --run-dir)")
    ap.add_argument("--gens", type=int, required=True, metavar="N", help="generators the run should have (>= 1)")
    ap.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to SECONDS for a metrics row that shows N live generators")
    return ap.parse_args(argv)


def live_generators(run_dir: str) -> int | None:
    rows = [r for r in read_metrics(run_dir) if r.get("cluster/generators") is not None]
    return int(rows[-1]["cluster/generators"]) if rows else None


def autoscale_bounds(run_dir: str) -> tuple[int, int] | None:
    """The run's cluster.autoscale (min, max), or None when it is off or its config cannot be read."""
    try:
        a = read_run_config(run_dir).cluster.autoscale
    except (OSError, ValueError):
        return None
    return (a.min, a.max) if a.max else None


def main(argv=None) -> int:
    args = parse_args(argv)
    run_dir = os.path.abspath(args.run_dir)
    try:
        info = read_cluster(run_dir)
    except FileNotFoundError:
        print(f"error: {run_dir} is not a covrl run directory (no cluster.json); give the --run-dir of a running run",
              file=sys.stderr)
        return 2
    if args.gens < 1:
        print(f"error: --gens {args.gens}: a run needs at least one generator", file=sys.stderr)
        return 2
    try:
        old = read_generator_target(run_dir)
        before = old.generators if old else info.generators
    except ValueError as e:
        print(f"warning: {e}; replacing it", file=sys.stderr)
        before = "?"
    target = write_generator_target(run_dir, args.gens)
    print(f"{run_dir}: generators {before} -> {target.generators} (request {target.revision}); "
          f"the launcher and the hub follow within a few seconds")
    if (bounds := autoscale_bounds(run_dir)) is not None:
        print(f"the run autoscales between {bounds[0]} and {bounds[1]} generators: it goes on from {args.gens} and may "
              f"change it again ({run_dir}/autoscale.jsonl says when and why)")
    if args.wait <= 0:
        return 0
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        if live_generators(run_dir) == args.gens:
            print(f"the metrics show {args.gens} live generator(s)")
            return 0
        time.sleep(0.5)
    print(f"error: after {args.wait:.0f}s the metrics show {live_generators(run_dir)} live generator(s), not "
          f"{args.gens}; see {run_dir}/logs", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
