"""Run several entropy-control methods on one preset and write a comparison report.

    covrl study --preset arith --methods grpo,clip_higher,clip_cov,kl_cov,par --steps N \\
        [--study-dir DIR] [--gens 1] [--learners 1] [--seed 0] [--set KEY=VALUE ...] [--report-only]

Each method is one `covrl run` (`python -m launch.cluster`) in STUDY_DIR/<method>, with the same seed, preset
overrides and user overrides; only the method's own overrides (METHODS) differ. Two more axes:
`--seeds 0,1` runs every method once per seed (STUDY_DIR/<method>@s<seed> beyond the first seed), so the report
can show the spread; `--staleness 0,4` runs the `--staleness-methods` (default grpo,kl_cov) again at each
`rollout.max_staleness_steps` k (STUDY_DIR/<method>@k<k>, first seed; the plain run is the config's k). Runs go
one after another in that order. `--preset staleness` (docs/study-staleness/PLAN.md) runs every method at every
forced lag k (`--staleness`, default 0,4,16,64) and seed instead, as STUDY_DIR/<method>@k<k>@s<seed>, each run
max(--steps, 4 k) steps long. A method whose run dir already holds a complete run (a metrics
row with step == N) is skipped, so rerunning an interrupted study's command resumes it; an
incomplete run dir is an error (delete it to redo that method). STUDY_DIR/study.json records the
settings, the exact command and per-method wall-clock time. Then study/report.py writes
STUDY_DIR/report.md and PNGs comparing the methods against the claims of Cui et al. 2025 ("The
Entropy Mechanism of RL for Reasoning LMs") and Jin et al. 2025 (PAR); `--report-only` rewrites
them without running anything.

The methods use their published defaults unchanged: no per-method tuning, so a method that "does
not hold at this scale" is reported as such rather than tuned until it does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from common.config import ConfigError, load_config
from study.archive import has_run, read_run
from study.arms import ARMS, GRID_ARMS, STALENESS_ARMS, STALENESS_LAGS, parse_run, run_name, staleness_steps
from study.dose_report import write_dose_report
from study.grid_report import write_grid_report
from study.staleness_report import write_staleness_report
from study.report import write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Presets: the step budget and the overrides every method of a study shares.
PRESETS = {
    "arith": {"steps": 150, "overrides": ["learner.mini_batches=4", "eval.every_steps=10"]},
    # The regime with headroom (study/chain.py; base model: covrl warmstart --task chain). PAR's threshold is
    # relative: the published absolute 0.2 nats is above anything a 1 M-parameter model's batch entropy reaches.
    # lr 2e-5: at the default 1e-4 four updates per batch knock this freshly fine-tuned model's accuracy from 0.74
    # to 0.34 in three steps (measured on a first chain model); at 2e-5 GRPO climbs steadily and plateaus within 80 steps.
    "chain": {"steps": 80, "overrides": [
        "model.path=assets/chain-base", "data.task=files", "data.train_files=['assets/chain-base/train.jsonl']",
        "data.eval_files=['assets/chain-base/eval.jsonl']", "learner.mini_batches=4", "eval.every_steps=4",
        "learner.lr=2e-5",
        "learner.par.target_entropy_relative=0.5"]},
}
# The dose-response study (docs/study-dose/PLAN.md): the chain regime at 8 updates per batch and the lr the pilots
# chose by the plan's rule, 60 steps, an evaluation every 10; its arms are study/arms.py's.
PRESETS["dose"] = {"steps": 60, "overrides": [
    *PRESETS["chain"]["overrides"][:4], "learner.mini_batches=8", "eval.every_steps=10", "learner.lr=5e-5"]}
# The staleness study (docs/study-staleness/PLAN.md): the dose study's regime with 2 samples per held-out prompt; each
# run at a forced lag k (`--staleness`, default 0,4,16,64) of max(steps, 4 k) steps, evaluated every eighth of them.
PRESETS["staleness"] = {"steps": 64, "overrides": [
    *PRESETS["chain"]["overrides"][:4], "learner.mini_batches=8", "eval.k=2", "learner.lr=5e-5"]}

# The grid study (docs/study-grid/PLAN.md): the choice-dense task (study/grid.py; base model: covrl warmstart --task
# grid), 8 updates a batch, the entropy change on every micro-batch (the premise gates read it), pass@8 evaluations.
PRESETS["grid"] = {"steps": 100, "overrides": [
    "model.path=assets/grid-base", "data.task=files", "data.train_files=['assets/grid-base/train.parquet']",
    "data.eval_files=['assets/grid-base/eval.parquet']", "data.instruction=", "reward.verifier=grid_path",
    "rollout.max_new_tokens=32", "learner.mini_batches=8", "learner.entropy_delta_stride=1", "eval.every_steps=10",
    "eval.k=8", "learner.lr=5e-5", "rollout.groups_per_step=64"]}


# Methods: the config overrides that make each method; published defaults, unchanged (no per-method tuning).
METHODS = {
    # GRPO baseline (Shao et al. 2024), symmetric clip 0.2/0.2 as in Cui et al. 2025's baseline; published defaults unchanged.
    "grpo": ["learner.loss.type=ppo", "learner.loss.clip_low=0.2", "learner.loss.clip_high=0.2"],
    # Clip-higher (DAPO, Yu et al. 2025): clip 0.2/0.28; published defaults unchanged.
    "clip_higher": ["learner.loss.type=ppo", "learner.loss.clip_low=0.2", "learner.loss.clip_high=0.28"],
    # Clip-Cov (Cui et al. 2025): the config's defaults are the paper's 7B recipe; published defaults unchanged.
    "clip_cov": ["learner.loss.type=clip_cov"],
    # KL-Cov (Cui et al. 2025): the config's defaults are the paper's 7B recipe; published defaults unchanged.
    "kl_cov": ["learner.loss.type=kl_cov"],
    # Entropy-guided PAR (Jin et al. 2025, arXiv 2511.05993) on the GRPO baseline; published defaults unchanged.
    "par": ["learner.loss.type=ppo", "learner.loss.clip_low=0.2", "learner.loss.clip_high=0.2",
            "learner.par.schedule=entropy_guided"],
}


def method_overrides(name: str) -> list[str]:
    """The overrides of a method (METHODS) or of a dose- or staleness-study arm (study/arms.py)."""
    if name in METHODS:
        return METHODS[name]
    for arms in (ARMS, GRID_ARMS, STALENESS_ARMS):
        if name in arms:
            return arms[name].overrides
    raise KeyError(name)


def default_methods(preset: str) -> list[str]:
    """What a preset runs when --methods is not given."""
    return {"dose": list(ARMS), "staleness": list(STALENESS_ARMS), "grid": list(GRID_ARMS)}.get(preset, list(METHODS))


class StudyError(ValueError):
    """A bad command line or study directory; the message says what to change (exit code 2)."""


class RunFailed(RuntimeError):
    """A method's cluster run failed; the message names the method and its log dir (exit code 1)."""


