"""The report of the dose-response study (`covrl study --preset dose`): STUDY_DIR/report.md and its PNGs.

The endpoints, arms and verdict rules were written before the runs (docs/study-dose/PLAN.md; the arms in
study/arms.py). Per run: end entropy (mean `actor/entropy` over the last 10 % of steps), steps to half entropy (the
first step at or below half the first 10 % mean; censored at the last step), held-out accuracy (mean of the last 3
evaluations over the data sources), and the dose it received (tokens a step and share of the step's summed
covariance, as measured). Per arm: means over seeds with 95 % t-intervals; per contrast: the paired-by-seed
difference with its 95 % t-interval and the minimum detectable effect at the seeds used. The mechanism is claimed
for a method only where both pre-registered contrasts exclude 0; every verdict can come out "does not hold". Jin et
al.'s off-policy factor can hold only as "confounded" (more updates a batch are also more optimizer steps).

Two sections are readings after the fact, not rules of PLAN.md, and say so: the law against the clock (3.1), and
each arm against GRPO on the on-policy held-out entropy (4.1, the staleness study's endpoint; its trust-region
reading is also what the staleness report reads its rule 2 with). `render` is pure; `write_dose_report` writes the
plots and report.md; every figure prints through study.stats.fmt.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

from study.archive import read_run
from study.arms import ARMS, LADDERS, OFF_POLICY, RANDOM_CONTROLS, parse_run, study_lr
from study.lawfit import (EvalPoint, eval_lengths, judge_law, key_series, mean_eval_acc, merge_rows, row_value,
                          run_eval_points)
from study.stats import bounds, fmt, paired_difference, t_interval, t_quantile

HEAD_TAIL = 0.1  # end entropy: the last 10 % of steps; the half-entropy reference: the first 10 %
LAST_EVALS = 3  # held-out accuracy: mean of the last 3 evaluations
PILOT_CLIMB = 0.05  # lr* rule: accuracy (mean of the last 3 evals) above step 0's by at least this ...
PILOT_CLIPFRAC = 1e-3  # ... and mean actor/pg_clipfrac at least this
PLOTS = ["entropy_by_arm.png", "dose_response.png"]


@dataclass(frozen=True)
class Endpoints:
    end_entropy: float
    half_step: int  # first step at or below half the start entropy; the last step when censored
    censored: bool
    acc: float | None
    dose_tokens: float  # tokens the loss selected a step (mean over steps)
    dose_share: float | None  # share of the step's summed covariance they carried (mean over steps)
    clipfrac: float
    entropy_per_response: tuple[float, float] | None  # first 10 % -> last 10 %
    eval_entropy: float | None  # on-policy held-out entropy (mean over data sources), mean of the last 3 evaluations


def mean_or_none(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _head_tail(values: list[float]) -> tuple[float, float]:
    k = max(1, round(len(values) * HEAD_TAIL))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def endpoints(rows: list[dict], responses_per_step: int) -> Endpoints | None:
    """The pre-registered endpoints of one run; None when it has no training rows."""
    rows = merge_rows(rows)
    entropy = key_series(rows, "actor/entropy")
    if not entropy:
        return None
    start, end = _head_tail([h for _, h in entropy])
    below = [s for s, h in entropy if h <= start / 2]
    evals = [a for r in rows if (a := mean_eval_acc(r)) is not None]
    train = [r for r in rows if row_value(r, "actor/entropy") is not None]
    tokens = [row_value(r, "actor/cov_selected_frac") * row_value(r, "response_length/mean") * responses_per_step
              for r in train if row_value(r, "response_length/mean") is not None]
    per_response = [h for _, h in key_series(rows, "actor/entropy_per_response")]
    on_policy = [p.entropy for p in on_policy_points("", rows)]
    return Endpoints(
        end_entropy=end, half_step=below[0] if below else entropy[-1][0], censored=not below,
        acc=mean_or_none(evals[-LAST_EVALS:]) if len(evals) >= LAST_EVALS else None,
        dose_tokens=mean_or_none(tokens) or 0.0, dose_share=mean_or_none([v for _, v in key_series(rows, "actor/cov_selected_share")]),
        clipfrac=mean_or_none([v for _, v in key_series(rows, "actor/pg_clipfrac")]) or 0.0,
        entropy_per_response=_head_tail(per_response) if per_response else None,
        eval_entropy=mean_or_none(on_policy[-LAST_EVALS:]) if len(on_policy) >= LAST_EVALS else None)


# ---------------------------------------------------------------------------
# Runs by arm and seed
# ---------------------------------------------------------------------------

def seed_of(name: str, first_seed: int) -> tuple[str, int]:
    """(arm, seed) of a run name: `arm` is the first seed's run, `arm@s<seed>` another seed's."""
    arm, seed, _ = parse_run(name)
    return arm, first_seed if seed is None else seed


def by_arm(rows: dict[str, list[dict]], first_seed: int, responses_per_step: int) -> dict[str, dict[int, Endpoints]]:
    """{arm: {seed: endpoints}} of every complete run, from each run's metrics rows by name."""
    out: dict[str, dict[int, Endpoints]] = {}
    for name, run_rows in rows.items():
        arm, seed = seed_of(name, first_seed)
        ends = endpoints(run_rows, responses_per_step)
        if ends is not None:
            out.setdefault(arm, {})[seed] = ends
    return out


