"""study/report.py: the report from synthetic run dirs; study/runs.py: argument checks, resume and
failures; covrl plots (study/plots.py) on the same runs. Never launches a cluster."""

import datetime
import json
import math
import os

from study import report as study_report
from study import runs as study_runs

A, B = 0.3, 1.2  # eval law: acc = -A exp(H) + B (mean over the two data sources)
A_TRAIN, B_TRAIN = 0.2, 0.9  # training reward law, distinct so the two tables can be told apart
STEPS, EVAL_EVERY = 40, 5
NOW = datetime.datetime(2025, 6, 1, 12, 0, 0)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Entropy of policy version v per method: GRPO collapses fastest, KL-Cov slowest.
ENTROPY = {
    "grpo": lambda v: 0.2 + 0.8 * math.exp(-v / 8),
    "clip_higher": lambda v: 0.35 + 0.65 * math.exp(-v / 15),
    "clip_cov": lambda v: 0.5 + 0.5 * math.exp(-v / 30),
    "kl_cov": lambda v: 0.6 + 0.4 * math.exp(-v / 40),
    "par": lambda v: 0.3 + 0.7 * math.exp(-v / 12),
}


def write_run(run_dir, entropy, cov_sign=-1.0, steps=STEPS, with_eval=True):
    """metrics.jsonl as the learner writes it: row s has the entropy of version s-1 and the delta to version s;
    eval rows (step 0 and every EVAL_EVERY) evaluate version s. cov_mean = cov_sign * 10 * delta + a small wobble,
    so cov_sign=-1 gives a negative correlation with the entropy change."""
    os.makedirs(run_dir, exist_ok=True)

    def evals(v):
        acc = -A * math.exp(entropy(v)) + B
        return {"eval/arith_easy/acc": acc + 0.1, "eval/arith_hard/acc": acc - 0.1,
                "eval/arith_easy/pass@4": min(1.0, acc + 0.15), "eval/arith_hard/pass@4": acc,
                "eval/arith_easy/response_length": 20.0}

    rows = [{"step": 0, **evals(0)}] if with_eval else []
    for s in range(1, steps + 1):
        delta = entropy(s) - entropy(s - 1)
        row = {"step": s, "actor/entropy": entropy(s - 1), "actor/entropy_delta": delta,
               "actor/cov_mean": cov_sign * 10 * delta + 0.001 * (s % 3),
               "critic/score/mean": -A_TRAIN * math.exp(entropy(s - 1)) + B_TRAIN, "response_length/mean": 30.0 + s,
               "actor/par_lambda": min(1.0, 0.05 * s)}
        if with_eval and s % EVAL_EVERY == 0:
            row.update(evals(s))
        rows.append(row)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def make_study(tmp_path, methods=tuple(ENTROPY), **overrides):
    for m in methods:
        write_run(tmp_path / m, overrides.get(m, ENTROPY[m]))
    return str(tmp_path)


def claim(report: str, tag: str) -> str:
    lines = [ln for ln in report.splitlines() if ln.startswith(f"- ({tag})")]
    assert lines, f"no claim ({tag}) in the report"
    return "\n".join(lines)


def render(study_dir, methods):
    runs = [study_report.load_run(study_dir, m) for m in methods]
    return study_report.render_report(runs, {}, NOW, method_overrides=study_runs.METHODS)


