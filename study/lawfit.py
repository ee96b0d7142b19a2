"""The entropy-performance law of Cui et al. 2025: R = -a * exp(H) + b.

R is accuracy, H the batch policy entropy. Fit by ordinary least squares of R
on x = exp(H): the slope is -a and the intercept b. The predicted ceiling, at
H = 0, is b - a. The paper fitted the first 36 steps and predicted the next 200
within 0.9 % RMSE; `early_prediction` makes that check on any run.

`eval_points` / `train_points` turn metrics.jsonl rows into (step, H, R) points:
held-out accuracy paired with the entropy of the evaluated policy version, or the
training reward paired with the step's batch entropy. `pearson` is the plain
sample correlation used for the covariance check (Cov(log pi, A) vs entropy change).

`judge_law` asks whether the fit can be told from a clock (time-only models, a shuffled-pairing control, and
the across-run correlation at equal step); `early_bias` judges the early prediction over many runs for bias
(signed errors, their t-interval, the sign test) rather than by its RMSE alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from study.stats import linear_r2, permutation_p, sign_test, t_interval, t_quantile

MIN_FIT_POINTS = 3  # a 2-point fit always has R^2 = 1 and says nothing; reports and the CLI ask for 3


@dataclass(frozen=True)
class LawFit:
    a: float
    b: float
    r2: float
    n: int

    @property
    def ceiling(self) -> float:
        return self.b - self.a

    def predict(self, entropy: float) -> float:
        return -self.a * math.exp(entropy) + self.b

    def formula(self, digits: int = 4) -> str:
        """The fitted law as a reader writes it: `R = -0.2588 exp(H) + 0.5000`, `R = 0.1 exp(H) - 0.2`."""
        slope = f"-{self.a:.{digits}f}" if self.a >= 0 else f"{-self.a:.{digits}f}"
        return f"R = {slope} exp(H) {'+' if self.b >= 0 else '-'} {abs(self.b):.{digits}f}"


def fit_law(entropies: list[float], rewards: list[float]) -> LawFit:
    if len(entropies) != len(rewards) or len(entropies) < 2:
        raise ValueError(f"fit_law needs at least 2 paired points, got {len(entropies)} entropies and {len(rewards)} rewards")
    xs = [math.exp(h) for h in entropies]
    n = len(xs)
    mx, my = sum(xs) / n, sum(rewards) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_law: every entropy is the same, so the slope is undefined; fit a run whose entropy moves")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, rewards)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, rewards))
    ss_tot = sum((y - my) ** 2 for y in rewards)
    return LawFit(a=-slope, b=intercept, r2=1.0 - ss_res / ss_tot if ss_tot else 1.0, n=n)


def early_prediction(entropies: list[float], rewards: list[float], fraction: float = 0.15,
                     k: int | None = None) -> tuple[LawFit, float]:
    """Fit on the first `fraction` of the points (or the first `k`); RMSE of its predictions on the rest."""
    k = max(2, int(len(entropies) * fraction)) if k is None else k
    if k >= len(entropies):
        raise ValueError(f"early_prediction: {len(entropies)} points leave nothing to predict after the first {k}")
    fit = fit_law(entropies[:k], rewards[:k])
    rest = list(zip(entropies[k:], rewards[k:]))
    rmse = math.sqrt(sum((fit.predict(h) - r) ** 2 for h, r in rest) / len(rest))
    return fit, rmse


FEW_EARLY_POINTS = 5  # an early fit on fewer points gets a warning: its interval is wide or undefined


def prediction_interval(entropies: list[float], rewards: list[float], fit: LawFit, entropy: float) -> float | None:
    """Half-width of the 95 % prediction interval of `fit` (least squares on these points) at `entropy`:
    t(n - 2) * s * sqrt(1 + 1/n + (x0 - mean x)^2 / Sxx), x = exp(H). None with 2 points (no residual
    degrees of freedom: a line through 2 points says nothing about its error)."""
    n = len(entropies)
    if n < 3:
        return None
    xs = [math.exp(h) for h in entropies]
    mx = sum(xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    s2 = sum((r - fit.predict(h)) ** 2 for h, r in zip(entropies, rewards)) / (n - 2)
    return t_quantile(0.975, n - 2) * math.sqrt(s2 * (1 + 1 / n + (math.exp(entropy) - mx) ** 2 / sxx))


# ---------------------------------------------------------------------------
# Fit points from metrics.jsonl rows (pure; no I/O, no plotting).
#
# Step s's training metrics describe the update from policy version s-1 to s, and
# `actor/entropy` on row s is the entropy of version s-1. Evaluation on row s is of
# version s (row 0 holds only the base model's evaluation). The law pairs a
# version's accuracy with that same version's entropy, so an eval point at version
# v takes its entropy from row v+1 (measured before that row's update), or, for
# the last version, from row v's entropy plus its `actor/entropy_delta`.
# ---------------------------------------------------------------------------

_EVAL_ACC = re.compile(r"^eval/(.+)/acc$")


def row_value(row: dict | None, key: str) -> float | None:
    """row[key] as a float, or None when the row, the key or a finite value is missing."""
    if row is None:
        return None
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def key_series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row with a numeric `key`."""
    return [(r["step"], v) for r in rows if (v := row_value(r, key)) is not None]


