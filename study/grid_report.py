"""The report of the grid study (`covrl study --preset grid`): STUDY_DIR/report.md and its PNGs.

Everything it judges was fixed before the runs in docs/study-grid/PLAN.md: the premise gates of the pilots
(study/premise.py), the positive control's dose, the endpoints (entropy AUC: the mean `actor/entropy` over the
run's steps; end entropy; per-response entropy AUC; held-out avg@8 and pass@8, the mean of the last 2 evaluations)
and the verdict rules: the positive control first (95 %), then the two primary contrasts at Bonferroni's 97.5 %,
paired by seed, each able to come out "not shown" or the other way. `render` is pure; `write_grid_report` writes
the plots and report.md.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass

from study.archive import has_run, read_run
from study.arms import GRID_ARMS, GRID_POSITIVE, GRID_PRIMARY, parse_run
from study.lawfit import key_series, merge_rows, row_value
from study.premise import cov_entropy_correlation, gates, gates_table, phase_table
from study.dose_report import ci_text, md_table, mean_or_none
from study.stats import bounds, fmt, paired_difference

END_STEPS = 10  # end entropy: the mean of the last 10 steps
LAST_EVALS = 2  # held-out avg@8 and pass@8: the evaluations at steps 90 and 100
PRIMARY_LEVEL = 0.975  # Bonferroni over the plan's two primary contrasts
LEVEL = 0.95
SOURCE = "grid"
PLOTS = ["entropy_by_arm.png", "pass_by_arm.png", "entropy_per_response_by_arm.png"]


@dataclass(frozen=True)
class Endpoints:
    auc: float  # mean actor/entropy over the run's steps
    end: float  # mean actor/entropy of the last END_STEPS steps
    per_response_auc: float | None
    acc: float | None  # eval/grid/acc (avg@k), mean of the last LAST_EVALS evaluations
    pass_k: float | None  # eval/grid/pass@k, the same evaluations
    tokens: float  # tokens the loss selected a step
    share: float | None  # share of the step's summed covariance they carried
    corr: float  # corr over steps of actor/cov_mean with actor/entropy_delta (gate G5's figure)
    steps: int


def endpoints(rows: list[dict], responses_per_step: int) -> Endpoints | None:
    """The plan's endpoints of one run; None when it has no training rows."""
    rows = merge_rows(rows)
    entropy = [h for _, h in key_series(rows, "actor/entropy")]
    if not entropy:
        return None
    evals = [r for r in rows if row_value(r, f"eval/{SOURCE}/acc") is not None][-LAST_EVALS:]
    pass_keys = sorted({k for r in evals for k in r if k.startswith(f"eval/{SOURCE}/pass@")})
    train = [r for r in rows if row_value(r, "actor/entropy") is not None]
    tokens = [row_value(r, "actor/cov_selected_frac") * row_value(r, "response_length/mean") * responses_per_step
              for r in train if row_value(r, "response_length/mean") is not None
              and row_value(r, "actor/cov_selected_frac") is not None]
    per_response = [h for _, h in key_series(rows, "actor/entropy_per_response")]
    return Endpoints(
        auc=sum(entropy) / len(entropy), end=sum(entropy[-END_STEPS:]) / len(entropy[-END_STEPS:]),
        per_response_auc=mean_or_none(per_response),
        acc=mean_or_none([row_value(r, f"eval/{SOURCE}/acc") for r in evals]) if len(evals) == LAST_EVALS else None,
        pass_k=mean_or_none([v for r in evals if pass_keys and (v := row_value(r, pass_keys[-1])) is not None])
        if len(evals) == LAST_EVALS else None,
        tokens=mean_or_none(tokens) or 0.0, share=mean_or_none([v for _, v in key_series(rows, "actor/cov_selected_share")]),
        corr=cov_entropy_correlation(rows)[0], steps=len(entropy))


# ---------------------------------------------------------------------------
# Arms, contrasts, verdicts
# ---------------------------------------------------------------------------

Arms = dict[str, dict[int, Endpoints]]


def by_arm(rows: dict[str, list[dict]], first_seed: int, responses_per_step: int) -> Arms:
    out: Arms = {}
    for name, run_rows in rows.items():
        arm, seed, _ = parse_run(name)
        ends = endpoints(run_rows, responses_per_step)
        if ends is not None:
            out.setdefault(arm, {})[first_seed if seed is None else seed] = ends
    return out


