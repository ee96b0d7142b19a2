"""`covrl verify RUN_DIR`: every checkpoint of a run and its state, after a copy or before a resume.

    covrl verify RUN_DIR [--fast]
    covrl verify RUN_DIR/checkpoints/step_N [--fast]

Each checkpoint's files are checked against its manifest (common/checkpoint_dirs.py): present, at their size and,
unless --fast, with their CRC-32. States: good, damaged (the file and what is wrong with it), unverified (written
before covrl wrote manifests), incomplete (`step_N.tmp`: a write that never finished), set aside (a resume passed
it over and renamed it). The last line names the checkpoint a resume would start from (whether or not the run has steps left). Exit status: 0 when nothing
is damaged, 1 when one is (set-aside ones aside), 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import os
import sys

from common.checkpoint_dirs import (DAMAGED, DS_TAG, MANIFEST, STATE_FILE, checkpoint_step, set_aside_dirs, step_dirs,
                                    verify)
from common.cli import fail


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="covrl verify", description="Check a run's checkpoints against their manifests.")
    ap.add_argument("path", metavar="RUN_DIR", help="a run directory, or one checkpoint directory (checkpoints/step_N)")
    ap.add_argument("--fast", action="store_true", help="sizes only: do not read the files to compare checksums")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    path = os.path.abspath(args.path)
    if path.endswith(".tmp") and os.path.isdir(path):
        print(f"{path}: incomplete: a checkpoint write that never finished (no resume takes it)")
        return 1
    if (checkpoint_step(os.path.basename(path)) is not None  # one checkpoint, whatever it lost
            or any(os.path.exists(os.path.join(path, f)) for f in (STATE_FILE, MANIFEST, DS_TAG))):
        check = verify(path, checksums=not args.fast)  # one checkpoint directory, e.g. copied for evaluation
        print(f"{path}: {check.summary()}")
        for problem in check.problems[1:]:
            print(f"  also: {problem}")
        return 1 if check.state == DAMAGED else 0
    root = os.path.join(path, "checkpoints")
    if not os.path.isdir(root):
        return fail(f"{args.path}: neither a run directory with checkpoints/ nor a checkpoint directory "
                    f"(one holds {STATE_FILE}); give RUN_DIR or RUN_DIR/checkpoints/step_N")
    return report(path, root, not args.fast)


def report(run_dir: str, root: str, checksums: bool) -> int:
    found = step_dirs(run_dir)
    checks = [verify(p, checksums, s) for s, p in found]
    width = max([len(os.path.basename(p)) for p in os.listdir(root)] + [6])
    print(f"{root}:")
    for check in checks:
        print(f"  {check.name:<{width}}  {check.summary()}")
        for problem in check.problems[1:]:
            print(f"  {'':<{width}}  also: {problem}")
    for name in sorted(n for n in os.listdir(root) if n.endswith(".tmp")):
        print(f"  {name:<{width}}  incomplete: a checkpoint write that never finished (no resume takes it)")
    for path in set_aside_dirs(run_dir):
        print(f"  {os.path.basename(path):<{width}}  set aside by a resume: {verify(path, checksums).summary()}")
    if not found:
        print("  no checkpoint: a resume starts from step 0")
        return 0
    usable = [c for c in checks if c.state != DAMAGED]  # what `choose` takes: the newest of these
    if not usable:
        print("no checkpoint verifies: a resume cannot start (restore the damaged files from a copy)")
        return 1
    skipped = [c.name for c in checks if c.step > usable[-1].step]
    line = f"the checkpoint a resume takes: {usable[-1].name}"
    if skipped:
        line += f", passing over {', '.join(skipped)} (it sets them aside, renamed step_N.damaged)"
    print(line)
    return 1 if skipped or len(usable) < len(checks) else 0


if __name__ == "__main__":
    sys.exit(main())
