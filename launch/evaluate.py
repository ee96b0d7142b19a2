"""Evaluate a model directory on held-out sets: avg@k and pass@k per data source.

    covrl eval --model DIR [--config FILE] [--set key=value ...] [--data FILE ...] [--out FILE]

Runs `python -m actors.eval_model` (a generator's engine and scoring, in its own process: launch/
starts roles, it does not import them) with the same arguments. For the same model, data, config
and seed the numbers equal those the in-training evaluation logged: pass the run's config
(`--config RUN_DIR/config.toml`) to evaluate a checkpoint exactly as training did.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.call([sys.executable, "-m", "actors.eval_model", *argv], env=env)  # paths stay relative to the caller


if __name__ == "__main__":
    sys.exit(main())
