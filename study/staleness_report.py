"""The report of the staleness study (`covrl study --preset staleness`): STUDY_DIR/report.md and its PNGs.

The setting, endpoints and verdict rules were written before the runs (docs/study-staleness/PLAN.md; the methods in
study/arms.py STALENESS_ARMS). Per run (<method>@k<k>@s<seed>): on-policy end entropy (held-out samples' own
entropy, mean of the last 3 evaluations), steps to half of it, held-out accuracy (mean of the last 3 evaluations),
the first collapse (an evaluation 0.15 below the best earlier one), and the off-policy measures averaged over the
steps at full lag. Per (method, k): means over seeds with 95 % t-intervals; per contrast: the paired-by-seed
difference with its interval and minimum detectable effect. The report is written from the runs that are complete
and names the missing ones; a verdict that lacks its runs says "undetermined". `render` is pure;
`write_staleness_report` writes the plots and report.md.

Corrections of 2026-12-07, made after every result had been seen (the report says so where each applies):
- A run whose actor/entropy and critic/score/mean equal an earlier run's at every step is a duplicate of it (the
  rule of study/report.py): rule 6, which pools methods, counts each distinct trajectory once.
- A paired comparison whose seeds are, all but at most one, the same trajectory in both arms cannot fail (its
  t-interval always contains 0): it is an implementation check, not a verdict. So is an endpoint that takes one value
  in every run of a lag (steps to half entropy, set by the evaluation grid).
- Rule 6 compares every run of a lag over one window, the steps before the earliest collapse at that lag, as
  PLAN.md's text says ("before the same step in the non-collapsed runs"); before, a collapsed run's window ran to its
  own collapse and the survivors' only to the earliest one.
- Rule 2's lag-0 difference is read beside the dose study's controls on the same endpoint (docs/study-dose).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, replace

from study.archive import has_run, read_run
from study.arms import STALENESS_ARMS, STALENESS_LAGS, parse_run, run_name, staleness_steps, study_lr
from study.dose_report import (Contrast, ci_text, contrast, md_table, mean_by_step, mean_or_none, on_policy_points,
                               study_arms, trust_region_contrasts, trust_region_reading)
from study.lawfit import key_series, merge_rows, row_value
from study.report import MethodRun, find_duplicates
from study.stats import bounds, diff_interval, fmt

LAST_EVALS = 3
COLLAPSE_DROP = 0.15  # accuracy this far below the best earlier evaluation: a collapse
CORRECTED = "2026-12-07"  # the date of the corrections in the module docstring, written after the data
# The dose study archived in this repository: its controls on the on-policy endpoint read rule 2's lag-0 difference.
DOSE_STUDY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "study-dose")
PLOTS = {"accuracy.png": ("held-out accuracy", "acc"), "entropy.png": ("on-policy held-out entropy", "entropy"),
         "cov.png": ("actor/cov_mean", "actor/cov_mean"), "ess.png": ("offpolicy/ess_seq", "offpolicy/ess_seq")}
# The off-policy measures averaged over the steps at full lag: (attribute, metric key).
OFF_POLICY = (("kl", "offpolicy/kl_behav_prox"), ("capfrac", "actor/is_weight_clipfrac"), ("ess_seq", "offpolicy/ess_seq"),
              ("ess_token", "offpolicy/ess_token"), ("m2", "offpolicy/m2"), ("m2po_masked", "offpolicy/m2po_masked"),
              ("lr_scale", "offpolicy/ess_lr_scale"))


@dataclass(frozen=True)
class LagRun:
    method: str
    k: int
    seed: int
    steps: int
    end_entropy: float | None  # on-policy, mean of the last 3 evaluations
    half_step: int  # first evaluation step at or below half the step-0 on-policy entropy; `steps` when censored
    censored: bool
    acc: float | None
    collapse_step: int | None  # first collapsed evaluation, None if never
    off: dict[str, float]  # OFF_POLICY means over the steps at full lag
    clip_tilt: float | None  # clipped share in the top entropy quintile minus the bottom one, same steps
    ess_series: list[tuple[int, float]]  # (step, offpolicy/ess_seq)
    exact_lag: bool  # every row's staleness/min = staleness/max = min(step - 1, k)
    first_eval: int | None = None  # the first evaluation step after step 0
    duplicate_of: str | None = None  # the earlier run whose trajectory this one repeats (`with_duplicates`)

    @property
    def name(self) -> str:
        return run_name(self.method, self.seed, self.k)

    @property
    def trajectory(self) -> str:
        """The run that stands for this run's trajectory: itself, or the earlier run it duplicates."""
        return self.duplicate_of or self.name


def parse_name(name: str) -> tuple[str, int, int]:
    """(method, k, seed) of <method>@k<k>@s<seed> (study.arms.parse_run, reordered; both variants required)."""
    method, seed, k = parse_run(name)
    if seed is None or k is None:
        raise ValueError(f"{name!r} is not a staleness run name (<method>@k<k>@s<seed>)")
    return method, k, seed


def first_collapse(points: list[tuple[int, float]]) -> int | None:
    """The step of the first evaluation whose accuracy is COLLAPSE_DROP or more below the best earlier one."""
    best = None
    for step, acc in points:
        if best is not None and acc <= best - COLLAPSE_DROP + 1e-9:  # a drop of exactly 0.15 counts
            return step
        best = acc if best is None else max(best, acc)
    return None


def half_entropy_step(points: list[tuple[int, float]], steps: int) -> tuple[int, bool]:
    """(first evaluation step whose entropy is at most half the step-0 one, censored?); (steps, True) if none."""
    if not points or points[0][0] != 0:
        return steps, True
    start = points[0][1]
    hit = next((s for s, h in points[1:] if h <= start / 2), None)
    return (steps, True) if hit is None else (hit, False)


def _full_lag_mean(rows: list[dict], key: str, k: int) -> float | None:
    return mean_or_none([v for r in rows if r["step"] > k and (v := row_value(r, key)) is not None])


