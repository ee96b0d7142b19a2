"""The dose-response study (study/arms.py, study/dose_report.py, `covrl study --preset dose --jobs N`): endpoints
on hand-built rows, verdicts that must flip with the data, and several runs at a time as real processes."""

import datetime
import json
import math
import os
import signal
import sys
import time

import pytest

from study import dose_report
from study import runs as study_runs
from study.arms import ARMS, LADDERS, OFF_POLICY, RANDOM_CONTROLS

NOW = datetime.datetime(2026, 11, 26, 12, 0, 0)


def rows_for(entropies, *, evals=None, selected_frac=0.0, share=None, length=20.0):
    """metrics.jsonl rows: row 0 holds the base model's eval; row s (1..n) its training metrics and, where `evals`
    has one, the eval of version s."""
    evals = evals or {}
    out = [{"step": 0, "eval/a/acc": evals.get(0, 0.3), "eval/b/acc": evals.get(0, 0.3)}]
    for s, h in enumerate(entropies, 1):
        row = {"step": s, "actor/entropy": h, "actor/cov_selected_frac": selected_frac, "response_length/mean": length,
               "actor/pg_clipfrac": 1e-3}
        if share is not None:
            row["actor/cov_selected_share"] = share
        if s in evals:
            row |= {"eval/a/acc": evals[s], "eval/b/acc": evals[s]}
        out.append(row)
    return out


def test_endpoints_hand_computed():
    # 20 steps: the first 10 % (2 steps) average 0.1, so half is 0.05, first reached at step 7; the last 2 average 0.02.
    entropies = [0.1, 0.1, 0.09, 0.08, 0.07, 0.06, 0.05, 0.04] + [0.03] * 10 + [0.02, 0.02]
    e = dose_report.endpoints(rows_for(entropies, evals={10: 0.5, 15: 0.6, 20: 0.7}, selected_frac=0.01, share=0.3),
                              responses_per_step=8)
    assert e.end_entropy == pytest.approx(0.02) and e.half_step == 7 and not e.censored
    assert e.acc == pytest.approx(0.6)  # the mean of the last 3 evaluations (steps 10, 15, 20)
    assert e.dose_tokens == pytest.approx(0.01 * 20.0 * 8) and e.dose_share == pytest.approx(0.3)
    never = dose_report.endpoints(rows_for([0.1] * 20), responses_per_step=8)
    assert never.censored and never.half_step == 20 and never.acc is None  # one eval only: no last-3 mean


def test_an_interval_end_that_is_not_zero_never_prints_as_zero():
    # A lower end of 7e-06 excludes 0 (the verdict says so); at 4 decimals it would read 0.0000 and seem to touch it.
    assert dose_report.bounds(7e-06, 0.0011) == "[7e-06, 0.0011]"
    assert dose_report.bounds(-3.2e-07, 4.56e-05) == "[-3.2e-07, 4.6e-05]"
    assert dose_report.bounds(0.0, 0.0) == "[0.0000, 0.0000]"  # an exact 0 stays at its decimals
    assert dose_report.bounds(-0.0123, 0.0456, 3) == "[-0.012, 0.046]"
    assert dose_report.bounds(None, float("nan")) == "[n/a, n/a]"
    assert dose_report.fmt(1.1e-13, 5) == "1.1e-13" and dose_report.fmt(2e-05, 3, sign=True) == "+2e-05"
    assert dose_report.fmt(0.02, 3, sign=True) == "+0.020" and dose_report.fmt(0.0) == "0.0000"
    assert dose_report.bounds(-0.0, 0.0) == "[0.0000, 0.0000]" and dose_report.fmt(-4e-05, sign=True) == "-4e-05"
    # Every table and verdict goes through it: a mean over seeds, and the dose report's arm-against-GRPO table.
    assert dose_report.ci_text([1e-06, 2e-06, 3e-06]) == "2e-06 [-4.8e-07, 4.5e-06]"
    tiny = {"grpo": [0.03, 0.03, 0.03], "kl_cov": [0.03002, 0.03001, 0.03003]}
    assert "| kl_cov | 2e-05 [-4.8e-06, 4.5e-05] |" in dose_report.section_against_grpo(arms_from(tiny))
    c = dose_report.Contrast("G", 3, 0.00057, 6.7e-06, 0.0011, 0.0007)
    assert c.excludes_zero(1) and c.text() == "G: +0.0006 [6.7e-06, 0.0011] over 3 seeds (minimum detectable effect 0.0007)"