class Interrupted(RuntimeError):
    """Ctrl-C while a method ran; the message says how to resume (exit code 130)."""


# ---------------------------------------------------------------------------
# Command line and plan
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    preset: str
    methods: list[str]
    steps: int
    seeds: list[int]  # the first is the plain runs' seed
    staleness: list[int]  # extra rollout.max_staleness_steps values for staleness_methods (first seed)
    staleness_methods: list[str]
    gens: int
    learners: int
    jobs: int  # runs at a time
    user_overrides: list[str]
    study_dir: str  # absolute
    report_only: bool
    command: str  # the exact command line, shell-quoted


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="covrl study", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="arith", help=f"one of {', '.join(PRESETS)} (default arith)")
    ap.add_argument("--methods", help=f"comma-separated, in run order (default all: {','.join(METHODS)}; with "
                                      f"--preset dose, the arms of study/arms.py: {','.join(ARMS)}; with --preset "
                                      f"staleness: {','.join(STALENESS_ARMS)}; with --preset grid: "
                                      f"{','.join(GRID_ARMS)})")
    ap.add_argument("--steps", type=int, help="learner steps per method (default: the preset's)")
    ap.add_argument("--study-dir", help="output directory (default runs/study-<YYYYmmdd-HHMMSS>)")
    ap.add_argument("--gens", type=int, default=1, help="generator processes per run (default 1)")
    ap.add_argument("--learners", type=int, default=1, help="learner ranks per run (default 1)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1; each run's output then goes to "
                                                        "STUDY_DIR/logs/<run>.log when above 1)")
    ap.add_argument("--seed", type=int, default=0, help="run.seed of every method (default 0; see --seeds)")
    ap.add_argument("--seeds", help="comma-separated run.seed values: every method runs once per seed "
                                    "(default: --seed alone); the report shows the spread")
    ap.add_argument("--staleness", help="comma-separated rollout.max_staleness_steps values at which the "
                                        "--staleness-methods run again (first seed), e.g. 0,4; with --preset "
                                        "staleness, the forced lags every method runs at (default 0,4,16,64)")
    ap.add_argument("--staleness-methods", default="grpo,kl_cov",
                    help="methods of the staleness axis (default grpo,kl_cov; each must be in --methods)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every method")
    ap.add_argument("--report-only", action="store_true", help="run nothing; rewrite the report of --study-dir")
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace, command: str, now: datetime.datetime) -> Plan:
    """Validate the arguments (raising StudyError with the fix) and resolve the defaults."""
    if args.preset not in PRESETS:
        raise StudyError(f"unknown --preset {args.preset!r}; valid presets: {', '.join(PRESETS)}")
    default = default_methods(args.preset)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods is not None else default
    unknown = [m for m in methods if m not in METHODS and m not in ARMS and m not in STALENESS_ARMS and m not in GRID_ARMS]
    if unknown or not methods:
        raise StudyError(f"unknown method(s) {', '.join(unknown) or '(none given)'} in --methods; "
                         f"valid methods: {', '.join(METHODS)}; dose-study arms: {', '.join(ARMS)}; staleness-study "
                         f"arms: {', '.join(STALENESS_ARMS)}; grid-study arms: {', '.join(GRID_ARMS)}")
    if len(set(methods)) != len(methods):
        raise StudyError(f"--methods lists a method twice ({args.methods}); each method runs once per study")
    steps = args.steps if args.steps is not None else PRESETS[args.preset]["steps"]
    for name, value in (("--steps", steps), ("--gens", args.gens), ("--learners", args.learners), ("--jobs", args.jobs)):
        if value < 1:
            raise StudyError(f"{name} must be at least 1, got {value}")
    for kv in args.set:
        if "=" not in kv:
            raise StudyError(f"--set {kv!r} is not KEY=VALUE, e.g. --set rollout.group_size=8")
        key = kv.split("=", 1)[0].strip()
        if key in ("run.seed", "run.steps"):
            raise StudyError(f"--set {kv!r}: use --{key.split('.')[1]} instead, so study.json records it")
    seeds = _ints(args.seeds, "--seeds") if args.seeds is not None else [args.seed]
    lags = list(STALENESS_LAGS) if args.preset == "staleness" else []
    staleness = _ints(args.staleness, "--staleness") if args.staleness is not None else lags
    if len(set(seeds)) != len(seeds) or any(x < 0 for x in seeds + staleness) or len(set(staleness)) != len(staleness):
        raise StudyError("--seeds and --staleness list distinct non-negative integers, e.g. --seeds 0,1 --staleness 0,4")
    stale_methods = [m.strip() for m in args.staleness_methods.split(",") if m.strip()] if staleness else []
    if args.preset == "staleness":  # every method runs at every lag and seed
        stale_methods = methods
    if not set(stale_methods) <= set(methods):
        raise StudyError(f"--staleness-methods {args.staleness_methods}: each must also be in --methods "
                         f"({', '.join(methods)})")
    if args.report_only and not args.study_dir:
        raise StudyError("--report-only needs --study-dir: the report is rebuilt from an existing study's runs")
    study_dir = args.study_dir or os.path.join("runs", f"study-{now:%Y%m%d-%H%M%S}")
    plan = Plan(preset=args.preset, methods=methods, steps=steps, seeds=seeds, staleness=staleness,
                staleness_methods=stale_methods, gens=args.gens, learners=args.learners, jobs=args.jobs,
                user_overrides=list(args.set),
                study_dir=os.path.abspath(study_dir), report_only=args.report_only, command=command)
    for name in run_names(plan):  # each run's config, checked before the study directory exists
        try:
            load_config(None, [*run_overrides(plan, name), f"run.steps={run_steps(plan, name)}"])
        except ConfigError as e:
            raise StudyError(f"run {name}: {e}") from None
    return plan


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StudyError(f"{flag} {text!r}: give comma-separated integers, e.g. {flag} 0,1") from None
    if not values:
        raise StudyError(f"{flag} {text!r}: give at least one integer")
    return values


