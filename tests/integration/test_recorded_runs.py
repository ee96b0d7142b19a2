"""Deterministic runs against their recorded metrics: a refactor that changes a number fails here, on any x86-64 CPU.

Each `recorded/NAME.toml` is a run config; `recorded/rows/NAME.jsonl` holds the metrics rows it wrote (wall-clock
keys removed). Left to themselves, the CPU libraries pick their kernels by the CPU they find (torch's vector code
by instruction set, MKL's BLAS by instruction set and vendor, oneDNN by ISA, glibc's libm and numpy by features),
the last bits differ, and the runs' discrete choices (Clip-Cov's token selection, the top-entropy tokens, dynamic
sampling, a near-tied sampled token) turn those bits into different trajectories within a step. So the recorded
runs, and their recordings, run under PINNED: torch's portable scalar kernels, MKL's conditional numerical
reproducibility in its compatible, strict mode (the same code path and results on every x86-64 CPU, whatever the
thread count), oneDNN held to SSE4.1. With those, the rows are the same bits on every kind of CPU; `meta.json`
lists the kinds and emulated kinds they were checked on (`verified`).

Re-record after a change that is meant to change the numbers, and say so in the commit:
    .venv/bin/python -m tests.integration.test_recorded_runs
Check this machine (and, with the emulation settings of docs/testing.md in the environment, an emulated kind)
against the recording, adding it to `verified` when the rows are equal:
    .venv/bin/python -m tests.integration.test_recorded_runs --verify [--emulating "WHAT"]
The pinning does not reach everything: on a 2-core Intel Xeon with AVX-512 (2026-12-07) both cases part from the
recording (made on an AMD EPYC with AVX2) in the first step's update, in the last bits, with every setting of
docs/testing.md's emulation as well; the leak is not found. Such a kind's rows are kept beside the recording
(`recorded/rows/kinds/KIND/`, `meta.json` "kinds"), and a run passes when it equals one recording to the bit, so a
change to the numbers still fails on every kind recorded. Add this machine's kind (after a change meant to change
the numbers, re-record every kind on its own machine, or drop the kinds you cannot):
    .venv/bin/python -m tests.integration.test_recorded_runs --add-kind
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import tempfile

import pytest
import torch

from common.metrics import read_metrics
from tests.helpers.runs import VOLATILE, launch

pytestmark = pytest.mark.slow

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded")
ROWS = os.path.join(HERE, "rows")
CASES = sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".toml"))
ARGS = ["--gens", "1", "--learners", "2"]
# The same kernels on every x86-64 CPU: set for the launcher, so for every role it starts (they inherit it).
PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def run_case(name: str, run_dir: str) -> list[dict]:
    launch(run_dir, *ARGS, "--config", os.path.join(HERE, f"{name}.toml"), env=PINNED)
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(run_dir)]


KINDS = os.path.join(ROWS, "kinds")  # KINDS/<kind>/NAME.jsonl: the rows of a kind of CPU the pinning does not reach


def recorded(name: str, kind: str | None = None) -> list[dict]:
    with open(os.path.join(ROWS, f"{name}.jsonl") if kind is None else os.path.join(KINDS, kind, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f]


def recordings(name: str) -> dict[str | None, list[dict]]:
    """The main recording (None) and each recorded kind's rows of case `name`."""
    kinds = sorted(os.listdir(KINDS)) if os.path.isdir(KINDS) else []
    return {None: recorded(name), **{k: recorded(name, k) for k in kinds
                                     if os.path.exists(os.path.join(KINDS, k, f"{name}.jsonl"))}}


def kind_slug() -> str:
    return cpu_kind().replace(" ", "_")


