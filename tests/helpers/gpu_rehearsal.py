"""`rehearse`: stages of `make gpu-proof` (hardware/proof.py) run on the CPU at toy scale, and their common checks."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.paths import REPO


def rehearse(tmp_path, stages: str, extra: tuple = ()) -> tuple[dict, str]:
    """`make gpu-proof`'s stages as it runs them on a GPU machine (a module, from the repository root), on the CPU:
    (gpu_proof.json, stdout). The rehearsal is split for time: the throughput workers and the ZeRO-3 run are
    rehearsed by `make bench` (tests/bench/test_bench_gpu_rehearsal.py)."""
    out = subprocess.run([sys.executable, "-m", "hardware.proof", "--rehearse-cpu", "--stages", stages,
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    doc = json.loads((tmp_path / "out" / "gpu_proof.json").read_text())
    assert all(st["git_commit"] == doc["git_commit"] and st["date"] >= doc["date"] for st in doc["stages"].values())
    assert "ALL PASSED" in out.stdout
    return doc, out.stdout
