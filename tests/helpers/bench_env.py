"""The bench-only environment `.venv-bench` (TRL, for the peer comparisons): its interpreter and whether it works."""

from __future__ import annotations

import os
import subprocess

from tests.helpers.paths import REPO

BENCH_PY = os.path.join(REPO, ".venv-bench", "bin", "python")


def bench_env_problem() -> str | None:
    """Why `.venv-bench` cannot run the TRL side, with the fix; None when it can."""
    if not os.path.exists(BENCH_PY):
        return f"needs the bench-only environment {os.path.dirname(os.path.dirname(BENCH_PY))} with TRL; build it with `make bench-env`"
    p = subprocess.run([BENCH_PY, "-c", "import trl, transformers, math_verify"], capture_output=True, text=True)
    if p.returncode != 0:
        return f".venv-bench cannot import trl / transformers / math_verify ({p.stderr.strip().splitlines()[-1]}); rebuild it with `make bench-env`"
    return None
