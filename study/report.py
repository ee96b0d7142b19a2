"""The report of a study (study/runs.py): STUDY_DIR/report.md and its PNGs, from the runs' metrics alone.

Reads STUDY_DIR/<method>/metrics.jsonl of every method and study.json's content (`meta`) and compares the
methods against the claims of Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs") and Jin et al.
2025 (PAR): a summary, the entropy-performance law R = -a exp(H) + b per method and pooled, its early prediction,
the covariance check, one verdict per claim, the spread over seeds (runs `<method>@s<seed>`) and the staleness
axis (runs `<method>@k<k>`; study/runs.py names them). Every number is computed from the runs' metrics; a missing run
or key never raises, it reads n/a with the reason. `render_report` is pure (no I/O); `write_report` writes the
PNGs and report.md (atomically). The runner passes in the overrides that make each method (its METHODS), so this
module imports nothing of it; `covrl study --report-only --study-dir DIR` rewrites a study's report.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

from study.lawfit import (
    MIN_FIT_POINTS,
    LawFit,
    early_prediction,
    eval_points,
    eval_sources,
    fit_law,
    key_series,
    mean_eval_acc,
    merge_rows,
    pearson,
    prediction_interval,
    row_value,
    train_points,
)
from common.metrics import read_metrics

# The runs the law is claimed for: the PPO-clip loss without a covariance intervention (GRPO, clip-higher, PAR, and
# their seed and staleness variants). Clip-Cov and KL-Cov change how entropy turns into reward on purpose.
GRPO_FAMILY = ("grpo", "clip_higher", "par")
LAW_R2_HOLDS = 0.9  # claim (d): the eval fit pooled over the GRPO family "holds" at R^2 >= this
EARLY_FRACTION = 0.15  # claim (h): fit on the first 15 % of a run's eval points (at least MIN_FIT_POINTS) ...
EARLY_HOLDS = 0.02  # ... and predict its final accuracy within 2 points
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
    if not os.path.isdir(run_dir):
        return MethodRun(method, [], f"not run (no {run_dir})")
    rows = merge_rows(read_metrics(run_dir))
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


def early_count(n: int) -> int:
    """How many of n points the early fit uses: the first EARLY_FRACTION, at least MIN_FIT_POINTS (a 2-point fit
    always passes through both points and says nothing)."""
    return max(MIN_FIT_POINTS, math.ceil(n * EARLY_FRACTION))


def early_check(points: list[tuple[float, float]]) -> str:
    """'fit on first k of n: RMSE x on the rest' or 'n/a (why)'."""
    if len(points) <= early_count(len(points)):
        return f"{MISSING} ({len(points)} points)"
    try:
        fit, rmse = early_prediction([h for h, _ in points], [r for _, r in points], k=early_count(len(points)))
    except ValueError as e:
        return f"{MISSING} ({e})"
    return f"fit on first {fit.n} of {len(points)}: RMSE {rmse:.4f} on the other {len(points) - fit.n}"


def variant(name: str) -> tuple[str, str | None]:
    """(method, kind of variant) of a run name (study/runs.py): grpo -> (grpo, None), grpo@s1 -> (grpo, "seed"),
    grpo@k4 -> (grpo, "staleness")."""
    method, _, v = name.partition("@")
    return method, {"s": "seed", "k": "staleness"}.get(v[:1]) if v else None


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


def _spread(values: list[float]) -> str:
    return f"{sum(values) / len(values):.4f} ({min(values):.4f}–{max(values):.4f})" if values else MISSING


def _monotone(values: list[float]) -> str:
    if len(values) < 2:
        return "one point"
    if all(b > a for a, b in zip(values, values[1:])):
        return "rises with k"
    if all(b < a for a, b in zip(values, values[1:])):
        return "falls with k"
    return "no monotone trend"


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------

def _f(x: float | None, digits: int = 4) -> str:
    return MISSING if x is None else f"{x:.{digits}f}"


def _arrow(pair: tuple[float, float] | None, digits: int = 4) -> str:
    return MISSING if pair is None else f"{_f(pair[0], digits)} → {_f(pair[1], digits)}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _pct(start: float, end: float) -> str:
    return f"{100 * (end - start) / abs(start):+.1f} %" if start else "n/a %"


def _verdict(ok: bool) -> str:
    return "**holds**" if ok else "**does not hold at this scale**"


def _first_last(rows: list[dict], key: str) -> tuple[float, float] | None:
    s = key_series(rows, key)
    return (s[0][1], s[-1][1]) if s else None


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def section_header(runs: list[MethodRun], meta: dict, now: datetime.datetime,
                   method_overrides: dict[str, list[str]]) -> str:
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
             _table(["method", "method overrides", "status", "wall-clock (s)", "metrics rows"],
                    [[r.name, ", ".join(f"`{o}`" for o in method_overrides.get(r.name, [])),
                      status.get(r.name, MISSING), _f(wall.get(r.name), 1), str(len(r.rows))] for r in runs])]
    notes = data_notes(runs)
    if notes:
        lines += ["", "Missing data (shown as n/a below):", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


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
        cells += [_f(row_value(ev[-1], k) if ev else None) for k in pkeys]
        ev_rows.append(cells)
    ev_header = (["method", "evals"] + [f"acc {ds} first → last" for ds in sources] + ["mean acc first → last"]
                 + [f"{k.removeprefix('eval/')} last" for k in pkeys])
    tr_rows = [[r.name, str(len(key_series(r.rows, "actor/entropy"))),
                _arrow(head_tail_means([v for _, v in key_series(r.rows, "critic/score/mean")])),
                _arrow(entropy_span(r.rows)), _arrow(_first_last(r.rows, "response_length/mean"), 1)] for r in runs]
    return "\n".join([
        "## 2. Summary", "",
        "Held-out evaluation (avg@k accuracy per data source; first eval is the base model when step 0 was evaluated):", "",
        _table(ev_header, ev_rows), "",
        "Training (reward and entropy: mean of the first 10 % of steps → mean of the last 10 %; "
        "response length: first → last step):", "",
        _table(["method", "training steps", "train reward first 10 % → last 10 %", "entropy first 10 % → last 10 %",
                "response length first → last"], tr_rows)])


def in_family(name: str) -> bool:
    return variant(name)[0] in GRPO_FAMILY


def family_points(points_by_run: dict[str, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The points of every GRPO-family run, pooled: what claim (d) and the law plot's black line fit."""
    return [p for name, pts in points_by_run.items() if in_family(name) for p in pts]