@dataclass(frozen=True)
class Contrast:
    a: str
    b: str
    mean: float
    lo: float
    hi: float
    mde: float
    seeds: list[int]
    level: float

    @property
    def sign(self) -> int:
        """+1 when the interval lies above 0, -1 below, 0 when it includes 0 (or there are too few seeds)."""
        return 1 if self.lo > 0 else -1 if self.hi < 0 else 0

    def text(self, digits: int = 4) -> str:
        return (f"{fmt(self.mean, digits, sign=True)} {bounds(self.lo, self.hi, digits, sign=True)} "
                f"({round(100 * self.level, 1):g} %, MDE {fmt(self.mde, digits)}, seeds {','.join(map(str, self.seeds))})")


def contrast(arms: Arms, a: str, b: str, value, level: float = LEVEL) -> Contrast | None:
    """value(arm a) - value(arm b), paired by the seeds both have and both measured; None with fewer than 2."""
    seeds = sorted(s for s in set(arms.get(a, {})) & set(arms.get(b, {}))
                   if value(arms[a][s]) is not None and value(arms[b][s]) is not None)
    if len(seeds) < 2:
        return None
    mean, lo, hi, mde = paired_difference([value(arms[a][s]) for s in seeds], [value(arms[b][s]) for s in seeds], level)
    return Contrast(a, b, mean, lo, hi, mde, seeds, level)


def positive_control(arms: Arms) -> tuple[Contrast | None, bool]:
    """(PC, whether the endpoint moved): the entropy bonus's AUC above GRPO's at 95 %."""
    pc = contrast(arms, *GRID_POSITIVE, lambda e: e.auc)
    return pc, pc is not None and pc.sign > 0


def primary(arms: Arms) -> dict[str, Contrast | None]:
    return {name: contrast(arms, a, b, lambda e: e.auc, PRIMARY_LEVEL) for name, (a, b) in GRID_PRIMARY.items()}


def contrast_verdict(name: str, c: Contrast | None, moved: bool = True) -> str:
    """Rule 2's words for one primary contrast; every one is undetermined when rule 1's positive control failed."""
    words = {"P1": ("the covariance choice holds entropy", "random tokens hold more"),
             "P2": ("KL-Cov holds entropy above GRPO", "KL-Cov holds entropy below GRPO")}[name]
    if not moved:
        return "undetermined: the endpoint did not move under a direct entropy bonus (rule 1)"
    if c is None:
        return "undetermined: fewer than 2 seeds of both arms"
    return words[0] if c.sign > 0 else words[1] if c.sign < 0 else "not shown"


def mechanism_verdict(p1: Contrast | None, p2: Contrast | None, moved: bool) -> str:
    """The plan's rule 2, read only when the positive control moved the endpoint (rule 1)."""
    if not moved:
        return "undetermined: the endpoint did not move under a direct entropy bonus (rule 1)"
    if p1 is None or p2 is None:
        return "undetermined: a primary contrast has fewer than 2 seeds"
    if p1.sign > 0 and p2.sign > 0:
        return "supported here: KL-Cov holds entropy above GRPO and above its random-token control"
    if p2.sign > 0:
        return ("contradicted: KL-Cov holds entropy above GRPO but not above random tokens of the same count, so the "
                "effect is the penalty or the count, not the covariance choice")
    return "contradicted: KL-Cov does not hold entropy above GRPO here" + (
        " (its entropy is below GRPO's)" if p2.sign < 0 else " (not shown, see P2's MDE)")


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------

def ci(values: list[float], digits: int = 4) -> str:
    """The mean with its 95 % interval; one value alone, without an interval."""
    return fmt(values[0], digits) if len(values) == 1 else ci_text(values, digits)


def section_arms(arms: Arms) -> str:
    rows = []
    for arm in [a for a in GRID_ARMS if a in arms] + [a for a in arms if a not in GRID_ARMS]:
        seeds = arms[arm]
        pick = lambda f: [v for e in seeds.values() if (v := f(e)) is not None]  # noqa: E731
        rows.append([f"`{arm}`", GRID_ARMS[arm].label if arm in GRID_ARMS else "", str(len(seeds)),
                     ci(pick(lambda e: e.auc)), ci(pick(lambda e: e.end)), ci(pick(lambda e: e.per_response_auc), 3),
                     ci(pick(lambda e: e.acc), 3), ci(pick(lambda e: e.pass_k), 3),
                     fmt(mean_or_none(pick(lambda e: e.tokens)), 3), fmt(mean_or_none(pick(lambda e: e.share)), 3)])
    return "\n".join(["## 3. Every arm (means over seeds, 95 % t-intervals)", "",
                      md_table(["arm", "what", "seeds", "entropy AUC", "end entropy", "per-response entropy AUC",
                                "held-out avg@8", "pass@8", "tokens selected a step", "their share of the covariance"],
                               rows)])