# ---------------------------------------------------------------------------
# Statistics and their text
# ---------------------------------------------------------------------------

def ci_text(values: list[float], digits: int = 4) -> str:
    if not values:
        return "n/a"
    mean, lo, hi = t_interval(values)
    return f"{fmt(mean, digits)} {bounds(lo, hi, digits)}"


@dataclass(frozen=True)
class Contrast:
    label: str
    n: int  # seeds present in both arms
    mean: float | None
    lo: float | None
    hi: float | None
    mde: float | None

    def excludes_zero(self, direction: int) -> bool:
        """The interval lies wholly above 0 (direction 1) or below it (-1)."""
        if self.lo is None or self.hi is None or math.isnan(self.lo):
            return False
        return self.lo > 0 if direction > 0 else self.hi < 0

    def corrected(self, comparisons: int) -> tuple[float, float] | None:
        """The paired interval at Bonferroni's level for `comparisons` (1 - 0.05 / comparisons): the same standard
        error, read back from the 95 % interval, times the stricter t with n - 1 degrees of freedom. None without
        an interval."""
        if self.mean is None or self.lo is None or self.hi is None or math.isnan(self.lo) or self.n < 2:
            return None
        se = (self.hi - self.lo) / 2.0 / t_quantile(0.975, self.n - 1)
        half = se * t_quantile(1.0 - 0.025 / comparisons, self.n - 1)
        return self.mean - half, self.mean + half

    def text(self, digits: int = 4) -> str:
        if self.mean is None:
            return f"{self.label}: n/a (no seed in both arms)"
        return (f"{self.label}: {fmt(self.mean, digits, sign=True)} {bounds(self.lo, self.hi, digits)} over "
                f"{self.n} seeds (minimum detectable effect {fmt(self.mde, digits)})")


def contrast(arms: dict[str, dict[int, Endpoints]], a: str, b: str, value, label: str) -> Contrast:
    """`value(a) - value(b)`, paired by seed over the seeds both arms ran."""
    seeds = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    pairs = [(value(arms[a][s]), value(arms[b][s])) for s in seeds]
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
    if not pairs:
        return Contrast(label, 0, None, None, None, None)
    mean, lo, hi, mde = paired_difference([x for x, _ in pairs], [y for _, y in pairs])
    return Contrast(label, len(pairs), mean, lo, hi, mde if len(pairs) > 1 else None)


def end_entropy(e: Endpoints) -> float:
    return e.end_entropy


