"""The staleness study's plan (`covrl study --preset staleness`: runs, lengths, forced-lag overrides) and its report
(study/staleness_report.py): endpoints worked out by hand on made-up runs, and each verdict rule able to come out
either way."""

import datetime
import json
import os
from dataclasses import replace

import pytest

from study import runs as study_runs
from study.arms import parse_run, run_name, staleness_steps
from study import staleness_report as sr
from study.dose_report import Contrast
from study.stats import t_interval


def _rows(k: int, steps: int, *, entropy0=0.2, entropy_end=0.05, acc=(0.4, 0.6, 0.7), kl=0.01, capfrac=0.001,
          lag_exact=True, tilt=0.004):
    """A made-up run: training rows 1..steps, evaluations at 0, steps/2 and steps (accuracies `acc`)."""
    rows = []
    for step in range(1, steps + 1):
        lag = min(step - 1, k)
        rows.append({"step": step, "actor/entropy": 0.1, "staleness/min": lag, "staleness/max": lag if lag_exact else lag + 1,
                     "offpolicy/kl_behav_prox": kl if step > k else 0.0, "actor/is_weight_clipfrac": capfrac,
                     "offpolicy/ess_seq": 0.9, "offpolicy/ess_token": 0.99, "offpolicy/m2": 2 * kl,
                     "offpolicy/m2po_masked": 0.0, "offpolicy/ess_lr_scale": 1.0, "actor/cov_mean": 0.001,
                     "offpolicy/clipped_q1": 0.001, "offpolicy/clipped_q5": 0.001 + tilt})
    for step, a, h in zip((0, steps // 2, steps), acc, (entropy0, (entropy0 + entropy_end) / 2, entropy_end)):
        rows.append({"step": step, "eval/a/acc": a, "eval/b/acc": a, "eval/a/entropy": h, "eval/b/entropy": h})
    return rows


def test_collapse_and_half_entropy_rules():
    assert sr.first_collapse([(0, 0.36), (8, 0.5), (16, 0.7), (24, 0.54)]) == 24  # 0.16 below the best earlier
    assert sr.first_collapse([(0, 0.36), (8, 0.5), (16, 0.7), (24, 0.56)]) is None  # 0.14: within the noise rule
    assert sr.first_collapse([(0, 0.36), (8, 0.2)]) == 8
    assert sr.first_collapse([(0, 0.65), (8, 0.5)]) == 8  # exactly 0.15, whatever the floating point says
    assert sr.half_entropy_step([(0, 0.2), (8, 0.15), (16, 0.1)], 64) == (16, False)
    assert sr.half_entropy_step([(0, 0.2), (8, 0.15)], 64) == (64, True)


def test_run_endpoints_by_hand():
    r = sr.run_endpoints("grpo_tis@k2@s1", _rows(2, 8, acc=(0.4, 0.6, 0.8), entropy0=0.2, entropy_end=0.04), 8)
    assert (r.method, r.k, r.seed, r.steps) == ("grpo_tis", 2, 1, 8)
    assert r.end_entropy == pytest.approx((0.2 + 0.12 + 0.04) / 3)  # the last 3 evaluations: all three here
    assert r.acc == pytest.approx(0.6) and r.collapse_step is None
    assert (r.half_step, r.censored) == (8, False)  # 0.04 <= 0.1 at step 8; 0.12 at step 4 is not
    assert r.off["kl"] == pytest.approx(0.01)  # over steps 3..8 (full lag), not the warm-up's zeros
    assert r.clip_tilt == pytest.approx(0.004) and r.exact_lag
    assert not sr.run_endpoints("grpo_tis@k2@s1", _rows(2, 8, lag_exact=False), 8).exact_lag


def _c(mean, lo, hi, n=3):
    return Contrast("x", n, mean, lo, hi, 0.01)


def test_kl_cov_verdict_can_come_out_every_way():
    nan = (float("nan"),) * 3
    assert "survives" in sr.kl_cov_verdict({0: _c(.02, .01, .03), 64: _c(.02, .01, .03)}, nan)
    assert "weakens" in sr.kl_cov_verdict({0: _c(.04, .03, .05), 64: _c(.02, .01, .03)}, (-.02, -.03, -.01))
    assert "fails" in sr.kl_cov_verdict({0: _c(.02, .01, .03), 64: _c(0, -.01, .01)}, nan)
    assert "not shown to shrink" in sr.kl_cov_verdict({0: _c(.02, .01, .03), 64: _c(.03, -.01, .07)}, (.01, -.03, .05))
    assert "shrink" not in sr.kl_cov_verdict({0: _c(.02, .01, .03), 64: _c(0, -.01, .01)}, (-.02, -.03, -.01))
    assert "only with lag" in sr.kl_cov_verdict({0: _c(0, -.01, .01), 64: _c(.02, .01, .03)}, nan)
    assert "cannot be answered" in sr.kl_cov_verdict({0: _c(0, -.01, .01), 64: _c(0, -.01, .01)}, nan)
    assert "undetermined" in sr.kl_cov_verdict({0: _c(0, None, None, n=1), 64: _c(0, -.01, .01)}, nan)


def test_m2po_verdict_can_come_out_every_way():
    assert "fights" in sr.m2po_verdict(_c(-.02, -.03, -.01), _c(0, -.01, .01), (0, 0))
    assert "helps" in sr.m2po_verdict(_c(0, -.01, .01), _c(.05, .01, .09), (0, 0))
    assert "helps" in sr.m2po_verdict(_c(0, -.01, .01), _c(0, -.01, .01), (0, 2))  # fewer collapses
    assert "no detectable effect" in sr.m2po_verdict(_c(0, -.01, .01), _c(0, -.01, .01), (1, 1))
    assert "lower" not in sr.m2po_verdict(_c(0, -.01, .01), _c(0, -.01, .01), (1, 1))
    assert "held-out accuracy is **lower** with M2PO" in sr.m2po_verdict(_c(0, -.01, .01), _c(-.05, -.09, -.01), (1, 1))


def test_lag_budget_verdict_can_come_out_every_way():
    nul = _c(0, -.01, .01)
    assert sr.lag_budget_verdict(_c(.02, .01, .03), nul, _c(.03, .01, .05)) == (
        "it **raises** the on-policy entropy over KL-Cov's; it keeps entropy above GRPO's")
    assert sr.lag_budget_verdict(_c(-.02, -.03, -.01), _c(-.05, -.09, -.01), nul) == (
        "it **lowers** the on-policy entropy below KL-Cov's; it **costs accuracy**; it is not shown to keep entropy "
        "above GRPO's (MDE 0.0100)")
    assert sr.lag_budget_verdict(nul, _c(.05, .01, .09), nul).startswith("no detectable effect on entropy (MDE")
    assert "gains accuracy" in sr.lag_budget_verdict(nul, _c(.05, .01, .09), nul)
    assert sr.lag_budget_verdict(_c(0, None, None, n=1), nul, nul) == "undetermined (fewer than two seeds)"


def test_tiny_differences_and_mdes_never_print_as_zero():
    # Rule 7's lag-64 gain at lr 2e-5 excluded 0 by 6.7e-06; at 4 decimals it read [0.0000, 0.0011].
    tiny = Contrast("G", 3, 2e-05, -4.8e-06, 4.5e-05, 1.4e-06)
    assert sr._diff_cell(tiny, 4) == "+2e-05 [-4.8e-06, 4.5e-05] (n 3)"
    assert sr.lag_budget_verdict(tiny, tiny, tiny) == (
        "no detectable effect on entropy (MDE 1.4e-06); it is not shown to keep entropy above GRPO's (MDE 1.4e-06)")


def test_lag_budget_restores_the_control_only_where_kl_cov_fails_and_it_holds():
    def cells(lag_entropy):
        ends = {("grpo_tis", 0): 0.05, ("grpo_tis", 64): 0.05, ("kl_cov_tis", 0): 0.08, ("kl_cov_tis", 64): 0.05,
                ("kl_cov_lag", 0): 0.08, ("kl_cov_lag", 64): lag_entropy}
        runs = [sr.LagRun(m, k, seed, 64, e + 0.001 * seed * (m != "grpo_tis"), 64, True, 0.6, None, {}, None, [], True)
                for (m, k), e in ends.items() for seed in (0, 1, 2)]
        return sr.by_cell(runs)

    assert "the lag budget: **restores the control** there (C_64 above 0)" in sr.section_lag_budget(cells(0.09))
    assert "the lag budget: does not restore it (C_64 not above 0; MDE" in sr.section_lag_budget(cells(0.05))
    without = {c: seeds for c, seeds in cells(0.09).items() if not c.startswith("kl_cov_lag")}
    assert "the lag budget: undetermined (C_64 lacks two seeds)" in sr.section_lag_budget(without)
    holds = {c: seeds for c, seeds in cells(0.09).items() if c != "kl_cov_tis@k64"}  # rule 2 cannot say "fails"
    assert "KL-Cov fails" not in sr.section_lag_budget(holds)


def _study(tmp_path, names, steps_of, **kinds):
    for name in names:
        method, k, seed = sr.parse_name(name)
        os.makedirs(tmp_path / name)
        kw = kinds.get(method, {})
        rows = _rows(k, steps_of[name], kl=0.001 * (k + 1) * (1 + 0.1 * seed), capfrac=1e-4 * (k + 1) * (1 + 0.1 * seed),
                     **kw)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    meta = {"run_steps": steps_of, "steps": 8, "command": "covrl study ...", "overrides": {"preset": ["learner.lr=5e-5"]}}
    return meta


def test_report_from_a_partial_study(tmp_path):
    """Two methods at every lag with two seeds: the lag bites (KL and cap fraction grow with k); KL-Cov keeps entropy
    higher at every lag, so it survives; M2PO is missing, so its verdicts are undetermined; a run left incomplete
    is named missing."""
    names = [f"{m}@k{k}@s{s}" for s in (0, 1) for m in ("grpo_tis", "kl_cov_tis") for k in (0, 4, 16, 64)]
    steps_of = {n: staleness_steps(sr.parse_name(n)[1], 8) for n in names}
    meta = _study(tmp_path, names, steps_of, kl_cov_tis={"entropy_end": 0.15})
    with open(tmp_path / "grpo_tis@k0@s1" / "metrics.jsonl") as f:  # seed 1's k0 run: its last step never came
        kept = [line for line in f if json.loads(line)["step"] < 8]
    with open(tmp_path / "grpo_tis@k0@s1" / "metrics.jsonl", "w") as f:
        f.writelines(kept)
    path = sr.write_staleness_report(str(tmp_path), [*names, "kl_cov_m2po@k0@s0"], meta,
                                     now=datetime.datetime(2026, 11, 26, 20, 0))
    text = open(path).read()
    assert "15 of 17 runs complete" in text and "Missing (not yet run): grpo_tis@k0@s1, kl_cov_m2po@k0@s0" in text
    assert "Verdict: **the lag bites**" not in text  # k = 0 has one seed of GRPO left: no interval for rule 1
    caveat = "Verdict (the manipulation check is undetermined, so this is not yet a staleness effect): "
    assert caveat + "undetermined: D_0 or D_64 lacks two seeds" in text  # GRPO's k = 0 has seed 0 alone
    assert caveat + "undetermined (fewer than two seeds)" in text  # M2PO never ran
    for png in sr.PLOTS:
        assert os.path.getsize(tmp_path / png) > 0


def test_report_verdicts_when_every_cell_has_seeds(tmp_path):
    names = [f"{m}@k{k}@s{s}" for s in (0, 1, 2) for m in ("grpo_tis", "kl_cov_tis", "kl_cov_lag") for k in (0, 4, 16, 64)]
    # KL-Cov's entropy effect shrinks to nothing at lag: seeds differ a little so intervals exist. The lag budget
    # raises the end entropy, more with lag, except at k = 0 (its runs there equal KL-Cov's, one seed aside).
    meta = _study(tmp_path, names, {n: staleness_steps(sr.parse_name(n)[1], 8) for n in names}, kl_cov_tis={"entropy_end": 0.05})
    for name in names:
        method, k, seed = sr.parse_name(name)
        if method == "kl_cov_lag" and (k > 0 or seed == 2):
            rows = _rows(k, staleness_steps(k, 8), kl=0.001 * (k + 1) * (1 + 0.1 * seed), capfrac=1e-4 * (k + 1) * (1 + 0.1 * seed),
                         entropy_end=0.05 + 0.001 * (k + 1) * (1 + 0.1 * seed))
            with open(tmp_path / name / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    text = open(sr.write_staleness_report(str(tmp_path), names, meta)).read()
    assert "Verdict: **the lag bites**" in text
    assert "**cannot be answered positively at this scale**" in text  # same entropy: no control at k = 0 or 64
    assert "every trained token exactly min(step - 1, k) versions old (staleness/min = staleness/max): 36 of 36 runs" in text
    section = text.split("## 6. The staleness-aware budget")[1].split("## 7.")[0]
    assert section.count("Verdict: it **raises** the on-policy entropy over KL-Cov's; it keeps entropy above GRPO's") == 3
    assert "equals KL-Cov + TIS in every endpoint and off-policy measure: 2 of 3 seeds" in text
    multi = text.split("## 10. Multiplicity")[1].split("## 11.")[0]
    assert "rule 2, KL-Cov + TIS - GRPO + TIS (m = 8): none excludes 0 at 95 %" in multi
    assert multi.count("**holds**") == 4 and "does not hold" not in multi  # G and C at 16 and 64, far from 0


def test_a_bonferroni_reading_keeps_only_what_survives_the_stricter_t():
    # lr 5e-5, ESS steps' accuracy at lag 64 (rule 4, m = 16), and lr 2e-5, rule 7's G_64 (m = 6), from the reports.
    strong, weak = Contrast("a", 3, 0.229, 0.195, 0.263, 0.05), Contrast("G", 3, 0.00057, 6.7e-06, 0.0011, 0.0007)
    assert strong.corrected(1) == pytest.approx((0.195, 0.263))  # one comparison: the 95 % interval itself
    assert strong.corrected(16) == pytest.approx((0.087, 0.371), abs=1e-3)  # t 17.9 instead of 4.30
    assert weak.excludes_zero(1) and weak.corrected(6)[0] < 0 < weak.corrected(6)[1]
    assert sr._survivor(strong, 3, 16).endswith("**holds**") and sr._survivor(weak, 4, 6).endswith("does not hold")
    assert Contrast("one seed", 1, 0.1, None, None, None).corrected(4) is None


def test_staleness_preset_plans_forced_lag_runs(tmp_path):
    args = study_runs.parse_args(["--preset", "staleness", "--seeds", "0,1", "--study-dir", str(tmp_path / "s")])
    plan = study_runs.make_plan(args, "cmd", datetime.datetime(2026, 11, 26))
    names = study_runs.run_names(plan)
    assert len(names) == 2 * 6 * 4 and names[:4] == ["grpo_tis@k0@s0", "grpo_tis@k4@s0", "grpo_tis@k16@s0", "grpo_tis@k64@s0"]
    assert names[24] == "grpo_tis@k0@s1"
    assert "learner.loss.lag_ref_steps=16" in study_runs.run_overrides(plan, "kl_cov_lag@k16@s0")
    assert [study_runs.run_steps(plan, n) for n in names[:4]] == [64, 64, 64, 256]
    over = study_runs.run_overrides(plan, "kl_cov_m2po@k64@s1")
    assert over[0] == "run.seed=1" and "learner.importance.m2po_threshold=0.04" in over
    assert over[-3:] == ["rollout.max_staleness_steps=64", "rollout.forced_lag=64", "eval.every_steps=32"]
    assert parse_run("grpo_ess@k16@s2") == ("grpo_ess", 2, 16)


def test_run_names_round_trip_through_one_contract():
    for method, seed, k in [("grpo", None, None), ("grpo", 1, None), ("grpo", None, 4), ("kl_cov_m2po", 2, 64)]:
        assert parse_run(run_name(method, seed, k)) == (method, seed, k)
    assert sr.parse_name("grpo_ess@k16@s2") == ("grpo_ess", 16, 2)
    with pytest.raises(ValueError, match="not a staleness run name"):
        sr.parse_name("grpo_ess@s2")


def _lag_run(method, seed, collapse, ess):
    return sr.LagRun(method, 4, seed, 16, 0.05, 16, True, 0.6, collapse, {}, None,
                     [(s, ess) for s in range(1, 17)], True)


def test_ess_before_collapse_rule_both_ways():
    fell = {s: _lag_run("grpo_tis", s, 8, 0.2 + 0.01 * s) for s in range(3)}
    held = {s: _lag_run("kl_cov_tis", s, None, 0.6 + 0.01 * s) for s in range(3)}
    text = sr.section_ess_collapse({"grpo_tis@k4": fell, "kl_cov_tis@k4": held})
    assert ("k = 4: 3 collapsed, 3 did not; lowest ESS before step 8 (the earliest collapse), collapsed minus not: "
            "-0.4000 [") in text and "VCPO's claim: holds." in text
    higher = {s: _lag_run("grpo_tis", s, 8, 0.9 + 0.01 * s) for s in range(3)}
    assert "VCPO's claim: does not hold (the collapsed runs' ESS was higher)" in sr.section_ess_collapse(
        {"grpo_tis@k4": higher, "kl_cov_tis@k4": held})
    mixed = {s: _lag_run("grpo_tis", s, 8, (0.3, 0.9, 0.6)[s]) for s in range(3)}  # mean below, interval across 0
    assert "VCPO's claim: not shown (the interval includes 0)" in sr.section_ess_collapse(
        {"grpo_tis@k4": mixed, "kl_cov_tis@k4": held})
    early = {s: _lag_run("grpo_tis", s, 1, 0.2) for s in range(3)}  # collapsed before any ESS reading
    assert "undetermined (too few ESS readings)" in sr.section_ess_collapse({"grpo_tis@k4": early, "kl_cov_tis@k4": held})
    assert "k = 0: 0 collapsed, 0 did not: undetermined" in text


def _ess_run(method, seed, collapse, ess):
    """A lag-4 run of 16 steps whose offpolicy/ess_seq at step s is ess(s)."""
    return sr.LagRun(method, 4, seed, 16, 0.05, 16, True, 0.6, collapse, {}, None,
                     [(s, ess(s)) for s in range(1, 17)], True)


def test_ess_before_collapse_reads_every_run_over_the_same_steps():
    """PLAN.md rule 6: "the lowest ESS before the collapse step (before the same step in the non-collapsed runs)".
    One run collapses at step 8; three collapse at 16 after their ESS fell from step 8 on; three never collapse. Over
    the steps every run shares (1-7, before the earliest collapse) the collapsed runs' ESS is not lower: not shown.
    The unequal windows (each collapsed run up to its own collapse, the survivors up to step 8) saw the late fall and
    said "holds"; the report gives that reading beside the corrected one."""
    fell = {"grpo_tis@k4": {0: _ess_run("grpo_tis", 0, 8, lambda s: 0.55)},
            "kl_cov_tis@k4": {i: _ess_run("kl_cov_tis", i, 16, lambda s, i=i: 0.6 + 0.01 * i if s < 8 else 0.2 + 0.01 * i)
                              for i in range(3)}}
    held = {"grpo_ess@k4": {i: _ess_run("grpo_ess", i, None, lambda s, i=i: 0.6 + 0.01 * i) for i in range(3)}}
    step, equal, unequal = sr.ess_before_collapse([r for c in (fell | held).values() for r in c.values()])
    # Steps 1-7: collapsed minima 0.55, 0.60, 0.61, 0.62 (mean 0.595) against 0.60, 0.61, 0.62 (mean 0.61).
    assert step == 8 and equal[0] == pytest.approx(-0.015) and equal[1] < 0 < equal[2]
    # Unequal: 0.55, 0.20, 0.21, 0.22 (mean 0.295) against the same survivors: -0.315, and the interval lies below 0.
    assert unequal[0] == pytest.approx(-0.315) and unequal[2] < 0
    text = sr.section_ess_collapse(fell | held)
    assert "k = 4: 4 collapsed, 3 did not; lowest ESS before step 8 (the earliest collapse), collapsed minus not: -0.0150" in text
    assert "VCPO's claim: not shown (the interval includes 0). The unequal windows read -0.3150 [" in text
    assert "]: holds.\n- k = 16" in text and "made after seeing the data" in text


def test_ess_before_collapse_counts_each_trajectory_once():
    """Rule 6 pools methods: a run that repeats another's trajectory (M2PO that never masked, the lag budget at lag 0)
    is one observation. Three survivors of which one is a duplicate leave two: undetermined."""
    fell = {s: _lag_run("grpo_tis", s, 8, 0.2 + 0.01 * s) for s in range(3)}
    held = {s: _lag_run("kl_cov_tis", s, None, 0.6 + 0.01 * s) for s in range(2)}
    twin = {0: replace(_lag_run("kl_cov_m2po", 0, None, 0.6), duplicate_of="kl_cov_tis@k4@s0")}
    text = sr.section_ess_collapse({"grpo_tis@k4": fell, "kl_cov_tis@k4": held, "kl_cov_m2po@k4": twin})
    assert "k = 4: 3 collapsed, 2 did not (distinct runs; 1 duplicates counted once): undetermined (needs 3 of each)" in text
    counted = {"grpo_tis@k4": fell, "kl_cov_tis@k4": held, "kl_cov_m2po@k4": {0: _lag_run("kl_cov_m2po", 0, None, 0.6)}}
    assert "k = 4: 3 collapsed, 3 did not; lowest ESS" in sr.section_ess_collapse(counted)


def test_a_comparison_with_all_but_one_seed_identical_cannot_fail():
    # n - 1 differences exactly 0 and one x: the mean is x / n, the half-width t·|x| / n with t > 1, whatever x is.
    for x in (1e-9, -0.3, 5.0):
        for n in (2, 3, 5):
            mean, lo, hi = t_interval([0.0] * (n - 1) + [x])
            assert lo < 0 < hi and mean == pytest.approx(x / n)
    assert sr.cannot_fail(3, 3) and sr.cannot_fail(2, 3) and not sr.cannot_fail(1, 3) and not sr.cannot_fail(1, 1)
    assert "a run minus itself: 0" in sr.why_cannot_fail(3, 3)
    assert "2 of the 3 per-seed differences are exactly 0" in sr.why_cannot_fail(2, 3)


def test_steps_to_half_entropy_leaves_the_table_only_when_every_run_of_a_lag_shares_it():
    def run(method, k, seed, half):
        return sr.LagRun(method, k, seed, 64, 0.03, half, False, 0.7, None, {}, None, [], True, first_eval=8)

    pinned = sr.by_cell([run(m, k, s, 8) for m in ("grpo_tis", "kl_cov_tis") for k in (0, 4) for s in range(3)])
    assert sr.half_step_by_lag(pinned) == {0: 8, 4: 8}
    assert "| steps to half |" not in sr.section_endpoints(pinned)
    check = sr.implementation_checks(pinned)
    assert "steps to half entropy (a plan endpoint no verdict rule uses) takes one value in every run of a lag: step 8 " \
           "at k = 0 and 4; that is the first evaluation after step 0 in every run" in check
    spread = sr.by_cell([run("grpo_tis", 0, s, 8 + 8 * s) for s in range(3)])
    assert sr.half_step_by_lag(spread) is None and "steps to half" in sr.section_endpoints(spread)
    assert "steps to half entropy" not in sr.implementation_checks(spread)


def _d0_cells(kl_cov_gain):
    """GRPO + TIS and KL-Cov + TIS at lag 0 (and 64, equal there), 3 seeds; KL-Cov's on-policy end entropy higher by
    `kl_cov_gain` with a little seed noise."""
    noise = (0.0, 0.0012, -0.0010)
    runs = [sr.LagRun(m, k, s, 64, 0.03 + 0.001 * s + (kl_cov_gain + noise[s] if m == "kl_cov_tis" and k == 0 else 0.0),
                      8, False, 0.7, None, {}, None, [], True)
            for m in ("grpo_tis", "kl_cov_tis") for k in (0, 64) for s in range(3)]
    return sr.by_cell(runs)


def test_rule_2_reads_its_lag_0_difference_beside_the_dose_studys_controls():
    controls = ("5e-5", {a: Contrast(a, 3, d, d - 0.003, d + 0.003, 0.004) for a, d in
                         (("kl_cov", 0.0046), ("kl_cov_random", 0.0058), ("ppo_clip1", 0.0043), ("grpo_mb1", 0.0),
                          ("grpo_mb4", 0.0), ("grpo_mb16", 0.0), ("choice", -0.0012))})
    text = sr.section_kl_cov(_d0_cells(0.003), controls)
    assert "**KL-Cov fails under staleness**" in text
    reading = text.split("Reading (2026-12-07, written after the data; the verdict above stands as rule 2 gives it): ")[1]
    assert reading.startswith("D_0 = +0.0031 [0.0003, 0.0058] is not shown to be covariance selection") and "the chain task at lr 5e-5" in reading
    assert "KL-Cov's random-token control +0.0058 [0.0028, 0.0088]" in reading and "wider trust region" in reading
    assert "D_0 does not survive Bonferroni's correction within rule 2 (m = 8: corrected [" in reading
    strong = sr.section_kl_cov(_d0_cells(0.03), None)
    assert "D_0 survives Bonferroni's correction" in strong and "its controls are not read here" in strong
    assert "Reading (" not in sr.section_kl_cov(_d0_cells(0.0), controls)  # D_0 not above 0: nothing to read
    assert sr.dose_controls("/nonexistent") is None


def _with_score(name, steps_of, score, **kw):
    method, k, seed = sr.parse_name(name)
    rows = _rows(k, steps_of[name], kl=0.001 * (k + 1) * (1 + 0.1 * seed), capfrac=1e-4 * (k + 1) * (1 + 0.1 * seed), **kw)
    return [r | {"critic/score/mean": score + 0.001 * r["step"]} if "actor/entropy" in r else r for r in rows]


def test_duplicates_are_found_from_the_runs_and_their_comparisons_become_checks(tmp_path):
    """M2PO on-policy repeats TIS to the bit, and at lag 4 it never fired in seeds 0 and 1: those runs are found as
    duplicates from their trajectories (actor/entropy and critic/score/mean), named in the report, and the comparisons
    they make cannot fail, so they are implementation checks, not verdicts."""
    names = [f"{m}@k{k}@s{s}" for s in (0, 1, 2) for m in ("grpo_tis", "kl_cov_tis", "kl_cov_m2po", "grpo_m2po")
             for k in (0, 4, 16, 64)]
    steps_of = {n: staleness_steps(sr.parse_name(n)[1], 8) for n in names}
    meta = _study(tmp_path, names, steps_of)
    for name in names:
        method, k, seed = sr.parse_name(name)
        own = k > 4 or (k == 4 and seed == 2)  # M2PO acts: a trajectory of its own
        base = {"kl_cov_m2po": "kl_cov_tis", "grpo_m2po": "grpo_tis"}.get(method, method) if not own else method
        score = {"grpo_tis": 0.1, "kl_cov_tis": 0.2, "kl_cov_m2po": 0.3, "grpo_m2po": 0.4}[base] + 0.01 * seed + 0.001 * k
        kw = {"entropy_end": 0.06} if base.startswith("kl_cov") else {}
        rows = _with_score(name, steps_of, score, **kw)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    text = open(sr.write_staleness_report(str(tmp_path), names, meta, dose_dir=str(tmp_path / "no-dose"))).read()
    assert ("10 of the 48 runs repeat an earlier run's actor/entropy and critic/score/mean at every step (bit-identical "
            "duplicates: kl_cov_m2po@k0 = kl_cov_tis@k0 (seeds 0, 1, 2); kl_cov_m2po@k4 = kl_cov_tis@k4 (seeds 0, 1); "
            "grpo_m2po@k0 = grpo_tis@k0 (seeds 0, 1, 2); grpo_m2po@k4 = grpo_tis@k4 (seeds 0, 1)), so they hold 38 "
            "distinct trajectories") in text
    rule3 = text.split("## 4.")[1].split("## 5.")[0]
    assert "k = 0: not a verdict: KL-Cov + M2PO ran KL-Cov + TIS's trajectory at 3 of 3 seeds, so no outcome could differ" in rule3
    assert "k = 4: not a verdict: KL-Cov + M2PO ran KL-Cov + TIS's trajectory at 2 of 3 seeds, so its intervals cannot exclude 0" in rule3
    assert rule3.count("Verdict") == 2  # k = 16 and 64 only
    assert "| grpo_m2po | 4 | not a comparison: grpo_tis's runs at 2 of 3 seeds (section 9) |" in text
    checks = text.split("## 9.")[1].split("## 10.")[0]
    assert "M2PO with KL-Cov (rule 3) at k = 0 cannot fail: its runs are the other arm's at 3 of 3 seeds" in checks
    assert "grpo_m2po - grpo_tis (rule 4) at k = 4 cannot fail: its runs are the other arm's at 2 of 3 seeds" in checks
    rule6 = text.split("## 8.")[1].split("## 9.")[0]
    assert "k = 0: 0 collapsed, 6 did not (distinct runs; 6 duplicates counted once)" in rule6
    assert "k = 4: 0 collapsed, 8 did not (distinct runs; 4 duplicates counted once)" in rule6


def test_archive_keeps_every_complete_run_any_invocation_asked_for(tmp_path):
    """Two invocations on one directory (GRPO's runs, then KL-Cov's): study.json's run_steps keeps both, and the
    archive copies every complete run of either, judged at its own length."""
    from study import archive

    src = tmp_path / "src"
    names = ["grpo_tis@k0@s0", "grpo_tis@k64@s0", "kl_cov_tis@k0@s0"]
    steps_of = {n: staleness_steps(sr.parse_name(n)[1], 8) for n in names}
    _study(src, names, steps_of)
    for n in names:
        open(src / n / "config.toml", "w").write("")
    first = study_runs.new_meta(study_runs.make_plan(study_runs.parse_args(
        ["--preset", "staleness", "--steps", "8", "--methods", "grpo_tis", "--staleness", "0,64", "--study-dir", str(src)]),
        "cmd", datetime.datetime(2026, 11, 26)), None, datetime.datetime(2026, 11, 26))
    second = study_runs.new_meta(study_runs.make_plan(study_runs.parse_args(
        ["--preset", "staleness", "--steps", "8", "--methods", "kl_cov_tis", "--staleness", "0", "--study-dir", str(src)]),
        "cmd", datetime.datetime(2026, 11, 26)), first, datetime.datetime(2026, 11, 26))
    assert second["runs"] == ["kl_cov_tis@k0@s0"] and second["run_steps"] == steps_of
    with open(src / "study.json", "w") as f:
        json.dump(second, f)
    assert sorted(archive.archive(str(src), str(tmp_path / "dest"))) == sorted(names)


def test_archive_keeps_every_value_exactly_but_the_machines_clocks(tmp_path):
    from study import archive

    rows = [{"step": 1, "actor/entropy": 0.1 + 0.2, "offpolicy/ess_seq": 1 / 3, "timing_s/step": 2.5,
             "perf/gen_tokens_per_s": 812.25, "eval/chain/acc": None, "note": "caf\u00e9"},
            {"step": 2, "actor/entropy": 1e-300, "timing_s/train": 1.0, "staleness/max": 4}]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("[run]\nseed = 0\n")
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    archive.write_runs(str(tmp_path / "dest"), archive.run_files(str(tmp_path / "run")))
    assert os.listdir(tmp_path / "dest") == ["runs.tar.xz"]
    assert archive.read_run(str(tmp_path / "dest" / "run")) == [
        {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]
    assert archive.archived(str(tmp_path / "dest"))["run/config.toml"] == b"[run]\nseed = 0\n"


def test_the_report_from_the_archive_equals_the_report_from_the_run_directories(tmp_path):
    """What docs/study-staleness keeps (runs.tar.xz beside study.json) gives the report and plots its run
    directories gave."""
    from study import archive

    names = [f"{m}@k{k}@s{s}" for s in (0, 1) for m in ("grpo_tis", "kl_cov_tis") for k in (0, 4, 16, 64)]
    steps_of = {n: staleness_steps(sr.parse_name(n)[1], 8) for n in names}
    meta = _study(tmp_path / "src", names, steps_of, kl_cov_tis={"entropy_end": 0.15})
    for n in names:
        (tmp_path / "src" / n / "config.toml").write_text(f"# {n}\n")
    with open(tmp_path / "src" / "study.json", "w") as f:
        json.dump(meta, f)
    assert sorted(archive.archive(str(tmp_path / "src"), str(tmp_path / "dest"))) == sorted(names)
    assert sorted(os.listdir(tmp_path / "dest")) == ["runs.tar.xz", "study.json"]
    now = datetime.datetime(2026, 11, 28, 9, 0)
    reports = [open(sr.write_staleness_report(str(tmp_path / d), names, meta, now=now)).read() for d in ("src", "dest")]
    assert reports[0] == reports[1] and "16 of 16 runs complete" in reports[0]
    for png in sr.PLOTS:
        assert (tmp_path / "src" / png).read_bytes() == (tmp_path / "dest" / png).read_bytes()


def test_header_names_the_learning_rate_that_the_runs_used():
    """The preset sets lr 5e-5 and a user's --set learner.lr=2e-5 comes after it: the runs train at 2e-5 (the last
    override wins), so the report's title must say 2e-5, not the preset's value."""
    meta = {"overrides": {"preset": ["learner.lr=5e-5"], "user": ["learner.lr=2e-5"]}, "command": "covrl study x"}
    now = datetime.datetime(2026, 11, 27, 3, 30)
    head = sr.section_header(meta, now, ["grpo_tis@k0@s0"], [])
    assert head.startswith("# Staleness study at learner.lr = 2e-5\n") and "last invocation: `covrl study x`" in head
    assert sr.section_header({"overrides": {"preset": ["learner.lr=5e-5"]}}, now, [], []).startswith(
        "# Staleness study at learner.lr = 5e-5\n")
    # The dose report picks its pilot by the same rule.
    from study.arms import study_lr
    assert study_lr(meta) == "2e-5" and study_lr({"overrides": {"preset": ["eval.k=2"]}}) is None