def run_names(plan: Plan) -> list[str]:
    """Every run of the study in run order: each method at each seed, then the staleness axis (the grid preset:
    every method at the first seed, then at the next). The staleness
    preset runs every method at every forced lag and seed instead: seed by seed, method by method, lag by lag
    (<method>@k<k>@s<seed>)."""
    if plan.preset == "staleness":
        return [run_name(m, seed, k) for seed in plan.seeds for m in plan.methods for k in plan.staleness]
    if plan.preset == "grid":  # seed by seed (docs/study-grid/PLAN.md), so a partial study has whole seeds
        return [run_name(m, None if i == 0 else seed) for i, seed in enumerate(plan.seeds) for m in plan.methods]
    names = [run_name(m, None if i == 0 else seed) for m in plan.methods for i, seed in enumerate(plan.seeds)]
    return names + [run_name(m, k=k) for m in plan.staleness_methods for k in plan.staleness]


def run_steps(plan: Plan, name: str) -> int:
    """A run's learner steps: the study's, or under the staleness preset max(steps, 4 k) for its lag k."""
    k = parse_run(name)[2]
    return staleness_steps(k, plan.steps) if plan.preset == "staleness" and k is not None else plan.steps


def _lag_overrides(plan: Plan, name: str, k: int | None) -> list[str]:
    """What a run's staleness k sets: the bound alone, or under the staleness preset a forced lag of k with its
    bound and an evaluation every eighth of the run."""
    if k is None:
        return []
    if plan.preset != "staleness":
        return [f"rollout.max_staleness_steps={k}"]
    return [f"rollout.max_staleness_steps={k}", f"rollout.forced_lag={k}", f"eval.every_steps={run_steps(plan, name) // 8}"]


