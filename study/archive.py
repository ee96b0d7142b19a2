"""Keep a finished study in the repository: each run's config and metrics, compressed, and the study's own files.

    python -m study.archive STUDY_DIR DEST

Copies STUDY_DIR/study.json and, for every run it names that is complete (a metrics row at its last step),
RUN/config.toml and RUN/metrics.jsonl as RUN/metrics.jsonl.xz (common.metrics.read_metrics reads either),
into DEST; checkpoints, rollouts, logs and TensorBoard files stay behind. The archived metrics keep every key but
the machine's clocks (`timing_s/*`, `perf/*`: seconds and tokens/s of a shared 2-core machine running two studies'
runs at once, a fifth of the compressed bytes, and no study reads them; study.json keeps each run's wall clock),
every kept value exactly as logged. Run it again as runs finish: it rewrites
what changed. `covrl study --report-only --study-dir DEST` then rebuilds the report from DEST alone.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import sys

from common.metrics import CLOCK_KEYS, read_metrics


def complete(run_dir: str, steps: int) -> bool:
    return any(r.get("step") == steps for r in read_metrics(run_dir))


def archive_run(src: str, dest: str) -> None:
    """RUN/config.toml and RUN/metrics.jsonl (as .xz, without the CLOCK_KEYS) from src into dest."""
    os.makedirs(dest, exist_ok=True)
    shutil.copyfile(os.path.join(src, "config.toml"), os.path.join(dest, "config.toml"))
    with lzma.open(os.path.join(dest, "metrics.jsonl.xz"), "wt", preset=9, encoding="utf-8") as out:
        for row in read_metrics(src):
            kept = {k: v for k, v in row.items() if not k.startswith(CLOCK_KEYS)}
            out.write(json.dumps(kept, separators=(",", ":"), allow_nan=False) + "\n")


def archive(study_dir: str, dest: str) -> list[str]:
    """Archive every complete run of the study; returns their names."""
    with open(os.path.join(study_dir, "study.json")) as f:
        meta = json.load(f)
    steps = meta.get("run_steps", {})  # every run any invocation asked for, with its length; else the study's
    names = list(steps) or meta.get("runs", meta.get("methods", []))
    done = [name for name in names if complete(os.path.join(study_dir, name), steps.get(name, meta["steps"]))]
    for name in done:
        archive_run(os.path.join(study_dir, name), os.path.join(dest, name))
    os.makedirs(dest, exist_ok=True)
    shutil.copyfile(os.path.join(study_dir, "study.json"), os.path.join(dest, "study.json"))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.archive", description=__doc__.split("\n")[0])
    ap.add_argument("study_dir")
    ap.add_argument("dest")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.study_dir, "study.json")):
        print(f"study.archive: error: {args.study_dir} has no study.json; pass a study directory (covrl study "
              f"--study-dir)", file=sys.stderr)
        return 2
    done = archive(args.study_dir, args.dest)
    print(f"study.archive: {len(done)} complete run(s) into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
