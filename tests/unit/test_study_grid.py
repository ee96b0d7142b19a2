"""The grid study's premise gates (study/premise.py) and its report's verdict rules (study/grid_report.py), on
synthetic runs where the answer is known: each gate and each verdict must be able to come out either way."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from study import grid_report as gr
from study.premise import all_pass, cov_entropy_correlation, fisher_interval, gates, half_step


def synthetic_run(*, start=0.6, half_at=30.0, coupling=-0.5, top10=0.1, length=12.0, length_end=12.0, seed=0,
                  steps=100, entropy_offset=0.0, acc=0.7, selected=0.0):
    """A run whose entropy halves every `half_at` steps; entropy_delta = coupling x cov + noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(1, steps + 1):
        h = start * 0.5 ** (s / half_at) + entropy_offset
        cov = 0.02 * h / start + 0.004 * rng.standard_normal()
        n = length + (length_end - length) * s / steps
        rows.append({"step": s, "actor/entropy": h, "actor/cov_top10_share": top10, "actor/entropy_per_response": h * n,
                     "actor/cov_mean": cov, "actor/entropy_delta": coupling * cov + 0.001 * rng.standard_normal(),
                     "actor/cov_selected_frac": selected, "response_length/mean": n,
                     "actor/cov_selected_share": 0.3 if selected else 0.0})
        if s % 10 == 0:
            rows.append({"step": s, "eval/grid/acc": acc, "eval/grid/pass@k": min(1.0, acc + 0.2)})
    return rows


def verdicts(rows):
    return {g.name: g.passed for g in gates(rows)}


def test_every_gate_passes_where_the_premise_holds():
    rows = synthetic_run()
    assert all_pass(rows), gates(rows)
    r, lo, hi, n = cov_entropy_correlation(rows)
    assert r < -0.9 and hi < 0 and n == 100


@pytest.mark.parametrize("change, gate", [
    ({"start": 0.2}, "G1"),  # too little entropy to act on
    ({"top10": 0.6}, "G2"),  # concentrated covariance (the chain regime's 63 %)
    ({"half_at": 5.0}, "G3"),  # over before step 15
    ({"half_at": 400.0}, "G3"),  # never halves
    ({"length_end": 80.0}, "G4"),  # the per-response entropy holds: the fall is length
    ({"coupling": +0.5}, "G5"),  # the wrong sign, as on chain
    ({"coupling": 0.0}, "G5"),  # no coupling: the interval includes 0
])
def test_each_gate_fails_where_its_premise_does_not_hold(change, gate):
    v = verdicts(synthetic_run(**change))
    assert v[gate] is False
    assert all(p for name, p in v.items() if name != gate) or gate == "G3"  # G3's cases move G4 too


def test_gates_are_not_available_without_their_metrics():
    rows = [{k: v for k, v in r.items() if k != "actor/entropy_delta"} for r in synthetic_run()]
    assert verdicts(rows)["G5"] is None and not all_pass(rows)


def test_half_step_and_fisher_interval():
    start, step = half_step(synthetic_run(half_at=30.0))
    assert start == pytest.approx(0.6 * np.mean([0.5 ** (s / 30) for s in (1, 2, 3)])) and 30 <= step <= 36
    lo, hi = fisher_interval(0.0, 103)
    assert lo == pytest.approx(-0.1940, abs=1e-3) and hi == pytest.approx(0.1940, abs=1e-3)


ARMS = ("grpo", "kl_cov", "kl_cov_random", "clip_cov", "grpo_ent")


def study_rows(offsets: dict[str, float], seeds=(0, 1, 2, 3)) -> dict[str, list[dict]]:
    out = {}
    for arm in ARMS:
        for i, s in enumerate(seeds):
            name = arm if i == 0 else f"{arm}@s{s}"
            noise = 0.002 * ((s * 7 + len(arm)) % 5 - 2)
            out[name] = synthetic_run(seed=s, entropy_offset=offsets.get(arm, 0.0) + noise,
                                      selected=0.004 if arm.startswith("kl_cov") else 0.0)
    return out


def arms_of(rows):
    return gr.by_arm(rows, 0, 128)


def test_the_mechanism_is_supported_only_when_both_primary_contrasts_lie_above_zero():
    arms = arms_of(study_rows({"grpo_ent": 0.2, "kl_cov": 0.05}))
    p = gr.primary(arms)
    assert p["P1"].sign > 0 and p["P2"].sign > 0 and p["P1"].level == 0.975
    assert gr.mechanism_verdict(p["P1"], p["P2"], gr.positive_control(arms)[1]).startswith("supported")


def test_kl_cov_matched_by_random_tokens_contradicts_the_covariance_choice():
    arms = arms_of(study_rows({"grpo_ent": 0.2, "kl_cov": 0.05, "kl_cov_random": 0.05}))
    p = gr.primary(arms)
    assert p["P1"].sign == 0 and p["P2"].sign > 0
    assert "not the covariance choice" in gr.mechanism_verdict(p["P1"], p["P2"], True)
    assert gr.contrast_verdict("P1", p["P1"]) == "not shown"