def _fit_rows(points_by_method: dict[str, list[tuple[float, float]]]) -> list[list[str]]:
    rows = []
    pooled = [p for pts in points_by_method.values() for p in pts]
    family = family_points(points_by_method)
    for name, pts in list(points_by_method.items()) + [("pooled (GRPO family)", family),
                                                        ("pooled (all methods)", pooled)]:
        fit, why = try_fit(pts)
        rows.append([name, str(len(pts))] + ([_f(fit.a), _f(fit.b), _f(fit.r2, 3), _f(fit.ceiling), ""] if fit
                                             else [MISSING] * 4 + [why]))
    return rows


def section_law(eval_pts: dict, train_pts: dict) -> str:
    header = ["fit", "points", "a", "b", "R²", "ceiling b − a", "note"]
    return "\n".join([
        "## 3. Entropy–performance law R = −a·exp(H) + b", "",
        "On held-out accuracy (mean over data sources) against the evaluated version's entropy:", "",
        _table(header, _fit_rows(eval_pts)), "",
        "Secondary: on training reward (critic/score/mean) against the step's batch entropy:", "",
        _table(header, _fit_rows(train_pts))])


def early_final(points: list[tuple[float, float]]) -> tuple[int, float, float, float | None] | None:
    """Fit on the first EARLY_FRACTION of (entropy, accuracy) points (at least MIN_FIT_POINTS) and predict the last:
    (points fitted, predicted final, measured final, 95 % prediction half-width or None); None when too few."""
    k = early_count(len(points))
    if len(points) <= k:
        return None
    early = points[:k]
    try:
        fit = fit_law([h for h, _ in early], [r for _, r in early])
    except ValueError:
        return None
    h_end, r_end = points[-1]
    return k, fit.predict(h_end), r_end, prediction_interval([h for h, _ in early], [r for _, r in early], fit, h_end)