def arms_from(end_entropy: dict[str, list[float]]) -> dict:
    """{arm: {seed: Endpoints}} with these end entropies per seed (other endpoints fixed)."""
    def ends(h, half=10):
        return dose_report.Endpoints(end_entropy=h, half_step=half, censored=False, acc=0.8, dose_tokens=5.0,
                                     dose_share=0.3, clipfrac=1e-3, entropy_per_response=(2.0, 1.0), eval_entropy=0.03)
    return {arm: {seed: ends(h) for seed, h in enumerate(values)} for arm, values in end_entropy.items()}


@pytest.mark.parametrize("method", sorted(LADDERS))
def test_mechanism_holds_only_when_dose_and_covariance_both_matter(method):
    top, random_arm = RANDOM_CONTROLS[method]
    published = LADDERS[method][0]  # the lowest dose
    works = arms_from({published: [0.030, 0.031, 0.029], top: [0.050, 0.052, 0.049], random_arm: [0.031, 0.030, 0.030]})
    assert "**holds**" in dose_report.claim_mechanism(works, method)
    # Random tokens of the same count raise entropy as much: the count, not the covariance, did it.
    count_only = works | arms_from({random_arm: [0.050, 0.053, 0.048]})
    assert "does not hold" in dose_report.claim_mechanism(count_only, method)
    # No dose effect at all.
    flat = arms_from({published: [0.030, 0.031, 0.029], top: [0.031, 0.029, 0.030], random_arm: [0.030, 0.030, 0.031]})
    assert "does not hold" in dose_report.claim_mechanism(flat, method)
    assert "**undetermined**" in dose_report.claim_mechanism({top: works[top]}, method)  # no control ran


def test_off_policy_claim_flips_with_the_data():
    def arms(end16, half16):
        base = {OFF_POLICY[1]: {s: dose_report.Endpoints(0.04 + 0.001 * s, 20 + s, False, 0.8, 0, None, 0, None, None)
                                for s in range(3)}}
        return base | {OFF_POLICY[16]: {s: dose_report.Endpoints(end16 + 0.001 * s, half16 + s, False, 0.8, 0, None, 0,
                                                                 None, None) for s in range(3)}}

    # The rule holds, but 16 updates a batch are also 16x the optimizer steps of 1: the verdict says it is confounded.
    holds = dose_report.claim_off_policy(arms(0.02, 10))
    assert "**confounded: holds as run**, but 16 updates a batch are also 16x the optimizer steps of 1" in holds
    assert "not monotone" not in holds  # two rungs, falling
    # With the middle rungs, end entropy that does not fall at every rung is named (the dose study's 1, 4, 8, 16).
    middle = {a: {s: dose_report.Endpoints(h + 0.001 * s, 12, False, 0.8, 0, None, 0, None, None) for s in range(3)}
              for a, h in ((OFF_POLICY[4], 0.018), (OFF_POLICY[8], 0.019))}
    ladder = dose_report.claim_off_policy(arms(0.02, 10) | middle)
    assert "end entropy is not monotone in updates per batch (0.0410 at 1, 0.0190 at 4, 0.0200 at 8, 0.0210 at 16)" in ladder
    assert "**holds**" not in ladder
    assert "does not hold" in dose_report.claim_off_policy(arms(0.04, 20))  # no difference
    assert "does not hold" in dose_report.claim_off_policy(arms(0.02, 25))  # lower at the end but slower to halve


