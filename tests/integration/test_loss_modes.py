"""Every loss mode, selected from TOML, trains 3 steps through the real pipeline.

Each case also turns on a different set of modifiers, so every importance weight, aggregation,
advantage estimator, prox mode and modifier runs end to end at least once.
"""

import os

import pytest

from common.metrics import read_metrics
from tests.helpers.runs import launch

pytestmark = pytest.mark.slow

COMMON = """
[run]
steps = 3
[data]
train_size = 256
[rollout]
group_size = 4
groups_per_step = 4
max_new_tokens = 24
[eval]
every_steps = 0
"""

CASES = {
    "ppo": """
[learner]
advantage = "drgrpo"
mini_batches = 2
[learner.loss]
type = "ppo"
[learner.importance]
type = "mis"
prox = "loglinear"
[learner.filter]
overlong_buffer_tokens = 8
""",
    "clip_cov": """
[learner]
cov_scope = "step"
[learner.loss]
type = "clip_cov"
cov_fraction = 0.05
cov_lb = 0.0
cov_ub = 5.0
[learner.importance]
type = "seq_tis"
""",
    "kl_cov": """
[learner]
mini_batches = 2
advantage = "rloo"
ess_step_scaling = "sqrt"
[learner.importance]
m2po_threshold = 1e-6
[learner.loss]
type = "kl_cov"
kl_fraction = 0.02
lag_ref_steps = 1
[learner.par]
schedule = "entropy_guided"
""",
    "gspo": """
[learner]
agg = "seq-mean-token-mean"
advantage = "reinforce_pp_baseline"
[learner.loss]
type = "gspo"
[learner.importance]
type = "geo_mask"
geo_lo = 0.9
geo_hi = 1.1
""",
    "cispo": """
[learner]
agg = "seq-mean-token-sum-norm"
entropy_coef = 0.001
high_entropy_fraction = 0.2
cov_scope = "micro_batch"
[learner.loss]
type = "cispo"
[learner.kl]
coef = 0.01
estimator = "k3"
[learner.par]
schedule = "constant"
lam = 0.5
""",
}


# Options of a case outside the sections COMMON already opens.
SETS = {"kl_cov": ["--set", "rollout.max_staleness_steps=2", "--set", "rollout.forced_lag=2"]}
OFFPOLICY = ("ess_token", "ess_seq", "m2", "kl_behav_prox", "m2po_masked", "ess_lr_scale",
             *(f"{cut}_q{q}" for cut in ("clipped", "masked") for q in range(1, 6)))


# The paper's two losses run end to end in `make test`; the other three, whose maths tests/unit/test_losses*.py
# check, in `make bench` (the `long` marker), for time.
LONG = ("ppo", "gspo", "cispo")


@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.long] if m in LONG else []) for m in CASES])
def test_loss_mode_runs_three_steps(mode, tmp_path):
    cfg = tmp_path / f"{mode}.toml"
    cfg.write_text(COMMON + CASES[mode])
    run = tmp_path / "run"
    launch(run, "--gens", "1", "--learners", "2", "--config", str(cfg), *SETS.get(mode, []))
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert open(os.path.join(run, "config.toml")).read().count(f'type = "{mode}"') == 1
    for r in rows:
        assert r["learner/ranks_participating"] == 2
        for key in ("actor/entropy", "actor/entropy_delta", "actor/cov_mean", "actor/pg_loss", "actor/grad_norm",
                    "actor/par_lambda", "filter/dropped_groups"):
            assert r.get(key) is not None, key
        assert all(r.get(f"offpolicy/{key}") is not None for key in OFFPOLICY)
        assert sum(v for k, v in r.items() if k.startswith("staleness/share_lag_")) == pytest.approx(1.0)
    if mode == "kl_cov":  # forced lag 2, M2PO, ESS-scaled steps, the lag budget; two ranks, two mini-batches
        assert [(r["staleness/min"], r["staleness/max"]) for r in rows] == [(0, 0), (1, 1), (2, 2)]
        assert rows[2]["staleness/share_lag_2-3"] == 1.0
        assert rows[0]["offpolicy/m2po_masked"] == 0 < rows[2]["offpolicy/m2po_masked"]
        assert sum(rows[2][f"offpolicy/masked_q{q}"] for q in range(1, 6)) > 0  # M2PO's drops, placed by entropy
        assert rows[2]["offpolicy/ess_lr_scale"] < 1.0 and rows[2]["offpolicy/ess_seq"] < 1.0
        for r in rows:  # the staleness-aware budget: every token counts 1 + lag / 1, so k = int(0.02 n (1 + lag))
            n = round(r["response_length/mean"] * 16)
            assert round(r["actor/cov_selected_frac"] * n) == int(0.02 * (n * (1 + r["staleness/min"])))
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        board = EventAccumulator(str(run / "tb"), size_guidance={"histograms": 0, "scalars": 0})
        board.Reload()
        assert len(board.Histograms("staleness/tokens")) == 3 and "offpolicy/ess_seq" in board.Tags()["scalars"]
    if mode in ("clip_cov", "kl_cov"):
        assert any(r["actor/cov_selected_frac"] > 0 for r in rows), "the covariance selection never touched a token"
    if mode == "cispo":
        assert all(r["actor/par_lambda"] == 0.5 for r in rows) and any(r["actor/kl_ref"] != 0 for r in rows)