def half_step(e: Endpoints) -> float:
    return float(e.half_step)


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def md_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def section_header(meta: dict, now: datetime.datetime, names: list[str]) -> str:
    wall = meta.get("wall_clock_s", {})
    rows = [[n, "n/a" if wall.get(n) is None else str(wall[n]), meta.get("status", {}).get(n, "n/a")] for n in names]
    shared = ", ".join(f"`{o}`" for o in meta.get("overrides", {}).get("preset", []))
    return "\n".join([
        "# Dose-response study of the entropy mechanism", "",
        "The plan, its endpoints and verdict rules were committed before the runs: [PLAN.md](PLAN.md).", "",
        f"- Report written {now:%Y-%m-%d %H:%M:%S}; study started {meta.get('start_time') or 'n/a'}, ended "
        f"{meta.get('end_time') or 'n/a'}",
        f"- Command: `{meta.get('command', 'n/a')}`",
        f"- Steps {meta.get('steps', 'n/a')}, seeds {meta.get('seeds', 'n/a')}; overrides shared by every run: {shared}",
        "", md_table(["run", "wall-clock (s)", "status"], rows)])


def pilot_rows(pilot_dirs: dict[str, str]) -> list[tuple[str, float | None, float | None, float, bool]]:
    """(lr, step-0 accuracy, accuracy at the end, mean pg_clipfrac, meets both lr* rules) per pilot."""
    out = []
    for lr, run_dir in pilot_dirs.items():
        rows = merge_rows(read_run(run_dir))
        evals = [a for r in rows if (a := mean_eval_acc(r)) is not None]
        clip = mean_or_none([v for _, v in key_series(rows, "actor/pg_clipfrac")]) or 0.0
        first, last = (evals[0], mean_or_none(evals[-LAST_EVALS:])) if len(evals) > LAST_EVALS else (None, None)
        climbs = first is not None and last - first >= PILOT_CLIMB
        out.append((lr, first, last, clip, climbs and clip >= PILOT_CLIPFRAC))
    return out


def section_pilots(pilot_dirs: dict[str, str]) -> str:
    rows = pilot_rows(pilot_dirs)
    table = md_table(["lr", "held-out acc step 0", "acc, last 3 evals", "mean pg_clipfrac", "meets both rules"],
                   [[lr, fmt(a), fmt(b), f"{c:.2e}", "yes" if ok else "no"] for lr, a, b, c, ok in rows])
    return "\n".join(["## 1. Pilots and lr*", "",
                      f"GRPO, seed 0, at each lr. Rule (PLAN.md): lr* is the largest lr whose accuracy climbs (last 3 "
                      f"evals at least {PILOT_CLIMB} above step 0) and whose mean `actor/pg_clipfrac` is at least "
                      f"{PILOT_CLIPFRAC:g}.", "", table])


def arm_row(arm: str, seeds: dict[int, Endpoints]) -> list[str]:
    ends = list(seeds.values())
    per_response = [e.entropy_per_response for e in ends if e.entropy_per_response]
    censored = sum(e.censored for e in ends)
    spec = ARMS.get(arm)
    return [arm, spec.label if spec else "n/a", spec.departure or "published" if spec else "n/a", str(len(ends)),
            fmt(mean_or_none([e.dose_tokens for e in ends]), 1), fmt(mean_or_none([e.dose_share for e in ends if e.dose_share is not None]), 3),
            ci_text([e.end_entropy for e in ends]),
            ci_text([float(e.half_step) for e in ends], 1) + (f" ({censored} censored)" if censored else ""),
            ci_text([e.acc for e in ends if e.acc is not None], 3),
            f"{mean_or_none([e.clipfrac for e in ends]):.1e}",
            f"{fmt(mean_or_none([p[0] for p in per_response]), 2)} → {fmt(mean_or_none([p[1] for p in per_response]), 2)}"
            if per_response else "n/a"]