def run_endpoints(name: str, rows: list[dict], steps: int) -> LagRun:
    method, k, seed = parse_name(name)
    merged = merge_rows(rows)
    evals = on_policy_points(name, rows)
    last = evals[-LAST_EVALS:]
    trained = [r for r in merged if row_value(r, "actor/entropy") is not None]
    q5 = _full_lag_mean(trained, "offpolicy/clipped_q5", k)
    q1 = _full_lag_mean(trained, "offpolicy/clipped_q1", k)
    half, censored = half_entropy_step([(p.step, p.entropy) for p in evals], steps)
    exact = all(r.get("staleness/min") == r.get("staleness/max") == min(r["step"] - 1, k) for r in trained)
    return LagRun(method, k, seed, steps, mean_or_none([p.entropy for p in last]), half, censored, mean_or_none([p.acc for p in last]),
                  first_collapse([(p.step, p.acc) for p in evals]),
                  {attr: v for attr, key in OFF_POLICY if (v := _full_lag_mean(trained, key, k)) is not None},
                  None if q5 is None or q1 is None else q5 - q1,
                  key_series(trained, "offpolicy/ess_seq"),
                  bool(trained) and exact, next((p.step for p in evals if p.step > 0), None))


def with_duplicates(runs: list[LagRun], rows: dict[str, list[dict]]) -> list[LagRun]:
    """`runs` with `duplicate_of` set from their metrics rows by name (study.report.find_duplicates: actor/entropy
    and critic/score/mean equal at every step), the earlier run in `runs` order standing for the trajectory."""
    dups = find_duplicates([MethodRun(r.name, merge_rows(rows[r.name]), None) for r in runs])
    return [replace(r, duplicate_of=dups.get(r.name)) for r in runs]


Cells = dict[str, dict[int, LagRun]]  # "<method>@k<k>" -> seed -> run


def cell(method: str, k: int) -> str:
    return run_name(method, k=k)


def by_cell(runs: list[LagRun]) -> Cells:
    out: Cells = {}
    for r in runs:
        out.setdefault(cell(r.method, r.k), {})[r.seed] = r
    return out


def _values(cells: Cells, method: str, k: int, value) -> list[float]:
    return [v for r in cells.get(cell(method, k), {}).values() if (v := value(r)) is not None]


def _ci_of(cells: Cells, method: str, k: int, value, digits: int = 4) -> str:
    return ci_text(_values(cells, method, k, value), digits)


def end_entropy(r: LagRun) -> float | None:
    return r.end_entropy


def accuracy(r: LagRun) -> float | None:
    return r.acc


def off(attr: str):
    return lambda r: r.off.get(attr)


def _pair(cells: Cells, a: str, b: str, k: int, value, label: str) -> Contrast:
    return contrast(cells, cell(a, k), cell(b, k), value, label)


def identical_seeds(cells: Cells, a: str, b: str, k: int) -> tuple[int, int]:
    """(seeds at which `a` and `b` ran one trajectory, seeds both ran) at lag k."""
    ra, rb = cells.get(cell(a, k), {}), cells.get(cell(b, k), {})
    seeds = set(ra) & set(rb)
    return sum(ra[s].trajectory == rb[s].trajectory for s in seeds), len(seeds)


def cannot_fail(same: int, n: int) -> bool:
    """A paired comparison over n seeds of which `same` are one trajectory in both arms cannot fail when at most one
    seed differs: its n - 1 differences are exactly 0, so with the one other difference x the mean is x / n and the
    t-interval's half-width t·|x| / n with t > 1 (4.30 at 3 seeds): the interval always contains 0."""
    return n >= 2 and n - same <= 1


def why_cannot_fail(same: int, n: int) -> str:
    if same == n:
        return f"its runs are the other arm's at {same} of {n} seeds, so every difference is a run minus itself: 0"
    return (f"its runs are the other arm's at {same} of {n} seeds, so {same} of the {n} per-seed differences are "
            f"exactly 0 and the paired t-interval contains 0 whatever the last one is (only a collapse of that one "
            f"seed could move the verdict)")


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def section_header(meta: dict, now: datetime.datetime, names: list[str], missing: list[str]) -> str:
    lines = [f"# Staleness study at learner.lr = {study_lr(meta) or '?'}", "",
             f"Written {now:%Y-%m-%d %H:%M} by `covrl study --report-only`. Plan, endpoints and verdict rules: "
             f"[docs/study-staleness/PLAN.md](../PLAN.md), fixed before the runs. The study's last invocation: "
             f"`{meta.get('command', '?')}` (the runs come from every invocation of the same study directory, which "
             f"must share its settings; a run's own settings are its config.toml).",
             "", f"{len(names)} of {len(names) + len(missing)} runs complete; every number below is from them. Each "
             f"run is named `<method>@k<lag>@s<seed>`; its config.toml and metrics.jsonl are in runs.tar.xz beside this "
             f"report (or in its own directory, while the study runs)."]
    if missing:
        lines += ["", f"Missing (not yet run): {', '.join(missing)}."]
    return "\n".join(lines)


def duplicates_text(cells: Cells) -> str:
    """The runs that repeat an earlier run's trajectory, grouped as `<method>@k<k> = <method>@k<k> (seeds ...)`."""
    runs = _all_runs(cells)
    groups: dict[tuple[str, str], list[int]] = {}
    for r in runs:
        if r.duplicate_of is not None:
            method, k, _ = parse_name(r.duplicate_of)
            groups.setdefault((cell(r.method, r.k), cell(method, k)), []).append(r.seed)
    dups = sum(len(v) for v in groups.values())
    if not dups:
        return f"none of the {len(runs)} runs repeats another's actor/entropy and critic/score/mean at every step"
    pairs = "; ".join(f"{a} = {b} (seed{'s' if len(v) > 1 else ''} {', '.join(map(str, sorted(v)))})"
                      for (a, b), v in groups.items())
    return (f"{dups} of the {len(runs)} runs repeat an earlier run's actor/entropy and critic/score/mean at every step "
            f"(bit-identical duplicates: {pairs}), so they hold {len(runs) - dups} distinct trajectories")


