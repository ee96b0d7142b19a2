"""The report of a study (study/runs.py): STUDY_DIR/report.md and its PNGs, from the runs' metrics alone.

Reads STUDY_DIR/<run>/metrics.jsonl (or metrics.jsonl.xz) of every run and study.json's content (`meta`) and
compares the methods against the claims of Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs") and
Jin et al. 2025 (PAR). Every verdict states its criterion and can come out either way; a check that cannot fail by
construction is listed apart, as an implementation check. The rules:

- A run whose actor/entropy and critic/score/mean equal another run's at every step is a duplicate of it (flagged);
  pooled fits and the early-prediction test count each distinct trajectory once.
- Method vs GRPO (entropy, accuracy): the mean difference paired by seed, its 95 % t-interval and the minimum
  detectable effect at the seeds used; a claim holds only when the interval excludes 0 in the claimed direction.
- The law (d) is judged against time-only models and across runs at equal step (study.lawfit.judge_law); the early
  prediction (h) for bias with a sign test (study.lawfit.early_bias).
- A staleness axis with one seed per k cannot separate k from seed noise: its findings are "undetermined".

Seeds are runs `<method>@s<seed>`, staleness runs `<method>@k<k>` (study/runs.py names them). A missing run or key
never raises, it reads n/a with the reason; every figure prints through study.stats.fmt and bounds (a value that is
not 0 never reads as 0). `render_report` is pure (no I/O); `write_report` writes the PNGs and report.md
(atomically). The runner passes in the overrides that make each method, so this module imports nothing of it;
`covrl study --report-only --study-dir DIR` rewrites a study's report.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

from study.archive import has_run, read_run
from study.lawfit import (
    EARLY_FRACTION,
    EARLY_MAE,
    EARLY_SIGN_P,
    MIN_FIT_POINTS,
    MIN_RUNS_PER_STEP,
    PERMUTATIONS,
    EarlyBias,
    LawFit,
    LawJudgement,
    early_bias,
    early_k,
    early_run,
    early_prediction,
    eval_points,
    eval_sources,
    fit_law,
    judge_law,
    key_series,
    mean_eval_acc,
    merge_rows,
    pearson,
    row_value,
    run_eval_points,
    within_step_points,
    train_points,
)
from study.stats import bounds, diff_interval, fmt, min_detectable_effect, t_interval

# The runs the law is claimed for: the PPO-clip loss without a covariance intervention (GRPO, clip-higher, PAR, and
# their seed and staleness variants). Clip-Cov and KL-Cov change how entropy turns into reward on purpose.
GRPO_FAMILY = ("grpo", "clip_higher", "par")
LEVEL = 0.95  # every interval in the report
POWER = 0.8  # the minimum detectable effect: found with this probability by a two-sided test at 1 - LEVEL
PLATEAU_SHARE = 0.25  # claim (a): GRPO plateaus when its last third of evals gains < this share of its total gain
PLOTS = ["entropy.png", "eval_acc.png", "response_length.png", "law_fit.png", "cov_vs_entropy_delta.png"]
STALENESS_PLOT = "staleness_entropy.png"  # only when the study has a staleness axis
MISSING = "n/a"


# ---------------------------------------------------------------------------
# Data per method
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MethodRun:
    name: str
    rows: list[dict]  # merged, sorted by step; empty when the run is missing
    why_empty: str | None  # why `rows` is empty, if it is


def load_run(study_dir: str, method: str) -> MethodRun:
    run_dir = os.path.join(study_dir, method)
    if not has_run(run_dir):
        return MethodRun(method, [], f"not run (no {run_dir})")
    rows = merge_rows(read_run(run_dir))
    return MethodRun(method, rows, None if rows else f"{run_dir}/metrics.jsonl is missing or empty")


def eval_rows(rows: list[dict]) -> list[dict]:
    """Rows holding at least one eval/<ds>/acc value."""
    return [r for r in rows if mean_eval_acc(r) is not None]


def pass_keys(rows: list[dict]) -> list[str]:
    """Sorted eval/<ds>/pass@<k> keys present in any row."""
    return sorted({k for r in rows for k in r if k.startswith("eval/") and "/pass@" in k})


def entropy_span(rows: list[dict], fraction: float = 0.1) -> tuple[float, float] | None:
    """(entropy at the start, entropy at the end) of a run: means of actor/entropy over the first and the last
    `fraction` of the steps (at least one each). One step's value moves with its batch's prompts, so the verdicts
    compare means, not single steps."""
    return head_tail_means([v for _, v in key_series(rows, "actor/entropy")], fraction)


def head_tail_means(values: list[float], fraction: float = 0.1) -> tuple[float, float] | None:
    """(mean of the first `fraction` of values, mean of the last `fraction`), at least one value each."""
    if not values:
        return None
    k = max(1, round(len(values) * fraction))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def final_eval(rows: list[dict]) -> tuple[int, float] | None:
    """(step, mean eval accuracy) of the last eval row."""
    ev = eval_rows(rows)
    return (ev[-1]["step"], mean_eval_acc(ev[-1])) if ev else None


def cov_points(rows: list[dict]) -> list[tuple[float, float]]:
    """(actor/cov_mean, actor/entropy_delta) per step holding both."""
    return [(c, d) for r in rows if (c := row_value(r, "actor/cov_mean")) is not None
            and (d := row_value(r, "actor/entropy_delta")) is not None]


def try_fit(points: list[tuple[float, float]]) -> tuple[LawFit | None, str]:
    """(fit, "") or (None, why not) for (entropy, reward) points."""
    if len(points) < MIN_FIT_POINTS:
        return None, f"{MISSING} ({len(points)} points; need {MIN_FIT_POINTS})"
    try:
        return fit_law([h for h, _ in points], [r for _, r in points]), ""
    except ValueError as e:
        return None, f"{MISSING} ({e})"


def early_check(points: list[tuple[float, float]]) -> str:
    """'fit on first k of n: RMSE x on the rest' or 'n/a (why)'."""
    if len(points) <= early_k(len(points)):
        return f"{MISSING} ({len(points)} points)"
    try:
        fit, rmse = early_prediction([h for h, _ in points], [r for _, r in points], k=early_k(len(points)))
    except ValueError as e:
        return f"{MISSING} ({e})"
    return f"fit on first {fit.n} of {len(points)}: RMSE {fmt(rmse)} on the other {len(points) - fit.n}"


def variant(name: str) -> tuple[str, str | None]:
    """(method, kind of variant) of a run name (study/runs.py): grpo -> (grpo, None), grpo@s1 -> (grpo, "seed"),
    grpo@k4 -> (grpo, "staleness")."""
    method, _, v = name.partition("@")
    return method, {"s": "seed", "k": "staleness"}.get(v[:1]) if v else None


def seed_label(name: str) -> str:
    """The seed a run stands for, as runs of different methods pair on it: "" for the plain run, "s1" for `m@s1`."""
    return name.partition("@")[2]


def seed_runs(runs: list[MethodRun]) -> dict[str, list[MethodRun]]:
    """Per method, its runs that differ only by seed (the plain run first), for methods with data in two or more."""
    out: dict[str, list[MethodRun]] = {}
    for r in runs:
        method, kind = variant(r.name)
        if kind in (None, "seed") and r.rows:
            out.setdefault(method, []).append(r)
    return {m: rs for m, rs in out.items() if len(rs) >= 2}


def staleness_runs(runs: list[MethodRun]) -> dict[str, list[tuple[float, MethodRun]]]:
    """Per method with a staleness axis: (the largest staleness/max its steps saw, run), sorted by it, the plain
    run included."""
    out: dict[str, list[MethodRun]] = {}
    for r in runs:
        method, kind = variant(r.name)
        if kind in (None, "staleness") and r.rows:
            out.setdefault(method, []).append(r)
    return {m: sorted(((max((v for _, v in key_series(r.rows, "staleness/max")), default=0.0), r) for r in rs),
                      key=lambda x: x[0])
            for m, rs in out.items() if any(variant(r.name)[1] == "staleness" for r in rs)}


def in_family(name: str) -> bool:
    return variant(name)[0] in GRPO_FAMILY


# ---------------------------------------------------------------------------
# Duplicates: a run that repeats another's trajectory is one observation, not two
# ---------------------------------------------------------------------------

DUPLICATE_KEYS = ("actor/entropy", "critic/score/mean")


def find_duplicates(runs: list[MethodRun]) -> dict[str, str]:
    """run name -> the earlier run (in `runs` order) whose DUPLICATE_KEYS series equal its own at every step.
    A run without those series is never a duplicate."""
    seen: dict[tuple, str] = {}
    out = {}
    for r in runs:
        series = tuple(tuple(key_series(r.rows, k)) for k in DUPLICATE_KEYS)
        if not all(series):
            continue
        if series in seen:
            out[r.name] = seen[series]
        else:
            seen[series] = r.name
    return out


@dataclass(frozen=True)
class Study:
    runs: list[MethodRun]
    duplicates: dict[str, str]  # run -> the earlier run it duplicates

    @property
    def by(self) -> dict[str, MethodRun]:
        return {r.name: r for r in self.runs}

    @property
    def distinct(self) -> list[MethodRun]:
        return [r for r in self.runs if r.name not in self.duplicates]


def make_study(runs: list[MethodRun]) -> Study:
    return Study(runs, find_duplicates(runs))


# ---------------------------------------------------------------------------
# Method vs GRPO, paired by seed
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Comparison:
    method: str
    seeds: list[str]  # the runs of `method` paired, e.g. ["kl_cov", "kl_cov@s1"]
    diffs: list[float]  # method - grpo per seed
    identical: int  # seeds whose method run duplicates the same-seed grpo run
    mean: float
    lo: float
    hi: float
    mde: float  # minimum detectable effect at these seeds (sd of the differences)

    @property
    def holds(self) -> bool:
        """The claim "method above grpo": the interval lies above 0."""
        return self.lo > 0

    def verdict(self) -> str:
        if math.isnan(self.lo):
            return "**undetermined** (one seed: no interval)"
        below = " (the interval lies below 0: lower than GRPO)" if self.hi < 0 else ""
        return _verdict(self.holds) + below

    def describe(self, digits: int = 4) -> str:
        n = len(self.diffs)
        same = (f"; {self.identical} of {n} seed(s) bit-identical to grpo (difference exactly 0)"
                if self.identical else "")
        return (f"mean {fmt(self.mean, digits, sign=True)}, {_pc(LEVEL)} CI {_ci(self.lo, self.hi, digits)} over {n} "
                f"seed(s) (per seed {', '.join(fmt(d, digits, sign=True) for d in self.diffs)}{same}); minimum "
                f"detectable effect at {n} seed(s) {fmt(self.mde, digits)} (two-sided {_pc(1 - LEVEL)}, "
                f"{_pc(POWER)} power, from the sd of the differences)")


def compare_to_grpo(study: Study, method: str, value) -> Comparison | None:
    """`value(run)` of `method` minus that of the same-seed grpo run, over the seeds both have; None with none."""
    by = study.by
    pairs = []
    for r in study.runs:
        base = by.get("grpo" + (f"@{seed_label(r.name)}" if seed_label(r.name) else ""))
        if variant(r.name)[0] != method or variant(r.name)[1] not in (None, "seed") or base is None:
            continue
        mine, theirs = value(r), value(base)
        if mine is not None and theirs is not None:
            pairs.append((r.name, mine - theirs, study.duplicates.get(r.name) == base.name))
    if not pairs:
        return None
    diffs = [d for _, d, _ in pairs]
    mean, lo, hi = diff_interval(diffs, [0.0] * len(diffs), paired=True, level=LEVEL)
    sd = _sd(diffs)
    mde = min_detectable_effect(sd, len(diffs), LEVEL, POWER, paired=True) if not math.isnan(sd) else math.nan
    return Comparison(method, [n for n, _, _ in pairs], diffs, sum(s for _, _, s in pairs), mean, lo, hi, mde)


def _sd(values: list[float]) -> float:
    if len(values) < 2:
        return math.nan
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _end_entropy(run: MethodRun) -> float | None:
    return span[1] if (span := entropy_span(run.rows)) else None


def _final_acc(run: MethodRun) -> float | None:
    return fin[1] if (fin := final_eval(run.rows)) else None


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------

def _pc(fraction: float) -> str:
    """0.95 -> '95 %' (the report's spelling of a percentage)."""
    return f"{100 * fraction:g} %"


def _ci(lo: float, hi: float, digits: int = 4) -> str:
    """A signed interval by study.stats.bounds, or n/a without one."""
    return MISSING if math.isnan(lo) else bounds(lo, hi, digits, sign=True)


def _arrow(pair: tuple[float, float] | None, digits: int = 4) -> str:
    return MISSING if pair is None else f"{fmt(pair[0], digits)} → {fmt(pair[1], digits)}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _pct(start: float, end: float) -> str:
    return f"{fmt(100 * (end - start) / abs(start), 1, sign=True)} %" if start else "n/a %"


def _verdict(ok: bool) -> str:
    return "**holds**" if ok else "**does not hold at this scale**"


def _first_last(rows: list[dict], key: str) -> tuple[float, float] | None:
    s = key_series(rows, key)
    return (s[0][1], s[-1][1]) if s else None


def _mean_ci(values: list[float], digits: int = 4) -> str:
    """'mean [lo, hi]' (95 % t-interval) or 'mean (one seed)'."""
    if not values:
        return MISSING
    mean, lo, hi = t_interval(values, LEVEL)
    return f"{fmt(mean, digits)} (one seed)" if math.isnan(lo) else f"{fmt(mean, digits)} {bounds(lo, hi, digits)}"


def response_entropy_span(rows: list[dict]) -> tuple[tuple[float, float], bool] | None:
    """((start, end), logged): entropy per response, means of the first and last 10 % of steps. `logged` when the run
    has actor/entropy_per_response; otherwise the approximation token entropy x mean response length per step."""
    logged = [v for _, v in key_series(rows, "actor/entropy_per_response")]
    if logged:
        return head_tail_means(logged), True
    approx = [h * n for r in rows if (h := row_value(r, "actor/entropy")) is not None
              and (n := row_value(r, "response_length/mean")) is not None]
    return (head_tail_means(approx), False) if approx else None


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def section_header(study: Study, meta: dict, now: datetime.datetime, method_overrides: dict[str, list[str]]) -> str:
    wall, status, overrides = meta.get("wall_clock_s", {}), meta.get("status", {}), meta.get("overrides", {})
    procs = (f"{meta['gens']} generator(s) + {meta['learners']} learner rank(s) per run"
             if "gens" in meta and "learners" in meta else MISSING)
    shared = ", ".join(f"`{o}`" for o in overrides.get("preset", []) + overrides.get("user", [])) or "none"
    lines = ["# covrl study report", "", "## 1. Study", "",
             f"- Date: {now:%Y-%m-%d %H:%M:%S} (report written); study started {meta.get('start_time') or MISSING}, "
             f"ended {meta.get('end_time') or MISSING}",
             f"- Command: `{meta.get('command') or MISSING}`",
             f"- Preset: {meta.get('preset', MISSING)}; steps: {meta.get('steps', MISSING)}; seed: {meta.get('seed', MISSING)}",
             f"- Processes: {procs}",
             f"- Overrides shared by every method: {shared}", "",
             _table(["method", "method overrides", "status", "wall-clock (s)", "metrics rows", "duplicate of"],
                    [[r.name, ", ".join(f"`{o}`" for o in method_overrides.get(r.name, [])),
                      status.get(r.name, MISSING), fmt(wall.get(r.name), 1), str(len(r.rows)),
                      study.duplicates.get(r.name, "")] for r in study.runs])]
    lines += ["", duplicates_note(study)]
    notes = data_notes(study.runs)
    if notes:
        lines += ["", "Missing data (shown as n/a below):", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def duplicates_note(study: Study) -> str:
    if not study.duplicates:
        return (f"Duplicates: none (no run repeats another's {' and '.join(DUPLICATE_KEYS)} at every step).")
    pairs = ", ".join(f"{d} = {o}" for d, o in study.duplicates.items())
    return (f"Duplicates: {len(study.duplicates)} run(s) repeat another run's {' and '.join(DUPLICATE_KEYS)} at every "
            f"step ({pairs}): the same trajectory, so one observation. Pooled fits and the early-prediction test count "
            f"each distinct trajectory once ({len(study.distinct)} of {len(study.runs)} runs); the per-run tables show "
            f"every run, and a paired comparison counts a duplicate of the same-seed GRPO run as a difference of 0.")


def data_notes(runs: list[MethodRun]) -> list[str]:
    """One line per method and kind of missing data, saying why cells read n/a."""
    notes = []
    for r in runs:
        if r.why_empty:
            notes.append(f"{r.name}: {r.why_empty}")
            continue
        if not eval_rows(r.rows):
            notes.append(f"{r.name}: no eval/<ds>/acc values (evaluation off or not reached)")
        elif len(eval_points(r.rows)) < len(eval_rows(r.rows)):
            notes.append(f"{r.name}: {len(eval_rows(r.rows)) - len(eval_points(r.rows))} eval row(s) without the "
                         f"evaluated version's entropy (no actor/entropy on the next row nor entropy_delta)")
        for key in ("actor/entropy", "actor/entropy_delta", "actor/cov_mean", "critic/score/mean", "response_length/mean"):
            if not key_series(r.rows, key):
                notes.append(f"{r.name}: no {key} values")
    return notes


def _training_row(r: MethodRun) -> list[str]:
    span, per_resp = entropy_span(r.rows), response_entropy_span(r.rows)
    resp = MISSING
    if per_resp and per_resp[0]:
        (a, b), logged = per_resp
        resp = f"{fmt(a, 3)} → {fmt(b, 3)} ({_pct(a, b)}){'' if logged else ' ≈'}"
    return [r.name, str(len(key_series(r.rows, "actor/entropy"))),
            _arrow(head_tail_means([v for _, v in key_series(r.rows, "critic/score/mean")])),
            f"{_arrow(span)} ({_pct(*span)})" if span else MISSING, resp,
            _arrow(_first_last(r.rows, "response_length/mean"), 1)]


def section_summary(runs: list[MethodRun]) -> str:
    all_rows = [row for r in runs for row in r.rows]
    sources, pkeys = eval_sources(all_rows), pass_keys(all_rows)
    ev_rows = []
    for r in runs:
        ev = eval_rows(r.rows)
        span = f"{len(ev)} (steps {ev[0]['step']}–{ev[-1]['step']})" if ev else "0"
        cells = [r.name, span]
        cells += [_arrow(_first_last(ev, f"eval/{ds}/acc")) for ds in sources]
        cells.append(_arrow((mean_eval_acc(ev[0]), mean_eval_acc(ev[-1])) if ev else None))
        cells += [fmt(row_value(ev[-1], k) if ev else None) for k in pkeys]
        ev_rows.append(cells)
    ev_header = (["method", "evals"] + [f"acc {ds} first → last" for ds in sources] + ["mean acc first → last"]
                 + [f"{k.removeprefix('eval/')} last" for k in pkeys])
    logged = any(key_series(r.rows, "actor/entropy_per_response") for r in runs)
    return "\n".join([
        "## 2. Summary", "",
        "Held-out evaluation (avg@k accuracy per data source; first eval is the base model when step 0 was evaluated):", "",
        _table(ev_header, ev_rows), "",
        "Training (reward and entropy: mean of the first 10 % of steps → mean of the last 10 %; response length: first → "
        "last step). Entropy per token is what actor/entropy logs; entropy per response is the summed entropy of a "
        "response, " + ("actor/entropy_per_response where logged; where marked ≈ it is " if logged else "") +
        "approximated (≈) as token entropy × mean response length per step, when the run has no "
        "actor/entropy_per_response. Responses that grow with near-deterministic tokens dilute the per-token mean: the "
        "gap between the two falls is that length dilution.", "",
        _table(["method", "training steps", "train reward first 10 % → last 10 %", "entropy per token first 10 % → last "
                "10 %", "entropy per response first 10 % → last 10 %", "response length first → last"],
               [_training_row(r) for r in runs])])


def _fit_rows(study: Study, points_by_run: dict[str, list[tuple[float, float]]]) -> list[list[str]]:
    """One row per run (duplicates noted), then the pooled fits over the distinct runs."""
    rows = []
    distinct = {n: pts for n, pts in points_by_run.items() if n not in study.duplicates}
    family = [p for n, pts in distinct.items() if in_family(n) for p in pts]
    pooled = [p for pts in distinct.values() for p in pts]
    for name, pts in list(points_by_run.items()) + [("pooled (GRPO family, distinct runs)", family),
                                                    ("pooled (all methods, distinct runs)", pooled)]:
        fit, why = try_fit(pts)
        if name in study.duplicates:
            why = f"duplicate of {study.duplicates[name]}: left out of the pooled fits"
        rows.append([name, str(len(pts))] + ([fmt(fit.a), fmt(fit.b), fmt(fit.r2, 3), fmt(fit.ceiling), why] if fit
                                             else [MISSING] * 4 + [why]))
    return rows


def family_eval_points(study: Study) -> dict[str, list]:
    """The eval points (study.lawfit.EvalPoint) of each distinct GRPO-family run: what claims (d) and (h) judge."""
    return {r.name: pts for r in study.distinct if in_family(r.name) and (pts := run_eval_points(r.name, r.rows))}


def section_law(study: Study, eval_pts: dict, train_pts: dict, judged: LawJudgement | None) -> str:
    header = ["fit", "points", "a", "b", "R²", "ceiling b − a", "note"]
    return "\n".join([
        "## 3. Entropy–performance law R = −a·exp(H) + b", "",
        "On held-out accuracy (mean over data sources) against the evaluated version's entropy:", "",
        _table(header, _fit_rows(study, eval_pts)), "",
        "Secondary: on training reward (critic/score/mean) against the step's batch entropy:", "",
        _table(header, _fit_rows(study, train_pts)), "", law_vs_clock(judged)])


def law_vs_clock(j: LawJudgement | None) -> str:
    """The law's fit next to models that know only the step, and the across-run test at equal step."""
    head = "### 3.1 Law or clock?"
    if j is None:
        return f"{head}\n\n{MISSING} (fewer than {MIN_FIT_POINTS} GRPO-family eval points, or no spread in entropy or step)."
    forms = {"exp(H)": "exp(H)", "H (linear)": "H", "eval response length": "(mean eval response length)"}
    rows = [[m, f"acc = a·{forms.get(m, m.removeprefix('time: '))} + b", fmt(r2, 3)] for m, r2 in j.r2.items()]
    rows.append(["shuffled pairing (control)", f"run i's accuracy against run j's exp(H) at the same step, mean over "
                 f"{j.runs - 1} cyclic shifts of the runs", fmt(j.shuffled_r2, 3)])
    lo, hi = j.entropy_range
    return "\n".join([
        head, "",
        f"Every model fitted the same way (least squares, pooled over the {j.n} eval points of the {j.runs} distinct "
        f"GRPO-family runs). A model that knows only the step fits a run whose entropy falls while its accuracy "
        f"climbs as well as the law does; so does another run's entropy.", "",
        _table(["model", "form", "R²"], rows), "",
        f"Across runs at equal step: exp(H) and accuracy demeaned within each step evaluated in ≥ {MIN_RUNS_PER_STEP} "
        f"runs ({j.within_steps} steps, {j.within_points} points): Pearson r = {fmt(j.within_r, 3)}, two-sided "
        f"permutation p = {fmt(j.within_p, 4)} ({PERMUTATIONS:,} shuffles of accuracy across runs within each step, "
        f"seed 0). The law predicts r < 0: at a step, the run with the lower entropy has the higher accuracy.", "",
        f"Exponential or linear: over H in {bounds(lo, hi, 3)}, exp(H) and 1 + H differ by at most "
        f"{fmt(100 * j.exp_linear_gap, 2)} % (relative); " + (
            f"the exponential form is not tested (indistinguishable from linear over H in {bounds(lo, hi, 3)})."
            if not j.exp_form_tested else "the data can tell the two forms apart (compare the R² of exp(H) and H).")])


def _early_row(study: Study, name: str, pts: list, judged: dict) -> list[str]:
    e = judged.get(name) or early_run(name, pts)
    if e is None:
        return [MISSING] * 5 + ["no (too few points)"]
    why = ("yes" if name in judged else f"no (duplicate of {study.duplicates[name]})" if name in study.duplicates
           else "no (outside the GRPO family)" if not in_family(name) else "no")
    return [fmt(e.predicted), fmt(e.final), fmt(e.error, sign=True),
            f"{fmt(2 * e.pi_half / e.acc_range, 1)}×" if e.pi_half is not None and e.acc_range else MISSING,
            MISSING if e.pooled_predicted is None else fmt(e.final - e.pooled_predicted, sign=True), why]


def section_early(study: Study, eval_pts: dict, train_pts: dict, bias: EarlyBias | None) -> str:
    judged = {e.run: e for e in bias.runs} if bias else {}
    rows = [[m, early_check(pts), early_check(train_pts[m])] + _early_row(study, m, pts, judged)
            for m, pts in eval_pts.items()]
    pooled = (f" The pooled early fit is one law fitted on the judged runs' first points together "
              f"({bias.pooled.formula()}, {bias.pooled.n} points)." if bias and bias.pooled else "")
    return "\n".join([
        f"## 4. Early prediction (fit on the first {_pc(EARLY_FRACTION)} of points)", "",
        f"RMSE of the early fit on the remaining points (eval and training), and its prediction of the final held-out "
        f"accuracy from the final entropy (fit on the first {_pc(EARLY_FRACTION)} of the eval points, at least "
        f"{MIN_FIT_POINTS}). Error is final − predicted (positive: predicted too low). The 95 % prediction interval's "
        f"full width is given as a multiple of the run's whole accuracy range (max − min over its evals): an interval "
        f"wider than the range contains any final the run could reach. Claim (h) judges the distinct GRPO-family "
        f"runs.{pooled}", "",
        _table(["method", "eval points", "training points", "predicted final acc", "measured final acc",
                "error (final − predicted)", "95 % PI width ÷ accuracy range", "error of the pooled early fit",
                "judged in (h)"], rows)])


def section_cov(study: Study, cov_pts: dict) -> str:
    pooled = [p for name, pts in cov_pts.items() if name not in study.duplicates for p in pts]
    rows = []
    for name, pts in list(cov_pts.items()) + [("pooled (all methods, distinct runs)", pooled)]:
        r = pearson([c for c, _ in pts], [d for _, d in pts])
        rows.append([name, str(len(pts)), fmt(r, 3) if r is not None else f"{MISSING} (needs ≥ 3 points that vary)"])
    return "\n".join([
        "## 5. Covariance check", "",
        "Pearson correlation, per step, of actor/cov_mean (mean Cov(log π, A) of the batch) with "
        "actor/entropy_delta (entropy change of the step's update). The paper predicts a negative correlation.", "",
        _table(["method", "steps", "Pearson r"], rows)])


def _why_absent(by: dict[str, MethodRun], names: tuple[str, ...], has, lacking: str) -> str | None:
    """None if every named method has the data `has(run)` checks; else why not, e.g. 'par was not run'
    or 'grpo has <lacking>'."""
    why = [f"{n} was not run" if n not in by or by[n].why_empty else f"{n} has {lacking}"
           for n in names if n not in by or not has(by[n])]
    return "; ".join(why) or None


PLATEAU_MIN_GAIN = 0.05  # ... and only a run that gained this much has a plateau (else it never learned)


def plateau(rows: list[dict]) -> tuple[float, float] | None:
    """(total gain, gain of the last third) of a run's mean eval accuracy: the mean of the last third of its evals
    minus the first eval, and minus the mean of the middle third. None with fewer than 6 evals."""
    accs = [mean_eval_acc(r) for r in eval_rows(rows)]
    n = len(accs) // 3
    if n < 2:
        return None
    last, middle = sum(accs[-n:]) / n, sum(accs[-2 * n:-n]) / n
    return last - accs[0], last - middle


def claim_collapse(by: dict[str, MethodRun]) -> str:
    """(a) GRPO's entropy falls over the run (end < start) and its accuracy plateaus (the last third of the evals
    gains less than PLATEAU_SHARE of the run's gain). The entropy per response is stated beside it."""
    why = (_why_absent(by, ("grpo",), lambda r: entropy_span(r.rows) is not None, "no actor/entropy values")
           or _why_absent(by, ("grpo",), lambda r: plateau(r.rows) is not None, "fewer than 6 evals"))
    if why:
        return f"(a) Entropy collapse and plateau under GRPO: skipped ({why})."
    h0, h1 = entropy_span(by["grpo"].rows)
    total, late = plateau(by["grpo"].rows)
    flat = total >= PLATEAU_MIN_GAIN and late < PLATEAU_SHARE * total
    per_resp = response_entropy_span(by["grpo"].rows)
    resp = ""
    if per_resp and per_resp[0]:
        (a, b), logged = per_resp
        resp = (f"; entropy per response {'' if logged else '(≈ token entropy × mean response length) '}"
                f"{fmt(a, 3)} → {fmt(b, 3)} ({_pct(a, b)}): the rest of the per-token fall is responses growing longer")
    return (f"(a) Entropy collapse and plateau under GRPO. Paper: without entropy control, GRPO's policy entropy "
            f"falls sharply and its performance saturates. Measured: grpo entropy per token (mean of the first → last "
            f"10 % of steps) {fmt(h0)} → {fmt(h1)} ({_pct(h0, h1)}){resp}; mean eval accuracy (mean of the last third "
            f"of the evals) gained {fmt(total, sign=True)} over the first eval, and {fmt(late, sign=True)} over the "
            f"middle third (a plateau: a gain of at least {fmt(PLATEAU_MIN_GAIN, 2)}, less than {_pc(PLATEAU_SHARE)} of "
            f"it in the last third): {_verdict(h1 < h0 and flat)}.")


def claim_vs_grpo(study: Study, title: str, paper: str, method: str, value, endpoint: str) -> str:
    """A "method above GRPO" claim judged by the paired-by-seed difference's 95 % interval."""
    why = _why_absent(study.by, ("grpo", method), lambda r: value(r) is not None, f"no {endpoint}")
    cmp = None if why else compare_to_grpo(study, method, value)
    if cmp is None:
        return f"{title}: skipped ({why or f'no seed that both {method} and grpo ran'})."
    return (f"{title}. Paper: {paper}. Measured {endpoint}, {method} − grpo paired by seed: {cmp.describe()}. Holds "
            f"when the {_pc(LEVEL)} interval lies above 0: {cmp.verdict()}.")


def claim_law(j: LawJudgement | None) -> str:
    """(d) the law holds only if exp(H) beats every time-only model's R^2 and the within-step correlation of exp(H)
    with accuracy is negative with p < 0.05."""
    if j is None:
        return "(d) The entropy–performance law fits: skipped (too few GRPO-family eval points; see section 3.1)."
    clock = ", ".join(f"{m.removeprefix('time: ')} {fmt(j.r2[m], 3)}" for m in j.time_models)
    others = ", ".join(f"{m} {fmt(r2, 3)}" for m, r2 in j.r2.items() if m != "exp(H)" and m not in j.time_models)
    verdict = ("**holds**" if j.holds else "**does not hold at this scale: cannot tell the law from a clock**")
    lo, hi = j.entropy_range
    form = ("" if j.exp_form_tested else f" The exponential form is not tested (indistinguishable from linear over H in "
            f"{bounds(lo, hi, 3)}: exp(H) and 1 + H differ by at most {fmt(100 * j.exp_linear_gap, 2)} %).")
    return (f"(d) The entropy–performance law fits. Paper: R = −a·exp(H) + b fits held-out accuracy (R² ≈ 0.96–0.99 "
            f"per model family). Measured on the {j.n} eval points of the {j.runs} distinct GRPO-family runs: R² of "
            f"exp(H) {fmt(j.r2['exp(H)'], 3)}; time-only models {clock}; {others}; shuffled pairing (another run's "
            f"entropy at the same step) {fmt(j.shuffled_r2, 3)}. Across runs at equal step: r = {fmt(j.within_r, 3)}, "
            f"permutation p = {fmt(j.within_p, 3)} ({j.within_steps} steps, {j.within_points} points). Holds only if "
            f"exp(H)'s R² beats every time-only model's and the within-step r is negative with p < 0.05: "
            f"{verdict}.{form}")


def claim_early(bias: EarlyBias | None) -> str:
    """(h) the early fit predicts the final accuracy: mean absolute error <= EARLY_MAE and no bias by the sign test."""
    if bias is None:
        return "(h) Early points predict the final accuracy: skipped (no GRPO-family run with enough eval points)."
    errs = [e.error for e in bias.runs]
    above = sum(x > 0 for x in errs)
    widths = [2 * e.pi_half / e.acc_range for e in bias.runs if e.pi_half is not None and e.acc_range]
    inside = sum(e.pi_half is not None and abs(e.error) <= e.pi_half for e in bias.runs)
    pooled = [e.final - e.pooled_predicted for e in bias.runs if e.pooled_predicted is not None]
    verdict = _verdict(bias.holds) + (
        f": a bias, the early fit predicts too {'low' if bias.mean > 0 else 'high'}" if bias.biased else "")
    pi = ""
    if widths:
        pi = (f" The final lies inside the early fit's 95 % prediction interval in {inside} of {len(errs)} runs; the "
              f"interval's width is {fmt(min(widths), 1)}–{fmt(max(widths), 1)}× each run's whole accuracy range" +
              (", so that count cannot fail here." if min(widths) >= 1 else "."))
    pooled_s = (f" One early fit pooled over these runs' first points: errors {fmt(min(pooled), sign=True)} to "
                f"{fmt(max(pooled), sign=True)}." if pooled else "")
    return (f"(h) Early points predict the final accuracy. Paper: a fit on the first 15 % of training predicts the "
            f"final performance (RMSE ~1 %). Measured over the {len(errs)} distinct GRPO-family runs, final − "
            f"predicted: {', '.join(f'{e.run} {fmt(e.error, sign=True)}' for e in bias.runs)}; mean {fmt(bias.mean, sign=True)}, "
            f"{_pc(LEVEL)} CI {_ci(bias.lo, bias.hi)}; {above} of {len(errs)} above the prediction, sign test p = "
            f"{fmt(bias.sign_p)}; mean absolute error {fmt(bias.mae)}. Holds when the mean absolute error is ≤ "
            f"{fmt(EARLY_MAE, 2)} and the sign test finds no bias (p ≥ {EARLY_SIGN_P}): {verdict}.{pooled_s}{pi}")


def claim_cov(pooled_r: float | None, n_steps: int) -> str:
    """(e) the pooled Pearson r of cov_mean vs entropy_delta is negative beyond chance: r < -2/sqrt(n), about the
    two-sided 5 % level for no correlation (a sign alone would call r = -0.01 over 1,500 steps a correlation)."""
    if pooled_r is None:
        return (f"(e) Covariance drives entropy change: skipped ({n_steps} steps with actor/cov_mean and "
                f"actor/entropy_delta; need ≥ 3 that vary).")
    bound = 2 / math.sqrt(n_steps)
    return (f"(e) Covariance drives entropy change. Paper: steps whose log-prob/advantage covariance is high lower "
            f"entropy, so the correlation is negative. Measured pooled Pearson r = {fmt(pooled_r, 3)} over {n_steps} "
            f"steps of the distinct runs (negative beyond chance at r < −{fmt(bound, 3)}): {_verdict(pooled_r < -bound)}.")


def check_par_active(by: dict[str, MethodRun]) -> str:
    """PAR's entropy-guided schedule moved λ: an implementation check, since it cannot fail once entropy halves."""
    why = _why_absent(by, ("par",), lambda r: key_series(r.rows, "actor/par_lambda"), "no actor/par_lambda values")
    if why:
        return f"PAR's entropy-guided schedule is active: skipped ({why})."
    lams = [v for _, v in key_series(by["par"].rows, "actor/par_lambda")]
    down = sum(b < a for a, b in zip(lams, lams[1:]))
    return (f"PAR's entropy-guided schedule is active: λ (the weight of positive-advantage tokens) went down on {down} "
            f"of {len(lams) - 1} steps, ranged {fmt(min(lams), 2)}–{fmt(max(lams), 2)}, mean {fmt(sum(lams) / len(lams), 2)}: "
            f"{'passes' if down > 0 else 'fails'}. Cannot fail by construction: the schedule lowers λ after every step "
            f"whose entropy is under its target (a fraction of the first steps' entropy) and raises it otherwise, so "
            f"any run whose entropy falls below the target, as claim (a) finds, moves λ down.")


def _summed_fall(rows: list[dict], steps: list[int]) -> float | None:
    """The entropy the updates of `steps` removed: -sum of actor/entropy_delta (same batch, before -> after the
    update) over those steps, in % of actor/entropy at the first of them; None when a value is missing."""
    by = {r["step"]: r for r in rows}
    deltas = [row_value(by.get(s), "actor/entropy_delta") for s in steps]
    h0 = row_value(by.get(steps[0]), "actor/entropy")
    if any(d is None for d in deltas) or not h0:
        return None
    return -100 * sum(deltas) / h0


def step_ranges(steps: list[int]) -> str:
    """Sorted steps as runs of consecutive ones: [1, 41, 42, 43, 45] -> "1, 41–43, 45"."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)


def par_zero_rows(study: Study) -> list[tuple[str, list[int], int, float, float]]:
    """Per PAR run with a same-seed GRPO run: (run, the steps with λ = 0, steps, PAR's summed fall over those steps,
    GRPO's over the same step numbers)."""
    out = []
    for r in study.runs:
        base = study.by.get("grpo" + (f"@{seed_label(r.name)}" if seed_label(r.name) else ""))
        if variant(r.name)[0] != "par" or variant(r.name)[1] not in (None, "seed") or base is None:
            continue
        lams = key_series(r.rows, "actor/par_lambda")
        zero = [s for s, v in lams if v == 0.0]
        if not zero:
            continue
        mine, theirs = _summed_fall(r.rows, zero), _summed_fall(base.rows, zero)
        if mine is not None and theirs is not None:
            out.append((r.name, zero, len(lams), mine, theirs))
    return out


def claim_par_zero(study: Study) -> str:
    """(f3) On the steps where PAR trains positive-advantage tokens with weight λ = 0, entropy falls clearly less than
    under GRPO on the same steps: the paired-by-seed difference of the falls has its 95 % interval below 0."""
    title = "(f3) Positive-advantage tokens drive the entropy fall"
    rows = par_zero_rows(study)
    if not rows:
        return (f"{title}: skipped (no PAR run with a same-seed grpo run, a step with actor/par_lambda = 0 and "
                f"actor/entropy_delta on those steps).")
    diffs = [p - g for *_, p, g in rows]
    mean, lo, hi = t_interval(diffs, LEVEL)
    clearly = not math.isnan(hi) and hi < 0
    verdict = "**undetermined** (one seed: no interval)" if math.isnan(hi) else _verdict(clearly)
    negative = ("" if clearly or math.isnan(hi) else
                f" With positive-advantage tokens at weight 0, entropy still fell, and not detectably less than under "
                f"GRPO (the interval allows a fall up to {fmt(-lo, 0)} points smaller, or none): Jin et al.'s mechanism claim "
                f"is not supported at this scale, not refuted.")
    per = "; ".join(f"{n}: λ = 0 on {len(z)} of {t} steps ({step_ranges(z)}), entropy fell {fmt(p, 0)} % vs {fmt(g, 0)} % "
                    f"for the same-seed grpo run" for n, z, t, p, g in rows)
    return (f"{title}. Paper (Jin et al. 2025): entropy collapse is driven by the positive-advantage tokens, so a "
            f"step that gives them weight λ = 0 (training only on negative-advantage tokens) lowers entropy less. "
            f"Measured, over exactly the steps with λ = 0, the summed same-batch entropy change of the updates "
            f"(−Σ actor/entropy_delta, each the entropy change of one update on its own batch, in % of actor/entropy at "
            f"the first such step), PAR against the same-seed GRPO run "
            f"over the same step numbers: {per}. PAR − GRPO: mean {fmt(mean, 1, sign=True)} points, {_pc(LEVEL)} CI "
            f"{_ci(lo, hi, 1)} over {len(rows)} seed(s). Holds when PAR's fall is clearly smaller (interval below 0): "
            f"{verdict}.{negative}")


def claim_lines(study: Study, judged: LawJudgement | None, bias: EarlyBias | None, pooled_r: float | None,
                n_cov: int) -> list[str]:
    """The "Does it match the paper?" sentences, each with the claim, the criterion, the numbers and a verdict."""
    cov_paper = "Clip-Cov and KL-Cov keep entropy above the GRPO baseline (KL-Cov over 10× its plateau at 7B)"
    end_h = "mean entropy over the last 10 % of steps"
    final = "final mean eval accuracy"
    return [
        claim_collapse(study.by),
        claim_vs_grpo(study, "(b) Clip-Cov ends with higher entropy than GRPO", cov_paper, "clip_cov", _end_entropy, end_h),
        claim_vs_grpo(study, "(b) KL-Cov ends with higher entropy than GRPO", cov_paper, "kl_cov", _end_entropy, end_h),
        claim_vs_grpo(study, "(c) Clip-higher ends with higher entropy than GRPO",
                      "raising the upper clip bound (0.28 vs 0.2) slows entropy collapse", "clip_higher",
                      _end_entropy, end_h),
        claim_law(judged),
        claim_cov(pooled_r, n_cov),
        claim_vs_grpo(study, "(f2) PAR beats GRPO on final eval accuracy",
                      "entropy-guided PAR 45.66 vs GRPO 44.12 avg@64 (Jin et al. 2025)", "par", _final_acc, final),
        claim_par_zero(study),
        claim_vs_grpo(study, "(g) Clip-Cov ends at a higher held-out accuracy than GRPO", "yes", "clip_cov",
                      _final_acc, final),
        claim_vs_grpo(study, "(g) KL-Cov ends at a higher held-out accuracy than GRPO", "yes", "kl_cov",
                      _final_acc, final),
        claim_early(bias),
    ]


def section_claims(claims: list[str], checks: list[str]) -> str:
    return "\n".join(["## 6. Does it match the paper?", "",
                      "Each claim states its criterion; each could come out either way on these runs.", ""]
                     + [f"- {c}" for c in claims]
                     + ["", "Implementation checks (these cannot fail by construction):", ""]
                     + [f"- {c}" for c in checks])


def section_seeds(study: Study) -> str:
    """Per method run at several seeds: its final held-out accuracy and end entropy with 95 % intervals; then every
    method against GRPO, paired by seed."""
    groups = seed_runs(study.runs)
    head = "## 7. Seeds"
    if not groups:
        return f"{head}\n\nEach method ran at one seed, so the spread between seeds is unknown (`--seeds 0,1`)."
    rows = [[m, ", ".join(r.name + (f" (= {study.duplicates[r.name]})" if r.name in study.duplicates else "")
                          for r in rs),
             _mean_ci([v for r in rs if (v := _final_acc(r)) is not None]),
             _mean_ci([v for r in rs if (v := _end_entropy(r)) is not None])] for m, rs in groups.items()]
    cmp_rows = []
    for m in [m for m in groups if m != "grpo"]:
        for endpoint, value in (("final mean eval accuracy", _final_acc), ("entropy, last 10 % of steps", _end_entropy)):
            c = compare_to_grpo(study, m, value)
            if c is not None:
                cmp_rows.append([f"{m} − grpo", endpoint, str(len(c.diffs)), fmt(c.mean, sign=True), _ci(c.lo, c.hi),
                                 fmt(c.mde), str(c.identical)])
    return "\n".join([
        head, "", f"Mean over seeds [{_pc(LEVEL)} t-interval, n − 1 degrees of freedom]; a run marked (= other) "
        "repeats that run's trajectory:", "",
        _table(["method", "runs", "final mean eval accuracy", "entropy, last 10 % of steps"], rows), "",
        f"Each method against GRPO, paired by seed (the difference per seed, its mean and {_pc(LEVEL)} t-interval; the "
        f"minimum detectable effect is the true difference a two-sided {_pc(1 - LEVEL)} test finds with {_pc(POWER)} "
        f"power at these seeds, from the sd of the differences):", "",
        _table(["comparison", "endpoint", "seeds", "mean difference", f"{_pc(LEVEL)} CI", "minimum detectable effect",
                "seeds identical to grpo"], cmp_rows)])


def _seed_spread(study: Study, method: str, value) -> str:
    """'sd X (min–max) over n seeds' of `value` over the method's seed runs at the plain k, or why unknown."""
    values = [v for r in seed_runs(study.runs).get(method, []) if (v := value(r)) is not None]
    if len(values) < 2:
        return "unknown (one seed)"
    return f"sd {fmt(_sd(values))} ({fmt(min(values))}–{fmt(max(values))}) over {len(values)} seeds"


def section_staleness(study: Study) -> str:
    """The staleness axis: per method, entropy collapse, Cov and final accuracy at each bound k. With one seed per k
    nothing separates an effect of k from seed noise, so every finding is undetermined."""
    groups = staleness_runs(study.runs)
    head = "## 8. Staleness"
    if not groups:
        return f"{head}\n\nNo staleness axis in this study (`--staleness 0,4`)."
    rows, findings = [], []
    for m, pairs in groups.items():
        ends, accs = [], []
        for k, r in pairs:
            span, fin = entropy_span(r.rows), final_eval(r.rows)
            covs = [v for _, v in key_series(r.rows, "actor/cov_mean")]
            rows.append([m, r.name, f"{fmt(k, 0)}", _arrow(span), _pct(*span) if span else MISSING,
                         fmt(sum(covs) / len(covs) if covs else None), fmt(fin[1] if fin else None)])
            ends.append(fmt(span[1] if span else None))
            accs.append(fmt(fin[1] if fin else None))
        findings.append(
            f"- {m}: end entropy by k ({', '.join(f'{fmt(k, 0)}' for k, _ in pairs)}) {', '.join(ends)}; final mean eval "
            f"accuracy {', '.join(accs)}: **undetermined** (one seed per k; the seed spread of the plain runs is "
            f"{_seed_spread(study, m, _end_entropy)} in end entropy and {_seed_spread(study, m, _final_acc)} in final "
            f"accuracy).")
    return "\n".join([head, "", "k is the largest staleness (policy versions between generation and training) the "
                      "run's steps saw; entropy: mean of the first → last 10 % of steps.", "",
                      _table(["method", "run", "k", "entropy first → last", "change", "mean actor/cov_mean",
                              "final mean eval accuracy"], rows), "", *findings, "",
                      "With one run per k, a difference between two values of k also carries one run's own noise, "
                      "whose size the plain runs' seed spread shows: judged against that spread, the range over k "
                      "comes out \"beyond the spread\" about half the time with no effect at all. An effect of k needs "
                      "several seeds at each k and a paired interval, as section 7 gives for the methods."])


def render_report(runs: list[MethodRun], meta: dict, now: datetime.datetime, *,
                  method_overrides: dict[str, list[str]]) -> str:
    """The whole report.md text (pure: no I/O). `method_overrides`: the config overrides of each method, by name."""
    study = make_study(runs)
    eval_pts = {r.name: [(h, a) for _, h, a in eval_points(r.rows)] for r in runs}
    train_pts = {r.name: [(h, x) for _, h, x in train_points(r.rows)] for r in runs}
    cov_pts = {r.name: cov_points(r.rows) for r in runs}
    pooled_cov = [p for r in study.distinct for p in cov_pts[r.name]]
    pooled_r = pearson([c for c, _ in pooled_cov], [d for _, d in pooled_cov])
    family = family_eval_points(study)
    judged = judge_law(family)
    bias = early_bias({n: [(p.entropy, p.acc) for p in pts] for n, pts in family.items()})
    claims = claim_lines(study, judged, bias, pooled_r, len(pooled_cov))
    plots = PLOTS + ([STALENESS_PLOT] if staleness_runs(runs) else [])
    return "\n\n".join([
        section_header(study, meta, now, method_overrides),
        section_summary(runs),
        section_law(study, eval_pts, train_pts, judged),
        section_early(study, eval_pts, train_pts, bias),
        section_cov(study, cov_pts),
        section_claims(claims, [check_par_active(study.by)]),
        section_seeds(study),
        section_staleness(study),
        "## 9. Plots\n\n" + "\n\n".join(f"![{p.removesuffix('.png')}]({p})" for p in plots),
    ]) + "\n"


def write_plots(study_dir: str, runs: list[MethodRun]) -> list[str]:
    """The report's PNGs in study_dir; returns their paths."""
    from study.plots import plot_law_fit, plot_lines, plot_metric, plot_scatter

    study = make_study(runs)
    rows = {r.name: r.rows for r in runs}
    sources = eval_sources([row for r in runs for row in r.rows])
    acc_panels = {"mean over data sources": {r.name: [(e["step"], mean_eval_acc(e)) for e in eval_rows(r.rows)] for r in runs}}
    acc_panels |= {ds: {r.name: key_series(r.rows, f"eval/{ds}/acc") for r in runs} for ds in sources}
    eval_pts = {r.name: [(h, a) for _, h, a in eval_points(r.rows)] for r in study.distinct}
    fits = {m: try_fit(pts)[0] for m, pts in eval_pts.items()}
    family = try_fit([p for n, pts in eval_pts.items() if in_family(n) for p in pts])[0]
    xs, ys, _ = within_step_points([p for pts in family_eval_points(study).values() for p in pts])
    out = os.path.join
    return [
        plot_metric(rows, "actor/entropy", out(study_dir, "entropy.png"), title="policy entropy (actor/entropy) vs step"),
        plot_lines(acc_panels, out(study_dir, "eval_acc.png"), xlabel="step (policy version)", ylabel="eval accuracy",
                   title="held-out accuracy"),
        plot_metric(rows, "response_length/mean", out(study_dir, "response_length.png"), title="mean response length vs step"),
        plot_law_fit(eval_pts, fits, out(study_dir, "law_fit.png"), pooled=family, ylabel="mean eval accuracy",
                     title="R = −a·exp(H) + b on eval points of the distinct runs (dashed: per run, black: pooled "
                           "over the GRPO family)", within=list(zip(xs, ys))),
        plot_scatter({r.name: cov_points(r.rows) for r in study.distinct}, out(study_dir, "cov_vs_entropy_delta.png"),
                     xlabel="actor/cov_mean", ylabel="actor/entropy_delta", title="covariance vs entropy change per step"),
    ] + ([plot_lines({m: {f"k={fmt(k, 0)} ({r.name})": key_series(r.rows, "actor/entropy") for k, r in pairs}
                      for m, pairs in stale.items()}, out(study_dir, STALENESS_PLOT), xlabel="step",
                     ylabel="actor/entropy", title="entropy vs step at each staleness bound k")]
         if (stale := staleness_runs(runs)) else [])


def write_report(study_dir: str, methods: list[str], meta: dict, now: datetime.datetime | None = None, *,
                 method_overrides: dict[str, list[str]]) -> str:
    """Write STUDY_DIR/report.md and its PNGs from STUDY_DIR/<method>/metrics.jsonl; returns the report path.

    `meta` is study.json's content (any key may be missing: it shows as n/a); `method_overrides` the config
    overrides of each method, by name (a method missing from it shows none). Missing runs or keys never raise;
    they read n/a with the reason.
    """
    now = now or datetime.datetime.now()
    runs = [load_run(study_dir, m) for m in methods]
    write_plots(study_dir, runs)
    path = os.path.join(study_dir, "report.md")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(render_report(runs, meta, now, method_overrides=method_overrides))
    os.replace(tmp, path)
    return path