def section_arms(arms: dict[str, dict[int, Endpoints]]) -> str:
    header = ["arm", "what", "published or departure", "seeds", "dose: tokens a step", "dose: share of covariance",
              "end entropy [95 % CI]", "steps to half entropy", "held-out acc, last 3 evals", "pg_clipfrac",
              "entropy per response, first → last 10 %"]
    return "\n".join(["## 2. Arms: endpoints over seeds", "",
                      "Means over seeds with 95 % t-intervals. The dose is what the run's loss actually selected "
                      "(`actor/cov_selected_frac` x tokens, `actor/cov_selected_share`), mean over steps. For the Clip-Cov "
                      "arms `pg_clipfrac` is the share of tokens Clip-Cov zeroed (its selection, as the paper logs "
                      "it), not a PPO clip rate; KL-Cov has no clip (0).", "",
                      md_table(header, [arm_row(a, arms[a]) for a in ARMS if a in arms])])


def _verdict(holds: bool, *contrasts: Contrast) -> str:
    """A verdict needs every contrast over at least 2 seeds (an interval); without, it is undetermined."""
    if any(c.n < 2 for c in contrasts):
        return "**undetermined** (an arm has fewer than 2 seeds in common with its control)"
    return "**holds**" if holds else "**does not hold at this scale**"


def claim_mechanism(arms: dict[str, dict[int, Endpoints]], method: str) -> str:
    """PLAN.md: end entropy rises from the lowest to the top dose under covariance selection, and the top dose
    beats random selection of the same count (both paired-difference intervals above 0)."""
    top, random_arm = RANDOM_CONTROLS[method]
    lowest = LADDERS[method][0]
    dose = contrast(arms, top, lowest, end_entropy, f"end entropy, {top} − {lowest}")
    chance = contrast(arms, top, random_arm, end_entropy, f"end entropy, {top} − {random_arm}")
    ladder = "; ".join(f"{a} ({ARMS[a].label}): {ci_text([e.end_entropy for e in arms[a].values()])}"
                       for a in LADDERS[method] if a in arms)
    holds = dose.excludes_zero(1) and chance.excludes_zero(1)
    return (f"{method}: the covariance choice raises entropy with dose and beats random tokens: "
            f"{_verdict(holds, dose, chance)}. "
            f"End entropy by dose, {ladder}. {dose.text()}; {chance.text()}.")


def claim_off_policy(arms: dict[str, dict[int, Endpoints]]) -> str:
    """PLAN.md (Jin et al.): 16 updates per batch end lower in entropy than 1 and halve it in fewer steps. The rule
    cannot hold cleanly: at a fixed lr, u updates a batch are also u times the optimizer steps, so what it finds is
    the factor and the step count together. Where it holds the verdict says "confounded: holds as run", and names
    the end entropies by updates per batch when they do not fall at every step of the ladder."""
    many, one = OFF_POLICY[16], OFF_POLICY[1]
    end = contrast(arms, many, one, end_entropy, f"end entropy, {many} − {one}")
    half = contrast(arms, many, one, half_step, f"steps to half entropy, {many} − {one}")
    by_k = "; ".join(f"{k} updates: end entropy {ci_text([e.end_entropy for e in arms[a].values()])}, steps to half "
                     f"{ci_text([float(e.half_step) for e in arms[a].values()], 1)}" for k, a in OFF_POLICY.items() if a in arms)
    verdict = _verdict(end.excludes_zero(-1) and half.excludes_zero(-1), end, half)
    if verdict == "**holds**":
        means = {k: mean_or_none([e.end_entropy for e in arms[a].values()]) for k, a in OFF_POLICY.items() if a in arms}
        ladder = list(means.values())
        monotone = all(a > b for a, b in zip(ladder, ladder[1:]))
        verdict = (f"**confounded: holds as run**, but {max(OFF_POLICY)} updates a batch are also {max(OFF_POLICY) // min(OFF_POLICY)}x "
                   f"the optimizer steps of {min(OFF_POLICY)} at the same lr, so the rule cannot tell more off-policy "
                   f"updates from more steps" + ("" if monotone else
                   "; and end entropy is not monotone in updates per batch (" +
                   ", ".join(f"{fmt(h)} at {k}" for k, h in means.items()) + ")"))
    return (f"Jin et al.: more off-policy updates per batch make entropy fall faster: {verdict}. {by_k}. "
            f"{end.text()}; {half.text(1)}.")


