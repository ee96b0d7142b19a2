"""study/report.py: the report from synthetic run dirs; study/runs.py: argument checks, resume and
failures; covrl plots (study/plots.py) on the same runs. Never launches a cluster."""

import datetime
import json
import math
import os
import re

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
    assert "**undetermined** (one seed: no interval)" in claim(text, "g")
    assert "`python study/runs.py x`" in text and "2025-06-01 12:00:00" in text and "12.5" in text
    # The header's method table shows the overrides the runner passed in.
    assert "| clip_higher | `learner.loss.type=ppo`, `learner.loss.clip_low=0.2`, `learner.loss.clip_high=0.28` | ran |" in text
    # Eval points lie exactly on the law, so every fit and the pooled one recover a=0.3, b=1.2, R^2=1,
    # ceiling 0.9; 9 eval points per method (steps 0, 5, ..., 40), 45 pooled.
    assert "| pooled (all methods, distinct runs) | 45 | 0.3000 | 1.2000 | 1.000 | 0.9000 |" in text
    assert "| grpo | 9 | 0.3000 | 1.2000 | 1.000 | 0.9000 |" in text
    # Training points: 40 per method on their own law.
    assert "| pooled (all methods, distinct runs) | 200 | 0.2000 | 0.9000 | 1.000 | 0.7000 |" in text
    # Early prediction: ceil(9 * 0.15) = 2, at least 3 points fitted, exact, so RMSE 0.
    assert "fit on first 3 of 9: RMSE 0.0000 on the other 6" in text
    # Summary: GRPO's entropy, mean of actor/entropy over the first 4 steps (versions 0-3) -> the last 4 (36-39).
    assert "0.8697 → 0.2074" in text
    assert "arith_easy/pass@4 last" in text
    for tag in ("a", "d", "e", "h"):
        assert "**holds**" in claim(text, tag) or "does not hold" in claim(text, tag)
    for tag in ("b", "c", "f2", "g"):  # one seed each: no interval, so no verdict
        assert "**undetermined** (one seed" in claim(text, tag)
    assert "skipped (no PAR run" in claim(text, "f3")  # lambda never reaches 0 here
    assert "Duplicates: none" in text
    # The law is claimed for the GRPO family (grpo, clip_higher, par): 27 points; all five methods in the table.
    assert "| pooled (GRPO family, distinct runs) | 27 | 0.3000 | 1.2000 | 1.000 | 0.9000 |" in text
    # The synthetic accuracy follows each run's own entropy, which differs across runs at every step: the law beats
    # the clock and holds across runs at equal step.
    d_claim = claim(text, "d")
    assert "27 eval points of the 3 distinct GRPO-family runs: R² of exp(H) 1.000" in d_claim and "**holds**" in d_claim
    assert "r = -1.000" in d_claim and "exponential form is not tested" not in d_claim
    # Early prediction of the final accuracy: 3 exact points predict the last exactly: no error but float noise, no
    # bias. The noise prints as itself (study.stats.fmt: a value that is not 0 never reads 0.0000), e.g. -2.2e-16.
    h_claim = claim(text, "h")
    errors = re.search(r"predicted: grpo (\S+), clip_higher (\S+), par (\S+);", h_claim).groups()
    mae = re.search(r"mean absolute error (\S+)\.", h_claim).group(1)
    assert all(abs(float(e)) < 1e-12 for e in (*errors, mae))
    assert "**holds**" in claim(text, "h")
    assert "- PAR's entropy-guided schedule is active" in text.split("Implementation checks (these cannot fail")[1]
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


def write_seeds(root, method, offsets, base="grpo"):
    """Runs method, method@s1, ... whose entropy is `base`'s synthetic entropy plus one offset per seed."""
    for i, d in enumerate(offsets):
        write_run(root / (method + (f"@s{i}" if i else "")), lambda v, d=d: ENTROPY[base](v) + d)
    return [method + (f"@s{i}" if i else "") for i in range(len(offsets))]


def render_names(root, names):
    return study_report.render_report([study_report.load_run(str(root), n) for n in names], {}, NOW,
                                      method_overrides={})