def section_corrections(cells: Cells) -> str:
    pinned = half_step_by_lag(cells) is not None
    lines = [
        f"Duplicates: {duplicates_text(cells)}. The tables give every run; rule 6, which pools methods, counts each "
        f"trajectory once; a paired comparison whose seeds are, all but at most one, the same trajectory in both arms "
        f"cannot fail and is an implementation check (section 9), not a verdict.",
        "Rule 6 reads every run of a lag over the same steps, as PLAN.md's text says (section 8); it read unequal "
        "windows before.",
        "Rule 2's lag-0 difference is read beside the dose study's controls on the same endpoint (section 3).",
        *(["Steps to half entropy moved from section 2's table to section 9: it takes one value in every run of a "
           "lag."] if pinned else [])]
    return "\n".join([f"## Corrections of {CORRECTED} (written after every result had been seen; no rule of PLAN.md "
                      f"changed)", ""] + [f"- {line}" for line in lines])


def section_manipulation(cells: Cells) -> tuple[str, bool | None]:
    """Rule 1: the lag bites (GRPO + TIS's KL(behav || prox) and cap fraction rise with k). Returns the section and
    the verdict (None: undetermined)."""
    rows, means = [], {}
    for k in STALENESS_LAGS:
        rows.append([str(k), str(len(cells.get(cell("grpo_tis", k), {}))), *(_ci_of(cells, "grpo_tis", k, off(a), 5)
                     for a in ("kl", "capfrac", "m2", "ess_seq", "ess_token"))])
        means[k] = {a: mean_or_none(_values(cells, "grpo_tis", k, off(a))) for a in ("kl", "capfrac")}
    verdict, why = None, "undetermined: GRPO + TIS lacks a lag or a second seed"
    lo, hi = STALENESS_LAGS[0], STALENESS_LAGS[-1]
    diffs = {a: _unpaired(cells, "grpo_tis", hi, lo, off(a)) for a in ("kl", "capfrac")}
    if all(means[k][a] is not None for k in STALENESS_LAGS for a in means[k]) and all(not math.isnan(d[1]) for d in diffs.values()):
        rises = {a: all(means[a_k][a] < means[b_k][a] for a_k, b_k in zip(STALENESS_LAGS, STALENESS_LAGS[1:]))
                 for a in ("kl", "capfrac")}
        verdict = all(rises.values()) and all(d[1] > 0 for d in diffs.values())
        why = ("**the lag bites**" if verdict else "**the lag did not bite** by the rule: no effect below is read as "
               "a staleness effect") + "; rises at every k: " + ", ".join(
            f"{a} {'yes' if r else 'no'}" for a, r in rises.items()) + "; k = 64 minus k = 0: " + "; ".join(
            f"{a} {fmt(d[0], 5, sign=True)} {bounds(d[1], d[2], 5)}" for a, d in diffs.items())
    table = md_table(["k", "seeds", "KL(behav‖prox) per token", "TIS cap fraction", "M2PO m2", "ESS (responses)",
                      "ESS (tokens)"], rows)
    return "\n".join(["## 1. Manipulation check: does the lag bite? (rule 1, GRPO + TIS)", "", table, "", f"Verdict: {why}."]), verdict


def _unpaired(cells: Cells, method: str, a: int, b: int, value) -> tuple[float, float, float]:
    xa, xb = _values(cells, method, a, value), _values(cells, method, b, value)
    if not xa or not xb:
        return math.nan, math.nan, math.nan
    return diff_interval(xa, xb, paired=False)


def _all_runs(cells: Cells) -> list[LagRun]:
    return [r for seeds in cells.values() for r in seeds.values()]


def half_step_by_lag(cells: Cells) -> dict[int, int] | None:
    """{k: the one steps-to-half value every run of lag k has}, when each lag's runs share one (uncensored); else
    None. Evaluations every L/8 steps quantize the endpoint: when the entropy halves between the same two evaluations
    in every run, it cannot tell any run from another."""
    by_k: dict[int, set[int]] = {}
    for r in _all_runs(cells):
        by_k.setdefault(r.k, set()).add(-1 if r.censored else r.half_step)
    if not by_k or any(len(v) != 1 or -1 in v for v in by_k.values()):
        return None
    return {k: next(iter(v)) for k, v in sorted(by_k.items())}


def section_endpoints(cells: Cells) -> str:
    pinned = half_step_by_lag(cells) is not None  # then section 9 gives it, as a check
    rows = []
    for method in STALENESS_ARMS:
        for k in STALENESS_LAGS:
            runs = cells.get(cell(method, k), {})
            if not runs:
                continue
            collapsed = sorted(r.collapse_step for r in runs.values() if r.collapse_step is not None)
            halves = f"{fmt(mean_or_none([r.half_step for r in runs.values()]), 1)} ({sum(r.censored for r in runs.values())} censored)"
            rows.append([method, str(k), str(len(runs)), _ci_of(cells, method, k, end_entropy), *([] if pinned else [halves]),
                         _ci_of(cells, method, k, accuracy, 3),
                         f"{len(collapsed)}/{len(runs)}" + (f" (first at step {collapsed[0]})" if collapsed else ""),
                         _ci_of(cells, method, k, off("ess_seq"), 3), _ci_of(cells, method, k, off("m2po_masked"), 4),
                         _ci_of(cells, method, k, off("lr_scale"), 3)])
    table = md_table(["method", "k", "seeds", "on-policy end entropy", *([] if pinned else ["steps to half"]),
                      "held-out acc", "collapsed", "ESS (responses)", "M2PO masked", "lr scale"], rows)
    note = ["", "Steps to half entropy, a plan endpoint no verdict rule uses, takes one value in every run of a lag "
            "here; section 9 gives it."] if pinned else []
    return "\n".join(["## 2. Endpoints by method and lag (means over seeds, 95 % t-intervals)", "", table, *note])