def section_verdicts(arms: dict[str, dict[int, Endpoints]]) -> str:
    lines = [claim_mechanism(arms, m) for m in LADDERS] + [claim_off_policy(arms)]
    return "\n".join(["## 3. Verdicts (rules of PLAN.md)", ""] + [f"- {line}" for line in lines])


def section_against_grpo(arms: dict[str, dict[int, Endpoints]]) -> str:
    """Every arm against GRPO, paired by seed: what each difference is, and the smallest one these seeds could see."""
    rows = []
    for arm in ARMS:
        if arm == "grpo" or arm not in arms:
            continue
        h = contrast(arms, arm, "grpo", end_entropy, "end entropy")
        a = contrast(arms, arm, "grpo", lambda e: e.acc, "accuracy")
        rows.append([arm, f"{fmt(h.mean)} {bounds(h.lo, h.hi)}", fmt(h.mde), f"{fmt(a.mean, 3)} {bounds(a.lo, a.hi, 3)}",
                     fmt(a.mde, 3), str(h.n)])
    return "\n".join(["## 4. Each arm against GRPO", "",
                      "Paired-by-seed differences (arm − GRPO) with 95 % t-intervals, and the minimum detectable effect "
                      "(two-sided 5 %, power 80 %) at the seeds used: a difference smaller than it can not be told from "
                      "seed noise here.", "",
                      md_table(["arm", "end entropy diff [95 % CI]", "MDE", "accuracy diff [95 % CI]", "MDE", "seeds"], rows)])


def on_policy_entropy(e: Endpoints) -> float | None:
    return e.eval_entropy


# KL-Cov at its published dose, its random-token control (the same count, no covariance choice) and PPO with clip 1
# and no selection (the Cov methods' trust region alone): the arms that tell covariance selection from the trust region.
TRUST_REGION_ARMS = ("kl_cov", "kl_cov_random", "ppo_clip1")


def trust_region_contrasts(arms: dict[str, dict[int, Endpoints]]) -> dict[str, Contrast]:
    """On the on-policy end entropy, paired by seed: each of TRUST_REGION_ARMS and each other rung of the updates
    ladder (GRPO's own clip) minus GRPO, and ("choice") KL-Cov minus its random-token control."""
    names = [*TRUST_REGION_ARMS, *(a for a in OFF_POLICY.values() if a != "grpo")]
    kl, rnd = RANDOM_CONTROLS["kl_cov"]
    return ({a: contrast(arms, a, "grpo", on_policy_entropy, f"{a} − grpo") for a in names}
            | {"choice": contrast(arms, kl, rnd, on_policy_entropy, f"{kl} − {rnd}")})


def trust_region_reading(cs: dict[str, Contrast]) -> str:
    """Whether the arms without a covariance choice move the on-policy end entropy above GRPO's as KL-Cov does, and
    whether arms with GRPO's own clip do too (then GRPO's runs sit low on this endpoint and the trust region is the
    reading the controls point to, not a cause they isolate)."""
    def num(a: str) -> str:
        return f"{fmt(cs[a].mean, sign=True)} {bounds(cs[a].lo, cs[a].hi)}"
    kl, rnd, ppo = TRUST_REGION_ARMS
    numbers = (f"KL-Cov's random-token control {num(rnd)}, PPO with clip 1 and no selection {num(ppo)}; KL-Cov at "
               f"its published dose {num(kl)}, KL-Cov minus its random control {num('choice')} (MDE {fmt(cs['choice'].mde)})")
    if not (cs[rnd].excludes_zero(1) and cs[ppo].excludes_zero(1)):
        return f"the arms with no covariance choice are not both shown above GRPO on this endpoint ({numbers})"
    same_clip = [a for a in OFF_POLICY.values() if a in cs and cs[a].excludes_zero(1)]
    spread = ("" if not same_clip else
              ". But GRPO with its own clip at other updates a batch ends above it too ("
              + ", ".join(f"{a} {num(a)}" for a in same_clip) + "): GRPO's runs sit low on this endpoint, so the trust "
              "region is what the controls point to, not a cause they isolate")
    return (f"the arms with no covariance choice end above GRPO on this endpoint, by about as much as KL-Cov ("
            f"{numbers}): an on-policy entropy above GRPO's here comes with the wider trust region (KL-Cov drops PPO's "
            f"clip; clip 1 widens it), not with the covariance choice{spread}")