def section_early(eval_pts: dict, train_pts: dict) -> str:
    rows = []
    for m, pts in eval_pts.items():
        e = early_final(pts)
        rows.append([m, early_check(pts), early_check(train_pts[m])] + (
            [f"{e[1]:.4f}" + (f" ± {e[3]:.4f}" if e[3] is not None else ""), f"{e[2]:.4f}", f"{e[1] - e[2]:+.4f}"]
            if e else [MISSING] * 3))
    return "\n".join([
        "## 4. Early prediction (fit on the first 15 % of points)", "",
        f"RMSE of the early fit on the remaining points, and its prediction of the final held-out accuracy from the "
        f"final entropy (fit on the first {EARLY_FRACTION:.0%} of the eval points, at least {MIN_FIT_POINTS}; ± the 95 % "
        f"prediction interval):", "",
        _table(["method", "eval points", "training points", "predicted final acc", "measured final acc", "error"],
               rows)])


def section_cov(cov_pts: dict) -> str:
    pooled = [p for pts in cov_pts.values() for p in pts]
    rows = []
    for name, pts in list(cov_pts.items()) + [("pooled (all methods)", pooled)]:
        r = pearson([c for c, _ in pts], [d for _, d in pts])
        rows.append([name, str(len(pts)), _f(r, 3) if r is not None else f"{MISSING} (needs ≥ 3 points that vary)"])
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
    gains less than PLATEAU_SHARE of the run's gain)."""
    why = (_why_absent(by, ("grpo",), lambda r: entropy_span(r.rows) is not None, "no actor/entropy values")
           or _why_absent(by, ("grpo",), lambda r: plateau(r.rows) is not None, "fewer than 6 evals"))
    if why:
        return f"(a) Entropy collapse and plateau under GRPO: skipped ({why})."
    h0, h1 = entropy_span(by["grpo"].rows)
    total, late = plateau(by["grpo"].rows)
    flat = total >= PLATEAU_MIN_GAIN and late < PLATEAU_SHARE * total
    return (f"(a) Entropy collapse and plateau under GRPO. Paper: without entropy control, GRPO's policy entropy "
            f"falls sharply and its performance saturates. Measured: grpo entropy (mean of the first → last 10 % of "
            f"steps) {h0:.4f} → {h1:.4f} ({_pct(h0, h1)}); mean eval accuracy (mean of the last third of the evals) "
            f"gained {total:+.4f} over the first eval, and {late:+.4f} over the middle third (a plateau: a gain of at "
            f"least {PLATEAU_MIN_GAIN:.2f}, less than {PLATEAU_SHARE:.0%} of it in the last third): "
            f"{_verdict(h1 < h0 and flat)}.")


def _end_entropy(run: MethodRun) -> float | None:
    return span[1] if (span := entropy_span(run.rows)) else None


def _final_acc(run: MethodRun) -> float | None:
    return fin[1] if (fin := final_eval(run.rows)) else None


def _seed_values(by: dict[str, MethodRun], runs: list[MethodRun], method: str, value) -> list[float]:
    """`value(run)` for each seed of `method` (its plain run alone when it ran at one seed), Nones left out."""
    return [v for r in seed_runs(runs).get(method, [by[method]] if method in by else []) if (v := value(r)) is not None]


def _beyond_seeds(mine: list[float], base: list[float]) -> tuple[bool, str]:
    """(mine is higher, how to say it): with two or more seeds each, higher only when every seed of `mine` is above
    every seed of `base`; with one, a plain comparison whose spread is unknown."""
    if len(mine) < 2 or len(base) < 2:
        return mine[0] > base[0], " (one seed: the spread between seeds is unknown)"
    if min(mine) > max(base):
        return True, " (beyond the seed spread)"
    higher = sum(mine) / len(mine) > sum(base) / len(base)
    return False, " (higher on average, but within the seed spread: not an effect)" if higher else ""


