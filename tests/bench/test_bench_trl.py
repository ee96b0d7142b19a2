"""Peer comparison: covrl vs TRL's GRPOTrainer on the same model, prompts, reward and batch, on this CPU.

TRL is not a covrl dependency: its side runs tests/bench/trl_peer.py in the bench-only environment `.venv-bench`
(built by `make bench-env`); without it this test is skipped. covrl runs `launch/cluster.py --gens 1 --learners 1`
with its defaults (max_staleness_steps 1, run.deterministic true) except evaluation off and dynamic sampling off
(TRL does not filter groups). Both: 16 prompts x 8 samples per step, the same prompts in the same order, up to 64
new tokens, lr 1e-4, STEPS steps (see trl_peer.py for the full list of matched settings). TRL, one process, runs
once with 1 and once with 2 torch threads; the faster is compared (covrl: 2 processes x 1 thread).

Measured, both sides:
- seconds per training sample in the steady state: wall time from the end of step W to the end of step STEPS - 1,
  divided by the samples trained in between (start-up excluded; covrl's last step is left out because its pipeline
  has nothing left to generate then, and TRL's is left out to match);
- seconds per training sample including start-up (process start to exit, over all STEPS x 128 samples);
- the reward: the mean training reward (fraction correct) of the last LAST steps, and of the first LAST steps.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess

import pytest

from tests.bench.common import REPO, record, verdict
from tests.helpers.bench_env import BENCH_PY, bench_env_problem
from tests.helpers.pipeline_clock import SAMPLES_PER_STEP, SETTINGS, launch_clocked, mean, window_rate

STEPS, WARMUP, LAST = 24, 4, 5
LEAN = "learner.log_entropy_delta=false"
# TRL is one process: it gets the two cores as torch threads. Both counts are run and the faster one is compared:
# on an idle machine 2 threads are faster (1.1 vs 1.7 s/step), with other work beside it 2 threads were 2-5x slower.
TRL_THREADS = (1, 2)


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def test_covrl_vs_trl(tmp_path):
    problem = bench_env_problem()
    if problem:
        pytest.skip(problem)
    runs = {}
    for threads in TRL_THREADS:
        out = tmp_path / f"trl{threads}.json"
        cpu0 = children_cpu_s()
        p = subprocess.run([BENCH_PY, os.path.join(REPO, "tests", "bench", "trl_peer.py"), "--steps", str(STEPS),
                            "--threads", str(threads), "--out", str(out)],
                           capture_output=True, text=True, cwd=REPO, timeout=900,
                           env={**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"})
        if p.returncode != 0:
            raise RuntimeError(f"trl_peer.py --threads {threads} exited {p.returncode}:\n{p.stderr[-3000:]}")
        runs[threads] = {**json.loads(out.read_text()), "cpu_s": children_cpu_s() - cpu0}
        runs[threads]["rate"] = window_rate(runs[threads]["step_end_s"], WARMUP, runs[threads]["samples_per_step"])[0]
    best = max(runs, key=lambda n: runs[n]["rate"])
    trl = runs[best]
    cpu1 = children_cpu_s()
    covrl = launch_clocked(str(tmp_path / "covrl"), SETTINGS, STEPS)
    cpu2 = children_cpu_s()  # the launcher waits for its roles, and they for their reward workers
    # The same run without covrl's one metric-only pass (actor/entropy_delta: entropy after the update of every
    # learner.entropy_delta_stride-th micro-batch, a no-grad forward; TRL computes nothing like it). Same updates,
    # so the same rewards.
    lean = launch_clocked(str(tmp_path / "covrl_lean"), SETTINGS + [LEAN], STEPS)
    lean_rate, _ = window_rate(lean["end_s"], WARMUP, SAMPLES_PER_STEP)
    rows = covrl["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "metrics.jsonl should hold one row per step"

    covrl_rate, _ = window_rate(covrl["end_s"], WARMUP, SAMPLES_PER_STEP)
    trl_rate = trl["rate"]
    total = STEPS * SAMPLES_PER_STEP
    c_reward = [r["critic/score/mean"] for r in rows]
    side = {
        "covrl": {"s_per_sample_steady": 1 / covrl_rate, "s_per_sample_incl_startup": covrl["wall_s"] / total,
                  "wall_s": covrl["wall_s"], "startup_s": covrl["end_s"][0] - (rows[0]["timing_s/step"]),
                  "cpu_s": cpu2 - cpu1, "reward_first": mean(c_reward[:LAST]), "reward_last": mean(c_reward[-LAST:]),
                  "reward_all_steps": mean(c_reward),
                  "reward_per_step": c_reward, "response_length_last": mean(r["response_length/mean"] for r in rows[-LAST:]),
                  "entropy_last": mean(r["actor/entropy"] for r in rows[-LAST:])},
        "trl": {"s_per_sample_steady": 1 / trl_rate, "s_per_sample_incl_startup": trl["wall_s"] / total,
                "wall_s": trl["wall_s"], "startup_s": trl["startup_s"],
                "cpu_s": trl["cpu_s"], "threads": best, "reward_first": mean(trl["reward"][:LAST]), "reward_last": mean(trl["reward"][-LAST:]),
                "reward_all_steps": mean(trl["reward"]),
                "reward_per_step": trl["reward"], "response_length_last": mean(trl["completion_length"][-LAST:]),
                "entropy_last": mean(trl["entropy"][-LAST:])},
    }
    # Both see the same prompts at each step, whose difficulty swings the reward far more than training does:
    # compare step by step (covrl - TRL), with the standard error of that mean.
    diffs = [a - b for a, b in zip(c_reward, trl["reward"])]
    diff_se = (sum((d - mean(diffs)) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
    ratio = side["trl"]["s_per_sample_steady"] / side["covrl"]["s_per_sample_steady"]
    ratio_total = side["trl"]["s_per_sample_incl_startup"] / side["covrl"]["s_per_sample_incl_startup"]
    trl_wins = [k for k in ("s_per_sample_steady", "s_per_sample_incl_startup", "startup_s")
                if side["trl"][k] < side["covrl"][k]]
    trl_wins += [k for k in ("reward_last", "reward_all_steps") if side["trl"][k] > side["covrl"][k]]
    if side["trl"]["cpu_s"] < side["covrl"]["cpu_s"]:
        trl_wins.append("cpu_s")
    met = ratio >= 1.0
    record("trl_peer", {
        "steps": STEPS, "samples_per_step": SAMPLES_PER_STEP, "steady_steps": [WARMUP + 1, STEPS - 1], "reward_over_steps": LAST,
        "covrl_settings": SETTINGS + ["defaults otherwise: max_staleness_steps 1, deterministic true, 1 torch thread per role"],
        "trl_threads_tried": {str(n): {"s_per_sample_steady": 1 / r["rate"], "cpu_s": r["cpu_s"]} for n, r in runs.items()},
        "versions_bench_env": trl["versions"],
        **side,
        "trl_over_covrl_s_per_sample_steady": ratio, "trl_over_covrl_s_per_sample_incl_startup": ratio_total,
        "trl_wins_on": trl_wins,
        "covrl_without_entropy_delta_pass": {
            "setting": LEAN, "s_per_sample_steady": 1 / lean_rate, "trl_over_covrl_s_per_sample_steady": (1 / trl_rate) * lean_rate,
            "same_rewards_as_default": [r["critic/score/mean"] for r in lean["rows"]] == c_reward},
        "reward_diff_covrl_minus_trl_per_step": {"mean": mean(diffs), "standard_error": diff_se,
                                                 "last_steps": mean(diffs[-LAST:]),
                                                 # step 1: the same base model on the same prompts, so sampling noise only
                                                 "step_1": diffs[0]},
        "loadavg_1m_after": os.getloadavg()[0],
        "target": "covrl / TRL wall-clock per training sample <= 1.0 (steady state, covrl at its defaults), same model, "
                  "task, reward and batch",
        "verdict": verdict(met),
    })
    c, t = side["covrl"], side["trl"]
    print(f"\ncovrl vs TRL {trl['versions']['trl']} ({best} thread(s), the faster of {list(TRL_THREADS)}; {STEPS} steps x {SAMPLES_PER_STEP} samples): "
          f"steady {c['s_per_sample_steady'] * 1e3:.1f} vs {t['s_per_sample_steady'] * 1e3:.1f} ms/sample (TRL/covrl {ratio:.2f}x), "
          f"incl. start-up {c['s_per_sample_incl_startup'] * 1e3:.1f} vs {t['s_per_sample_incl_startup'] * 1e3:.1f} ms/sample "
          f"({ratio_total:.2f}x); reward last {LAST} steps {c['reward_last']:.3f} vs {t['reward_last']:.3f} "
          f"(first {LAST}: {c['reward_first']:.3f} vs {t['reward_first']:.3f}; per-step difference over all steps "
          f"{mean(diffs):+.3f} +- {diff_se:.3f}); CPU {c['cpu_s']:.0f} vs {t['cpu_s']:.0f} s; TRL wins on: {trl_wins or 'nothing'}")
    print(f"  covrl with {LEAN}: {1e3 / lean_rate:.1f} ms/sample steady (TRL/covrl {lean_rate / trl_rate:.2f}x)")
    assert covrl_rate > 0 and trl_rate > 0