def cpu_kind() -> str:
    """This CPU: its vendor and the instruction set torch takes in this process (PINNED is set for the runs only)."""
    vendor = "unknown vendor"
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def differences(want: list[dict], got: list[dict]) -> list[str]:
    """Every difference between two runs' rows, to the bit (NaN equals NaN)."""
    if [r["step"] for r in want] != [r["step"] for r in got]:
        return [f"steps {[r['step'] for r in got]}, recorded {[r['step'] for r in want]}"]
    out = []
    for w, g in zip(want, got):
        if set(w) != set(g):
            out.append(f"step {w['step']}: keys {sorted(set(w) ^ set(g))} only on one side")
        for k in sorted(set(w) & set(g)):  # the shared keys are compared whatever the mismatch above
            a, b = w[k], g[k]
            if not (a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))):
                out.append(f"step {w['step']} {k}: {g[k]!r}, recorded {w[k]!r}")
    return out


CHECK = "clip_cov_high_entropy"  # `make check`'s end-to-end run: 3 steps, 2 ranks, every number to the bit


@pytest.mark.parametrize("name", [pytest.param(c, marks=[pytest.mark.check] if c == CHECK else []) for c in CASES])
def test_metrics_equal_the_recorded_run(name, tmp_path):
    with open(os.path.join(HERE, "meta.json")) as f:
        meta = json.load(f)
    assert meta["env"] == PINNED, "the recording was made under other settings: re-record (see this module's doc)"
    rows = run_case(name, str(tmp_path / name))
    diffs = {kind: differences(want, rows) for kind, want in recordings(name).items()}
    if all(diffs.values()):  # equal to no recording, to the bit
        checked = "; ".join(f"{v['cpu']} ({v['emulating']})" for v in meta["verified"])
        kinds = ", ".join(k for k in diffs if k) or "none"
        diff = diffs[None]
        pytest.fail(f"{name}: the run's metrics differ from the recording ({len(diff)} values; this CPU: {cpu_kind()}; "
                    f"the recording holds on: {checked}; other kinds' recordings: {kinds}, none equal either):\n"
                    + "\n".join(diff[:40]))


def main(argv: list[str]) -> int:
    path = os.path.join(HERE, "meta.json")
    verify = "--verify" in argv
    emulating = argv[argv.index("--emulating") + 1] if "--emulating" in argv else "native"
    with open(path) as f:
        meta = json.load(f)
    if "--add-kind" in argv:
        return add_kind(meta, path)
    if not verify:
        meta = {"env": PINNED, "torch": torch.__version__, "verified": []}
    os.makedirs(ROWS, exist_ok=True)
    for name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_case(name, os.path.join(tmp, name))
        if verify:
            if diff := differences(recorded(name), rows):
                print(f"{name}: differs from the recording here ({cpu_kind()}, {emulating}):\n" + "\n".join(diff[:20]))
                return 1
            print(f"{name}: equal to the recording, {len(rows)} rows")
        else:
            with open(os.path.join(ROWS, f"{name}.jsonl"), "w") as f:
                f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
            print(f"recorded {name}: {len(rows)} rows")
    meta["verified"].append({"cpu": cpu_kind(), "emulating": emulating, "torch": torch.__version__,
                             "date": datetime.date.today().isoformat()})
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return 0


def add_kind(meta: dict, path: str) -> int:
    """`--add-kind`: this CPU's rows beside the main recording, for a kind of CPU whose runs the pinning does not make
    equal to it (the test then takes either). Refused where the rows equal a recording already."""
    got = {}
    for name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            got[name] = run_case(name, os.path.join(tmp, name))
        if any(not differences(want, got[name]) for want in recordings(name).values()):
            print(f"{name}: equal to a recording already here ({cpu_kind()}); nothing added")
            return 1
    os.makedirs(os.path.join(KINDS, kind_slug()), exist_ok=True)
    for name, rows in got.items():
        with open(os.path.join(KINDS, kind_slug(), f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        print(f"recorded {name} for {cpu_kind()}: {len(rows)} rows")
    meta.setdefault("kinds", {})[kind_slug()] = {"cpu": cpu_kind(), "torch": torch.__version__,
                                                 "date": datetime.date.today().isoformat()}
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