def claim_entropy_above_grpo(by: dict[str, MethodRun], runs: list[MethodRun], tag: str, method: str, label: str,
                             paper: str) -> str:
    """(b)/(c) `method` ends with higher entropy than GRPO, judged against the seed spread when there are seeds."""
    title = f"({tag}) {label} ends with higher entropy than GRPO"
    why = _why_absent(by, ("grpo", method), lambda r: entropy_span(r.rows) is not None,
                      "no actor/entropy values")
    if why:
        return f"{title}: skipped ({why})."
    mine, base = _seed_values(by, runs, method, _end_entropy), _seed_values(by, runs, "grpo", _end_entropy)
    higher, how = _beyond_seeds(mine, base)
    ratio = (sum(mine) / len(mine)) / (sum(base) / len(base)) if sum(base) else float("nan")
    return (f"{title}. Paper: {paper}. Measured mean entropy over the last 10 % of steps: {method} {_spread(mine)} vs "
            f"grpo {_spread(base)} over {len(mine)} and {len(base)} seed(s), {ratio:.2f}× GRPO's: "
            f"{_verdict(higher)}{how}.")


def claim_law(pooled: tuple[LawFit | None, str]) -> str:
    """(d) the eval fit pooled over the GRPO family has R^2 >= LAW_R2_HOLDS."""
    fit, why = pooled
    if fit is None:
        return f"(d) The entropy–performance law fits: skipped (GRPO-family eval fit {why})."
    return (f"(d) The entropy–performance law fits. Paper: R = −a·exp(H) + b fits held-out accuracy (R² ≈ 0.96–0.99 "
            f"per model family). Measured eval fit pooled over the GRPO family ({', '.join(GRPO_FAMILY)} and their "
            f"variants): a = {fit.a:.4f}, b = {fit.b:.4f}, R² = {fit.r2:.3f} on {fit.n} points "
            f"(holds at R² ≥ {LAW_R2_HOLDS}): {_verdict(fit.r2 >= LAW_R2_HOLDS)}.")


def claim_early(eval_pts: dict[str, list[tuple[float, float]]]) -> str:
    """(h) for every GRPO-family run, the fit on its first 15 % of eval points, given the final entropy, predicts its
    final accuracy within EARLY_HOLDS. Also said: how many finals lie inside the fit's 95 %
    prediction interval, since one final eval of 256 prompts x 4 samples is itself uncertain by about 1.5 points."""
    results = {m: e for m, pts in eval_pts.items() if in_family(m) and (e := early_final(pts)) is not None}
    if not results:
        return "(h) Early points predict the final accuracy: skipped (no GRPO-family run with enough eval points)."
    errors = {m: e[1] - e[2] for m, e in results.items()}
    inside = sum(abs(v) <= EARLY_HOLDS for v in errors.values())
    in_pi = sum(e[3] is not None and abs(e[1] - e[2]) <= e[3] for e in results.values())
    return (f"(h) Early points predict the final accuracy. Paper: a fit on the first 15 % of training predicts the "
            f"final performance (RMSE ~1 %). Measured, per GRPO-family run, the early fit's prediction at the final "
            f"entropy minus the measured final accuracy: {', '.join(f'{m} {v:+.4f}' for m, v in errors.items())}; "
            f"{in_pi} of {len(errors)} inside the fit's 95 % prediction interval; {inside} of {len(errors)} within "
            f"{EARLY_HOLDS:.2f} (the target): {_verdict(inside == len(errors))}.")