def run_variant(name: str) -> list[str]:
    """What the report lists as a run's own overrides: its method's, and its seed or staleness if it varies them."""
    method, seed, k = parse_run(name)
    extra = ([f"run.seed={seed}"] if seed is not None else []) + ([f"rollout.max_staleness_steps={k}"] if k is not None else [])
    known = method in METHODS or method in ARMS or method in STALENESS_ARMS or method in GRID_ARMS
    return [*(method_overrides(method) if known else []), *extra]


def run_overrides(plan: Plan, name: str) -> list[str]:
    """The config overrides that make one run, in order: its seed, the preset's, its method's, the user's, its
    staleness."""
    method, seed, k = parse_run(name)
    out = [f"run.seed={plan.seeds[0] if seed is None else seed}", *PRESETS[plan.preset]["overrides"], *method_overrides(method),
           *plan.user_overrides]
    return out + _lag_overrides(plan, name, k)


def cluster_command(plan: Plan, name: str) -> list[str]:
    """The cluster command line of one run (run with cwd = repo root, so `-m launch.cluster` finds the package)."""
    cmd = [sys.executable, "-m", "launch.cluster", "--gens", str(plan.gens), "--learners", str(plan.learners),
           "--run-dir", os.path.join(plan.study_dir, name), "--steps", str(run_steps(plan, name))]
    for kv in run_overrides(plan, name):
        cmd += ["--set", kv]
    return cmd


def run_status(run_dir: str, steps: int) -> str:
    """'missing' (no dir, nor in the study's runs.tar.xz), 'complete' (its metrics have a row with step == steps)
    or 'incomplete'."""
    if not has_run(run_dir):
        return "missing"
    return "complete" if any(r.get("step") == steps for r in read_run(run_dir)) else "incomplete"


def _settings(plan: Plan) -> dict:
    """The settings a resumed study must share with the runs already in its directory."""
    return {"preset": plan.preset, "steps": plan.steps, "seed": plan.seeds[0], "gens": plan.gens,
            "learners": plan.learners, "user_overrides": plan.user_overrides}


def check_resumable(plan: Plan, previous: dict | None) -> dict[str, str]:
    """Status of every method's run dir; raises StudyError on an incomplete run or changed settings."""
    if previous:
        old = {k: previous.get(k) if k != "user_overrides" else previous.get("overrides", {}).get("user")
               for k in _settings(plan)}
        changed = [f"{k}: {old[k]!r} -> {v!r}" for k, v in _settings(plan).items() if old[k] != v]
        if changed:
            raise StudyError(f"{plan.study_dir} was started with other settings ({'; '.join(changed)}); results "
                             f"would not be comparable. Rerun with the original settings or pick a new --study-dir")
    status = {m: run_status(os.path.join(plan.study_dir, m), run_steps(plan, m)) for m in run_names(plan)}
    for m, s in status.items():
        if s == "incomplete":
            d = os.path.join(plan.study_dir, m)
            raise StudyError(f"{d} holds an incomplete {m} run (no metrics row with step {run_steps(plan, m)}); "
                             f"delete it (rm -r {shlex.quote(d)}) and rerun the same command to redo {m}")
    return status


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------