def section_verdicts(arms: Arms) -> str:
    pc, moved = positive_control(arms)
    p = primary(arms)
    lines = ["## 4. Verdicts (docs/study-grid/PLAN.md)", "",
             f"- **Rule 1, the positive control** (PC = AUC(`{GRID_POSITIVE[0]}`) - AUC(`{GRID_POSITIVE[1]}`)): "
             + ("undetermined (fewer than 2 seeds)" if pc is None else
                f"{pc.text()}: " + ("the endpoint can move" if moved else "**the endpoint did not move**"))]
    for name, c in p.items():
        a, b = GRID_PRIMARY[name]
        lines.append(f"- **Rule 2, {name}** = AUC(`{a}`) - AUC(`{b}`): "
                     + (f"{c.text()}: **{contrast_verdict(name, c, moved)}**" if c else contrast_verdict(name, c, moved)))
    lines.append(f"- **Cui et al.'s mechanism on this task: {mechanism_verdict(p['P1'], p['P2'], moved)}.**")
    return "\n".join(lines)


def section_secondary(arms: Arms) -> str:
    """Rule 3 as the plan lists it (95 %, uncorrected): Clip-Cov - GRPO on the entropy AUC; every arm - GRPO on end
    entropy, per-response entropy AUC, held-out avg@8 and pass@8; KL-Cov - random on pass@8. The primary contrasts
    and the positive control are not repeated here at another level."""
    measures = {"end entropy": lambda e: e.end, "per-response entropy AUC": lambda e: e.per_response_auc,
                "held-out avg@8": lambda e: e.acc, "pass@8": lambda e: e.pass_k}
    cell = lambda c, digits: c.text(digits) if c else "n/a"  # noqa: E731
    rows = []
    if "clip_cov" in arms and "grpo" in arms:
        rows.append(["`clip_cov` - `grpo`", "entropy AUC", cell(contrast(arms, "clip_cov", "grpo", lambda e: e.auc), 4)])
    for a in [a for a in GRID_ARMS if a != "grpo" and a in arms and "grpo" in arms]:
        for m, f in measures.items():
            rows.append([f"`{a}` - `grpo`", m, cell(contrast(arms, a, "grpo", f), 4 if m == "end entropy" else 3)])
    if "kl_cov" in arms and "kl_cov_random" in arms:
        rows.append(["`kl_cov` - `kl_cov_random`", "pass@8", cell(contrast(arms, "kl_cov", "kl_cov_random",
                                                                          lambda e: e.pass_k), 3)])
    return "\n".join(["## 5. Secondary contrasts (rule 3: 95 %, paired by seed, uncorrected)", "",
                      md_table(["contrast", "endpoint", "difference"], rows)])


def section_premise_in_runs(arms: Arms) -> str:
    """Rule 4: G5's correlation in each run, by arm."""
    rows = []
    for arm, seeds in arms.items():
        rs = [e.corr for e in seeds.values() if math.isfinite(e.corr)]
        rows.append([f"`{arm}`", ", ".join(fmt(r, 3, sign=True) for r in rs), ci(rs, 3)])
    return "\n".join(["## 6. The premise in the study's own runs (rule 4, secondary)", "",
                      "Pearson r over steps of `actor/cov_mean` with `actor/entropy_delta`, per run and its mean over "
                      "seeds; the mechanism predicts it negative.", "",
                      md_table(["arm", "r per seed", "mean [95 % CI]"], rows)])


def implementation_checks(arms: Arms) -> str:
    """The plan's two checks, judged: the random control selects KL-Cov's count (within 10 %), and KL-Cov's tokens
    carry a larger share of the covariance than the random ones."""
    k, r = arms.get("kl_cov", {}), arms.get("kl_cov_random", {})
    lines = ["## 7. Implementation checks (they cannot fail as science)", ""]
    if k and r:
        kt, rt = mean_or_none([e.tokens for e in k.values()]), mean_or_none([e.tokens for e in r.values()])
        ks = mean_or_none([e.share for e in k.values() if e.share is not None])
        rs = mean_or_none([e.share for e in r.values() if e.share is not None])
        same = kt is not None and rt is not None and abs(kt - rt) <= 0.1 * max(kt, rt)
        larger = ks is not None and rs is not None and ks > rs
        lines += [f"- The same count: KL-Cov selected {fmt(kt, 3)} tokens a step, its random control {fmt(rt, 3)}: "
                  + ("holds" if same else "**does not hold**") + ".",
                  f"- KL-Cov's tokens carry more of the covariance: {fmt(ks, 3)} against {fmt(rs, 3)}: "
                  + ("holds" if larger else "**does not hold**") + "."]
    return "\n".join(lines)