def claim_cov(pooled_r: float | None, n_steps: int) -> str:
    """(e) the pooled Pearson r of cov_mean vs entropy_delta is negative beyond chance: r < -2/sqrt(n), about the
    two-sided 5 % level for no correlation (a sign alone would call r = -0.01 over 1,500 steps a correlation)."""
    if pooled_r is None:
        return (f"(e) Covariance drives entropy change: skipped ({n_steps} steps with actor/cov_mean and "
                f"actor/entropy_delta; need ≥ 3 that vary).")
    bound = 2 / math.sqrt(n_steps)
    return (f"(e) Covariance drives entropy change. Paper: steps whose log-prob/advantage covariance is high lower "
            f"entropy, so the correlation is negative. Measured pooled Pearson r = {pooled_r:.3f} over {n_steps} "
            f"steps (negative beyond chance at r < −{bound:.3f}): {_verdict(pooled_r < -bound)}.")


def claim_par_active(by: dict[str, MethodRun]) -> str:
    """(f1) PAR's entropy-guided schedule acted: lambda went down (entropy below the target) on some step."""
    why = _why_absent(by, ("par",), lambda r: key_series(r.rows, "actor/par_lambda"), "no actor/par_lambda values")
    if why:
        return f"(f1) PAR's entropy-guided schedule is active: skipped ({why})."
    lams = [v for _, v in key_series(by["par"].rows, "actor/par_lambda")]
    down = sum(b < a for a, b in zip(lams, lams[1:]))
    return (f"(f1) PAR's entropy-guided schedule is active. The schedule lowers λ (the weight of positive-advantage "
            f"tokens) after every step whose batch entropy is under the target and raises it otherwise. Measured: λ "
            f"went down on {down} of {len(lams) - 1} steps, ranged {min(lams):.2f}–{max(lams):.2f}, mean "
            f"{sum(lams) / len(lams):.2f}: {_verdict(down > 0)}.")


def claim_par(by: dict[str, MethodRun]) -> str:
    """(f2) PAR's final mean eval accuracy is above GRPO's."""
    why = _why_absent(by, ("grpo", "par"), lambda r: final_eval(r.rows) is not None, "no eval rows")
    if why:
        return f"(f2) PAR beats GRPO on final eval accuracy: skipped ({why})."
    (sg, ag), (sp, ap) = final_eval(by["grpo"].rows), final_eval(by["par"].rows)
    at = f"both at step {sg}" if sg == sp else f"grpo at step {sg}, par at step {sp}"
    return (f"(f2) PAR beats GRPO on final eval accuracy. Paper (Jin et al. 2025): entropy-guided PAR 45.66 vs GRPO "
            f"44.12 avg@64. Measured final mean eval accuracy: par {ap:.4f} vs grpo {ag:.4f} ({at}): {_verdict(ap > ag)}.")


def claim_lines(runs: list[MethodRun], pooled_eval_fit: tuple[LawFit | None, str], pooled_r: float | None,
                n_cov: int) -> list[str]:
    """The "Does it match the paper?" sentences, each with the claim, the numbers and a verdict."""
    by = {r.name: r for r in runs}
    cov_paper = "Clip-Cov and KL-Cov keep entropy above the GRPO baseline (KL-Cov over 10× its plateau at 7B)"
    return [
        claim_collapse(by),
        claim_entropy_above_grpo(by, runs, "b", "clip_cov", "Clip-Cov", cov_paper),
        claim_entropy_above_grpo(by, runs, "b", "kl_cov", "KL-Cov", cov_paper),
        claim_entropy_above_grpo(by, runs, "c", "clip_higher", "Clip-higher",
                                 "raising the upper clip bound (0.28 vs 0.2) slows entropy collapse"),
        claim_law(pooled_eval_fit),
        claim_cov(pooled_r, n_cov),
        claim_par_active(by),
        claim_par(by),
    ]


def section_seeds(runs: list[MethodRun]) -> str:
    """Per method run at several seeds: the spread of its final held-out accuracy and end entropy."""
    groups = seed_runs(runs)
    head = "## 7. Seeds"
    if not groups:
        return f"{head}\n\nEach method ran at one seed, so the spread between seeds is unknown (`--seeds 0,1`)."
    rows = []
    for m, rs in groups.items():
        accs = [f[1] for r in rs if (f := final_eval(r.rows)) is not None]
        ends = [span[1] for r in rs if (span := entropy_span(r.rows)) is not None]
        rows.append([m, ", ".join(r.name for r in rs), _spread(accs), _spread(ends)])
    return "\n".join([head, "", "Mean over seeds (min–max):", "",
                      _table(["method", "runs", "final mean eval accuracy", "entropy, last 10 % of steps"], rows)])


