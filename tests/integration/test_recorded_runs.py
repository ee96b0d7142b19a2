"""Deterministic runs against their recorded metrics: a refactor that changes a number fails here.

Each `recorded/NAME.toml` is a run config; `recorded/PLATFORM/NAME.jsonl` holds the metrics rows that config
wrote (wall-clock keys removed) on one kind of CPU, described in `recorded/meta.json` (torch's vector instruction
set and the CPU vendor). A run today must write the same rows, to the bit, as a recording made on its kind of CPU.
Kinds differ: the same torch build on an AMD and an Intel AVX512 CPU takes different BLAS kernels, which differ in
the last bits, and the runs' discrete choices (Clip-Cov's token selection, the top-entropy tokens, dynamic
sampling) turn those bits into different trajectories within a step or two. Without a recording of its kind, the
test allows a relative 1e-4 and says so.

Record this machine's kind (it keeps the other kinds' recordings: use it when the code has not changed the
numbers, e.g. after checking that a commit known to match the recordings writes the same rows here):
    .venv/bin/python -m tests.integration.test_recorded_runs
After a change that is meant to change the numbers, re-record with `--only-this-cpu` (the other kinds'
recordings no longer describe the code and are removed) and say so in the commit.
"""

from __future__ import annotations

import json
import math
import os
import shutil
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


def vendor() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), None)
    except OSError:
        return None


def platform() -> str:
    return f"{(vendor() or 'unknown').lower()}-{capability().lower()}"


def recordings(meta: dict) -> dict[str, dict]:
    """The recordings made on this kind of CPU (same instruction set; same vendor, or a vendor not recorded)."""
    return {p: m for p, m in meta["platforms"].items()
            if m["cpu_capability"] == capability() and m.get("vendor") in (None, vendor())}


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
    mine = recordings(meta)
    rel = 0.0 if mine else 1e-4
    got = run_case(name, str(tmp_path / name))
    report = []
    for p in mine or meta["platforms"]:
        with open(os.path.join(HERE, p, f"{name}.jsonl")) as f:
            want = [json.loads(line) for line in f]
        diff = differences(want, got, rel)
        if not diff:
            return
        report.append(f"against {p} ({meta['platforms'][p]}):\n" + "\n".join(diff[:40]))
    pytest.fail(f"{name} (rel {rel}; this CPU: {vendor()} {capability()}):\n" + "\n".join(report))


def record(only_this_cpu: bool) -> None:
    path = os.path.join(HERE, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    if only_this_cpu:
        for p in meta["platforms"]:
            shutil.rmtree(os.path.join(HERE, p))
        meta["platforms"] = {}
    out = os.path.join(HERE, platform())
    os.makedirs(out, exist_ok=True)
    for name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_case(name, os.path.join(tmp, name))
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        print(f"recorded {name}: {len(rows)} rows in {out}")
    meta["platforms"][platform()] = {"cpu_capability": capability(), "vendor": vendor(), "torch": torch.__version__}
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(record(only_this_cpu="--only-this-cpu" in sys.argv[1:]))
