"""Small statistics for the study reports: Student t quantiles and intervals, the exact sign test,
the minimum detectable effect, R^2 of a straight-line fit, a seeded permutation test, and the one number
formatter (`fmt`, `bounds`) every report prints its figures with.

Pure numpy and math (scipy is not a dependency). The t distribution's CDF is computed from the
regularized incomplete beta function (Lentz's continued fraction, Numerical Recipes 6.4), and its
inverse by bisection, to about 1e-10 in t: far tighter than any interval printed in a report.

Conventions: every interval is two-sided at `level` (0.95: the 2.5 % and 97.5 % quantiles); a
sample too small for an interval gives nan bounds rather than an error, so a report can print
"n/a" beside its mean. Degrees of freedom may be fractional (Welch). A figure that is not 0 never
prints as 0 (`fmt`): an interval that excludes 0 by 7e-06 must not read as one that touches it.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-15
_TINY = 1e-300


def fmt(x: float | None, digits: int = 4, sign: bool = False) -> str:
    """`x` with `digits` decimals (a leading + if `sign`); a value that is not 0 but would print as 0 there gets two
    significant figures instead (`.2g`: 7e-06, 6.7e-06), so an interval that excludes 0 by 7e-06 never reads as one
    that touches it. -0.0 prints as 0; None and nan print as n/a."""
    if x is None or math.isnan(x):
        return "n/a"
    x += 0.0
    if x != 0 and round(x, digits) == 0:
        return f"{x:+.2g}" if sign else f"{x:.2g}"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def bounds(lo: float | None, hi: float | None, digits: int = 4, sign: bool = False) -> str:
    """An interval as `[lo, hi]`, each end written by `fmt` (with its sign if `sign`)."""
    return f"[{fmt(lo, digits, sign)}, {fmt(hi, digits, sign)}]"


def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), for x < (a + 1) / (a + b + 2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0 and x in [0, 1]."""
    if not (a > 0 and b > 0) or not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs a, b > 0 and x in [0, 1], got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` > 0 degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_cdf needs df > 0, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse of `t_cdf`: the t with P(T <= t) = p, for p in (0, 1), by bisection."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile needs p in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"t_quantile needs df > 0, got {df}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _clean(values, name: str) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be a flat list of finite numbers, got {list(values)!r}")
    return arr


def t_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): the `level` t-interval of the mean on n - 1 df; (mean, nan, nan) when n < 2."""
    arr = _clean(values, "t_interval values")
    if arr.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, math.nan, math.nan
    half = t_quantile(0.5 + level / 2.0, arr.size - 1) * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    return mean, mean - half, mean + half


def diff_interval(a, b, paired: bool, level: float = 0.95) -> tuple[float, float, float]:
    """(mean of a - b, lo, hi). Paired: the t-interval of the per-pair differences (a[i] pairs with
    b[i], e.g. the same seed). Unpaired: Welch's interval (unequal variances, Welch-Satterthwaite df).
    Bounds are nan when a side has fewer than 2 values (or, Welch, when both variances are 0 and
    the df is undefined: then the interval is the point itself)."""
    xa, xb = _clean(a, "diff_interval a"), _clean(b, "diff_interval b")
    if paired:
        if xa.size != xb.size:
            raise ValueError(f"a paired difference needs equal lengths, got {xa.size} and {xb.size}")
        return t_interval(xa - xb, level)
    if xa.size == 0 or xb.size == 0:
        raise ValueError("diff_interval needs at least one value on each side")
    diff = float(xa.mean() - xb.mean())
    if xa.size < 2 or xb.size < 2:
        return diff, math.nan, math.nan
    va, vb = float(xa.var(ddof=1)) / xa.size, float(xb.var(ddof=1)) / xb.size
    if va + vb == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (xa.size - 1) + vb ** 2 / (xb.size - 1))
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(va + vb)
    return diff, diff - half, diff + half


def paired_difference(a, b, level: float = 0.95) -> tuple[float, float, float, float]:
    """(mean of a - b, lo, hi, minimum detectable effect) of pairs a[i], b[i] (e.g. the same seed): the paired
    `level` t-interval and the MDE at that level from the sd of the differences; lo, hi and the MDE are nan with
    fewer than 2 pairs."""
    mean, lo, hi = diff_interval(a, b, paired=True, level=level)
    diffs = _clean(a, "paired_difference a") - _clean(b, "paired_difference b")
    if diffs.size < 2:
        return mean, lo, hi, math.nan
    return mean, lo, hi, min_detectable_effect(float(diffs.std(ddof=1)), int(diffs.size), level=level)


def sign_test(values) -> float:
    """Two-sided exact binomial sign test of median 0: zeros dropped, p = P(min(#pos, #neg) or fewer
    successes of the same rarity) = min(1, 2 * P(X <= min) with X ~ Bin(n, 1/2)). 1.0 with no signs."""
    arr = _clean(values, "sign_test values")
    pos, neg = int(np.sum(arr > 0)), int(np.sum(arr < 0))
    n = pos + neg
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(pos, neg) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def min_detectable_effect(sd: float, n: int, level: float = 0.95, power: float = 0.8,
                          paired: bool = True) -> float:
    """Smallest true difference a two-sided t-test at `level` detects with probability `power`
    (normal-shift approximation with t quantiles): (t_{1-alpha/2, df} + t_{power, df}) * se.

    paired=True: `sd` is the sd of the per-seed differences, n pairs, df = n - 1, se = sd / sqrt(n).
    paired=False: two groups of n each with common sd, df = 2n - 2, se = sd * sqrt(2 / n).
    nan when df < 1 (too few seeds to test anything)."""
    if sd < 0 or not math.isfinite(sd):
        raise ValueError(f"min_detectable_effect needs a finite sd >= 0, got {sd}")
    df = n - 1 if paired else 2 * n - 2
    if n < 1 or df < 1:
        return math.nan
    se = sd * math.sqrt((1.0 if paired else 2.0) / n)
    return (t_quantile(0.5 + level / 2.0, df) + t_quantile(power, df)) * se


def linear_fit(x, y) -> tuple[float, float, float]:
    """(slope, intercept, R^2) of y = slope * x + intercept by least squares.
    R^2 is nan when y is constant; a constant x raises (no slope)."""
    xs, ys = _clean(x, "linear_fit x"), _clean(y, "linear_fit y")
    if xs.size != ys.size or xs.size < 2:
        raise ValueError(f"linear_fit needs at least 2 paired points, got {xs.size} x and {ys.size} y")
    dx = xs - xs.mean()
    sxx = float(dx @ dx)
    if sxx == 0:
        raise ValueError("linear_fit: every x is the same, so the slope is undefined")
    slope = float(dx @ (ys - ys.mean())) / sxx
    intercept = float(ys.mean() - slope * xs.mean())
    ss_tot = float(((ys - ys.mean()) ** 2).sum())
    ss_res = float(((ys - slope * xs - intercept) ** 2).sum())
    return slope, intercept, (1.0 - ss_res / ss_tot) if ss_tot > 0 else math.nan


def linear_r2(x, y) -> float:
    """R^2 of y = a x + b by least squares (see `linear_fit`)."""
    return linear_fit(x, y)[2]


def correlation(x, y) -> float:
    """Pearson correlation; nan when either side is constant or there are fewer than 2 pairs."""
    xs, ys = _clean(x, "correlation x"), _clean(y, "correlation y")
    if xs.size != ys.size:
        raise ValueError(f"correlation needs paired samples, got {xs.size} x and {ys.size} y")
    if xs.size < 2:
        return math.nan
    dx, dy = xs - xs.mean(), ys - ys.mean()
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / denom if denom > 0 else math.nan


def permutation_p(x, y, groups=None, n_perm: int = 10000, seed: int = 0) -> tuple[float, float]:
    """(r, p): Pearson r of x with y and its two-sided permutation p-value, y shuffled within each
    group (all one group when `groups` is None), p = (1 + #{|r_perm| >= |r|}) / (1 + n_perm).
    Deterministic for a given seed (numpy Generator PCG64)."""
    xs, ys = _clean(x, "permutation_p x"), _clean(y, "permutation_p y")
    r = correlation(xs, ys)
    if math.isnan(r):
        return r, math.nan
    labels = np.zeros(xs.size, dtype=int) if groups is None else np.unique(np.asarray(list(groups)), return_inverse=True)[1]
    if labels.size != xs.size:
        raise ValueError(f"permutation_p: {labels.size} group labels for {xs.size} points")
    rng = np.random.default_rng(seed)
    shuffled = np.empty((n_perm, xs.size))  # [n_perm, n]: one permutation of y per row
    for g in np.unique(labels):
        idx = np.flatnonzero(labels == g)
        shuffled[:, idx] = rng.permuted(np.tile(ys[idx], (n_perm, 1)), axis=1)
    dx = xs - xs.mean()
    dy = shuffled - shuffled.mean(axis=1, keepdims=True)
    r_perm = (dy @ dx) / np.sqrt((dx @ dx) * np.einsum("ij,ij->i", dy, dy))
    hits = int(np.sum(np.abs(r_perm) >= abs(r) - 1e-12))
    return r, (1 + hits) / (1 + n_perm)