def merge_rows(rows: list[dict]) -> list[dict]:
    """Rows sorted by `step`, one per step; rows sharing a step are merged in file order (later keys win).

    Rows without an integer `step` are dropped: they cannot be placed on the time axis.
    """
    by_step: dict[int, dict] = {}
    for row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        by_step.setdefault(step, {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def eval_sources(rows: list[dict]) -> list[str]:
    """Sorted data-source names that have an `eval/<ds>/acc` key in any row."""
    return sorted({m.group(1) for row in rows for k in row if (m := _EVAL_ACC.match(k))})


def mean_eval_acc(row: dict) -> float | None:
    """Mean of the row's non-null `eval/<ds>/acc` values over data sources; None if it has none."""
    accs = [v for k in row if _EVAL_ACC.match(k) and (v := row_value(row, k)) is not None]
    return sum(accs) / len(accs) if accs else None


def version_entropy(by_step: dict[int, dict], version: int) -> float | None:
    """Entropy of policy version `version`: row version+1's `actor/entropy`, else row version's
    `actor/entropy + actor/entropy_delta`, else None. `by_step` maps step -> merged row."""
    after = row_value(by_step.get(version + 1), "actor/entropy")
    if after is not None:
        return after
    row = by_step.get(version)
    h, dh = row_value(row, "actor/entropy"), row_value(row, "actor/entropy_delta")
    return h + dh if h is not None and dh is not None else None


def eval_points(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, entropy of version step, mean eval accuracy of version step), sorted by step.

    Eval rows whose version has no entropy (see `version_entropy`) are skipped.
    """
    merged = merge_rows(rows)
    by_step = {r["step"]: r for r in merged}
    points = []
    for row in merged:
        acc = mean_eval_acc(row)
        h = version_entropy(by_step, row["step"]) if acc is not None else None
        if h is not None:
            points.append((row["step"], h, acc))
    return points


def train_points(rows: list[dict], reward_key: str = "critic/score/mean",
                 entropy_key: str = "actor/entropy") -> list[tuple[int, float, float]]:
    """(step, row[entropy_key], row[reward_key]) for rows holding both as numbers, sorted by step."""
    points = []
    for row in merge_rows(rows):
        h, r = row_value(row, entropy_key), row_value(row, reward_key)
        if h is not None and r is not None:
            points.append((row["step"], h, r))
    return points


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of paired samples; None with fewer than 3 pairs or a constant side."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson needs paired samples, got {len(xs)} xs and {len(ys)} ys")
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


# ---------------------------------------------------------------------------
# Judging the law: can it be told from a clock? (pure; numpy via study.stats)
#
# A fit of accuracy on exp(H) over runs whose entropy falls while accuracy climbs
# has a high R^2 whatever drives the climb: any monotone function of the step fits
# too. So the fit is compared with time-only models fitted the same way (least
# squares of accuracy on g(step)), with the eval response length, with the linear
# form a*H + b, and with a "shuffled pairing" control (run i's accuracy against
# run j's entropy at the same step). The test that separates the law from a clock
# is across runs at equal step: if entropy drives accuracy, the run with the
# lower entropy at a step has the higher accuracy at that step.
# ---------------------------------------------------------------------------

MIN_RUNS_PER_STEP = 3  # the across-run test uses only steps evaluated in at least this many runs
PERMUTATIONS = 10000  # within-step permutations for the across-run test's p-value
EXP_LINEAR_TESTED = 0.01  # exp(H) and 1 + H closer than this (relative) over the data: the exponential is not tested


@dataclass(frozen=True)
class EvalPoint:
    run: str
    step: int
    entropy: float
    acc: float
    length: float | None  # mean eval response length over data sources, None when not logged


@dataclass(frozen=True)
class LawJudgement:
    n: int  # pooled points
    runs: int
    r2: dict[str, float]  # model name -> R^2 of acc = a * feature + b on the pooled points
    shuffled_r2: float  # mean R^2 of exp(H) over every cyclic re-pairing of runs (nan with one run)
    within_r: float  # correlation of exp(H) with accuracy after demeaning both within each step
    within_p: float  # two-sided within-step permutation p of within_r
    within_points: int
    within_steps: int
    entropy_range: tuple[float, float]
    exp_linear_gap: float  # max over the range of (exp(H) - (1 + H)) / exp(H)

    @property
    def time_models(self) -> list[str]:
        return [m for m in self.r2 if m.startswith("time:")]

    @property
    def beats_clock(self) -> bool:
        return all(self.r2["exp(H)"] > self.r2[m] for m in self.time_models)

    @property
    def across_runs(self) -> bool:
        return self.within_r < 0 and self.within_p < 0.05

    @property
    def holds(self) -> bool:
        return self.beats_clock and self.across_runs

    @property
    def exp_form_tested(self) -> bool:
        return self.exp_linear_gap >= EXP_LINEAR_TESTED


def eval_lengths(rows: list[dict]) -> dict[int, float]:
    """step -> mean of the row's eval/<ds>/response_length values, for eval rows that log them."""
    out = {}
    for row in merge_rows(rows):
        vals = [v for k in row if k.startswith("eval/") and k.endswith("/response_length")
                and (v := row_value(row, k)) is not None]
        if vals:
            out[row["step"]] = sum(vals) / len(vals)
    return out


def run_eval_points(name: str, rows: list[dict]) -> list[EvalPoint]:
    """A run's eval points (see `eval_points`) with its eval response lengths."""
    lengths = eval_lengths(rows)
    return [EvalPoint(name, s, h, a, lengths.get(s)) for s, h, a in eval_points(rows)]


def _model_r2(points: list[EvalPoint]) -> dict[str, float]:
    """R^2 of acc = a * feature + b for the law's exp(H), the linear form, the time-only models and the eval response
    length (when every point has one and it varies)."""
    acc = [p.acc for p in points]
    features = {"exp(H)": [math.exp(p.entropy) for p in points], "H (linear)": [p.entropy for p in points],
                "time: sqrt(step)": [math.sqrt(p.step) for p in points],
                "time: log(1 + step)": [math.log1p(p.step) for p in points]}
    if all(p.length is not None for p in points):
        features["eval response length"] = [p.length for p in points]
    return {name: linear_r2(xs, acc) for name, xs in features.items() if max(xs) > min(xs)}  # a constant explains nothing


def shuffled_r2(by_run: dict[str, list[EvalPoint]]) -> float:
    """Mean R^2 of acc = a exp(H) + b when run i's accuracy is paired with run (i + s)'s entropy at the same step,
    over every shift s = 1 .. runs - 1 (steps one of the pair lacks are left out); nan with fewer than 2 runs."""
    names = list(by_run)
    entropy = {n: {p.step: p.entropy for p in by_run[n]} for n in names}
    r2s = []
    for shift in range(1, len(names)):
        pairs = [(math.exp(entropy[names[(i + shift) % len(names)]][p.step]), p.acc)
                 for i, n in enumerate(names) for p in by_run[n] if p.step in entropy[names[(i + shift) % len(names)]]]
        if len(pairs) >= MIN_FIT_POINTS:
            r2s.append(linear_r2([x for x, _ in pairs], [y for _, y in pairs]))
    return sum(r2s) / len(r2s) if r2s else math.nan


def within_step_points(points: list[EvalPoint]) -> tuple[list[float], list[float], list[int]]:
    """(exp(H), accuracy, step) of the points at steps evaluated in >= MIN_RUNS_PER_STEP runs, exp(H) and accuracy
    demeaned within each step: what is left once the step (the clock) is taken out."""
    by_step: dict[int, list[EvalPoint]] = {}
    for p in points:
        by_step.setdefault(p.step, []).append(p)
    xs, ys, groups = [], [], []
    for step, pts in sorted(by_step.items()):
        if len(pts) < MIN_RUNS_PER_STEP:
            continue
        mx = sum(math.exp(p.entropy) for p in pts) / len(pts)
        my = sum(p.acc for p in pts) / len(pts)
        xs += [math.exp(p.entropy) - mx for p in pts]
        ys += [p.acc - my for p in pts]
        groups += [step] * len(pts)
    return xs, ys, groups


def within_step(points: list[EvalPoint], seed: int = 0) -> tuple[float, float, int, int]:
    """(r, p, points, steps): the Pearson r of `within_step_points` and its two-sided permutation p (accuracy
    shuffled across runs within each step, seeded)."""
    xs, ys, groups = within_step_points(points)
    if len(xs) < MIN_FIT_POINTS:
        return math.nan, math.nan, len(xs), len(set(groups))
    r, p = permutation_p(xs, ys, groups=groups, n_perm=PERMUTATIONS, seed=seed)
    return r, p, len(xs), len(set(groups))


def judge_law(by_run: dict[str, list[EvalPoint]], seed: int = 0) -> LawJudgement | None:
    """The law against the clock on the pooled points of `by_run` (one entry per distinct run); None with fewer than
    MIN_FIT_POINTS points or no spread in entropy or step."""
    points = [p for pts in by_run.values() for p in pts]
    if len(points) < MIN_FIT_POINTS or len({p.entropy for p in points}) < 2 or len({p.step for p in points}) < 2:
        return None
    lo, hi = min(p.entropy for p in points), max(p.entropy for p in points)
    gap = max((math.exp(h) - 1 - h) / math.exp(h) for h in (lo, hi))  # 1 - (1 + h) e^-h: smallest at 0, so an end
    r, p, n_within, n_steps = within_step(points, seed)
    return LawJudgement(n=len(points), runs=len(by_run), r2=_model_r2(points), shuffled_r2=shuffled_r2(by_run),
                        within_r=r, within_p=p, within_points=n_within, within_steps=n_steps,
                        entropy_range=(lo, hi), exp_linear_gap=gap)


# ---------------------------------------------------------------------------
# Early prediction, judged for bias: fit each run's first points, predict its final accuracy
# ---------------------------------------------------------------------------

EARLY_FRACTION = 0.15  # fit on the first 15 % of a run's eval points (at least MIN_FIT_POINTS) ...
EARLY_MAE = 0.02  # ... the prediction holds when the mean absolute error of the finals is within 2 points ...
EARLY_SIGN_P = 0.05  # ... and the sign test finds no bias (p >= this)


@dataclass(frozen=True)
class EarlyRun:
    run: str
    k: int  # points fitted
    n: int  # points in the run
    predicted: float  # the early fit's accuracy at the run's final entropy
    final: float  # the measured final accuracy
    pi_half: float | None  # 95 % prediction half-width of the early fit at the final entropy
    acc_range: float  # max - min of the run's eval accuracies
    pooled_predicted: float | None  # the pooled early fit's prediction at the final entropy

    @property
    def error(self) -> float:
        """Signed: final - predicted (positive: the fit predicted too low)."""
        return self.final - self.predicted


@dataclass(frozen=True)
class EarlyBias:
    runs: list[EarlyRun]
    mean: float  # mean signed error
    lo: float
    hi: float  # 95 % t-interval of the mean signed error
    sign_p: float
    mae: float
    pooled: LawFit | None  # one law fitted on every run's early points

    @property
    def holds(self) -> bool:
        return self.mae <= EARLY_MAE and self.sign_p >= EARLY_SIGN_P

    @property
    def biased(self) -> bool:
        return self.sign_p < EARLY_SIGN_P


def early_k(n: int) -> int:
    """Points the early fit uses out of n: the first EARLY_FRACTION, at least MIN_FIT_POINTS."""
    return max(MIN_FIT_POINTS, math.ceil(n * EARLY_FRACTION))


def early_run(name: str, points: list[tuple[float, float]]) -> EarlyRun | None:
    """The early fit of one run's (entropy, accuracy) points and its prediction of the final; None when too few."""
    k = early_k(len(points))
    if len(points) <= k:
        return None
    hs, rs = [h for h, _ in points[:k]], [r for _, r in points[:k]]
    try:
        fit = fit_law(hs, rs)
    except ValueError:
        return None
    h_end, r_end = points[-1]
    accs = [r for _, r in points]
    return EarlyRun(name, k, len(points), fit.predict(h_end), r_end, prediction_interval(hs, rs, fit, h_end),
                    max(accs) - min(accs), None)


def early_bias(points_by_run: dict[str, list[tuple[float, float]]]) -> EarlyBias | None:
    """Per run (one entry per distinct run), the early fit's prediction of the final accuracy from the final entropy;
    the signed errors' mean, 95 % t-interval, sign test and mean absolute error; and the errors of one pooled early fit
    (every run's early points together). None when no run has enough points."""
    runs = [e for name, pts in points_by_run.items() if (e := early_run(name, pts)) is not None]
    if not runs:
        return None
    early = [p for pts in points_by_run.values() if len(pts) > early_k(len(pts)) for p in pts[:early_k(len(pts))]]
    try:
        pooled = fit_law([h for h, _ in early], [r for _, r in early])
    except ValueError:
        pooled = None
    if pooled is not None:
        runs = [EarlyRun(**{**e.__dict__, "pooled_predicted": pooled.predict(points_by_run[e.run][-1][0])})
                for e in runs]
    errors = [e.error for e in runs]
    mean, lo, hi = t_interval(errors)
    return EarlyBias(runs, mean, lo, hi, sign_test(errors), sum(abs(x) for x in errors) / len(errors), pooled)