def test_report_has_every_section_and_recovers_the_law(tmp_path):
    d = make_study(tmp_path)
    meta = {"preset": "arith", "steps": STEPS, "seed": 0, "gens": 1, "learners": 1, "command": "python study/runs.py x",
            "wall_clock_s": {m: 12.5 for m in ENTROPY}, "status": {m: "ran" for m in ENTROPY}}
    path = study_report.write_report(d, list(ENTROPY), meta, now=NOW, method_overrides=study_runs.METHODS)
    text = open(path).read()
    for heading in ("## 1. Study", "## 2. Summary", "## 3. Entropy–performance law", "## 4. Early prediction",
                    "## 5. Covariance check", "## 6. Does it match the paper?", "## 7. Seeds", "## 8. Staleness",
                    "## 9. Plots"):
        assert heading in text
    assert "Each method ran at one seed" in text and "No staleness axis in this study" in text
    assert "at one seed; the seed spread is unknown" in claim(text, "g")
    assert "`python study/runs.py x`" in text and "2025-06-01 12:00:00" in text and "12.5" in text
    # The header's method table shows the overrides the runner passed in.
    assert "| clip_higher | `learner.loss.type=ppo`, `learner.loss.clip_low=0.2`, `learner.loss.clip_high=0.28` | ran |" in text
    # Eval points lie exactly on the law, so every fit and the pooled one recover a=0.3, b=1.2, R^2=1,
    # ceiling 0.9; 9 eval points per method (steps 0, 5, ..., 40), 45 pooled.
    assert "| pooled (all methods) | 45 | 0.3000 | 1.2000 | 1.000 | 0.9000 |" in text
    assert "| grpo | 9 | 0.3000 | 1.2000 | 1.000 | 0.9000 |" in text
    # Training points: 40 per method on their own law.
    assert "| pooled (all methods) | 200 | 0.2000 | 0.9000 | 1.000 | 0.7000 |" in text
    # Early prediction: ceil(9 * 0.15) = 2, at least 3 points fitted, exact, so RMSE 0.
    assert "fit on first 3 of 9: RMSE 0.0000 on the other 6" in text
    # Summary: GRPO's entropy, mean of actor/entropy over the first 4 steps (versions 0-3) -> the last 4 (36-39).
    assert "0.8697 → 0.2074" in text
    assert "arith_easy/pass@4 last" in text
    for tag in ("a", "b", "c", "d", "e", "f1", "f2", "h"):
        assert "**holds**" in claim(text, tag) or "does not hold" in claim(text, tag)
    # The law is claimed for the GRPO family (grpo, clip_higher, par): 27 points; all five methods in the table.
    assert "| pooled (GRPO family) | 27 | 0.3000 | 1.2000 | 1.000 | 0.9000 |" in text
    assert "R² = 1.000 on 27 points" in claim(text, "d") and "**holds**" in claim(text, "d")
    # Early prediction of the final accuracy: 3 exact points predict the last exactly.
    assert "grpo +0.0000" in claim(text, "h") and "3 of 3 within 0.02" in claim(text, "h")
    assert "**holds**" in claim(text, "h")
    # The synthetic accuracy saturates with the entropy, so GRPO plateaus.
    assert "**holds**" in claim(text, "a") and "a plateau" in claim(text, "a")
    for png in study_report.PLOTS:
        assert f"]({png})" in text
        data = open(os.path.join(d, png), "rb").read()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png


def test_collapse_claim_flips(tmp_path):
    d = make_study(tmp_path / "falls", methods=("grpo",))
    assert "**holds**" in claim(render(d, ["grpo"]), "a")
    rising = lambda v: 0.2 + 0.01 * v  # noqa: E731
    d = make_study(tmp_path / "rises", methods=("grpo",), grpo=rising)
    text = claim(render(d, ["grpo"]), "a")
    # Means over versions 0-3 and 36-39: 0.215 -> 0.575, +167.4 %.
    assert "0.2150 → 0.5750 (+167.4 %)" in text and "does not hold at this scale" in text


def test_covariance_claim_flips(tmp_path):
    write_run(tmp_path / "neg" / "grpo", ENTROPY["grpo"], cov_sign=-1.0)
    write_run(tmp_path / "pos" / "grpo", ENTROPY["grpo"], cov_sign=+1.0)
    neg, pos = claim(render(str(tmp_path / "neg"), ["grpo"]), "e"), claim(render(str(tmp_path / "pos"), ["grpo"]), "e")
    assert "**holds**" in neg and "r = -" in neg
    assert "does not hold at this scale" in pos and "r = -" not in pos


def test_entropy_comparison_claims_flip(tmp_path):
    # KL-Cov collapsing harder than GRPO makes (b) fail for KL-Cov while Clip-Cov still holds.
    d = make_study(tmp_path, methods=("grpo", "clip_cov", "kl_cov"), kl_cov=lambda v: 0.1 + 0.9 * math.exp(-v / 4))
    text = claim(render(d, ["grpo", "clip_cov", "kl_cov"]), "b")
    cc, kc = text.splitlines()
    assert "Clip-Cov" in cc and "**holds**" in cc
    assert "KL-Cov" in kc and "does not hold at this scale" in kc


