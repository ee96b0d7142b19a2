"""The premise gates of the grid study (docs/study-grid/PLAN.md): can a run's regime express the entropy mechanism
of Cui et al. 2025 (dH ~ -eta Cov(log pi, A)) at all?

A GRPO pilot's metrics.jsonl rows in, five gates out, each with its figure, threshold and pass / fail:

    G1  mean actor/entropy of steps 1-3 >= 0.4 nats                        (entropy to act on)
    G2  median over steps of actor/cov_top10_share <= 0.20                 (the covariance is spread)
    G3  first step whose 5-step trailing mean entropy <= G1's start / 2 in [15, 60]   (a fall inside the run)
    G4  mean actor/entropy_per_response of the last 10 steps <= half of steps 1-3's   (the fall is not length)
    G5  corr over steps (actor/cov_mean, actor/entropy_delta) < 0, its 95 % Fisher-z interval below 0

and, as information only, G5's correlation on first differences (a shared trend in time removed). The thresholds
are the plan's; change them there (an amendment), not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from study.stats import fmt

START_STEPS = 3
END_STEPS = 10
SMOOTH = 5
MIN_ENTROPY = 0.4
MAX_TOP10_SHARE = 0.20
HALF_WINDOW = (15, 60)


@dataclass(frozen=True)
class Gate:
    name: str
    what: str
    value: str
    rule: str
    passed: bool | None  # None: the run does not log what the gate reads


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a metric over the run's training rows, in step order, rows without it left out."""
    pts = sorted((r["step"], float(r[key])) for r in rows if key in r and r.get("step") is not None
                 and r[key] is not None and math.isfinite(float(r[key])))
    return np.array([s for s, _ in pts], dtype=float), np.array([v for _, v in pts], dtype=float)