def section_pilots(pilots: dict[str, list[dict]]) -> str:
    if not pilots:
        return "## 1. The premise gates (pilots)\n\nNo pilot found in `pilots/`."
    summary = []
    for name, rows in pilots.items():
        gs = gates(rows)
        h = [v for _, v in key_series(merge_rows(rows), "actor/entropy")]
        late = sum(h[50:100]) / 50 if len(h) >= 100 else None
        summary.append([f"`{name}`", *("passes" if g.passed else "n/a" if g.passed is None else "**fails**" for g in gs),
                        fmt(late, 3)])
    lines = ["## 1. The premise gates (pilots, docs/study-grid/PLAN.md)", "",
             "Every pilot is seed 0 of the study's setting, 100 steps; `v1` to `v4` name the base model (PLAN.md "
             "amendments 1-3; v4 and its pilots are graded with the ice of amendment 3, v1-v3 without), `g64` 64 "
             "groups a step (amendment 4; the others ran 16). The gates judge the GRPO pilots (`/grpo`); the "
             "entropy-bonus pilots (`/grpo_ent`) are "
             "shown for information. The last column is the mean `actor/entropy` of steps 51-100, which the positive "
             "control's dose is chosen on.", "",
             md_table(["pilot / run", "G1", "G2", "G3", "G4", "G5", "entropy, steps 51-100"], summary), ""]
    for name, rows in pilots.items():
        lines += [f"### `{name}`", "", *gates_table(rows), ""]
    lines += ["### G5 by phase (post hoc: windows chosen after pilot `v4g64-lr5e-5` had run, not a gate)", "",
              "Pearson r over steps of `actor/cov_mean` with `actor/entropy_delta` [95 % Fisher-z interval] inside a "
              "window of steps, and the same on step-to-step differences (a shared trend removed). On base model v4 "
              "the entropy falls in steps 1-30 and sits on a plateau after step 40.", "", *phase_table(pilots), ""]
    return "\n".join(lines)


def section_profile(study_dir: str) -> str:
    """Post hoc: where the entropy sits (study/grid_entropy.py), from the JSON files it wrote beside the report."""
    files = sorted(f for f in os.listdir(study_dir) if f.startswith("entropy_by_position") and f.endswith(".json"))
    if not files:
        return ""
    rows = []
    for f in files:
        with open(os.path.join(study_dir, f)) as fh:
            profiles = json.load(fh)
        for r in profiles:
            rows.append([f"{r['model']} ({r['samples_per_prompt']} a prompt)", fmt(r["entropy"], 3),
                         *(f"{100 * r[k]['share']:.1f} % / {fmt(r[k]['entropy'], 3)}" for k in ("tie", "forced", "off course")),
                         fmt(r["tie"]["p_wrong"], 3), fmt(r["tie"]["skew"], 3)])
    return "\n".join([
        "## 2b. Where the entropy sits (post hoc, not in the plan: `python -m study.grid_entropy`)", "",
        "Held-out walks sampled at temperature 1, each token by the state it was drawn in: a tie (two "
        "moves equally short), forced (one right move), off course (after a wrong move). Share of the tokens / mean "
        "entropy in nats; at ties, the probability on wrong moves and the evenness gap between the two right moves "
        "(|p1 - p2| / (p1 + p2): 0 even, 1 collapsed).", "",
        md_table(["model", "token entropy", "tie", "forced", "off course", "tie: p(wrong)", "tie: evenness gap"], rows)])


def section_header(meta: dict, names: list[str], done: list[str], now: datetime.datetime) -> str:
    missing = [n for n in names if n not in done]
    return "\n".join([
        "# The grid study: can the covariance choice hold entropy where the mechanism can show itself?", "",
        f"Rendered {now:%Y-%m-%d %H:%M} from {len(done)} complete study runs"
        + (f"; missing: {', '.join(missing)}" if missing else "")
        + (". Command: `" + meta["command"] + "`." if meta.get("command") else " and the pilots."),
        "The plan, its gates, endpoints and rules: [PLAN.md](PLAN.md) (committed before the runs).", ""])


def section_base(base: dict | None) -> str:
    if not base:
        return ""
    m = base.get("measured", {})
    return "\n".join(["## 2. The base model (assets/grid-base/warmstart.json)", "",
                      f"Flaw fraction {base.get('flaw_fraction')}, switch coupling {base.get('switch_coupling')}, "
                      f"{base.get('ice_cells', 0)} ice cells, {base.get('steps')} SFT steps. " + "; ".join(
                          f"{name}: " + ", ".join(f"{k} {v}" for k, v in r.items()) for name, r in m.items()), ""])