def test_report_renders_every_arm_with_intervals_and_the_pilot_rule(tmp_path):
    pilots = {}
    for lr, late_acc, clip in (("2e-5", 0.7, 5e-4), ("5e-5", 0.75, 2e-3), ("1e-4", 0.2, 5e-3)):
        d = tmp_path / "pilots" / f"lr{lr}" / "grpo"
        d.mkdir(parents=True)
        rows = rows_for([0.1] * 30, evals={10: late_acc, 20: late_acc, 30: late_acc})
        for r in rows[1:]:
            r["actor/pg_clipfrac"] = clip
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        pilots[lr] = str(d)
    assert dose_report.study_pilots(str(tmp_path)) == pilots
    assert [ok for *_, ok in dose_report.pilot_rows(pilots)] == [False, True, False]  # lr* = 5e-5
    arms = arms_from({a: [0.03, 0.031, 0.032] for a in ARMS})
    text = dose_report.render(arms, {"command": "covrl study --preset dose"}, NOW, list(ARMS), pilots)
    for arm in ARMS:
        assert f"| {arm} |" in text
    assert "0.0310 [" in text and "minimum detectable effect" in text


def test_every_arm_is_a_valid_config_and_every_departure_says_so():
    from common.config import load_config

    for name, arm in ARMS.items():
        cfg = load_config(None, [*study_runs.PRESETS["dose"]["overrides"], *arm.overrides])
        assert cfg.learner.mini_batches in OFF_POLICY
        published = name in ("grpo", "clip_cov", "kl_cov")
        assert (arm.departure == "") == published, name


def test_jobs_run_several_runs_at_once_as_processes(tmp_path, monkeypatch, capsys):
    """--jobs 2: every run starts as its own process with its output in STUDY_DIR/logs; a failed run stops new
    starts, the one in flight finishes, and both outcomes are in study.json."""
    script = ("import json, os, sys, time; d = sys.argv[1]; time.sleep(0.3); os.makedirs(d);"
              "code = 3 if d.endswith('kl_cov') else 0;"
              "open(os.path.join(d, 'metrics.jsonl'), 'w').write(json.dumps({'step': 5, 'actor/entropy': 0.1}) + '\\n')"
              " if code == 0 else None; print('ran', d); sys.exit(code)")
    monkeypatch.setattr(study_runs, "cluster_command",
                        lambda plan, name: [sys.executable, "-c", script, os.path.join(plan.study_dir, name)])
    monkeypatch.setattr(study_runs, "write_report", lambda *a, **k: str(tmp_path / "report.md"))
    args = ["--methods", "grpo,kl_cov,par", "--steps", "5", "--study-dir", str(tmp_path), "--jobs", "2"]
    assert study_runs.main(args) == 1
    assert "method kl_cov: the cluster run exited with code 3" in capsys.readouterr().err
    meta = json.load(open(tmp_path / "study.json"))
    assert meta["status"] == {"grpo": "ran", "kl_cov": "failed (exit 3)"}  # par never started
    assert (tmp_path / "logs" / "grpo.log").read_text().startswith("ran ")
    assert study_runs.main(["--methods", "grpo", "--steps", "5", "--study-dir", str(tmp_path / "x"), "--jobs", "0"]) == 2


