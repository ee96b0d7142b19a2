"""Pipeline overlap: samples/s of the async pipeline (1 generator + 1 learner) vs the synchronous loop.

Async: `launch/cluster.py --gens 1 --learners 1` on the built-in `arith` task with run.deterministic = false and
rollout.max_staleness_steps = 1, so the generator samples batch v + 1 while the learner trains on batch v; one
torch thread per role (run.torch_threads = 1), each role on its own core of this 2-core machine.
Sync: tests/integration/reference_loop.py (generate -> score -> train -> load weights, one process, one thread)
on the same RUN_DIR/config.toml: same model, prompts, batch (16 groups x 8), max_new_tokens, steps.

What is timed, both sides: the wall time from the end of step W to the end of step N - 1 (steps W+1 .. N-1), and
samples/s = (N - 1 - W) x 128 / that time. Start-up (imports, DeepSpeed, reward workers, the first batch's
generation) is before the end of step W; the last step is left out because the pipeline has nothing left to
generate then. "End of step" is, async: the moment its row appears in metrics.jsonl (polled every 20 ms, written
right after the weights are published); sync: the moment the generator engine has loaded the step's new weights
(the reference loop's last act per step). The sync side also times its two stages per step: g = generate + score,
t = train + load weights; the overlap bound is (g + t) / max(g, t).

Dynamic sampling is off on both sides (the reference loop does not filter); evaluation is off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from common.metrics import read_metrics
from common.transport import free_port
from tests.bench.common import REPO, record, verdict

# The roles and the reference loop run in their own interpreters; this process only times them.

STEPS, WARMUP = 20, 4
SAMPLES_PER_STEP = 16 * 8  # rollout.groups_per_step x rollout.group_size (defaults)
SETTINGS = ["eval.every_steps=0", "learner.filter.dynamic_sampling=false"]
ASYNC = ["run.deterministic=false", "rollout.max_staleness_steps=1"]

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


def test_pipeline_overlap(tmp_path):
    load_before = os.getloadavg()
    run = str(tmp_path / "async")
    covrl = launch_clocked(run, SETTINGS + ASYNC, STEPS)
    rows = covrl["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "metrics.jsonl should hold one row per step"
    async_rate, async_span = window_rate(covrl["end_s"], WARMUP, SAMPLES_PER_STEP)

    sync_rows = run_sync(run)  # same RUN_DIR/config.toml: same model, data, batch, steps
    assert len(sync_rows) == STEPS
    sync_rate, sync_span, g, t, bound = sync_stages(sync_rows, WARMUP)
    speedup = async_rate / sync_rate
    inside = rows[WARMUP:STEPS - 1]
    async_train = mean(r["timing_s/train"] for r in inside)
    met = speedup >= 1.6
    why = (f"the stages are unequal: generation + scoring {g:.2f}s vs train + weight load {t:.2f}s per step, so "
           f"overlap can give at most (g + t) / max(g, t) = {bound:.2f}x; the pipeline reached "
           f"{speedup / bound:.0%} of that bound (training under overlap took {async_train:.2f}s per step vs {t:.2f}s alone)")
    record("pipeline_overlap", {
        "task": "arith, 1 generator + 1 learner, 1 torch thread each, 16 groups x 8 samples per step, max_new_tokens 64",
        "settings_both": SETTINGS, "settings_async": ASYNC, "steps": STEPS,
        "timed": f"steps {WARMUP + 1}-{STEPS - 1}: end of step {WARMUP} to end of step {STEPS - 1} (see module docstring)",
        "async_samples_per_s": async_rate, "sync_samples_per_s": sync_rate, "speedup": speedup,
        "async_window_s": async_span, "sync_window_s": sync_span,
        "sync_stage_s": {"generate_and_score": g, "train_and_load_weights": t},
        "async_learner_train_s_per_step": async_train,
        "async_step_s_sum_over_window": sum(r["timing_s/step"] for r in inside),
        "async_staleness_mean": mean(r["staleness/mean"] for r in rows),
        "overlap_bound": bound,
        "fraction_of_bound": speedup / bound,
        "async_wall_s_incl_startup": covrl["wall_s"],
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "target": "async >= 1.6x sync samples/s (2x is the bound with two equal stages)",
        "verdict": verdict(met),
        **({} if met else {"why_not_met": why}),
    })
    print(f"\npipeline overlap: async {async_rate:.1f} samples/s vs sync {sync_rate:.1f} -> {speedup:.2f}x "
          f"(target 1.6x: {verdict(met)}); sync stages g {g:.2f}s t {t:.2f}s, bound {bound:.2f}x")
    if not met:
        print(f"  {why}")
    assert async_rate > 0 and sync_rate > 0