def test_missing_methods_and_keys_do_not_crash(tmp_path):
    write_run(tmp_path / "grpo", ENTROPY["grpo"], with_eval=False)
    path = study_report.write_report(str(tmp_path), ["grpo", "par"], {}, now=NOW, method_overrides=study_runs.METHODS)
    text = open(path).read()
    assert "par: not run" in text and "grpo: no eval/<ds>/acc values" in text
    assert "n/a (0 points; need 3)" in text
    assert "skipped (grpo has no eval rows; par was not run)" in claim(text, "f2")
    assert "skipped (par was not run)" in claim(text, "f1")
    assert "skipped (clip_higher was not run)" in claim(text, "c")
    assert "skipped (GRPO-family eval fit n/a (0 points" in claim(text, "d")
    assert "skipped (grpo has fewer than 6 evals)" in claim(text, "a")
    assert "skipped (no GRPO-family run" in claim(text, "h")
    for png in study_report.PLOTS:
        assert open(os.path.join(tmp_path, png), "rb").read(8) == PNG_MAGIC


def _with_eval_accuracy(run_dir, acc):
    """Rewrite a run's eval accuracies as acc(step) (both sources equal), keeping everything else."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        for k in [k for k in r if k.endswith("/acc")]:
            r[k] = acc(r["step"])
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_plateau_and_early_prediction_flip_when_accuracy_keeps_climbing(tmp_path):
    # Accuracy rising linearly to the end: no plateau, and a fit on the first 3 evals (whose entropy falls fast)
    # misses the final accuracy by far more than 2 points.
    d = make_study(tmp_path, methods=("grpo",))
    _with_eval_accuracy(tmp_path / "grpo", lambda s: 0.1 + 0.02 * s)
    text = render(d, ["grpo"])
    a, h = claim(text, "a"), claim(text, "h")
    assert "does not hold at this scale" in a and "gained +0.7000" in a
    assert "0 of 1 within 0.02" in h and "does not hold at this scale" in h


def test_par_active_claim_reads_the_lambda_schedule(tmp_path):
    for name, lam in (("moving", lambda s: min(1.0, 0.05 * s) if s < 25 else max(0.0, 1.0 - 0.05 * (s - 24))),
                      ("still", lambda s: 1.0)):
        write_run(tmp_path / name / "par", ENTROPY["par"])
        path = tmp_path / name / "par" / "metrics.jsonl"
        rows = [json.loads(line) for line in open(path)]
        for r in rows:
            if r["step"] > 0:
                r["actor/par_lambda"] = lam(r["step"])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    moving, still = (claim(render(str(tmp_path / n), ["par"]), "f1") for n in ("moving", "still"))
    assert "went down on 16 of 39 steps" in moving and "**holds**" in moving
    assert "went down on 0 of 39 steps" in still and "does not hold at this scale" in still


def test_the_chain_preset_loads_for_every_run_and_names_files_that_exist():
    """The study preset with headroom: every run of the full study (5 methods x 2 seeds, staleness 0 and 4) has a
    valid config, and the base model and data files it names are in the repository."""
    args = study_runs.parse_args(["--preset", "chain", "--seeds", "0,1", "--staleness", "0,4"])
    plan = study_runs.make_plan(args, "covrl-study ...", NOW)  # loads every run's config; raises on a bad one
    assert len(study_runs.run_names(plan)) == 14 and plan.steps == study_runs.PRESETS["chain"]["steps"]
    cfg = study_runs.load_config(None, study_runs.run_overrides(plan, "kl_cov@k4"))
    assert cfg.rollout.max_staleness_steps == 4 and type(cfg.learner.loss).__name__ == "KLCovLoss" and cfg.data.task == "files"
    for path in (cfg.model.path, *cfg.data.train_files, *cfg.data.eval_files):
        assert os.path.exists(os.path.join(study_runs.REPO, path)), path
    assert os.path.isfile(os.path.join(study_runs.REPO, cfg.model.path, "model.safetensors"))


def test_unknown_method_and_preset_are_rejected(capsys):
    assert study_runs.main(["--methods", "grpo,ppo_plus"]) == 2
    err = capsys.readouterr().err
    assert "ppo_plus" in err and "valid methods: grpo, clip_higher, clip_cov, kl_cov, par" in err
    assert study_runs.main(["--preset", "gsm8k"]) == 2
    assert "valid presets: arith, chain" in capsys.readouterr().err
    assert study_runs.main(["--methods", "grpo,grpo"]) == 2
    assert study_runs.main(["--set", "run.seed=3"]) == 2
    assert "use --seed" in capsys.readouterr().err
    assert study_runs.main(["--report-only"]) == 2


def test_cluster_command_order(tmp_path):
    plan = study_runs.make_plan(study_runs.parse_args(["--methods", "clip_higher", "--steps", "7", "--seed", "3",
                                             "--study-dir", str(tmp_path), "--set", "rollout.group_size=4"]), "cmd", NOW)
    cmd = study_runs.cluster_command(plan, "clip_higher")
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert cmd[1:4] == ["-m", "launch.cluster", "--gens"] and cmd[cmd.index("--steps") + 1] == "7"
    assert cmd[cmd.index("--run-dir") + 1] == os.path.join(str(tmp_path), "clip_higher")
    assert sets == ["run.seed=3", *study_runs.PRESETS["arith"]["overrides"], *study_runs.METHODS["clip_higher"], "rollout.group_size=4"]


def test_resume_skips_complete_runs_and_rejects_incomplete(tmp_path, monkeypatch, capsys):
    def no_cluster(cmd):
        raise AssertionError(f"a test must not launch a cluster: {cmd}")

    monkeypatch.setattr(study_runs, "run_method", no_cluster)
    monkeypatch.setattr(study_report, "write_plots", lambda study_dir, runs: [])  # plots are tested above; keep this fast
    make_study(tmp_path, methods=("grpo", "kl_cov"))
    args = ["--methods", "grpo,kl_cov", "--steps", str(STEPS), "--study-dir", str(tmp_path)]
    assert study_runs.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("already holds a complete 40-step run; skipping") == 2
    meta = json.load(open(tmp_path / "study.json"))
    assert meta["methods"] == ["grpo", "kl_cov"] and meta["steps"] == STEPS and meta["end_time"]
    assert "-m study.runs --methods grpo,kl_cov" in meta["command"]
    assert (tmp_path / "report.md").exists()
    # Changed settings would mix incomparable runs.
    assert study_runs.main(args[:-2] + ["--seed", "1", "--study-dir", str(tmp_path)]) == 2
    assert "other settings" in capsys.readouterr().err
    # One step short of --steps: incomplete, must be deleted by the user.
    write_run(tmp_path / "y" / "grpo", ENTROPY["grpo"], steps=STEPS - 1)
    assert study_runs.main(["--methods", "grpo", "--steps", str(STEPS), "--study-dir", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "incomplete grpo run" in err and "rm -r" in err


def test_runs_each_method_and_stops_on_failure(tmp_path, monkeypatch, capsys):
    """run_method is faked: it writes a complete synthetic run, or fails for methods in `failing`,
    instead of starting cluster.py."""
    launched, failing = [], {"kl_cov"}

    def fake_cluster(cmd):
        run_dir = cmd[cmd.index("--run-dir") + 1]
        method = os.path.basename(run_dir)
        launched.append(method)
        if method in failing:
            os.makedirs(os.path.join(run_dir, "logs"))
            return 3
        write_run(run_dir, ENTROPY[method], steps=int(cmd[cmd.index("--steps") + 1]))
        return 0

    monkeypatch.setattr(study_runs, "run_method", fake_cluster)
    monkeypatch.setattr(study_report, "write_plots", lambda study_dir, runs: [])
    args = ["--methods", "grpo,kl_cov,par", "--steps", "10", "--study-dir", str(tmp_path)]
    assert study_runs.main(args) == 1
    err = capsys.readouterr().err
    assert "method kl_cov" in err and "exited with code 3" in err and os.path.join(str(tmp_path), "kl_cov", "logs") in err
    assert launched == ["grpo", "kl_cov"]  # stopped before par
    meta = json.load(open(tmp_path / "study.json"))
    assert meta["status"] == {"grpo": "ran", "kl_cov": "failed (exit 3)"}
    assert meta["wall_clock_s"]["grpo"] is not None and meta["end_time"] is None
    # Resuming without deleting the failed run dir is refused; after deleting it, grpo is skipped.
    assert study_runs.main(args) == 2 and "incomplete kl_cov run" in capsys.readouterr().err
    os.rename(tmp_path / "kl_cov", tmp_path / "kl_cov.failed")
    launched.clear()
    failing.clear()
    assert study_runs.main(args) == 0
    assert launched == ["kl_cov", "par"]
    meta = json.load(open(tmp_path / "study.json"))
    assert meta["status"]["grpo"] == "complete before this invocation" and meta["wall_clock_s"]["grpo"] is not None
    assert meta["status"]["par"] == "ran" and meta["end_time"]
    assert (tmp_path / "report.md").exists()


def test_plots_command_draws_runs_and_rejects_bad_input(tmp_path, capsys):
    from study import plots

    write_run(tmp_path / "grpo", ENTROPY["grpo"])
    write_run(tmp_path / "kl_cov", ENTROPY["kl_cov"])
    runs = [str(tmp_path / "grpo"), str(tmp_path / "kl_cov")]
    assert plots.main([*runs, "--key", "actor/entropy", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "actor_entropy.png").read_bytes()[:8] == PNG_MAGIC
    assert plots.main(runs[:1]) == 0  # one run: the default keys, into RUN_DIR/plots
    assert sorted(os.listdir(tmp_path / "grpo" / "plots")) == ["actor_entropy.png", "critic_score_mean.png",
                                                               "response_length_mean.png"]
    assert plots.main([*runs[:1], "--key", "no/such_key"]) == 2
    assert "has none of no/such_key" in capsys.readouterr().err
    assert plots.main([str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl is missing" in capsys.readouterr().err


def test_seeds_show_their_spread_and_judge_the_headline_comparison(tmp_path):
    """Two seeds per method: the seed section gives mean (min–max); claim (g) says whether Clip-Cov's lead over
    GRPO is beyond the spread of the seeds."""
    shift = {"grpo": 0.0, "grpo@s1": 0.05, "clip_cov": 0.6, "clip_cov@s1": 0.7, "kl_cov": 0.579, "kl_cov@s1": 0.622}
    for name, dh in shift.items():  # an entropy offset moves the final accuracy: acc = -A exp(H) + B
        method = name.partition("@")[0]
        write_run(tmp_path / name, lambda v, m=method, d=dh: ENTROPY[m](v) - d)
    text = study_report.render_report([study_report.load_run(str(tmp_path), n) for n in shift], {}, NOW,
                                      method_overrides={})
    seeds = text.split("## 7. Seeds")[1].split("## 8.")[0]
    assert "| grpo | grpo, grpo@s1 |" in seeds and "| clip_cov | clip_cov, clip_cov@s1 |" in seeds
    g = [ln for ln in text.splitlines() if ln.startswith("- (g)")]
    assert len(g) == 2 and "over 2 and 2 seed(s)" in g[0]
    # clip_cov's two seeds end with lower entropy, so higher accuracy, than both of grpo's: beyond the spread.
    assert g[0].startswith("- (g) Clip-Cov") and g[0].endswith("holds beyond the seed spread.")
    # kl_cov (0.845, 0.860) is higher than grpo (0.832, 0.850) on average but overlaps it: not a win.
    assert g[1].startswith("- (g) KL-Cov") and g[1].endswith("within the seed spread: not a win.")
    # (b) on entropy, judged the same way: clip_cov's seeds end below both of grpo's (larger offsets), so it does
    # not hold; with kl_cov made to end above grpo on one seed only, it is higher on average but not an effect.
    b = claim(text, "b").splitlines()
    assert "over 2 and 2 seed(s)" in b[0] and "does not hold at this scale" in b[0]
    for name, dh in (("kl_cov", -0.06), ("kl_cov@s1", 0.0)):
        write_run(tmp_path / name, lambda v, d=dh: ENTROPY["grpo"](v) - d)
    text = study_report.render_report([study_report.load_run(str(tmp_path), n) for n in shift], {}, NOW,
                                      method_overrides={})
    kl = claim(text, "b").splitlines()[1]
    assert kl.startswith("- (b) KL-Cov") and kl.endswith("within the seed spread: not an effect).")
    for name, dh in (("kl_cov", -0.1), ("kl_cov@s1", -0.2)):
        write_run(tmp_path / name, lambda v, d=dh: ENTROPY["grpo"](v) - d)
    text = study_report.render_report([study_report.load_run(str(tmp_path), n) for n in shift], {}, NOW,
                                      method_overrides={})
    assert claim(text, "b").splitlines()[1].endswith("**holds** (beyond the seed spread).")


def test_the_staleness_axis_is_tabled_and_plotted_per_method(tmp_path):
    """Runs grpo (k=1), grpo@k0, grpo@k4: the section orders them by the staleness their steps saw and says how
    the end entropy and the final accuracy move with k."""
    for name, k, dh in (("grpo", 1, 0.0), ("grpo@k0", 0, -0.1), ("grpo@k4", 4, 0.1)):
        write_run(tmp_path / name, lambda v, d=dh: ENTROPY["grpo"](v) - d)
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({**r, "staleness/max": float(min(k, r["step"]))} if r["step"] else r) + "\n"
                         for r in rows)
    names = ["grpo", "grpo@k0", "grpo@k4"]
    path = study_report.write_report(str(tmp_path), names, {}, now=NOW, method_overrides={})
    text = open(path).read()
    section = text.split("## 8. Staleness")[1].split("## 9.")[0]
    order = [ln.split("|")[2].strip() for ln in section.splitlines() if ln.startswith("| grpo |")]
    assert order == ["grpo@k0", "grpo", "grpo@k4"]  # by k: 0, 1, 4
    # Higher k here ends with lower entropy (larger offset), so higher accuracy on the law.
    assert "- grpo: the end entropy falls with k" in section and "final mean eval accuracy rises with k" in section
    assert "seed spread unknown" in section  # grpo ran at one seed here
    # A second seed 0.15 apart: the end entropy's range over k (0.2) is beyond it; one 0.3 apart: within it.
    for offset, word in ((0.15, "beyond"), (0.3, "within")):
        write_run(tmp_path / "grpo@s1", lambda v, d=offset: ENTROPY["grpo"](v) - d)
        section = study_report.render_report([study_report.load_run(str(tmp_path), n) for n in names + ["grpo@s1"]],
                                             {}, NOW, method_overrides={}).split("## 8. Staleness")[1]
        assert f"range 0.2000 {word} the seed spread {offset:.4f}" in section
    assert f"]({study_report.STALENESS_PLOT})" in text
    assert open(tmp_path / study_report.STALENESS_PLOT, "rb").read(8) == PNG_MAGIC


def test_seeds_and_staleness_make_the_runs_and_their_commands(tmp_path):
    plan = study_runs.make_plan(study_runs.parse_args(["--methods", "grpo,kl_cov,clip_cov", "--seeds", "0,1", "--staleness",
                                             "0,4", "--study-dir", str(tmp_path)]), "cmd", NOW)
    assert study_runs.run_names(plan) == ["grpo", "grpo@s1", "kl_cov", "kl_cov@s1", "clip_cov", "clip_cov@s1",
                                     "grpo@k0", "grpo@k4", "kl_cov@k0", "kl_cov@k4"]
    sets = lambda name: [c for i, c in enumerate(study_runs.cluster_command(plan, name)) if i and  # noqa: E731
                         study_runs.cluster_command(plan, name)[i - 1] == "--set"]
    assert sets("grpo@s1")[0] == "run.seed=1" and sets("grpo")[0] == "run.seed=0"
    assert sets("kl_cov@k4")[0] == "run.seed=0" and sets("kl_cov@k4")[-1] == "rollout.max_staleness_steps=4"
    assert study_runs.run_variant("grpo@k4")[-1] == "rollout.max_staleness_steps=4"
    for bad in (["--seeds", "0,0"], ["--seeds", "a"], ["--staleness", "0", "--staleness-methods", "par",
                                                       "--methods", "grpo"]):
        try:
            study_runs.make_plan(study_runs.parse_args(["--study-dir", str(tmp_path), *bad]), "cmd", NOW)
        except study_runs.StudyError:
            continue
        raise AssertionError(f"{bad} was accepted")


def test_covariance_claim_needs_a_correlation_beyond_chance():
    # r = -0.009 over 1,520 steps is no correlation (the chance bound is 2 / sqrt(1520) = 0.051); -0.2 is one.
    weak, strong = study_report.claim_cov(-0.009, 1520), study_report.claim_cov(-0.2, 1520)
    assert "r < −0.051" in weak and "does not hold at this scale" in weak
    assert "**holds**" in strong