def test_entropy_comparison_claims_flip(tmp_path):
    """(b) by the paired-by-seed interval: Clip-Cov ends 0.10-0.12 above GRPO at every seed (holds); KL-Cov ends
    +0.02, -0.01, -0.02 from it (mean below 0, interval across 0: does not hold)."""
    names = (write_seeds(tmp_path, "grpo", [0.0, 0.01, -0.01]) + write_seeds(tmp_path, "clip_cov", [0.10, 0.13, 0.10])
             + write_seeds(tmp_path, "kl_cov", [0.02, 0.0, -0.03]))
    cc, kc = claim(render_names(tmp_path, names), "b").splitlines()
    # Clip-Cov's differences: 0.10, 0.12, 0.11: mean 0.11, sd 0.01, half-width 4.3027 * 0.01 / sqrt 3 = 0.0248;
    # minimum detectable effect (4.3027 + 1.0607) * 0.01 / sqrt 3 = 0.0310.
    assert "Clip-Cov" in cc and "mean +0.1100, 95 % CI [+0.0852, +0.1348] over 3 seed(s)" in cc
    assert "minimum detectable effect at 3 seed(s) 0.0310" in cc and cc.endswith("**holds**.")
    # KL-Cov's differences: 0.02, -0.01, -0.02: mean -0.0033.
    assert "KL-Cov" in kc and "mean -0.0033" in kc and "does not hold at this scale" in kc


def test_missing_methods_and_keys_do_not_crash(tmp_path):
    write_run(tmp_path / "grpo", ENTROPY["grpo"], with_eval=False)
    path = study_report.write_report(str(tmp_path), ["grpo", "par"], {}, now=NOW, method_overrides=study_runs.METHODS)
    text = open(path).read()
    assert "par: not run" in text and "grpo: no eval/<ds>/acc values" in text
    assert "n/a (0 points; need 3)" in text
    assert "skipped (grpo has no final mean eval accuracy; par was not run)" in claim(text, "f2")
    assert "PAR's entropy-guided schedule is active: skipped (par was not run)" in text
    assert "skipped (clip_higher was not run)" in claim(text, "c")
    assert "skipped (too few GRPO-family eval points" in claim(text, "d")
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
    assert "over the 1 distinct GRPO-family runs" in h and "does not hold at this scale" in h


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
    moving, still = (claim(render(str(tmp_path / n), ["par"]).replace("- PAR's", "- (check) PAR's"), "check")
                     for n in ("moving", "still"))
    assert "went down on 16 of 39 steps" in moving and ": passes." in moving
    assert "went down on 0 of 39 steps" in still and ": fails." in still


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


def test_seeds_are_paired_and_judged_by_their_interval(tmp_path):
    """Three seeds per method: section 7 gives each method's mean and 95 % t-interval and every method against GRPO
    paired by seed; (g) holds only when the accuracy difference's interval lies above 0."""
    names = (write_seeds(tmp_path, "grpo", [0.0, 0.05, -0.05]) + write_seeds(tmp_path, "clip_cov", [-0.6, -0.55, -0.7])
             + write_seeds(tmp_path, "kl_cov", [-0.02, 0.06, -0.06]))
    text = render_names(tmp_path, names)
    seeds = text.split("## 7. Seeds")[1].split("## 8.")[0]
    assert "| grpo | grpo, grpo@s1, grpo@s2 |" in seeds and "| clip_cov − grpo | final mean eval accuracy | 3 |" in seeds
    g = [ln for ln in text.splitlines() if ln.startswith("- (g)")]
    # Lower entropy is higher accuracy on the law: clip_cov's seeds all end far below grpo's: (g) holds for it,
    # and (b) fails with the interval below 0.
    assert g[0].startswith("- (g) Clip-Cov") and g[0].endswith("**holds**.")
    assert claim(text, "b").splitlines()[0].endswith("(the interval lies below 0: lower than GRPO).")
    # kl_cov: -0.02, +0.01, -0.01 from grpo: the accuracy differences straddle 0.
    assert g[1].startswith("- (g) KL-Cov") and "does not hold at this scale" in g[1]
    mean, lo, hi = (float(x) for x in seeds.split("| grpo | grpo, grpo@s1, grpo@s2 | ")[1].split(" |")[0]
                    .replace("[", "").replace("]", "").replace(",", "").split())
    assert lo < mean < hi