def section_on_policy(arms: dict[str, dict[int, Endpoints]]) -> str:
    """Every arm against GRPO on the on-policy end entropy: the staleness study's primary endpoint, read here after
    the fact (PLAN.md's endpoint is `actor/entropy`)."""
    rows = []
    for arm in ARMS:
        if arm == "grpo" or arm not in arms:
            continue
        h = contrast(arms, arm, "grpo", on_policy_entropy, "on-policy end entropy")
        rows.append([arm, ci_text([v for e in arms[arm].values() if (v := e.eval_entropy) is not None]),
                     f"{fmt(h.mean, sign=True)} {bounds(h.lo, h.hi)}", fmt(h.mde), str(h.n)])
    grpo = ci_text([v for e in arms.get("grpo", {}).values() if (v := e.eval_entropy) is not None])
    return "\n".join([
        "## 4.1 Each arm against GRPO on the on-policy end entropy (post hoc: not in PLAN.md)", "",
        "Added 2026-12-07, after every result of this study and of the staleness study had been seen: the staleness "
        "study's primary endpoint (the held-out samples' own entropy, `eval/<ds>/entropy`, mean over the data sources "
        f"and over the last {LAST_EVALS} evaluations), on these runs, to read that study's lag-0 difference between "
        f"KL-Cov and GRPO. GRPO: {grpo}. Paired-by-seed differences (arm − GRPO) with 95 % t-intervals and the MDE, "
        f"uncorrected for the table's {len(rows)} comparisons.", "",
        md_table(["arm", "on-policy end entropy", "diff [95 % CI]", "MDE", "seeds"], rows), "",
        f"Reading: {trust_region_reading(trust_region_contrasts(arms))}."])


def study_arms(study_dir: str, names: list[str], meta: dict) -> tuple[dict[str, list[dict]], dict[str, dict[int, Endpoints]]]:
    """(each run's metrics rows by name, {arm: {seed: endpoints}}) of a dose study's runs, each read once."""
    rows = {n: read_run(os.path.join(study_dir, n)) for n in names}
    first_seed = (meta.get("seeds") or [0])[0]
    return rows, by_arm(rows, first_seed, responses_per_step=meta.get("responses_per_step", 128))


def reproduces_pilot(study_dir: str, first_run: str, pilot_dir: str | None) -> str | None:
    """Whether the study's GRPO run at the first seed repeats the lr* pilot (the same config) to the bit."""
    if pilot_dir is None:
        return None
    keys = ("actor/entropy", "critic/score/mean", "eval/chain_long/acc", "eval/chain_short/acc")
    mine, pilot = (merge_rows(read_run(d)) for d in (os.path.join(study_dir, first_run), pilot_dir))
    if not mine or not pilot:
        return None
    same = len(mine) == len(pilot) and all(a.get(k) == b.get(k) for a, b in zip(mine, pilot) for k in keys)
    return (f"grpo at the first seed {'repeats' if same else 'does NOT repeat'} the lr* pilot's entropy, reward and "
            f"held-out accuracy at every step, to the bit (the same config, run.deterministic)")


