"""The arms of the dose-response study (`covrl study --preset dose`, docs/study-dose/PLAN.md) and of the staleness
study (`--preset staleness`, docs/study-staleness/PLAN.md: STALENESS_ARMS at each forced lag).

Each arm is one set of config overrides on top of the preset (lr*, 8 updates per batch), run at every seed. An arm
at a published setting says so; every other dose is a departure, labelled with the share of the step's summed
covariance it was chosen to act on (measured on the lr* pilot, docs/study-dose/PLAN.md "Doses"). The study's
questions are fixed here too: which arms form each method's dose ladder, which random control sits at its top
dose, and which arms vary the updates per batch (Jin et al.'s off-policy factor).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arm:
    overrides: list[str]
    family: str  # the method: grpo, ppo_clip1, clip_cov, kl_cov
    label: str  # what the report prints: the dose (published / a share) or the factor varied
    departure: str = ""  # empty at published settings; else what departs from them


GRPO = ["learner.loss.type=ppo", "learner.loss.clip_low=0.2", "learner.loss.clip_high=0.2"]
CLIP_COV = ["learner.loss.type=clip_cov"]
KL_COV = ["learner.loss.type=kl_cov"]
RANDOM = ["learner.loss.selection=random"]

# Doses by share of the step's summed covariance, from the lr* pilot (docs/study-dose/PLAN.md "Doses").
CLIP_COV_D10 = "learner.loss.cov_fraction=0.0015"  # ~7.5 candidates a step at 1.33 % each (the calibration run)
CLIP_COV_D35 = "learner.loss.cov_fraction=0.0054"  # ~26 of the ~31 candidates a step (the calibration run)
KL_COV_D10 = "learner.loss.kl_fraction=0.0002"  # 1 token a step: the top token carries 11 % (the paper's 32B recipe)
KL_COV_D35 = "learner.loss.kl_fraction=0.0006"  # 3 tokens a step: ~35 % on the pilot's top-K curve

ARMS: dict[str, Arm] = {
    "grpo": Arm(GRPO, "grpo", "GRPO, clip 0.2 / 0.2, 8 updates per batch"),
    # The Cov methods' own trust region (clip ratios 1) without any covariance choice.
    "ppo_clip1": Arm(["learner.loss.type=ppo", "learner.loss.clip_low=1.0", "learner.loss.clip_high=1.0",
                      "learner.loss.dual_clip_c=0"], "ppo_clip1", "PPO, clip 1 / 1, no dual clip, no selection",
                     "control: the Clip-Cov trust region without its token choice"),
    "clip_cov": Arm(CLIP_COV, "clip_cov", "published dose (cov_fraction 2e-4)"),
    "clip_cov_d10": Arm([*CLIP_COV, CLIP_COV_D10], "clip_cov", "~10 % of the covariance (cov_fraction 1.5e-3)", "dose"),
    "clip_cov_d35": Arm([*CLIP_COV, CLIP_COV_D35], "clip_cov", "~35 % of the covariance (cov_fraction 5.4e-3)", "dose"),
    "clip_cov_d35_random": Arm([*CLIP_COV, CLIP_COV_D35, *RANDOM], "clip_cov", "top dose, random tokens",
                               "control: the top dose's count drawn uniformly"),
    "kl_cov_d10": Arm([*KL_COV, KL_COV_D10], "kl_cov", "~10 % of the covariance (kl_fraction 2e-4)",
                      "dose (the paper's 32B recipe, below its 7B one)"),
    "kl_cov_d35": Arm([*KL_COV, KL_COV_D35], "kl_cov", "~35 % of the covariance (kl_fraction 6e-4)", "dose"),
    "kl_cov": Arm(KL_COV, "kl_cov", "published 7B dose (kl_fraction 2e-3), ~63 % of the covariance"),
    "kl_cov_random": Arm([*KL_COV, *RANDOM], "kl_cov", "top (published) dose, random tokens",
                         "control: the top dose's count drawn uniformly"),
    "grpo_mb1": Arm([*GRPO, "learner.mini_batches=1"], "grpo", "1 update per batch", "off-policy factor"),
    "grpo_mb4": Arm([*GRPO, "learner.mini_batches=4"], "grpo", "4 updates per batch", "off-policy factor"),
    "grpo_mb16": Arm([*GRPO, "learner.mini_batches=16"], "grpo", "16 updates per batch", "off-policy factor"),
}

# Each Cov method's doses, smallest first, and its random control: (top dose, the same count drawn at random).
# KL-Cov's published dose already carries more than the shares asked for (~63 %), so it is its top dose.
LADDERS = {"clip_cov": ["clip_cov", "clip_cov_d10", "clip_cov_d35"], "kl_cov": ["kl_cov_d10", "kl_cov_d35", "kl_cov"]}
PUBLISHED = {"clip_cov": "clip_cov", "kl_cov": "kl_cov"}
RANDOM_CONTROLS = {"clip_cov": ("clip_cov_d35", "clip_cov_d35_random"), "kl_cov": ("kl_cov", "kl_cov_random")}
# Updates per batch -> arm (8 is the preset's, so GRPO itself).
OFF_POLICY = {1: "grpo_mb1", 4: "grpo_mb4", 8: "grpo", 16: "grpo_mb16"}


# The staleness study's methods (`covrl study --preset staleness`, docs/study-staleness/PLAN.md): every run trains
# with truncated IS (cap 2, the config's default); M2PO at the published 0.04, VCPO's square-root ESS step.
M2PO = ["learner.importance.m2po_threshold=0.04"]
STALENESS_ARMS: dict[str, Arm] = {
    "grpo_tis": Arm(GRPO, "grpo", "GRPO + TIS"),
    "kl_cov_tis": Arm(KL_COV, "kl_cov", "KL-Cov (published 7B dose) + TIS"),
    "kl_cov_m2po": Arm([*KL_COV, *M2PO], "kl_cov", "KL-Cov + TIS + M2PO 0.04"),
    "grpo_m2po": Arm([*GRPO, *M2PO], "grpo", "GRPO + TIS + M2PO 0.04"),
    "grpo_ess": Arm([*GRPO, "learner.ess_step_scaling=sqrt"], "grpo", "GRPO + TIS + ESS-scaled steps (sqrt)"),
    # covrl's staleness-aware budget (PLAN.md amendment 4): KL-Cov's count x (1 + lag / 16), so x 1.25 at lag 4,
    # x 2 at 16, x 5 at 64; at lag 0 the run is kl_cov_tis's, to the bit.
    "kl_cov_lag": Arm([*KL_COV, "learner.loss.lag_ref_steps=16"], "kl_cov", "KL-Cov + TIS, budget x (1 + lag / 16)",
                      "covrl extension: the staleness-aware budget"),
}
# The forced lags of the staleness study, and each lag's run length: at least 4 k steps, so 3/4 of it at full lag.
STALENESS_LAGS = (0, 4, 16, 64)


def staleness_steps(k: int, base: int) -> int:
    """Steps of a run at forced lag k in a study of `base` steps: max(base, 4 k)."""
    return max(base, 4 * k)


# Run names: the arm alone (the first seed's run), `arm@s<seed>` another seed's, `arm@k<k>` a staleness bound of k,
# and `arm@k<k>@s<seed>` the staleness preset's runs. Every study module reads names through these two.
def run_name(method: str, seed: int | None = None, k: int | None = None) -> str:
    """The run name of a method at a seed and staleness k (None: not varied)."""
    return method + (f"@k{k}" if k is not None else "") + (f"@s{seed}" if seed is not None else "")


def parse_run(name: str) -> tuple[str, int | None, int | None]:
    """(method, seed or None, staleness k or None) of a run name: grpo, grpo@s1, grpo@k4, grpo_tis@k16@s2."""
    method, *variants = name.split("@")
    seed = k = None
    for v in variants:
        if v.startswith("s"):
            seed = int(v[1:])
        elif v.startswith("k"):
            k = int(v[1:])
    return method, seed, k


def study_lr(meta: dict) -> str | None:
    """The learning rate a study's runs trained at, from its study.json: the last `learner.lr=` override, the
    preset's then the user's (`--set`), in the order a run applies them; None if neither sets it."""
    overrides = [*meta.get("overrides", {}).get("preset", []), *meta.get("overrides", {}).get("user", [])]
    lrs = [o.split("=", 1)[1] for o in overrides if o.startswith("learner.lr=")]
    return lrs[-1] if lrs else None


# The grid study's arms (`covrl study --preset grid`, docs/study-grid/PLAN.md): the dose study's GRPO, KL-Cov and
# its random control and Clip-Cov at their published doses, and the positive control: GRPO with an entropy bonus
# whose coefficient the pilots choose by the plan's rule (mean entropy over steps 51-100 about twice GRPO's). 0.01 is
# the rule's first pilot; no pilot passed the gates (docs/study-grid/report.md), so none was chosen yet. On base
# model v4 at 64 groups a step 0.01 and 0.03 gave 0.97x and 0.92x GRPO's entropy and 0.09 30x, unsteadily (the rule
# would take 0.01, which does not move the endpoint: the dose lies between 0.03 and 0.09).
GRID_ENTROPY_COEF = 0.01
GRID_ARMS: dict[str, Arm] = {
    "grpo": ARMS["grpo"],
    "kl_cov": Arm(KL_COV, "kl_cov", "KL-Cov, published 7B dose (kl_fraction 2e-3)"),
    "kl_cov_random": Arm([*KL_COV, *RANDOM], "kl_cov", "KL-Cov's count, random tokens",
                         "control: the same count drawn uniformly"),
    "clip_cov": Arm(CLIP_COV, "clip_cov", "Clip-Cov, published dose (cov_fraction 2e-4)"),
    "grpo_ent": Arm([*GRPO, f"learner.entropy_coef={GRID_ENTROPY_COEF}"], "grpo",
                    f"GRPO + entropy bonus {GRID_ENTROPY_COEF}", "positive control: a direct entropy bonus"),
}
# The plan's two primary contrasts (AUC of the training batch's entropy), paired by seed, and the positive control.
GRID_PRIMARY = {"P1": ("kl_cov", "kl_cov_random"), "P2": ("kl_cov", "grpo")}
GRID_POSITIVE = ("grpo_ent", "grpo")
