"""Deterministic runs against their recorded metrics: a refactor that changes a number fails here.

Each `recorded/NAME.toml` is a run config; `recorded/NAME.jsonl` holds the metrics rows that config wrote
(wall-clock keys removed) when it was recorded. A run today must write the same rows, to the bit, on a CPU
with the vector instruction set of the recording (`recorded/meta.json`). On another instruction set the
float kernels differ in their last bits, so there the test allows a relative 1e-4 and says so.

Re-record only for a change that is meant to change the numbers, and say so in the commit:
    .venv/bin/python -m tests.integration.test_recorded_runs
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import pytest
import torch

from common.metrics import read_metrics
from tests.integration.test_cluster import VOLATILE, launch

pytestmark = pytest.mark.slow

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded")
CASES = sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".toml"))
ARGS = ["--gens", "1", "--learners", "2"]


def run_case(name: str, run_dir: str) -> list[dict]:
    launch(run_dir, *ARGS, "--config", os.path.join(HERE, f"{name}.toml"))
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(run_dir)]


def capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def differences(want: list[dict], got: list[dict], rel: float) -> list[str]:
    if [r["step"] for r in want] != [r["step"] for r in got]:
        return [f"steps {[r['step'] for r in got]}, recorded {[r['step'] for r in want]}"]
    out = []
    for w, g in zip(want, got):
        if set(w) != set(g):
            out.append(f"step {w['step']}: keys {sorted(set(w) ^ set(g))} only on one side")
        for k in sorted(set(w) & set(g)):  # the shared keys are compared whatever the mismatch above
            a, b = w[k], g[k]
            same = a == b or (a != a and b != b) or (rel > 0 and math.isclose(a, b, rel_tol=rel, abs_tol=1e-9))
            if not same:
                out.append(f"step {w['step']} {k}: {g[k]!r}, recorded {w[k]!r}")
    return out


@pytest.mark.parametrize("name", CASES)
def test_metrics_equal_the_recorded_run(name, tmp_path):
    with open(os.path.join(HERE, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(HERE, f"{name}.jsonl")) as f:
        want = [json.loads(line) for line in f]
    got = run_case(name, str(tmp_path / name))
    rel = 0.0 if capability() == meta["cpu_capability"] else 1e-4
    diff = differences(want, got, rel)
    assert not diff, f"{name} (rel {rel}, recorded on {meta['cpu_capability']}, this CPU {capability()}):\n" + \
        "\n".join(diff[:40])


def record() -> None:
    for name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_case(name, os.path.join(tmp, name))
        with open(os.path.join(HERE, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        print(f"recorded {name}: {len(rows)} rows")
    with open(os.path.join(HERE, "meta.json"), "w") as f:
        json.dump({"cpu_capability": capability(), "torch": torch.__version__}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(record())
