"""Scale on paper: the discrete-event simulator (tests/bench/simulate.py) over G, L and k.

The grid goes to results.json with the model's assumptions, beside published async-RL speedups for comparison.
The checks are properties a wrong simulator would break: k = 0 reproduces an independent synchronous loop exactly,
no trained sample is older than k, the speedup never falls as k grows (on a window long enough that the run's
end does not count), it never beats the stage bound, and with two equal deterministic stages it reaches the
textbook 2x.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.bench import simulate as S
from tests.bench.common import record, verdict

STEPS, WARMUP = 30, 8  # 22 measured steps; shorter windows let the last steps' pre-generated batches bend the curve
KS = (0, 1, 2, 4, 8)
PUBLISHED = {
    "AReaL": "reported by Fu et al. 2025 (AReaL): up to 2.77x faster training than synchronous systems with the "
             "same number of GPUs, on math and code reasoning",
    "PipelineRL": "reported by Piche et al. 2025 (PipelineRL): about 2x faster learning than conventional "
                  "synchronous RL",
}


@pytest.mark.parametrize("generation", ["continuous", "static", "static_compact"])
@pytest.mark.parametrize("G, L", [(3, 1), (12, 4), (8, 8)])
def test_k0_is_the_synchronous_loop(generation, G, L):
    """Admission control with k = 0 must be generate -> train -> sync, step for step (rel. 1e-9)."""
    hw = S.Hardware(generation=generation)
    w = S.Workload(samples_per_step=32 * (G + L))
    got = S.simulate(G, L, 0, w, hw, steps=6, warmup_steps=2)
    ref = S.sync_reference(G, L, w, hw, steps=6, warmup_steps=2)
    assert got.step_end_s == pytest.approx(ref.step_end_s, rel=1e-9)
    assert got.staleness_max == 0


def test_two_equal_deterministic_stages_give_two():
    """No tail, iteration cost independent of occupancy, free sync: stages g = t, so k = 1 gives (g + t) / max = 2."""
    hw = S.Hardware(iter_per_seq_s=0.0, weight_sync_s=0.0, step_fixed_s=0.0)
    w = S.Workload(samples_per_step=64, sigma=0.0, median_tokens=1000)
    g = 1000 * hw.iter_base_s  # every response 1000 tokens, all in flight at once
    L = round(hw.train_s_per_token * 64 * (1000 + w.prompt_tokens) / g)  # learners that make t = g
    hw = replace(hw, train_s_per_token=g * L / (64 * (1000 + w.prompt_tokens)))
    speedup = S.speedup_curve(4, L, (0, 1), w, hw, steps=20, warmup_steps=5)
    assert speedup[1] == pytest.approx(2.0, rel=1e-6)


def test_grid_speedups():
    t0 = time.perf_counter()
    rows = S.grid(ks=KS, steps=STEPS, warmup_steps=WARMUP)
    failures = []
    for key in {(r["devices"], r["G"], r["L"]) for r in rows}:
        curve = sorted((r for r in rows if (r["devices"], r["G"], r["L"]) == key), key=lambda r: r["k"])
        speed = [r["speedup_vs_sync"] for r in curve]
        if speed[0] != 1.0:
            failures.append(f"{key}: speedup {speed[0]} at k = 0")
        if any(b < a * 0.99 for a, b in zip(speed, speed[1:])):
            failures.append(f"{key}: speedup falls as k grows: {speed}")
        if any(s > r["stage_bound"] * 1.01 for s, r in zip(speed, curve)):
            failures.append(f"{key}: speedup {speed} above the stage bound {curve[0]['stage_bound']}")
        if any(r["staleness_mean"] > r["k"] for r in curve):
            failures.append(f"{key}: mean staleness above k")
    tails = {}
    for name, w in (("lognormal sigma 0.9 (default)", S.Workload()), ("pareto alpha 1.5", S.Workload(length_dist="pareto")),
                    ("lognormal sigma 0.3 (light tail)", S.Workload(sigma=0.3))):
        for gen in ("continuous", "static"):
            hw = S.Hardware(generation=gen)
            curve = S.speedup_curve(12, 4, KS, w, hw, steps=STEPS, warmup_steps=WARMUP)
            bound = S.stage_bound(S.sync_reference(12, 4, w, hw, steps=STEPS, warmup_steps=WARMUP), 12, w, hw,
                                  warmup_steps=WARMUP)
            tails[f"{name}, {gen}"] = {"speedup_vs_sync": [round(x, 3) for x in curve],
                                       "stage_bound": round(bound["bound"], 3), "two_stage_bound": round(bound["two_stage_bound"], 3)}
            if any(b < a * 0.99 for a, b in zip(curve, curve[1:])) or max(curve) > bound["bound"] * 1.01:
                failures.append(f"{name}, {gen}: speedup {curve} not non-decreasing or above the bound {bound['bound']:.3f}")
    by_k = {k: [r["speedup_vs_colocated_sync"] for r in rows if r["k"] == k] for k in KS}
    summary = {k: [min(v), max(v)] for k, v in by_k.items()}
    in_range = 2.0 <= max(summary[1][1], summary[2][1]) and min(summary[1][0], summary[2][0]) <= 2.8
    record("simulate", {
        "assumptions": S.assumptions(),
        "steps_measured": [WARMUP + 1, STEPS],
        "grid": rows,
        "speedup_vs_colocated_sync_min_max_by_k": summary,
        "tail_and_batching_at_G12_L4": {"ks": list(KS), "speedup_vs_sync": tails},
        "published": PUBLISHED,
        "comparison": f"predicted speedup over colocated sync at N = 16-128: k = 1 {summary[1][0]:.2f}-{summary[1][1]:.2f}x, "
                      f"k = 2 {summary[2][0]:.2f}-{summary[2][1]:.2f}x, vs the reported 2-2.8x "
                      f"({'overlaps' if in_range else 'does not overlap'}); larger k predicts up to {summary[max(KS)][1]:.2f}x "
                      "because nothing here costs more as staleness grows (in practice stale samples also learn less "
                      "per sample, which wall-clock-to-reward numbers include); the speedup is nearly flat in N "
                      "because the model has no cost that grows with N (weak scaling, fixed sync and step costs)",
        "target": "properties: 1.0 at k = 0 (= independent sync loop), non-decreasing in k, <= stage bound, "
                  "staleness <= k; shape: k = 1-2 in the reported 2-2.8x range vs colocated sync",
        "verdict": verdict(not failures and in_range),
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
    })
    print(f"\nsimulated async/sync speedup (vs colocated sync) by k, N = 16-128: "
          + ", ".join(f"k={k}: {lo:.2f}-{hi:.2f}x" for k, (lo, hi) in summary.items()))
    for name, row in tails.items():
        print(f"  G=12 L=4 {name}: speedup vs sync over k={list(KS)}: {row['speedup_vs_sync']} (stage bound {row['stage_bound']})")
    assert not failures, failures
    assert all(r["samples_per_s"] > 0 for r in rows)
