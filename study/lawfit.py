"""The entropy-performance law of Cui et al. 2025: R = -a * exp(H) + b.

R is accuracy, H the batch policy entropy. Fit by ordinary least squares of R
on x = exp(H): the slope is -a and the intercept b. The predicted ceiling, at
H = 0, is b - a. The paper fitted the first 36 steps and predicted the next 200
within 0.9 % RMSE; `early_prediction` makes that check on any run.

`eval_points` / `train_points` turn metrics.jsonl rows into (step, H, R) points:
held-out accuracy paired with the entropy of the evaluated policy version, or the
training reward paired with the step's batch entropy. `pearson` is the plain
sample correlation used for the covariance check (Cov(log pi, A) vs entropy change).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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


# Two-sided 95 % Student-t quantiles by degrees of freedom; between listed dofs the smaller dof's (wider) value.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}
FEW_EARLY_POINTS = 5  # an early fit on fewer points gets a warning: its interval is wide or undefined


def t975(dof: int) -> float:
    return _T975[max(d for d in _T975 if d <= dof)] if dof < 120 else 1.96


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
    return t975(n - 2) * math.sqrt(s2 * (1 + 1 / n + (math.exp(entropy) - mx) ** 2 / sxx))


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