def implementation_checks(arms: dict[str, dict[int, Endpoints]], pilot_check: str | None = None) -> str:
    """Checks of the machinery, not claims: they cannot tell anything about the mechanism."""
    lines = [pilot_check] if pilot_check else []
    for method, (top, random_arm) in RANDOM_CONTROLS.items():
        if top in arms and random_arm in arms:
            a = mean_or_none([e.dose_tokens for e in arms[top].values()])
            b = mean_or_none([e.dose_tokens for e in arms[random_arm].values()])
            lines.append(f"{random_arm} selected {fmt(b, 1)} tokens a step against {fmt(a, 1)} for {top} (the control keeps "
                         f"the count; the runs' token counts differ as their responses do)")
    return "\n".join(["## 5. Implementation checks (not claims)", ""] + [f"- {line}" for line in lines])


def on_policy_points(name: str, rows: list[dict]) -> list[EvalPoint]:
    """A run's eval points with the on-policy held-out entropy (mean over data sources of eval/<ds>/entropy: the
    evaluated version's own samples) as H; rows without it are left out."""
    lengths = eval_lengths(rows)
    out = []
    for row in merge_rows(rows):
        hs = [v for k in row if k.startswith("eval/") and k.endswith("/entropy") and (v := row_value(row, k)) is not None]
        if hs and (acc := mean_eval_acc(row)) is not None:
            out.append(EvalPoint(name, row["step"], sum(hs) / len(hs), acc, lengths.get(row["step"])))
    return out


def law_line(label: str, points: dict[str, list[EvalPoint]]) -> str:
    """One judgement of the law (study.lawfit.judge_law) on these points, as a sentence with its verdict."""
    j = judge_law({n: p for n, p in points.items() if p})
    if j is None:
        return f"{label}: skipped (too few eval points)."
    models = ", ".join(f"{m} {r2:.3f}" for m, r2 in j.r2.items())
    lo, hi = j.entropy_range
    form = "" if j.exp_form_tested else (f" The exponential form is not tested: over H in [{lo:.3f}, {hi:.3f}] exp(H) "
                                         f"and 1 + H differ by at most {100 * j.exp_linear_gap:.2f} %.")
    verdict = "**holds**" if j.holds else "**does not hold at this scale**"
    return (f"{label}, over the {j.n} eval points of {j.runs} runs: R² of acc = a·f + b: {models}; shuffled pairing "
            f"{j.shuffled_r2:.3f}. Across runs at equal step: r(exp(H), accuracy) = {j.within_r:.3f}, permutation "
            f"p = {j.within_p:.2g} ({j.within_steps} steps). Holds only if exp(H) beats every time-only model and the "
            f"within-step r is negative with p < 0.05: {verdict}.{form}")


def section_law(on_policy: dict[str, list[EvalPoint]], batch: dict[str, list[EvalPoint]]) -> str:
    """The law R = -a exp(H) + b against the clock (study.lawfit.judge_law), with H measured two ways: the on-policy
    held-out entropy, computed on the very samples the accuracy is scored on, and the training batch's entropy of the
    same version, measured on other samples."""
    return "\n".join([
        "## 3.1 The law R = −a·exp(H) + b against the clock (post hoc: not in PLAN.md)", "",
        "PLAN.md names no analysis of the law: this section was added after the runs, so its verdicts are readings of "
        "data already seen, not tests fixed before it.", "",
        f"- {law_line('H = on-policy held-out entropy of the evaluated version (`eval/<ds>/entropy`)', on_policy)}",
        f"- {law_line('H = the training batch entropy of the same version (`actor/entropy`, as in the chain study)', batch)}",
        "", "How to read them: the doses did not move end entropy (section 3), so the spread of entropy across runs at "
        "equal step is run-to-run variation (seeds, and methods that differ in more than entropy: KL-Cov drops the PPO "
        "clip, Clip-Cov widens it to 1), not the intervention. The on-policy entropy is computed on the same samples "
        "that are scored, so part of its correlation with accuracy can be shared sampling (a less certain response "
        "is likelier wrong), not a law; the batch entropy of the same version, measured on other samples, is free of that. "
        "Neither says that raising entropy would lower accuracy."])


