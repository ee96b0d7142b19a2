"""Shared helpers for `make bench`: timing, peak memory in a fresh process, results.json."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best_of(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Minimum wall time of `repeats` calls: the least noisy estimate on a shared machine."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_measured(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line. Adds the process's peak RSS (MiB)."""
    wrapper = code + "\nimport resource, json as _j\nprint('__RSS__', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    p = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else 'killed'}"}
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("__RSS__"):
            out["peak_rss_mib"] = float(line.split()[1])
        elif line.startswith("{"):
            out.update(json.loads(line))
    return out


def record(section: str, data: dict) -> None:
    results = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
    results["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
    results[section] = {"date": datetime.date.today().isoformat(), **data}
    with open(RESULTS + ".tmp", "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(RESULTS + ".tmp", RESULTS)


def verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


_ = resource  # imported for children that exec this module's helpers