def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _responses_per_step(plan: Plan, name: str) -> int:
    rollout = load_config(None, run_overrides(plan, name)).rollout
    return rollout.group_size * rollout.groups_per_step


def new_meta(plan: Plan, previous: dict | None, now: datetime.datetime) -> dict:
    """study.json contents before any method runs; wall-clock times of earlier invocations are kept."""
    old_wall = (previous or {}).get("wall_clock_s", {})
    runs = run_names(plan)
    return {"preset": plan.preset, "methods": plan.methods, "runs": runs, "steps": plan.steps, "seed": plan.seeds[0],
            "seeds": plan.seeds, "staleness": plan.staleness, "staleness_methods": plan.staleness_methods,
            "gens": plan.gens, "learners": plan.learners,
            "overrides": {"preset": PRESETS[plan.preset]["overrides"], "methods": {m: method_overrides(m) for m in plan.methods},
                          "user": plan.user_overrides},
            "responses_per_step": _responses_per_step(plan, runs[0]),
            "command": plan.command, "start_time": now.isoformat(timespec="seconds"), "end_time": None,
            "wall_clock_s": {m: old_wall.get(m) for m in runs}, "status": {},
            # every run this directory has been asked for, by any invocation, with its length (study.archive reads it)
            "run_steps": {**(previous or {}).get("run_steps", {}), **{m: run_steps(plan, m) for m in runs}},
            "run_commands": {m: shlex.join(cluster_command(plan, m)) for m in runs}}


def run_method(cmd: list[str]) -> int:
    """Run one cluster command with the terminal as its stdout/stderr; returns its exit code.

    On Ctrl-C the child got the same SIGINT (same process group) and stops its roles itself,
    so we wait for it instead of killing it, then re-raise.
    """
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        raise


def start_logged(plan: Plan, name: str) -> subprocess.Popen:
    """Start one run's cluster command with its output in STUDY_DIR/logs/<run>.log (several runs at a time)."""
    os.makedirs(os.path.join(plan.study_dir, "logs"), exist_ok=True)
    with open(os.path.join(plan.study_dir, "logs", f"{name}.log"), "w") as log:
        return subprocess.Popen(cluster_command(plan, name), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def finish_run(plan: Plan, meta: dict, name: str, code: int, seconds: float) -> str | None:
    """Record a finished run in study.json; returns why it failed, or None."""
    run_dir = os.path.join(plan.study_dir, name)
    meta["wall_clock_s"][name] = round(seconds, 1)
    meta["status"][name] = "ran" if code == 0 else f"failed (exit {code})"
    _write_json(os.path.join(plan.study_dir, "study.json"), meta)
    if code != 0:
        return (f"method {name}: the cluster run exited with code {code}; see its logs in "
                f"{os.path.join(run_dir, 'logs')}. Fix the cause, delete {run_dir}, and rerun the same command to "
                f"resume (finished methods are skipped)")
    if run_status(run_dir, run_steps(plan, name)) != "complete":
        return (f"method {name}: the cluster run exited 0 but {run_dir}/metrics.jsonl has no step {run_steps(plan, name)}; "
                f"see {os.path.join(run_dir, 'logs')}")
    return None


def _announce(plan: Plan, meta: dict, name: str) -> None:
    runs = run_names(plan)
    print(f"study: [{runs.index(name) + 1}/{len(runs)}] {name} -> {os.path.join(plan.study_dir, name)}\n"
          f"  {meta['run_commands'][name]}", flush=True)


def run_study(plan: Plan, status: dict[str, str], meta: dict) -> None:
    """Run every run not yet complete, updating study.json after each; raises RunFailed on a failed run
    and Interrupted on Ctrl-C. With `plan.jobs` > 1, up to that many at a time (`run_parallel`)."""
    runs = run_names(plan)
    pending = []
    for i, name in enumerate(runs, 1):
        if status[name] == "complete":
            print(f"study: [{i}/{len(runs)}] {name}: {os.path.join(plan.study_dir, name)} already holds a complete "
                  f"{run_steps(plan, name)}-step run; skipping", flush=True)
            meta["status"][name] = "complete before this invocation"
        else:
            pending.append(name)
    if plan.jobs > 1:
        return run_parallel(plan, pending, meta)
    for name in pending:
        _announce(plan, meta, name)
        t0 = time.monotonic()
        try:
            code = run_method(cluster_command(plan, name))
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted while running {name}: {os.path.join(plan.study_dir, name)} is incomplete. "
                              f"To resume, delete it and rerun with --study-dir {plan.study_dir} and the same "
                              f"settings") from None
        if why := finish_run(plan, meta, name, code, time.monotonic() - t0):
            raise RunFailed(why)