def _contrast_lines(cells: Cells, a: str, b: str, value, what: str) -> list[Contrast]:
    return [_pair(cells, a, b, k, value, f"{what}, k = {k}") for k in STALENESS_LAGS]


def kl_cov_verdict(d: dict[int, Contrast], lag_change: tuple[float, float, float]) -> str:
    """Rule 2 on D_k = end entropy (KL-Cov + TIS) - (GRPO + TIS) at k = 0 and 64, and D_64 - D_0."""
    lo, hi = STALENESS_LAGS[0], STALENESS_LAGS[-1]
    if d[lo].n < 2 or d[hi].n < 2:
        return "undetermined: D_0 or D_64 lacks two seeds"
    controls = {k: d[k].excludes_zero(1) for k in (lo, hi)}
    falls = not math.isnan(lag_change[1]) and lag_change[2] < 0
    if controls[lo] and controls[hi]:
        if falls:
            return ("**KL-Cov weakens under staleness**: it keeps the on-policy entropy above GRPO's at lag 0 and at "
                    "lag 64, but its effect is smaller at lag 64 (D_64 - D_0 below 0)")
        return "**KL-Cov survives staleness**: it keeps the on-policy entropy above GRPO's at lag 0 and at lag 64"
    if controls[lo]:
        shrinks = "" if falls else (f"; D_64 - D_0 does not lie below 0, so the effect is not shown to shrink: it is "
                                    f"only not shown at lag 64, whose minimum detectable effect is {fmt(d[hi].mde)}")
        return "**KL-Cov fails under staleness**: it controls entropy on-policy but not at lag 64" + shrinks
    if controls[hi]:
        return ("KL-Cov does not control entropy on-policy here, but does at lag 64 (D_64 above 0): an effect that "
                "appears only with lag, not survival")
    if falls:
        return "KL-Cov does not control entropy on-policy here, and its (null) effect falls with lag"
    return ("**cannot be answered positively at this scale**: KL-Cov does not control entropy on-policy (D_0's "
            "interval includes 0, as the dose study found), nor at lag 64")


def d_zero(cells: Cells) -> Contrast:
    """D_0: on-policy end entropy, KL-Cov + TIS - GRPO + TIS at the smallest lag, paired by seed."""
    lo = STALENESS_LAGS[0]
    return _pair(cells, "kl_cov_tis", "grpo_tis", lo, end_entropy, f"D_{lo}")


# (the dose study's lr, its contrasts on the on-policy end entropy: study.dose_report.trust_region_contrasts)
Controls = tuple[str, dict[str, Contrast]]


