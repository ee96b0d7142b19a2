"""Clocked runs for the pipeline benchmarks: covrl's steps as their metrics rows land, and the synchronous loop's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from common.metrics import read_metrics
from common.transport import free_port
from tests.helpers.paths import REPO

# The roles and the reference loop run in their own interpreters; this process only times them.

SAMPLES_PER_STEP = 16 * 8  # rollout.groups_per_step x rollout.group_size (defaults)
SETTINGS = ["eval.every_steps=0", "learner.filter.dynamic_sampling=false"]

# The reference loop, unchanged, with clocks around its three acts (its module globals are swapped for timed ones).
SYNC_DRIVER = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import tests.integration.reference_loop as ref
rows, cur = [], {{}}
_rollout = ref.rollout
def rollout(*a, **k):
    t = time.perf_counter(); out = _rollout(*a, **k); cur["gen_s"] = time.perf_counter() - t; return out
class Trainer(ref.Trainer):
    def train_step(self, batch, *a, **k):
        t = time.perf_counter(); out = super().train_step(batch, *a, **k); cur["train_s"] = time.perf_counter() - t
        cur["tokens"] = sum(len(s.input_ids) // 4 for s in batch.samples); return out
class Engine(ref.TorchEngine):
    def load_flat(self, flat, version):
        t = time.perf_counter(); super().load_flat(flat, version); end = time.perf_counter()
        rows.append({{**cur, "load_s": end - t, "t_end": end}}); cur.clear()
ref.rollout, ref.Trainer, ref.TorchEngine = rollout, Trainer, Engine
ref.main(sys.argv[1], sys.argv[2])
print("__ROWS__", json.dumps(rows))
"""


def launch_clocked(run_dir: str, sets: list[str], steps: int, timeout_s: float = 600) -> dict:
    """Run launch/cluster.py --gens 1 --learners 1; clock each metrics.jsonl row as it appears."""
    argv = [sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--gens", "1", "--learners", "1",
            "--steps", str(steps), "--run-dir", run_dir, "--quiet"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    arrivals: list[float] = []
    path, size = os.path.join(run_dir, "metrics.jsonl"), -1
    try:
        while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
            now = time.perf_counter()
            if os.path.exists(path) and os.path.getsize(path) != size:  # parse only when a row may have landed
                size = os.path.getsize(path)
                n = len(read_metrics(run_dir))
                arrivals += [now] * (n - len(arrivals))
            time.sleep(0.02)
        if proc.poll() is None:
            raise RuntimeError(f"covrl did not finish {steps} steps within {timeout_s:.0f}s (run dir {run_dir})")
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops the process groups it started on SIGTERM
            proc.wait(timeout=60)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        logs = os.path.join(run_dir, "logs")
        tails = "".join(open(os.path.join(logs, f)).read()[-2000:] for f in sorted(os.listdir(logs))) if os.path.isdir(logs) else ""
        raise RuntimeError(f"launch/cluster.py exited {proc.returncode}\n{err[-2000:]}\n{tails}")
    rows = read_metrics(run_dir)
    arrivals += [time.perf_counter()] * (len(rows) - len(arrivals))  # rows written in the last poll interval
    return {"rows": rows, "end_s": [a - t0 for a in arrivals], "wall_s": wall, "summary": out.strip().splitlines()}


def window_rate(end_s: list[float], warmup: int, samples_per_step: int) -> tuple[float, float]:
    """(samples/s, seconds) over steps warmup+1 .. N-1 from the end time of each step (index i = step i + 1)."""
    span = end_s[-2] - end_s[warmup - 1]
    return (len(end_s) - 1 - warmup) * samples_per_step / span, span


def run_sync(run_dir: str) -> list[dict]:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, "-c", SYNC_DRIVER.format(repo=REPO), run_dir, os.path.join(tmp, "ref.safetensors")],
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"reference loop exited {p.returncode}:\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("__ROWS__"))
    return json.loads(line.split(" ", 1)[1])


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def sync_stages(rows: list[dict], warmup: int) -> tuple[float, float, float, float, float]:
    """The synchronous loop over steps warmup+1 .. N-1: (samples/s, seconds, mean generate + score s, mean train +
    load-weights s, overlap bound (g + t) / max(g, t))."""
    rate, span = window_rate([r["t_end"] for r in rows], warmup, SAMPLES_PER_STEP)
    window = rows[warmup:-1]
    g = mean(r["gen_s"] for r in window)
    t = mean(r["train_s"] + r["load_s"] for r in window)
    return rate, span, g, t, (g + t) / max(g, t)