def _reap(plan: Plan, meta: dict, running: dict[str, tuple[subprocess.Popen, float]]) -> list[str]:
    """Record and forget the runs in `running` that have ended; returns why each failed one failed."""
    ended = [(name, code, t0) for name, (proc, t0) in running.items() if (code := proc.poll()) is not None]
    for name, _, _ in ended:
        del running[name]
    return [why for name, code, t0 in ended if (why := finish_run(plan, meta, name, code, time.monotonic() - t0))]


def run_parallel(plan: Plan, pending: list[str], meta: dict) -> None:
    """Up to `plan.jobs` runs at a time, in run order; after a failure no new run starts, the ones in flight
    finish, then RunFailed names every failure. On Ctrl-C, or any error here, the runs still going get SIGINT (each
    then stops its roles) and are waited for, so no process is left behind; every run is recorded in study.json and
    only the unfinished ones are named."""
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failures: list[str] = []
    try:
        while (pending and not failures) or running:
            while pending and len(running) < plan.jobs and not failures:
                name = pending.pop(0)
                _announce(plan, meta, name)
                running[name] = (start_logged(plan, name), time.monotonic())
            time.sleep(0.5)
            failures += _reap(plan, meta, running)
    except BaseException as e:
        unfinished = _stop_all(plan, meta, running)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"interrupted while running {', '.join(unfinished) or 'nothing'}: incomplete. To resume, "
                              f"delete those run directories and rerun with --study-dir {plan.study_dir} and the same "
                              f"settings") from None
        raise
    if failures:
        raise RunFailed("; ".join(failures))


def _stop_all(plan: Plan, meta: dict, running: dict[str, tuple[subprocess.Popen, float]]) -> list[str]:
    """SIGINT the runs still going, wait for every one, record them all; returns the names of those that did not
    finish complete."""
    for proc, _ in running.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc, _ in running.values():
        proc.wait()
    unfinished = [name for name, (proc, _) in running.items()
                  if proc.returncode != 0 or run_status(os.path.join(plan.study_dir, name), run_steps(plan, name)) != "complete"]
    _reap(plan, meta, running)
    return unfinished


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a method's run failed, 2 bad arguments or study directory, 130 interrupted."""
    command = shlex.join([sys.executable, *sys.argv] if argv is None else [sys.executable, "-m", "study.runs", *argv])
    argv = sys.argv[1:] if argv is None else argv
    now = datetime.datetime.now()
    try:
        args = parse_args(argv)
        plan = make_plan(args, command, now)
        previous = _read_json(os.path.join(plan.study_dir, "study.json"))
        if plan.report_only:
            if not os.path.isdir(plan.study_dir):
                raise StudyError(f"--report-only: {plan.study_dir} does not exist; pass the directory of an earlier study")
            meta = previous or {}
            runs = run_names(plan) if args.methods is not None else meta.get("runs", meta.get("methods", plan.methods))
        else:
            status = check_resumable(plan, previous)
            os.makedirs(plan.study_dir, exist_ok=True)
            meta = new_meta(plan, previous, now)
            _write_json(os.path.join(plan.study_dir, "study.json"), meta)
            run_study(plan, status, meta)
            meta["end_time"] = datetime.datetime.now().isoformat(timespec="seconds")
            _write_json(os.path.join(plan.study_dir, "study.json"), meta)
            runs = run_names(plan)
    except StudyError as e:
        print(f"study: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"study: error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"\nstudy: {e}", file=sys.stderr)
        return 130
    preset = (meta.get("preset") if plan.report_only else None) or plan.preset
    if preset == "dose":
        path = write_dose_report(plan.study_dir, runs, meta)
    elif preset == "staleness":
        path = write_staleness_report(plan.study_dir, runs, meta)
    elif preset == "grid":
        path = write_grid_report(plan.study_dir, runs, meta)
    else:
        path = write_report(plan.study_dir, runs, meta, method_overrides={r: run_variant(r) for r in runs})
    print(f"study: report {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