def render(arms: dict[str, dict[int, Endpoints]], meta: dict, now: datetime.datetime, names: list[str],
           pilot_dirs: dict[str, str], law_points: tuple[dict, dict] = ({}, {}), pilot_check: str | None = None) -> str:
    return "\n\n".join([
        section_header(meta, now, names), section_pilots(pilot_dirs), section_arms(arms), section_verdicts(arms),
        section_law(*law_points), section_against_grpo(arms), section_on_policy(arms),
        implementation_checks(arms, pilot_check),
        "## 6. Plots\n\n" + "\n\n".join(f"![{p.removesuffix('.png')}]({p})" for p in PLOTS)]) + "\n"


def mean_by_step(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """(step, mean over the series that have a value at that step), in step order."""
    by_step: dict[int, list[float]] = {}
    for points in series:
        for step, v in points:
            by_step.setdefault(step, []).append(v)
    return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]


def _mean_curve(runs: list[list[dict]]) -> list[tuple[int, float]]:
    """actor/entropy by step, mean over these runs' rows."""
    return mean_by_step([key_series(merge_rows(run_rows), "actor/entropy") for run_rows in runs])


def write_plots(study_dir: str, rows: dict[str, list[dict]], arms: dict[str, dict[int, Endpoints]], first_seed: int) -> None:
    from study.plots import plot_lines

    runs_of = {arm: [r for n, r in rows.items() if seed_of(n, first_seed)[0] == arm] for arm in arms}
    groups = {"Clip-Cov": ["grpo", "ppo_clip1", *LADDERS["clip_cov"], RANDOM_CONTROLS["clip_cov"][1]],
              "KL-Cov": ["grpo", *LADDERS["kl_cov"], RANDOM_CONTROLS["kl_cov"][1]],
              "updates per batch": list(OFF_POLICY.values())}
    panels = {g: {a: _mean_curve(runs_of[a]) for a in members if a in arms} for g, members in groups.items()}
    plot_lines(panels, os.path.join(study_dir, PLOTS[0]), xlabel="step", ylabel="actor/entropy (mean over seeds)",
               title="entropy vs step by arm")
    dose = {m: {"covariance": [(e.dose_share, e.end_entropy) for a in LADDERS[m] for e in arms.get(a, {}).values()
                               if e.dose_share is not None],
                "random": [(e.dose_share, e.end_entropy) for e in arms.get(RANDOM_CONTROLS[m][1], {}).values()
                           if e.dose_share is not None]} for m in LADDERS}
    plot_lines(dose, os.path.join(study_dir, PLOTS[1]), xlabel="share of the step's covariance selected",
               ylabel="end entropy", title="dose-response: end entropy per run")


def study_pilots(study_dir: str) -> dict[str, str]:
    """{lr: run dir} of the pilots under STUDY_DIR/pilots/lr<lr>/grpo, smallest lr first."""
    root = os.path.join(study_dir, "pilots")
    if not os.path.isdir(root):
        return {}
    found = {d.removeprefix("lr"): os.path.join(root, d, "grpo") for d in os.listdir(root) if d.startswith("lr")}
    return dict(sorted(found.items(), key=lambda kv: float(kv[0])))


def write_dose_report(study_dir: str, names: list[str], meta: dict, now: datetime.datetime | None = None) -> str:
    """Write STUDY_DIR/report.md and its PNGs; returns the report path."""
    first_seed = (meta.get("seeds") or [0])[0]
    rows, arms = study_arms(study_dir, names, meta)
    write_plots(study_dir, rows, arms, first_seed)
    path = os.path.join(study_dir, "report.md")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        points = ({n: on_policy_points(n, r) for n, r in rows.items()}, {n: run_eval_points(n, r) for n, r in rows.items()})
        pilots = study_pilots(study_dir)
        check = reproduces_pilot(study_dir, "grpo", pilots.get(study_lr(meta))) if "grpo" in names else None
        f.write(render(arms, meta, now or datetime.datetime.now(), names, pilots, points, check))
    os.replace(tmp, path)
    return path