def fisher_interval(r: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """The interval of a Pearson r over n pairs by Fisher's z (normal, n - 3); (nan, nan) when n < 4."""
    if n < 4 or not math.isfinite(r):
        return math.nan, math.nan
    z, se = math.atanh(max(min(r, 1 - 1e-12), -1 + 1e-12)), 1 / math.sqrt(n - 3)
    q = NormalDist().inv_cdf(0.5 + level / 2)
    return math.tanh(z - q * se), math.tanh(z + q * se)


def cov_entropy_correlation(rows: list[dict], differences: bool = False,
                            steps: tuple[int, int] | None = None) -> tuple[float, float, float, int]:
    """(r, lo, hi, n): Pearson r over steps of actor/cov_mean with actor/entropy_delta (of their step-to-step
    differences when `differences`; over steps lo..hi only when `steps`), with its 95 % Fisher-z interval."""
    if steps is not None:
        rows = [r for r in rows if r.get("step") is not None and steps[0] <= r["step"] <= steps[1]]
    s1, cov = series(rows, "actor/cov_mean")
    s2, delta = series(rows, "actor/entropy_delta")
    common = sorted(set(s1) & set(s2))
    x = np.array([cov[list(s1).index(s)] for s in common])
    y = np.array([delta[list(s2).index(s)] for s in common])
    if differences:
        x, y = np.diff(x), np.diff(y)
    if len(x) < 4 or x.std() == 0 or y.std() == 0:
        return math.nan, math.nan, math.nan, len(x)
    r = float(np.corrcoef(x, y)[0, 1])
    lo, hi = fisher_interval(r, len(x))
    return r, lo, hi, len(x)


def half_step(rows: list[dict]) -> tuple[float, int | None]:
    """(start entropy: mean of steps 1-3, the first step whose trailing SMOOTH-step mean is at most half of it)."""
    steps, h = series(rows, "actor/entropy")
    if len(h) < START_STEPS:
        return math.nan, None
    start = float(h[:START_STEPS].mean())
    for i in range(SMOOTH - 1, len(h)):  # full 5-step windows only, as the plan says
        if h[i - SMOOTH + 1: i + 1].mean() <= start / 2:
            return start, int(steps[i])
    return start, None


def gates(rows: list[dict]) -> list[Gate]:
    """The five gates of the plan on one run's metric rows."""
    start, t_half = half_step(rows)
    _, top10 = series(rows, "actor/cov_top10_share")
    _, per_resp = series(rows, "actor/entropy_per_response")
    r, lo, hi, n = cov_entropy_correlation(rows)
    top = float(np.median(top10)) if len(top10) else math.nan
    p_start = float(per_resp[:START_STEPS].mean()) if len(per_resp) >= START_STEPS else math.nan
    p_end = float(per_resp[-END_STEPS:].mean()) if len(per_resp) >= END_STEPS else math.nan
    known = lambda *v: all(math.isfinite(x) for x in v)  # noqa: E731
    return [
        Gate("G1", "entropy to act on: mean actor/entropy of steps 1-3", f"{fmt(start, 3)} nats",
             f">= {MIN_ENTROPY}", start >= MIN_ENTROPY if known(start) else None),
        Gate("G2", "spread covariance: median actor/cov_top10_share", fmt(top, 3), f"<= {MAX_TOP10_SHARE}",
             top <= MAX_TOP10_SHARE if known(top) else None),
        Gate("G3", f"a fall inside the run: first step whose {SMOOTH}-step mean entropy <= half the start",
             "never" if t_half is None else str(t_half), f"in [{HALF_WINDOW[0]}, {HALF_WINDOW[1]}]",
             (t_half is not None and HALF_WINDOW[0] <= t_half <= HALF_WINDOW[1]) if known(start) else None),
        Gate("G4", "not length: per-response entropy, last 10 steps / steps 1-3",
             f"{fmt(p_end, 3)} / {fmt(p_start, 3)} = {fmt(p_end / p_start, 3) if known(p_end, p_start) and p_start else 'n/a'}",
             "<= 0.5", (p_end <= 0.5 * p_start) if known(p_end, p_start) else None),
        Gate("G5", "the mechanism's sign: corr(actor/cov_mean, actor/entropy_delta) over steps",
             f"r = {fmt(r, 3, sign=True)} [{fmt(lo, 3, sign=True)}, {fmt(hi, 3, sign=True)}], n = {n}",
             "interval below 0", (hi < 0) if known(r, hi) else None),
    ]


def gates_table(rows: list[dict]) -> list[str]:
    """The gates as markdown table lines, then G5 on first differences (information, not a gate)."""
    out = ["| gate | what | measured | rule | verdict |", "|---|---|---|---|---|"]
    for g in gates(rows):
        verdict = "n/a (not logged)" if g.passed is None else "passes" if g.passed else "**fails**"
        out.append(f"| {g.name} | {g.what} | {g.value} | {g.rule} | {verdict} |")
    r, lo, hi, n = cov_entropy_correlation(rows, differences=True)
    out += ["", f"Information, not a gate: the same correlation on step-to-step differences (a shared trend in time "
                f"removed): r = {fmt(r, 3, sign=True)} [{fmt(lo, 3, sign=True)}, {fmt(hi, 3, sign=True)}], n = {n}."]
    return out


# Post hoc (chosen after pilot 7, docs/study-grid/PLAN.md amendment 4's pilot, had run; not a gate): G5's
# correlation inside the entropy's fall and on the plateau after it, windows read off that pilot's curve.
PHASES = ((1, 30), (1, 40), (41, 100))


def phase_table(runs: dict[str, list[dict]]) -> list[str]:
    """Markdown lines: G5's correlation per window of PHASES for each run, as is and on first differences."""
    out = ["| run | " + " | ".join(f"steps {a}-{b}" for a, b in PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for name, rows in runs.items():
        cells = []
        for window in PHASES:
            r, lo, hi, n = cov_entropy_correlation(rows, steps=window)
            d, _, _, _ = cov_entropy_correlation(rows, differences=True, steps=window)
            cells.append(f"{fmt(r, 2, sign=True)} [{fmt(lo, 2, sign=True)}, {fmt(hi, 2, sign=True)}]; "
                         f"differences {fmt(d, 2, sign=True)}")
        out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return out


def all_pass(rows: list[dict]) -> bool:
    return all(g.passed for g in gates(rows))