def test_step_ranges():
    assert study_report.step_ranges([1, 41, 42, 43, 45]) == "1, 41–43, 45"
    assert study_report.step_ranges([]) == "" and study_report.step_ranges([7]) == "7"


def test_a_duplicate_run_is_flagged_and_counted_once(tmp_path):
    """clip_higher repeats grpo's trajectory exactly (the clip never bound): flagged in the run table and the seeds
    table, left out of the pooled fits, and its paired difference with grpo is exactly 0."""
    write_run(tmp_path / "grpo", ENTROPY["grpo"])
    write_run(tmp_path / "clip_higher", ENTROPY["grpo"])
    write_run(tmp_path / "par", ENTROPY["par"])
    text = render_names(tmp_path, ["grpo", "clip_higher", "par"])
    assert "| clip_higher |  | n/a | n/a | 41 | grpo |" in text
    assert "Duplicates: 1 run(s) repeat another run's actor/entropy and critic/score/mean at every step " \
           "(clip_higher = grpo)" in text
    assert "| clip_higher | 9 | 0.3000 | 1.2000 | 1.000 | 0.9000 | duplicate of grpo: left out of the pooled fits |" in text
    assert "| pooled (GRPO family, distinct runs) | 18 |" in text  # grpo and par only
    assert "on the 18 eval points of the 2 distinct GRPO-family runs" in claim(text, "d")
    c = claim(text, "c")
    assert "per seed +0.0000; 1 of 1 seed(s) bit-identical to grpo" in c and "**undetermined**" in c
    assert "clip_higher" not in claim(text, "h")  # judged once, as grpo


def _set_par_lambda(run_dir, zero_after, delta_scale=1.0):
    """Rewrite a run's actor/par_lambda to 0 after step `zero_after` (1 before), its entropy_delta on those steps
    scaled by delta_scale."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        if r["step"] > 0:
            r["actor/par_lambda"] = 0.0 if r["step"] > zero_after else 1.0
        if r["step"] > zero_after:
            r["actor/entropy_delta"] *= delta_scale
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_par_lambda_zero_result_flips(tmp_path):
    """(f3): on the steps with λ = 0, PAR's updates lower entropy by 10-20 % of GRPO's: clearly smaller, holds; by as
    much as GRPO's: does not hold, and the report says the claim is not supported (not that it is refuted)."""
    for case, scales in (("smaller", (0.1, 0.2, 0.15)), ("same", (1.0, 1.05, 0.95))):
        root = tmp_path / case
        names = write_seeds(root, "grpo", [0.0, 0.01, 0.02]) + write_seeds(root, "par", [0.001, 0.011, 0.021])
        for name, scale in zip(names[3:], scales):
            _set_par_lambda(root / name, 20, scale)
        f3 = claim(render_names(root, names), "f3")
        assert "par: λ = 0 on 20 of 40 steps (21–40)" in f3 and "over 3 seed(s)" in f3
        if case == "smaller":
            assert f3.endswith("**holds**.")
        else:
            assert "does not hold at this scale" in f3 and "mechanism claim is not supported at this scale, not refuted" in f3