def _against_seeds(values: list[float], seed_values: list[float]) -> str:
    """How the range of `values` over k compares with the same method's range over seeds at the plain k."""
    if len(values) < 2:
        return "one point"
    spread = max(values) - min(values)
    if len(seed_values) < 2:
        return f"range {spread:.4f}, seed spread unknown"
    seeds = max(seed_values) - min(seed_values)
    return f"range {spread:.4f} {'beyond' if spread > seeds else 'within'} the seed spread {seeds:.4f}"


def section_staleness(runs: list[MethodRun]) -> str:
    """The new axis: how the staleness bound k changes entropy collapse, Cov and final accuracy, per method."""
    groups = staleness_runs(runs)
    head = "## 8. Staleness"
    if not groups:
        return f"{head}\n\nNo staleness axis in this study (`--staleness 0,4`)."
    by = {r.name: r for r in runs}
    rows, findings = [], []
    for m, pairs in groups.items():
        ends, accs = [], []
        for k, r in pairs:
            span, fin = entropy_span(r.rows), final_eval(r.rows)
            covs = [v for _, v in key_series(r.rows, "actor/cov_mean")]
            rows.append([m, r.name, f"{k:.0f}", _arrow(span), _pct(*span) if span else MISSING,
                         _f(sum(covs) / len(covs) if covs else None), _f(fin[1] if fin else None)])
            if span and fin:
                ends.append(span[1])
                accs.append(fin[1])
        seed_ends, seed_accs = _seed_values(by, runs, m, _end_entropy), _seed_values(by, runs, m, _final_acc)
        findings.append(f"- {m}: the end entropy {_monotone(ends)} ({', '.join(f'{e:.4f}' for e in ends)}; "
                        f"{_against_seeds(ends, seed_ends)}), the final mean eval accuracy {_monotone(accs)} "
                        f"({', '.join(f'{a:.4f}' for a in accs)}; {_against_seeds(accs, seed_accs)}), in order of k.")
    return "\n".join([head, "", "k is the largest staleness (policy versions between generation and training) the "
                      "run's steps saw; entropy: mean of the first → last 10 % of steps.", "",
                      _table(["method", "run", "k", "entropy first → last", "change", "mean actor/cov_mean",
                              "final mean eval accuracy"], rows), "", *findings,
                      "", "One seed per k: a range over k within the seed spread (section 7: the same method at the "
                      "plain k, other seeds) is not an effect of k. A few seeds give a rough spread only: a final accuracy is one "
                      "evaluation, whose own sampling noise (binomial over prompts × samples) can exceed it."])


def claim_accuracy_beyond_seeds(by: dict[str, MethodRun], runs: list[MethodRun], method: str, label: str) -> str:
    """(g) `method` ends at a higher held-out accuracy than GRPO, judged against the seed spread."""
    title = f"(g) {label} ends at a higher held-out accuracy than GRPO"
    finals = {m: _seed_values(by, runs, m, _final_acc) for m in ("grpo", method)}
    if not finals["grpo"] or not finals[method]:
        missing = [m for m, v in finals.items() if not v]
        return f"{title}: skipped ({', '.join(missing)} has no evaluation)."
    mine, base = finals[method], finals["grpo"]
    measured = f"final mean eval accuracy {method} {_spread(mine)} vs grpo {_spread(base)} over {len(mine)} and " \
               f"{len(base)} seed(s)"
    if len(mine) < 2 or len(base) < 2:
        verdict = "holds" if mine[0] > base[0] else "does not hold"
        return f"{title}. Paper: yes. Measured {measured}: {verdict} at one seed; the seed spread is unknown."
    if min(mine) > max(base):
        verdict = "holds beyond the seed spread"
    elif sum(mine) / len(mine) > sum(base) / len(base):
        verdict = "higher on average but within the seed spread: not a win"
    else:
        verdict = "does not hold"
    return f"{title}. Paper: yes. Measured {measured}: {verdict}."