def dose_controls(dose_dir: str = DOSE_STUDY) -> Controls | None:
    """The dose study's controls on the on-policy end entropy, from its runs in `dose_dir`; None when it has none."""
    path = os.path.join(dose_dir, "study.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        meta = json.load(f)
    names = [n for n in meta.get("runs", []) if has_run(os.path.join(dose_dir, n))]
    cs = trust_region_contrasts(study_arms(dose_dir, names, meta)[1])
    return (study_lr(meta) or "?", cs) if all(c.n >= 2 for c in cs.values()) else None


def d_zero_reading(cells: Cells, controls: Controls | None) -> str:
    """What rule 2's lag-0 difference is, where it lies above 0: beside the dose study's arms without a covariance
    choice on the same endpoint, and under Bonferroni's correction within rule 2 (section 10)."""
    d0 = d_zero(cells)
    m = len(dict(multiplicity_families(cells))["rule 2, KL-Cov + TIS - GRPO + TIS"])
    corrected = d0.corrected(m)
    survives = corrected is not None and corrected[0] > 0
    dose = ("the dose study's runs are not in this repository (docs/study-dose), so its controls are not read here"
            if controls is None else
            f"in the dose study's runs (docs/study-dose/report.md section 4.1, the chain task at lr {controls[0]}), "
            f"{trust_region_reading(controls[1])}")
    bonf = (f"D_0 {'survives' if survives else 'does not survive'} Bonferroni's correction within rule 2 (m = {m}: "
            f"corrected {bounds(*corrected) if corrected else 'n/a'}, section 10)")
    return (f"Reading ({CORRECTED}, written after the data; the verdict above stands as rule 2 gives it): D_0 = "
            f"{fmt(d0.mean, sign=True)} {bounds(d0.lo, d0.hi)} is not shown to be covariance selection. D_0 is measured "
            f"on the on-policy held-out entropy; {dose}. And {bonf}. So the lag-0 control that rule 2 finds lost under "
            f"lag is a difference that arms without a covariance choice also make, not one shown to come from KL-Cov's "
            f"covariance choice.")


def section_kl_cov(cells: Cells, controls: Controls | None = None) -> str:
    d = {c_k: c for c_k, c in zip(STALENESS_LAGS, _contrast_lines(cells, "kl_cov_tis", "grpo_tis", end_entropy,
                                                                 "D_k = end entropy, KL-Cov + TIS - GRPO + TIS"))}
    acc = _contrast_lines(cells, "kl_cov_tis", "grpo_tis", accuracy, "accuracy, KL-Cov + TIS - GRPO + TIS")
    lo, hi = STALENESS_LAGS[0], STALENESS_LAGS[-1]
    d0 = [r.end_entropy - g.end_entropy for s, r in cells.get(cell("kl_cov_tis", lo), {}).items()
          if (g := cells.get(cell("grpo_tis", lo), {}).get(s)) and r.end_entropy is not None and g.end_entropy is not None]
    d64 = [r.end_entropy - g.end_entropy for s, r in cells.get(cell("kl_cov_tis", hi), {}).items()
           if (g := cells.get(cell("grpo_tis", hi), {}).get(s)) and r.end_entropy is not None and g.end_entropy is not None]
    change = diff_interval(d64, d0, paired=False) if d0 and d64 else (math.nan, math.nan, math.nan)
    lines = ["## 3. Does covariance-based entropy control survive staleness? (rule 2)", ""]
    lines += [f"- {c.text()}" for c in d.values()] + [f"- {c.text(3)}" for c in acc]
    lines += [f"- D_64 - D_0 (unpaired): {fmt(change[0])} {bounds(change[1], change[2])}", "",
              f"Verdict: {kl_cov_verdict(d, change)}."]
    if d[lo].n >= 2 and d[lo].excludes_zero(1):
        lines += ["", d_zero_reading(cells, controls)]
    return "\n".join(lines)


def m2po_verdict(m: Contrast, a: Contrast, collapses: tuple[int, int]) -> str:
    """Rule 3 at one k: M = end entropy difference, A = accuracy difference, collapses (with M2PO, without)."""
    if m.n < 2:
        return "undetermined (fewer than two seeds)"
    if m.excludes_zero(-1):
        return "M2PO **fights** KL-Cov (lower on-policy entropy)"
    if a.excludes_zero(1) or collapses[0] < collapses[1]:
        return "M2PO **helps** KL-Cov (higher accuracy or fewer collapses, entropy not lower)"
    lower = (" on entropy; but held-out accuracy is **lower** with M2PO (A_k below 0: an outcome rule 3 does not name, "
             "reported beside it)") if a.excludes_zero(-1) else ""
    return f"no detectable effect (entropy MDE {fmt(m.mde)}){lower}"


def _collapses(cells: Cells, method: str, k: int) -> int:
    return sum(r.collapse_step is not None for r in cells.get(cell(method, k), {}).values())


def _collapse_text(cells: Cells, method: str, k: int) -> str:
    """"collapsed/runs" of a method at lag k, or n/a when it has no complete run there."""
    runs = cells.get(cell(method, k), {})
    return f"{_collapses(cells, method, k)}/{len(runs)}" if runs else "n/a"


def section_m2po(cells: Cells) -> str:
    lines = ["## 4. Does M2PO help KL-Cov or fight it? (rule 3; read at k = 16 and 64)", ""]
    for k in STALENESS_LAGS:
        same, n = identical_seeds(cells, "kl_cov_m2po", "kl_cov_tis", k)
        if cannot_fail(same, n):
            lines.append(f"- k = {k}: not a verdict: KL-Cov + M2PO ran KL-Cov + TIS's trajectory at {same} of {n} seeds, "
                         f"so {'no outcome could differ' if same == n else 'its intervals cannot exclude 0'} (an "
                         f"implementation check, section 9).")
            continue
        lines.append(f"- {_m2po_line(cells, k)} Verdict: {m2po_verdict(*_m2po_contrasts(cells, k))}.")
    return "\n".join(lines)


def _m2po_contrasts(cells: Cells, k: int) -> tuple[Contrast, Contrast, tuple[int, int]]:
    return (_pair(cells, "kl_cov_m2po", "kl_cov_tis", k, end_entropy, f"M_{k} = end entropy, KL-Cov + M2PO - KL-Cov + TIS"),
            _pair(cells, "kl_cov_m2po", "kl_cov_tis", k, accuracy, f"A_{k} = accuracy"),
            (_collapses(cells, "kl_cov_m2po", k), _collapses(cells, "kl_cov_tis", k)))


def _m2po_line(cells: Cells, k: int) -> str:
    m, a, _ = _m2po_contrasts(cells, k)
    return (f"k = {k}: {m.text()}; {a.text(3)}; collapses {_collapse_text(cells, 'kl_cov_m2po', k)} with M2PO, "
            f"{_collapse_text(cells, 'kl_cov_tis', k)} without.")


def _diff_cell(c: Contrast, digits: int) -> str:
    return "n/a" if c.mean is None else f"{fmt(c.mean, digits, sign=True)} {bounds(c.lo, c.hi, digits)} (n {c.n})"


def section_secondary(cells: Cells) -> str:
    rows = []
    for method in ("grpo_m2po", "grpo_ess"):
        for k in STALENESS_LAGS:
            e = _pair(cells, method, "grpo_tis", k, end_entropy, "")
            a = _pair(cells, method, "grpo_tis", k, accuracy, "")
            same, n = identical_seeds(cells, method, "grpo_tis", k)
            diffs = ([f"not a comparison: grpo_tis's runs at {same} of {n} seeds (section 9)"] * 2
                     if cannot_fail(same, n) else [_diff_cell(e, 4), _diff_cell(a, 3)])
            collapses = f"{_collapse_text(cells, method, k)} vs {_collapse_text(cells, 'grpo_tis', k)}"
            rows.append([method, str(k), *diffs, collapses])
    table = md_table(["method - grpo_tis", "k", "end entropy (paired by seed)", "held-out accuracy", "collapses"], rows)
    return "\n".join(["## 5. M2PO and ESS-scaled steps on GRPO (rule 4)", "", table])


def lag_budget_verdict(gain: Contrast, acc: Contrast, control: Contrast) -> str:
    """Rule 7 at one lag: gain = end entropy (KL-Cov, lag budget) - (KL-Cov + TIS), acc the same for held-out
    accuracy, control = end entropy (KL-Cov, lag budget) - (GRPO + TIS); all paired by seed."""
    if gain.n < 2:
        return "undetermined (fewer than two seeds)"
    effect = ("it **raises** the on-policy entropy over KL-Cov's" if gain.excludes_zero(1) else
              "it **lowers** the on-policy entropy below KL-Cov's" if gain.excludes_zero(-1) else
              f"no detectable effect on entropy (MDE {fmt(gain.mde)})")
    cost = ("; it **costs accuracy**" if acc.excludes_zero(-1) else "; it **gains accuracy**" if acc.excludes_zero(1)
            else "")
    held = ("; it keeps entropy above GRPO's" if control.n >= 2 and control.excludes_zero(1) else
            f"; it is not shown to keep entropy above GRPO's (MDE {fmt(control.mde)})" if control.n >= 2 else "")
    return effect + cost + held


def section_lag_budget(cells: Cells) -> str:
    lines = ["## 6. The staleness-aware budget (rule 7, a covrl extension: KL-Cov's count x (1 + lag / 16); read at "
             "k = 16 and 64)", ""]
    for k in STALENESS_LAGS[1:]:
        gain = _pair(cells, "kl_cov_lag", "kl_cov_tis", k, end_entropy, "end entropy, lag budget - KL-Cov + TIS")
        acc = _pair(cells, "kl_cov_lag", "kl_cov_tis", k, accuracy, "accuracy")
        control = _pair(cells, "kl_cov_lag", "grpo_tis", k, end_entropy, "end entropy, lag budget - GRPO + TIS")
        lines += [f"- k = {k}: {gain.text()}; {acc.text(3)}; {control.text()}; collapses "
                  f"{_collapse_text(cells, 'kl_cov_lag', k)} with the lag budget, {_collapse_text(cells, 'kl_cov_tis', k)} "
                  f"without. Verdict: {lag_budget_verdict(gain, acc, control)}."]
    lo, hi = STALENESS_LAGS[0], STALENESS_LAGS[-1]
    d = {k: _pair(cells, "kl_cov_tis", "grpo_tis", k, end_entropy, "") for k in (lo, hi)}
    if "**KL-Cov fails under staleness**" in kl_cov_verdict(d, (math.nan,) * 3):  # rule 2's own verdict
        c = _pair(cells, "kl_cov_lag", "grpo_tis", hi, end_entropy, "")
        restores = ("undetermined (C_64 lacks two seeds)." if c.n < 2 else "**restores the control** there (C_64 above 0)."
                    if c.excludes_zero(1) else f"does not restore it (C_64 not above 0; MDE {fmt(c.mde)}).")
        lines += ["", f"KL-Cov fails at lag {hi} (rule 2); the lag budget: {restores}"]
    return "\n".join(lines)


def section_clip(cells: Cells) -> str:
    tilt = lambda r: r.clip_tilt  # noqa: E731
    lines = ["## 7. Where the clip falls (rule 5, GRPO + TIS): clip share in the top minus the bottom entropy quintile", ""]
    for k in STALENESS_LAGS:
        vals = _values(cells, "grpo_tis", k, tilt)
        lines.append(f"- k = {k}: {ci_text(vals, 5)} over {len(vals)} seeds" +
                     (" (falls on high-entropy tokens)" if len(vals) > 1 and diff_interval(vals, [0.0] * len(vals), True)[1] > 0 else ""))
    change = _unpaired(cells, "grpo_tis", STALENESS_LAGS[-1], STALENESS_LAGS[0], tilt)
    more = not math.isnan(change[1]) and change[1] > 0
    lines.append(f"- k = 64 minus k = 0: {fmt(change[0], 5)} {bounds(change[1], change[2], 5)}: "
                 + ("more so with lag" if more else "not detectably more with lag" if not math.isnan(change[1]) else "undetermined"))
    return "\n".join(lines)


def ess_minimum(r: LagRun, until: int) -> float:
    """The lowest offpolicy/ess_seq of a run over its steps before `until`; nan without a reading there."""
    return min((v for s, v in r.ess_series if s < until), default=math.nan)


def _ess_verdict(d: tuple[float, float, float]) -> str:
    return ("undetermined (too few ESS readings)" if math.isnan(d[1]) else "holds" if d[2] < 0 else
            "does not hold (the collapsed runs' ESS was higher)" if d[1] > 0 else "not shown (the interval includes 0)")


def _welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    a, b = [x for x in a if not math.isnan(x)], [x for x in b if not math.isnan(x)]
    return diff_interval(a, b, paired=False) if a and b else (math.nan, math.nan, math.nan)


def ess_before_collapse(runs: list[LagRun]) -> tuple[int, tuple[float, float, float], tuple[float, float, float]] | None:
    """Rule 6 at one lag over its distinct runs: (the window's end, the earliest collapse step; the collapsed runs'
    lowest ESS before it minus the others', Welch; the same with each collapsed run's window running to its own
    collapse, the unequal windows this report used before 2026-12-07). None without 3 collapsed and 3 other runs."""
    fell = [r for r in runs if r.collapse_step is not None]
    held = [r for r in runs if r.collapse_step is None]
    if len(fell) < 3 or len(held) < 3:
        return None
    step = min(r.collapse_step for r in fell)
    survivors = [ess_minimum(r, step) for r in held]
    return (step, _welch([ess_minimum(r, step) for r in fell], survivors),
            _welch([ess_minimum(r, r.collapse_step) for r in fell], survivors))


def section_ess_collapse(cells: Cells) -> str:
    """Rule 6: the lowest response ESS before the collapse, collapsed runs against the others of the same k, every
    run over the same steps (those before the earliest collapse at k); each distinct trajectory counted once."""
    lines = ["## 8. Does a falling ESS precede collapse? (rule 6)", "",
             "Every run of a lag is read over the same steps, those before the earliest collapse at that lag: the "
             "lowest `offpolicy/ess_seq` there, collapsed runs minus the others (Welch's 95 % interval), all methods "
             "pooled with each distinct trajectory counted once. PLAN.md says \"before the collapse step (before the "
             "same step in the non-collapsed runs)\"; until " + CORRECTED + " the report took each collapsed run's "
             "minimum up to its own collapse and the others' only up to the earliest one, windows of unequal length "
             "(a longer window can only lower a minimum, which favours the claim). This correction of the "
             "implementation to the plan's text was made after seeing the data; each line gives the earlier reading "
             "beside it.", ""]
    for k in STALENESS_LAGS:
        runs = [r for c, seeds in cells.items() if parse_run(c)[2] == k for r in seeds.values()]
        distinct = [r for r in runs if r.duplicate_of is None]
        fell = sum(r.collapse_step is not None for r in distinct)
        dups = len(runs) - len(distinct)
        pool = f"{fell} collapsed, {len(distinct) - fell} did not" + (f" (distinct runs; {dups} duplicates counted once)"
                                                                        if dups else "")
        found = ess_before_collapse(distinct)
        if found is None:
            lines.append(f"- k = {k}: {pool}: undetermined (needs 3 of each)")
            continue
        step, d, unequal = found
        lines.append(f"- k = {k}: {pool}; lowest ESS before step {step} (the earliest collapse), collapsed minus not: "
                     f"{fmt(d[0], sign=True)} {bounds(d[1], d[2])}: VCPO's claim: {_ess_verdict(d)}. The unequal "
                     f"windows read {fmt(unequal[0], sign=True)} {bounds(unequal[1], unequal[2])}: {_ess_verdict(unequal)}.")
    return "\n".join(lines)


def cannot_fail_checks(cells: Cells) -> list[str]:
    """The paired comparisons of rules 3 and 4 that cannot fail (`cannot_fail`), with why and their numbers."""
    lines = []
    for k in STALENESS_LAGS:
        same, n = identical_seeds(cells, "kl_cov_m2po", "kl_cov_tis", k)
        if cannot_fail(same, n):
            lines.append(f"M2PO with KL-Cov (rule 3) at k = {k} cannot fail: {why_cannot_fail(same, n)}. "
                         + _m2po_line(cells, k))
        for method in ("grpo_m2po", "grpo_ess"):
            same, n = identical_seeds(cells, method, "grpo_tis", k)
            if cannot_fail(same, n):
                e = _pair(cells, method, "grpo_tis", k, end_entropy, "end entropy")
                a = _pair(cells, method, "grpo_tis", k, accuracy, "accuracy")
                lines.append(f"{method} - grpo_tis (rule 4) at k = {k} cannot fail: {why_cannot_fail(same, n)}. "
                             f"{e.text()}; {a.text(3)}; collapses {_collapse_text(cells, method, k)} vs "
                             f"{_collapse_text(cells, 'grpo_tis', k)}.")
    return lines


def _and(xs: list) -> str:
    """[0, 4, 16] -> "0, 4 and 16"."""
    xs = [str(x) for x in xs]
    return xs[0] if len(xs) == 1 else f"{', '.join(xs[:-1])} and {xs[-1]}"


def half_step_check(cells: Cells) -> list[str]:
    """Steps to half entropy, where every run of each lag has one value (`half_step_by_lag`)."""
    by_k = half_step_by_lag(cells)
    if by_k is None:
        return []
    runs = _all_runs(cells)
    first = sum(r.half_step == r.first_eval for r in runs)
    lags: dict[int, list[int]] = {}
    for k, h in by_k.items():
        lags.setdefault(h, []).append(k)
    where = ", ".join(f"step {h} at k = {_and(ks)}" for h, ks in lags.items())
    floor = ("; that is the first evaluation after step 0 in every run, the earliest step the endpoint can read, so "
             "no run can show a faster fall than another" if first == len(runs) else
             f"; that is the first evaluation after step 0 in {first} of {len(runs)} runs")
    return [f"steps to half entropy (a plan endpoint no verdict rule uses) takes one value in every run of a lag: "
            f"{where}{floor}. Evaluations every L/8 steps quantize it and every run halved between the same two of "
            f"them, so at this spacing it tells no method or seed from another"]


def implementation_checks(cells: Cells) -> str:
    runs = [r for seeds in cells.values() for r in seeds.values()]
    exact = sum(r.exact_lag for r in runs)
    m2po0 = [v for r in runs if r.k == 0 and "m2po" in r.method and (v := r.off.get("m2po_masked")) is not None]
    no_ess = [v for r in runs if r.method != "grpo_ess" and (v := r.off.get("lr_scale")) is not None]
    at0 = [(r, twin) for r in cells.get(cell("kl_cov_lag", 0), {}).values()
           if (twin := cells.get(cell("kl_cov_tis", 0), {}).get(r.seed)) is not None]
    same = sum((r.end_entropy, r.acc, r.off) == (t.end_entropy, t.acc, t.off) for r, t in at0)
    lines = [f"every trained token exactly min(step - 1, k) versions old (staleness/min = staleness/max): {exact} of "
             f"{len(runs)} runs",
             f"M2PO at k = 0 masked a share of {fmt(max(m2po0), 6) if m2po0 else 'n/a'} at most (on-policy, nothing to mask)",
             f"the learning-rate scale without ESS scaling: {fmt(min(no_ess), 6) if no_ess else 'n/a'} at least (1 = untouched)",
             f"the lag budget at k = 0 (every lag 0) equals KL-Cov + TIS in every endpoint and off-policy measure: "
             f"{same} of {len(at0)} seeds", *half_step_check(cells), *cannot_fail_checks(cells)]
    return "\n".join(["## 9. Implementation checks (not claims)", ""] + [f"- {line}" for line in lines])


def multiplicity_families(cells: Cells) -> list[tuple[str, list[tuple[Contrast, int]]]]:
    """Each rule's paired comparisons (contrast, decimals), as its section reads them: rule 2 at every lag, rule 3 and
    rule 7 at k = 16 and 64, rule 4 at every lag."""
    read = STALENESS_LAGS[-2:]
    both = ((end_entropy, "end entropy", 4), (accuracy, "accuracy", 3))

    def pairs(a: str, b: str, lags, values=both, tag: str = "") -> list[tuple[Contrast, int]]:
        return [(_pair(cells, a, b, k, v, f"{tag}{what}, k = {k}"), digits) for v, what, digits in values for k in lags]
    return [
        ("rule 2, KL-Cov + TIS - GRPO + TIS", pairs("kl_cov_tis", "grpo_tis", STALENESS_LAGS)),
        ("rule 3, KL-Cov + M2PO - KL-Cov + TIS", pairs("kl_cov_m2po", "kl_cov_tis", read)),
        ("rule 4, GRPO + M2PO or GRPO + ESS steps - GRPO + TIS",
         pairs("grpo_m2po", "grpo_tis", STALENESS_LAGS, tag="M2PO ") + pairs("grpo_ess", "grpo_tis", STALENESS_LAGS,
                                                                              tag="ESS steps ")),
        ("rule 7, the lag budget - KL-Cov + TIS (G, B) and - GRPO + TIS (C)",
         pairs("kl_cov_lag", "kl_cov_tis", read) + pairs("kl_cov_lag", "grpo_tis", read, both[:1], "C ")),
    ]


def _survivor(c: Contrast, digits: int, m: int) -> str:
    corrected = c.corrected(m)
    kept = corrected is not None and (corrected[0] > 0 or corrected[1] < 0)
    return (f"{c.label}: {fmt(c.mean, digits, sign=True)} {bounds(c.lo, c.hi, digits)}, corrected "
            f"{bounds(*corrected, digits) if corrected else 'n/a'}: " + ("**holds**" if kept else "does not hold"))


def section_multiplicity(cells: Cells) -> str:
    """Every comparison whose 95 % interval excludes 0, and whether it still does under Bonferroni within its rule."""
    lines = ["## 10. Multiplicity (a reading added after the runs; the verdicts above stand as the plan wrote them)", "",
             "Each rule makes m paired comparisons at 95 % each, uncorrected, so a rule with many of them shows a "
             "difference by chance more often than one in twenty. Here every comparison of rules 2, 3, 4 and 7 whose "
             "95 % interval excludes 0, with its interval under Bonferroni's correction within its rule (level "
             "1 - 0.05 / m; with 3 seeds the t grows from 4.30 to 8.86 at m = 4 and 17.9 at m = 16). Rules 5 and 6 "
             "are not included.", ""]
    for title, family in multiplicity_families(cells):
        m = len(family)
        shown = [_survivor(c, digits, m) for c, digits in family if c.excludes_zero(1) or c.excludes_zero(-1)]
        lines.append(f"- {title} (m = {m}): " + ("; ".join(shown) if shown else "none excludes 0 at 95 %"))
    return "\n".join(lines)


def caveat(bites: bool | None) -> str:
    """What every verdict after the manipulation check carries when the lag did not (or may not) bite (rule 1)."""
    if bites:
        return ""
    return ("not a staleness effect: the lag did not bite" if bites is False
            else "the manipulation check is undetermined, so this is not yet a staleness effect")


def _with_caveat(section: str, note: str) -> str:
    return section.replace("Verdict: ", f"Verdict ({note}): ") if note else section


def render(cells: Cells, meta: dict, now: datetime.datetime, names: list[str], missing: list[str],
           controls: Controls | None = None) -> str:
    """The report's text (pure). `controls`: the dose study's, for rule 2's reading (`dose_controls`)."""
    manipulation, bites = section_manipulation(cells)
    note = caveat(bites)
    later = [section_kl_cov(cells, controls), section_m2po(cells), section_secondary(cells), section_lag_budget(cells),
             section_clip(cells), section_ess_collapse(cells)]
    return "\n\n".join([
        section_header(meta, now, names, missing), section_corrections(cells), manipulation, section_endpoints(cells),
        *(_with_caveat(s, note) for s in later), implementation_checks(cells), section_multiplicity(cells),
        "## 11. Plots (means over seeds; one panel per lag)\n\n" + "\n\n".join(f"![{p.removesuffix('.png')}]({p})" for p in PLOTS),
    ]) + "\n"


def _series(name: str, rows: list[dict], what: str) -> list[tuple[int, float]]:
    if what in ("acc", "entropy"):
        return [(p.step, p.acc if what == "acc" else p.entropy) for p in on_policy_points(name, rows)]
    return key_series(merge_rows(rows), what)


def write_plots(study_dir: str, rows: dict[str, list[dict]]) -> None:
    from study.plots import plot_lines

    def panel(k: int, what: str) -> dict[str, list[tuple[int, float]]]:
        runs = {m: [n for n in rows if parse_name(n)[:2] == (m, k)] for m in STALENESS_ARMS}
        return {m: mean_by_step([_series(n, rows[n], what) for n in names]) for m, names in runs.items() if names}

    for path, (label, what) in PLOTS.items():
        panels = {f"lag {k}": panel(k, what) for k in STALENESS_LAGS}
        plot_lines(panels, os.path.join(study_dir, path), xlabel="step", ylabel=label, title=f"{label} by lag",
                   sharex=False)  # lag 64 runs 256 steps, the others 64


def write_staleness_report(study_dir: str, names: list[str], meta: dict, now: datetime.datetime | None = None,
                           dose_dir: str = DOSE_STUDY) -> str:
    """Write STUDY_DIR/report.md and its PNGs from the complete runs among `names`; returns the report path.
    `dose_dir`: the dose study whose controls read rule 2's lag-0 difference, where it lies above 0."""
    steps = {n: staleness_steps(parse_name(n)[1], meta.get("steps", 64)) for n in names}
    rows = {n: read_run(os.path.join(study_dir, n)) for n in names if has_run(os.path.join(study_dir, n))}
    done = [n for n, r in rows.items() if any(x.get("step") == steps[n] for x in r)]
    rows = {n: rows[n] for n in done}
    cells = by_cell(with_duplicates([run_endpoints(n, rows[n], steps[n]) for n in done], rows))
    write_plots(study_dir, rows)
    controls = dose_controls(dose_dir) if d_zero(cells).excludes_zero(1) else None  # read only where rule 2 needs it
    path = os.path.join(study_dir, "report.md")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(render(cells, meta, now or datetime.datetime.now(), done, [n for n in names if n not in done], controls))
    os.replace(tmp, path)
    return path