def test_no_effect_reads_not_shown_and_a_dead_positive_control_makes_it_undetermined():
    arms = arms_of(study_rows({"grpo_ent": 0.2}))
    p = gr.primary(arms)
    assert gr.mechanism_verdict(p["P1"], p["P2"], True).startswith("contradicted: KL-Cov does not hold")
    dead = arms_of(study_rows({}))
    pc, moved = gr.positive_control(dead)
    assert not moved and gr.mechanism_verdict(p["P1"], p["P2"], moved).startswith("undetermined")


def test_the_report_renders_every_section_from_runs_and_pilots():
    rows = study_rows({"grpo_ent": 0.2, "kl_cov": 0.05})
    text = gr.render(arms_of(rows), {"grpo_lr5e-5": synthetic_run()}, {"command": "covrl study --preset grid"},
                     list(rows), list(rows), datetime.datetime(2026, 12, 7))
    for heading in ("## 1. The premise gates", "## 3. Every arm", "## 4. Verdicts", "## 5. Secondary",
                    "## 6. The premise in the study's own runs", "## 7. Implementation checks"):
        assert heading in text
    assert "supported here" in text and "| G5 |" in text
    e = arms_of(rows)["kl_cov"][0]
    assert e.tokens == pytest.approx(0.004 * 12.0 * 128, rel=0.01) and e.acc == 0.7 and e.pass_k == pytest.approx(0.9)


def test_without_study_runs_the_report_says_the_study_did_not_run_and_shows_every_pilots_gates():
    failing = synthetic_run(coupling=+0.5)
    text = gr.render({}, {"v1-lr5e-5/grpo": failing, "v2-lr5e-5/grpo": synthetic_run()}, {}, [], [],
                     datetime.datetime(2026, 12, 7))
    assert "## 3. The study: no run complete yet" in text and "## 4. Verdicts" not in text  # v2's pilot passed
    assert "| `v1-lr5e-5/grpo` | passes | passes | passes | passes | **fails** |" in text
    assert "| `v2-lr5e-5/grpo` | passes | passes | passes | passes | passes |" in text
    none = gr.render({}, {"v1-lr5e-5/grpo": failing, "v1-lr5e-5/grpo_ent": synthetic_run()}, {}, [], [],
                     datetime.datetime(2026, 12, 7))
    assert "## 3. The study: not run" in none  # a passing bonus pilot does not open the study: the gates are GRPO's


def test_a_dead_positive_control_makes_every_primary_verdict_undetermined_in_the_report():
    rows = study_rows({"kl_cov": 0.05})  # the bonus arm ends where GRPO ends
    text = gr.section_verdicts(arms_of(rows))
    assert "**the endpoint did not move**" in text
    assert text.count("undetermined: the endpoint did not move") == 3  # P1, P2 and the mechanism line
    assert "holds entropy" not in text.replace("KL-Cov holds entropy above GRPO and", "")


def test_the_secondary_table_holds_rule_3s_contrasts_only():
    text = gr.section_secondary(arms_of(study_rows({"grpo_ent": 0.2, "kl_cov": 0.05})))
    assert "| `clip_cov` - `grpo` | entropy AUC |" in text and "| `kl_cov` - `kl_cov_random` | pass@8 |" in text
    assert "| `kl_cov` - `grpo` | entropy AUC |" not in text and "| `kl_cov` - `kl_cov_random` | end entropy |" not in text


def test_the_phase_table_reads_each_window_of_a_run_on_its_own():
    """Post hoc G5 by window: a run whose covariance drives the entropy's change in steps 1-30 and not after shows a
    negative r there and none after; the table names each run and each window."""
    from study.premise import PHASES, cov_entropy_correlation, phase_table

    rng = np.random.default_rng(0)
    rows = []
    for s in range(1, 101):
        cov = float(rng.normal(0.05, 0.02))
        noise = float(rng.normal(0, 0.01))
        rows.append({"step": s, "actor/cov_mean": cov, "actor/entropy_delta": (-0.5 * cov if s <= 30 else 0.0) + noise})
    r_fall, _, hi_fall, n_fall = cov_entropy_correlation(rows, steps=(1, 30))
    r_late, lo_late, hi_late, n_late = cov_entropy_correlation(rows, steps=(41, 100))
    assert n_fall == 30 and n_late == 60 and r_fall < -0.5 and hi_fall < 0 and lo_late < 0 < hi_late
    lines = phase_table({"pilot/grpo": rows})
    assert PHASES[0] == (1, 30) and "steps 1-30" in lines[0] and lines[2].startswith("| `pilot/grpo` |")
    assert lines[2].count("differences") == len(PHASES)