def test_the_law_fails_when_accuracy_follows_the_clock_and_not_the_entropy(tmp_path):
    """Three GRPO-family runs with different entropies at every step but accuracies that follow the step, with a
    run-to-run wobble unrelated to entropy: (d) cannot tell the law from a clock."""
    for i, name in enumerate(("grpo", "clip_higher", "par")):
        write_run(tmp_path / name, ENTROPY[name])
        _with_eval_accuracy(tmp_path / name, lambda s, i=i: 0.2 + 0.1 * math.sqrt(s) + 0.01 * ((s // 5 + i) % 3 - 1))
    d = claim(render_names(tmp_path, ["grpo", "clip_higher", "par"]), "d")
    assert "does not hold at this scale: cannot tell the law from a clock" in d
    assert "sqrt(step) 0.99" in d


def test_entropy_per_response_is_approximated_and_labelled_when_not_logged(tmp_path):
    write_run(tmp_path / "grpo", ENTROPY["grpo"])
    text = render_names(tmp_path, ["grpo"])
    # Steps 1-4: entropy of versions 0-3 times length 31-34; steps 37-40: versions 36-39 times 67-70.
    first = sum(ENTROPY["grpo"](v) * (31 + v) for v in range(4)) / 4
    last = sum(ENTROPY["grpo"](v) * (31 + v) for v in range(36, 40)) / 4
    assert f"| {first:.3f} → {last:.3f} ({100 * (last - first) / first:+.1f} %) ≈ |" in text
    assert "entropy per response (≈ token entropy × mean response length)" in claim(text, "a")
    path = tmp_path / "grpo" / "metrics.jsonl"
    rows = [json.loads(line) for line in open(path)]
    path.write_text("".join(json.dumps({**r, "actor/entropy_per_response": 2.0 if r["step"] < 20 else 1.0}) + "\n"
                            for r in rows))
    text = render_names(tmp_path, ["grpo"])
    assert "| 2.000 → 1.000 (-50.0 %) |" in text and "entropy per response 2.000 → 1.000" in claim(text, "a")


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
    finding = section.split("- grpo: ")[1].split("\n")[0]
    assert finding.startswith("end entropy by k (0, 1, 4)") and "**undetermined** (one seed per k" in finding
    assert "the seed spread of the plain runs is unknown (one seed)" in finding  # grpo ran at one seed here
    # A second seed 0.15 apart in entropy: its sd over 2 seeds is 0.15 / sqrt 2 = 0.1061; still undetermined.
    write_run(tmp_path / "grpo@s1", lambda v: ENTROPY["grpo"](v) - 0.15)
    section = render_names(tmp_path, names + ["grpo@s1"]).split("## 8. Staleness")[1]
    assert "**undetermined** (one seed per k; the seed spread of the plain runs is sd 0.1061" in section
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


def test_early_prediction_flips_between_noise_and_bias(tmp_path):
    """Six GRPO seeds on the law. Finals moved ±0.01 in turn: errors symmetric and small, (h) holds. Finals all moved
    up by 0.01: the sign test finds the bias (6 of 6 above: p = 2 / 64 = 0.031) and (h) fails although every error
    is within 0.02."""
    for case, shift in (("noise", lambda i: 0.01 if i % 2 else -0.01), ("bias", lambda i: 0.01)):
        names = write_seeds(tmp_path / case, "grpo", [0.01 * i for i in range(6)])
        for i, name in enumerate(names):
            last = lambda s, i=i: -A * math.exp(ENTROPY["grpo"](s) + 0.01 * i) + B + (shift(i) if s == STEPS else 0)
            _with_eval_accuracy(tmp_path / case / name, last)
        h = claim(render_names(tmp_path / case, names), "h")
        assert "mean absolute error 0.0100" in h
        if case == "noise":
            assert "3 of 6 above the prediction, sign test p = 1.0000" in h and "(p ≥ 0.05): **holds**." in h
        else:
            assert "6 of 6 above the prediction, sign test p = 0.0312" in h
            assert "**does not hold at this scale**: a bias, the early fit predicts too low" in h


def test_the_chain_report_prints_through_the_one_formatter():
    # study.stats.fmt: a difference or interval end that is not 0 never prints as +0.0000 (the old formatting did).
    c = study_report.Comparison("kl_cov", ["kl_cov", "kl_cov@s1", "kl_cov@s2"], [6.7e-06, 1e-05, 0.0], 1, 5.6e-06,
                                -6.7e-06, 1.8e-05, 3e-05)
    text = c.describe()
    assert text.startswith("mean +5.6e-06, 95 % CI [-6.7e-06, +1.8e-05] over 3 seed(s) (per seed +6.7e-06, +1e-05, "
                           "+0.0000; 1 of 3 seed(s) bit-identical to grpo")
    assert "minimum detectable effect at 3 seed(s) 3e-05" in text
    assert study_report._ci(float("nan"), float("nan")) == "n/a" and study_report._pct(0.1, 0.05) == "-50.0 %"