def render_report(runs: list[MethodRun], meta: dict, now: datetime.datetime, *,
                  method_overrides: dict[str, list[str]]) -> str:
    """The whole report.md text (pure: no I/O). `method_overrides`: the config overrides of each method, by name."""
    eval_pts = {r.name: [(h, a) for _, h, a in eval_points(r.rows)] for r in runs}
    train_pts = {r.name: [(h, x) for _, h, x in train_points(r.rows)] for r in runs}
    cov_pts = {r.name: cov_points(r.rows) for r in runs}
    pooled_cov = [p for pts in cov_pts.values() for p in pts]
    pooled_r = pearson([c for c, _ in pooled_cov], [d for _, d in pooled_cov])
    family_fit = try_fit(family_points(eval_pts))
    by = {r.name: r for r in runs}
    claims = claim_lines(runs, family_fit, pooled_r, len(pooled_cov)) + [
        claim_accuracy_beyond_seeds(by, runs, "clip_cov", "Clip-Cov"),
        claim_accuracy_beyond_seeds(by, runs, "kl_cov", "KL-Cov"),
        claim_early(eval_pts)]
    plots = PLOTS + ([STALENESS_PLOT] if staleness_runs(runs) else [])
    return "\n\n".join([
        section_header(runs, meta, now, method_overrides),
        section_summary(runs),
        section_law(eval_pts, train_pts),
        section_early(eval_pts, train_pts),
        section_cov(cov_pts),
        "## 6. Does it match the paper?\n\n" + "\n".join(f"- {c}" for c in claims),
        section_seeds(runs),
        section_staleness(runs),
        "## 9. Plots\n\n" + "\n\n".join(f"![{p.removesuffix('.png')}]({p})" for p in plots),
    ]) + "\n"


def write_plots(study_dir: str, runs: list[MethodRun]) -> list[str]:
    """The report's PNGs in study_dir; returns their paths."""
    from study.plots import plot_law_fit, plot_lines, plot_metric, plot_scatter

    rows = {r.name: r.rows for r in runs}
    sources = eval_sources([row for r in runs for row in r.rows])
    acc_panels = {"mean over data sources": {r.name: [(e["step"], mean_eval_acc(e)) for e in eval_rows(r.rows)] for r in runs}}
    acc_panels |= {ds: {r.name: key_series(r.rows, f"eval/{ds}/acc") for r in runs} for ds in sources}
    eval_pts = {r.name: [(h, a) for _, h, a in eval_points(r.rows)] for r in runs}
    fits = {m: try_fit(pts)[0] for m, pts in eval_pts.items()}
    family = try_fit(family_points(eval_pts))[0]
    out = os.path.join
    return [
        plot_metric(rows, "actor/entropy", out(study_dir, "entropy.png"), title="policy entropy (actor/entropy) vs step"),
        plot_lines(acc_panels, out(study_dir, "eval_acc.png"), xlabel="step (policy version)", ylabel="eval accuracy",
                   title="held-out accuracy"),
        plot_metric(rows, "response_length/mean", out(study_dir, "response_length.png"), title="mean response length vs step"),
        plot_law_fit(eval_pts, fits, out(study_dir, "law_fit.png"), pooled=family, ylabel="mean eval accuracy",
                     title="R = −a·exp(H) + b on eval points (dashed: per run, black: pooled over the GRPO family)"),
        plot_scatter({r.name: cov_points(r.rows) for r in runs}, out(study_dir, "cov_vs_entropy_delta.png"),
                     xlabel="actor/cov_mean", ylabel="actor/entropy_delta", title="covariance vs entropy change per step"),
    ] + ([plot_lines({m: {f"k={k:.0f} ({r.name})": key_series(r.rows, "actor/entropy") for k, r in pairs}
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