NOT_RUN = ("## 3. The study: not run", "",
           "No GRPO pilot passed every gate, so by the plan no study run started: the primary contrasts, the positive "
           "control and the secondary endpoints are not measured. The gates' figures above are the result.")
NOT_YET = ("## 3. The study: no run complete yet", "",
           "A GRPO pilot passed every gate; the study's runs are not complete yet.")


def render(arms: Arms, pilots: dict[str, list[dict]], meta: dict, names: list[str], done: list[str],
           now: datetime.datetime, base: dict | None = None, profile: str = "") -> str:
    head = [section_header(meta, names, done, now), section_pilots(pilots), section_base(base), profile]
    if not arms:
        from study.premise import all_pass

        passed = any(all_pass(rows) for name, rows in pilots.items() if name.endswith("/grpo"))
        return "\n\n".join(p for p in [*head, "\n".join(NOT_YET if passed else NOT_RUN), ""] if p)
    parts = [*head, section_arms(arms), section_verdicts(arms), section_secondary(arms), section_premise_in_runs(arms),
             implementation_checks(arms), "", "![entropy by arm](entropy_by_arm.png)", "![pass@8 by arm](pass_by_arm.png)",
             "![per-response entropy by arm](entropy_per_response_by_arm.png)", ""]
    return "\n\n".join(p for p in parts if p)


def _mean_curve(runs: list[list[dict]], key: str) -> list[tuple[float, float]]:
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for s, v in key_series(merge_rows(rows), key):
            by_step.setdefault(s, []).append(v)
    return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items()) if len(v) == len(runs)]


def write_plots(study_dir: str, rows: dict[str, list[dict]]) -> None:
    from study.plots import plot_lines

    by: dict[str, list[list[dict]]] = {}
    for name, r in rows.items():
        by.setdefault(parse_run(name)[0], []).append(r)
    for path, key, ylabel in ((PLOTS[0], "actor/entropy", "token entropy (nats)"),
                              (PLOTS[1], f"eval/{SOURCE}/pass@k", "held-out pass@8"),
                              (PLOTS[2], "actor/entropy_per_response", "entropy per response (nats)")):
        series = {arm: _mean_curve(runs, key) for arm, runs in by.items()}
        plot_lines({"": series}, os.path.join(study_dir, path), xlabel="step", ylabel=ylabel,
                   title=f"{ylabel}, mean over seeds")


def read_pilots(study_dir: str) -> dict[str, list[dict]]:
    """{"<pilot>/<run>": rows} of every pilot: each STUDY_DIR/pilots/<pilot> is a study directory of its own (runs in
    its runs.tar.xz or as directories, named in its study.json)."""
    root = os.path.join(study_dir, "pilots")
    out: dict[str, list[dict]] = {}
    for pilot in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        meta_path = os.path.join(root, pilot, "study.json")
        if not os.path.isfile(meta_path):
            continue
        with open(meta_path) as f:
            meta = json.load(f)
        for run in meta.get("runs") or meta.get("methods") or []:
            if has_run(os.path.join(root, pilot, run)):
                out[f"{pilot}/{run}"] = read_run(os.path.join(root, pilot, run))
    return out


def write_grid_report(study_dir: str, names: list[str], meta: dict, now: datetime.datetime | None = None) -> str:
    done = [n for n in names if has_run(os.path.join(study_dir, n))]
    rows = {n: read_run(os.path.join(study_dir, n)) for n in done}
    per_step = meta.get("responses_per_step", 128)
    arms = by_arm(rows, (meta.get("seeds") or [0])[0], per_step)
    base_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "grid-base",
                             "warmstart.json")
    base = None
    if os.path.isfile(base_path):
        with open(base_path) as f:
            base = json.load(f)
    if rows:
        write_plots(study_dir, rows)
    text = render(arms, read_pilots(study_dir), meta, names, done, now or datetime.datetime.now(), base,
                  section_profile(study_dir))
    path = os.path.join(study_dir, "report.md")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def main(argv: list[str] | None = None) -> int:
    """python -m study.grid_report STUDY_DIR: the report from its pilots and whatever study runs it holds."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m study.grid_report", description=main.__doc__)
    ap.add_argument("study_dir")
    args = ap.parse_args(argv)
    meta_path = os.path.join(args.study_dir, "study.json")
    meta = {}
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    print(write_grid_report(args.study_dir, meta.get("runs", []), meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