def test_archive_keeps_complete_runs_config_and_metrics_in_one_archive(tmp_path, capsys):
    import tarfile

    from study import archive
    from study import runs as study_runs

    src, dest = tmp_path / "study", tmp_path / "kept"
    rows = rows_for([0.1, 0.08, 0.05])
    for name, n in (("grpo", 4), ("kl_cov", 2)):  # kl_cov stopped one step short of the study's 3
        d = src / name
        d.mkdir(parents=True)
        (d / "config.toml").write_text("[run]\nseed = 0\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
        (d / "rollouts").mkdir()
    (src / "study.json").write_text(json.dumps({"runs": ["grpo", "kl_cov"], "steps": 3}))
    assert archive.main([str(src), str(dest)]) == 0
    assert sorted(os.listdir(dest)) == ["runs.tar.xz", "study.json"]
    with tarfile.open(dest / "runs.tar.xz") as tar:
        assert tar.getnames() == ["grpo/config.toml", "grpo/metrics.jsonl"]
    assert archive.read_run(str(dest / "grpo")) == rows and archive.read_run(str(dest / "kl_cov")) == []
    assert study_runs.run_status(str(dest / "grpo"), 3) == "complete"  # a study continued from the archive skips it
    assert study_runs.run_status(str(dest / "kl_cov"), 3) == "missing"
    # kl_cov finishes later: archiving again adds it and keeps grpo as it was
    (src / "kl_cov" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = archive.archived(str(dest))
    assert archive.main([str(src), str(dest)]) == 0
    after = archive.archived(str(dest))
    assert sorted(after) == ["grpo/config.toml", "grpo/metrics.jsonl", "kl_cov/config.toml", "kl_cov/metrics.jsonl"]
    assert {k: after[k] for k in before} == before and archive.read_run(str(dest / "kl_cov")) == rows
    assert archive.main([str(tmp_path / "nowhere"), str(dest)]) == 2
    assert "has no study.json" in capsys.readouterr().err


def test_the_law_by_intervention_flips_with_the_data():
    """Arms that hold entropy apart at equal step: accuracy that follows -exp(H) passes, accuracy that follows only
    the step fails."""
    from study.lawfit import EvalPoint

    def points(follows_entropy):
        out = {}
        for run, offset in enumerate((0.0, 0.02, 0.04, 0.06)):
            pts = []
            for step in range(10, 70, 10):
                h = 0.12 - 0.001 * step + offset + 0.003 * ((run * 7 + step) % 5)
                acc = 2.0 - 1.6 * math.exp(h) if follows_entropy else 0.3 + 0.008 * step
                pts.append(EvalPoint(f"r{run}", step, h, acc + 0.001 * ((run + step) % 3), None))
            out[f"r{run}"] = pts
        return out

    assert "**holds**" in dose_report.law_line("H", points(True))
    assert "does not hold" in dose_report.law_line("H", points(False))
    both = dose_report.section_law(points(True), points(False))
    assert both.count("**holds**") == 1 and both.count("does not hold") == 1


def test_an_interrupted_parallel_study_stops_and_records_every_run(tmp_path, monkeypatch, capsys):
    """Ctrl-C while two runs are going: both get SIGINT and are waited for (no process left), both are recorded,
    and the message names the unfinished ones. The interrupt comes once both children print that they run: a
    SIGINT sent between a child's fork and its exec would be lost (the parent's handler is still installed there)."""
    started = []
    script = "import sys, time; print('running', flush=True); time.sleep(60)"
    real_sleep = time.sleep

    def command(plan, name):
        return [sys.executable, "-c", script, name]

    real_start = study_runs.start_logged

    def start(plan, name):
        proc = real_start(plan, name)
        started.append(proc)
        return proc

    def interrupt(_seconds):
        logs = [tmp_path / "logs" / f"{name}.log" for name in ("grpo", "kl_cov")]
        deadline = time.monotonic() + 30
        while not all(p.exists() and "running" in p.read_text() for p in logs) and time.monotonic() < deadline:
            real_sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(study_runs, "cluster_command", command)
    monkeypatch.setattr(study_runs, "start_logged", start)
    monkeypatch.setattr(study_runs.time, "sleep", interrupt)
    # Children inherit an ignored SIGINT (an earlier test in this process may have left it so): as under a shell,
    # a child of this test must see SIGINT's default, so its Python turns it into KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request_restore = lambda: signal.signal(signal.SIGINT, previous)  # noqa: E731
    args = ["--methods", "grpo,kl_cov,par", "--steps", "5", "--study-dir", str(tmp_path), "--jobs", "2"]
    t0 = time.monotonic()
    try:
        code = study_runs.main(args)
    finally:
        request_restore()
    assert code == 130
    assert time.monotonic() - t0 < 40  # the children stopped at the SIGINT, not after their 60 s
    assert len(started) == 2 and all(p.returncode is not None for p in started)
    assert "interrupted while running grpo, kl_cov" in capsys.readouterr().err
    meta = json.load(open(tmp_path / "study.json"))
    assert set(meta["status"]) == {"grpo", "kl_cov"} and all(v.startswith("failed") for v in meta["status"].values()), meta


def test_the_on_policy_reading_tells_the_trust_region_from_the_covariance_choice():
    """Section 4.1 (post hoc): the on-policy end entropy of each arm minus GRPO's. The trust-region reading needs both
    arms without a covariance choice (the random control, PPO clip 1) above GRPO; arms with GRPO's own clip above it
    too mean GRPO's runs sit low, which the reading then says."""
    grpo, noise = (0.030, 0.031, 0.029), (0.0, 0.0005, -0.0004)

    def arms(**effects):
        ends = {"grpo": 0.0} | {a: effects.get(a, 0.0) for a in ("kl_cov", "kl_cov_random", "ppo_clip1", "grpo_mb1",
                                                                 "grpo_mb4", "grpo_mb16")}
        return {a: {s: dose_report.Endpoints(0.03, 10, False, 0.8, 0, None, 0, None,
                                             g + d + (n if a != "grpo" else 0.0))
                    for s, (g, n) in enumerate(zip(grpo, noise))} for a, d in ends.items()}

    both = dose_report.trust_region_reading(dose_report.trust_region_contrasts(
        arms(kl_cov=0.005, kl_cov_random=0.005, ppo_clip1=0.004)))
    assert both.startswith("the arms with no covariance choice end above GRPO on this endpoint")
    assert "comes with the wider trust region" in both and "sit low" not in both
    assert "PPO with clip 1 and no selection +0.0040 [" in both and "KL-Cov minus its random control" in both
    one = dose_report.trust_region_reading(dose_report.trust_region_contrasts(arms(kl_cov=0.005, kl_cov_random=0.005)))
    assert one.startswith("the arms with no covariance choice are not both shown above GRPO")
    low = dose_report.trust_region_reading(dose_report.trust_region_contrasts(
        arms(kl_cov=0.005, kl_cov_random=0.005, ppo_clip1=0.004, grpo_mb16=0.004)))
    assert "GRPO's runs sit low on this endpoint" in low and "grpo_mb16 +0.0040 [" in low and "grpo_mb1 " not in low
    section = dose_report.section_on_policy(arms(kl_cov=0.005, kl_cov_random=0.005, ppo_clip1=0.004))
    assert section.startswith("## 4.1 Each arm against GRPO on the on-policy end entropy (post hoc: not in PLAN.md)")
    assert "| kl_cov_random | 0.0350 [" in section and "uncorrected for the table's 6 comparisons" in section


def test_on_policy_end_entropy_is_the_mean_of_the_last_three_evaluations():
    rows = rows_for([0.1] * 20, evals={5: 0.5, 10: 0.6, 15: 0.6, 20: 0.7})
    for r, h in zip([r for r in rows if "eval/a/acc" in r], (0.12, 0.05, 0.04, 0.03, 0.02)):
        r |= {"eval/a/entropy": h, "eval/b/entropy": h + 0.01}
    e = dose_report.endpoints(rows, responses_per_step=8)
    assert e.eval_entropy == pytest.approx((0.045 + 0.035 + 0.025) / 3)  # steps 10, 15, 20; mean over the 2 sources
