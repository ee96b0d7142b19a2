"""The loss registry (learner/objective.py LOSSES) and the train step's named metric sums (learner/trainer.py).

Each registered loss owns its step-wide token choice; these tests work the choices out by hand on a step of two
micro-batches seen by one rank (`OneRank`), where the step's statistics differ from each micro-batch's own.
"""

import typing
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from common import config
from learner import losses
from learner.objective import LOSSES, Objective, covariance_profile, loss_name, make_loss
from learner.tokens import Choices, Seen, Surveyed, Tokens
from learner.trainer import SUM_KEYS, StepStats, accumulate, micro_sums, step_metrics, sum_vector
from tests.helpers.collectives import OneRank

G = lambda s=0: torch.Generator().manual_seed(s)  # noqa: E731


def _lc(loss, **learner):
    return config.LearnerConfig(loss=loss, **learner)


def _step():
    """Two micro-batches [1, 3]; the last token of each is padding with values that would dominate if counted.

    Over the step: mean log pi_prox = (-0.5 - 2.5 - 3 - 1.5) / 4 = -1.875, mean A = 0, so
    Cov = [[1.375 * 1, -0.625 * 1, 0], [-1.125 * -1, 0.375 * -1, 0]] = [[1.375, -0.625, 0], [1.125, -0.375, 0]].
    Inside either micro-batch alone all A are equal, so its own Cov is 0 everywhere.
    """
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    return [Surveyed(old=torch.tensor([[-0.5, -2.5, 9.0]]), entropy=torch.tensor([[0.1, 0.9, 5.0]]),
                     adv=torch.tensor([[1.0, 1.0, 50.0]]), mask=mask),
            Surveyed(old=torch.tensor([[-3.0, -1.5, 9.0]]), entropy=torch.tensor([[0.5, 0.7, 5.0]]),
                     adv=torch.tensor([[-1.0, -1.0, 50.0]]), mask=mask)]


def _chosen(loss_cfg, seed=0, **learner):
    entries = _step()
    out = make_loss(_lc(loss_cfg, **learner)).select_step(entries, OneRank(), G(seed))
    return [s.tolist() for s in out]


def test_registry_covers_every_configurable_loss():
    tags = {loss_name(cls()) for cls in typing.get_args(config.LossConfig)}
    assert set(LOSSES) == tags
    for cls in typing.get_args(config.LossConfig):
        assert isinstance(make_loss(_lc(cls())), LOSSES[loss_name(cls())])


def test_unknown_loss_names_the_registered_ones():
    class Mystery(config._Loss, tag="mystery"):
        pass

    with pytest.raises(ValueError, match=r"'mystery'; registered: cispo, clip_cov, gspo, kl_cov, ppo"):
        make_loss(_lc(Mystery()))


@pytest.mark.parametrize("scope", ["step", "micro_batch"])
def test_only_covariance_losses_over_the_step_choose_step_wide(scope):
    has = {name: make_loss(_lc(cls(), cov_scope=scope)).select_step is not None
           for name, cls in (("ppo", config.PPOLoss), ("clip_cov", config.ClipCovLoss), ("kl_cov", config.KLCovLoss),
                             ("gspo", config.GSPOLoss), ("cispo", config.CISPOLoss))}
    want = scope == "step"
    assert has == {"ppo": False, "clip_cov": want, "kl_cov": want, "gspo": False, "cispo": False}


def test_kl_cov_step_choice_hand_computed():
    # Eligible (Cov > 0): 1.375 and 1.125. k = max(1, int(f * 4 valid tokens)).
    none = [[False, False, False]]
    assert _chosen(config.KLCovLoss(kl_fraction=0.25)) == [[[True, False, False]], none]  # k = 1: 1.375
    assert _chosen(config.KLCovLoss(kl_fraction=0.5)) == [[[True, False, False]], [[True, False, False]]]  # k = 2
    assert _chosen(config.KLCovLoss(kl_fraction=1.0)) == [[[True, False, False]], [[True, False, False]]]  # k = 4 > 2
    # Per micro-batch (cov_scope = "micro_batch") the same tokens have Cov 0: nothing is chosen.
    for e in _step():
        _, m = losses.kl_cov_loss(e.old, e.old, e.adv, e.mask, kl_fraction=1.0, kl_coef=1.0)
        assert m["cov_selected"].sum() == 0


def test_clip_cov_step_choice_hand_computed():
    # Candidates: lb < Cov < ub. With lb 1.2 only 1.375 is one; k = 1.
    assert _chosen(config.ClipCovLoss(cov_fraction=0.25, cov_lb=1.2)) == [[[True, False, False]], [[False, False, False]]]
    # lb 1.0: candidates 1.375 and 1.125; k = 2 takes both.
    assert _chosen(config.ClipCovLoss(cov_fraction=0.5, cov_lb=1.0)) == [[[True, False, False]], [[True, False, False]]]
    # k = 1 of the 2: one of them, drawn from the step's generator (the same seed, the same choice).
    one = _chosen(config.ClipCovLoss(cov_fraction=0.25, cov_lb=1.0), seed=3)
    assert sum(row[0][0] for row in one) == 1 and not any(row[0][1] or row[0][2] for row in one)
    assert _chosen(config.ClipCovLoss(cov_fraction=0.25, cov_lb=1.0), seed=3) == one
    seen = {str(_chosen(config.ClipCovLoss(cov_fraction=0.25, cov_lb=1.0), seed=s)) for s in range(16)}
    assert len(seen) == 2  # both candidates get drawn


def _wide_step(seed=0):
    """One micro-batch of 40 token slots, the last 8 padding, with covariance of both signs."""
    g = G(seed)
    mask = torch.ones(1, 40)
    mask[0, -8:] = 0.0
    return [Surveyed(old=-torch.rand(1, 40, generator=g) * 3, entropy=torch.ones(1, 40),
                     adv=torch.randn(1, 40, generator=g), mask=mask)]


@pytest.mark.parametrize("loss_cfg", [config.KLCovLoss(kl_fraction=0.2, selection="random"),
                                      config.ClipCovLoss(cov_fraction=0.2, cov_lb=-10.0, cov_ub=10.0,
                                                         selection="random")])
def test_random_selection_draws_the_count_asked_among_valid_tokens_seeded(loss_cfg):
    """The control for the covariance choice: k = int(0.2 * 32 valid) = 6 tokens, never padding, the same for the
    same seed, and spread over tokens the covariance rule would never take (negative covariance)."""
    entries = _wide_step()
    loss = make_loss(_lc(loss_cfg))
    cov = losses.covariance_score(entries[0].old.double(), entries[0].adv.double(), entries[0].mask)
    picks = [loss.select_step(_wide_step(), OneRank(), G(s))[0] for s in range(12)]
    for chosen in picks:
        assert int(chosen.sum()) == 6
        assert not bool((chosen & (entries[0].mask == 0)).any())
    assert torch.equal(loss.select_step(_wide_step(), OneRank(), G(3))[0], picks[3])
    assert len({tuple(p.flatten().tolist()) for p in picks}) == 12
    assert any(bool((p & (cov < 0)).any()) for p in picks)


def test_random_selection_takes_as_many_as_the_covariance_rule_would():
    """Clip-Cov with 2 candidates in its band and k = 3: covariance selection can take only 2, so random takes 2."""
    cfg = dict(cov_fraction=0.75, cov_lb=1.0)
    by_cov = _chosen(config.ClipCovLoss(**cfg))
    by_chance = _chosen(config.ClipCovLoss(**cfg, selection="random"), seed=5)
    assert sum(map(sum, (r[0] for r in by_cov))) == 2 == sum(map(sum, (r[0] for r in by_chance)))
    assert not any(r[0][2] for r in by_chance)  # the padded slot


def test_random_selection_needs_the_step_scope():
    bad = config.load_config(None, ["learner.loss.type=kl_cov", "learner.loss.selection=random"])
    assert bad.learner.loss.selection == "random"
    with pytest.raises(config.ConfigError, match=r"selection = \"random\" draws its tokens over the whole step; set "
                                                 r"learner.cov_scope = \"step\""):
        config.load_config(None, ["learner.loss.type=kl_cov", "learner.loss.selection=random",
                                  "learner.cov_scope=micro_batch"])


def _lagged(lags, ref, **kw):
    """`_step`'s KL-Cov choice when its tokens have these lags ([1, 3] per micro-batch, the last slot padding)."""
    entries = [replace(e, lag=torch.tensor([row], dtype=torch.float64)) for e, row in zip(_step(), lags, strict=True)]
    loss = make_loss(_lc(config.KLCovLoss(kl_fraction=0.25, lag_ref_steps=ref, **kw)))
    return [s.tolist() for s in loss.select_step(entries, OneRank(), G(0))]


def test_the_staleness_aware_budget_counts_each_token_as_one_plus_its_lag_over_the_reference():
    # 4 valid tokens, Cov > 0 on two (1.375, 1.125); kl_fraction 0.25. The padded slots' lag 400 must not count.
    one, both = [[[True, False, False]], [[False, False, False]]], [[[True, False, False]], [[True, False, False]]]
    assert _lagged([[0, 0, 400], [0, 0, 400]], ref=4.0) == one  # budget 4: k = 1, as without it
    assert _lagged([[4, 4, 400], [4, 4, 400]], ref=4.0) == both  # each counts 1 + 4 / 4 = 2: budget 8, k = 2
    assert _lagged([[4, 0, 400], [0, 0, 400]], ref=4.0) == one  # budget 5: k = int(1.25) = 1
    assert _lagged([[4, 4, 400], [4, 0, 400]], ref=4.0) == one  # budget 7: k = int(1.75) = 1
    assert _lagged([[4, 4, 400], [4, 4, 400]], ref=0.0) == one  # off: lags are not read


def test_the_staleness_aware_budget_sets_the_random_controls_count_too():
    """32 valid tokens, kl_fraction 0.1: k = int(3.2) = 3 without lags; with half of them 16 versions old and a
    reference of 8, the budget is 16 + 16 x 3 = 64 tokens, k = int(6.4) = 6 (the control draws the same count)."""
    lag = torch.zeros(1, 40, dtype=torch.float64)
    lag[0, 16:] = 16.0  # the 8 padded slots among them
    for ref, want in ((0.0, 3), (8.0, 6)):
        loss = make_loss(_lc(config.ClipCovLoss(cov_fraction=0.1, cov_lb=-10.0, cov_ub=10.0, selection="random",
                                                lag_ref_steps=ref)))
        chosen = loss.select_step([replace(e, lag=lag) for e in _wide_step()], OneRank(), G(1))[0]
        assert int(chosen.sum()) == want


def test_the_staleness_aware_budget_needs_the_step_scope():
    with pytest.raises(config.ConfigError, match=r"lag_ref_steps=16.0 scales the step's token budget by its lags; set "
                                                 r"learner.cov_scope = \"step\""):
        config.load_config(None, ["learner.loss.type=kl_cov", "learner.loss.lag_ref_steps=16",
                                  "learner.cov_scope=micro_batch"])


def as_seen(entries: list[Surveyed], selected: list | None = None) -> list[Seen]:
    """The entries as the step's profiles read them after the loss: with the loss's choice `selected` (per entry,
    None for none) and nothing clipped or masked."""
    selected = selected or [None] * len(entries)
    return [Seen(start=e, choices=Choices(selected=s), clipped=torch.zeros_like(e.mask), masked=torch.zeros_like(e.mask))
            for e, s in zip(entries, selected, strict=True)]


def test_covariance_profile_hand_computed():
    """_step's Cov over the step: [[1.375, -0.625, pad], [1.125, -0.375, pad]], sum 1.5."""
    entries = _step()
    chosen = [None, torch.tensor([[True, False, True]])]  # the padded slot never counts
    out = covariance_profile(as_seen(entries, chosen), OneRank(), bounds=(1.0, 5.0))
    assert out["cov_sum"] == pytest.approx(1.5)
    assert out["cov_candidates"] == 2  # 1.375 and 1.125 lie in (1, 5)
    assert out["cov_candidates_share"] == pytest.approx(2.5 / 1.5)
    assert out["cov_selected_share"] == pytest.approx(1.125 / 1.5)
    assert out["cov_top1_share"] == pytest.approx(1.375 / 1.5)
    assert out["cov_top10_share"] == pytest.approx(1.0)  # fewer than 10 valid tokens: all of them
    assert covariance_profile(as_seen(_step()), OneRank(), bounds=(1.2, 5.0))["cov_candidates"] == 1


def test_covariance_profile_counts_tied_tokens_only_up_to_k():
    """Two identical responses give tied top scores: the top-1 share is one of them, not both."""
    mask = torch.ones(1, 4)
    tied = [Surveyed(old=torch.tensor([[-0.5, -0.5, -3.0, -2.0]]), entropy=torch.ones(1, 4),
                     adv=torch.tensor([[1.0, 1.0, -1.0, -1.0]]), mask=mask)]
    # means: logp -1.5, A 0 -> Cov [1, 1, 1.5, 0.5], sum 4; the top-1 is 1.5, the top-2 is 1.5 + one tied 1
    assert covariance_profile(as_seen(tied), OneRank(), bounds=(1.0, 5.0))["cov_top1_share"] == pytest.approx(1.5 / 4)
    tied = [replace(tied[0], old=torch.tensor([[-0.5, -0.5, -2.5, -2.5]]))]  # Cov [1, 1, 1, 1]: all tie
    assert covariance_profile(as_seen(tied), OneRank(), bounds=(0.0, 5.0))["cov_top1_share"] == pytest.approx(0.25)


def test_covariance_profile_leaves_shares_out_when_the_sum_is_not_positive():
    flat = [replace(e, adv=torch.zeros_like(e.adv)) for e in _step()]
    out = covariance_profile(as_seen(flat), OneRank(), bounds=(1.0, 5.0))
    assert out["cov_sum"] == 0 and "cov_top1_share" not in out and "cov_selected_share" not in out


def test_objective_select_fills_the_step_choices():
    # High entropy: top 50 % of 4 valid tokens = 2 (0.9 and 0.7); the padded 5.0 never counts.
    obj = Objective(_lc(config.KLCovLoss(kl_fraction=0.25), high_entropy_fraction=0.5), max_new_tokens=8)
    assert obj.selects_over_step
    choices = obj.select(_step(), OneRank(), G(0))
    assert [c.keep.tolist() for c in choices] == [[[0.0, 1.0, 0.0]], [[0.0, 1.0, 0.0]]]
    assert [c.selected.tolist() for c in choices] == [[[True, False, False]], [[False, False, False]]]
    assert all(c.m2po_keep is None for c in choices)
    # Nothing step-wide: no survey is needed for it, and select chooses nothing.
    plain = Objective(_lc(config.ClipCovLoss(), cov_scope="micro_batch"), max_new_tokens=8)
    assert not plain.selects_over_step
    assert plain.select(_step(), OneRank(), G(0)) == [Choices(), Choices()]


def _tokens(adv, selected=None, seed=0):
    g = G(seed)
    logp = (-torch.rand(1, 12, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(1, 12, generator=g)
    mask = torch.ones(1, 12)
    mask[0, -2:] = 0.0
    return Tokens(logp=logp, entropy=torch.ones(1, 12), old=old, behav=old, adv=adv * torch.ones(1, 12), mask=mask,
                  seq_ids=torch.tensor([[0] * 6 + [1] * 6]), num_seqs=2, choices=Choices(selected=selected))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_registered_loss_gives_zero_loss_and_gradient_at_zero_advantage(name):
    cfg = next(cls() for cls in typing.get_args(config.LossConfig) if loss_name(cls()) == name)
    loss = make_loss(_lc(cfg))
    selected = torch.zeros(1, 12, dtype=torch.bool) if loss.select_step is not None else None
    t = _tokens(0.0, selected)
    tok, metrics = loss(t, G(1))
    losses.aggregate(tok, t.mask, "token-mean", global_tokens=t.mask.sum()).backward()
    assert_close(tok, torch.zeros(1, 12))
    assert_close(t.logp.grad, torch.zeros(1, 12))
    assert {"pg_clipfrac", "ppo_kl"} <= set(metrics) <= set(SUM_KEYS)


def test_registry_binds_the_config_knobs():
    # PPO: dual_clip_c = 0 turns dual-clip off. A = -1, r = e^2 = 7.39 > c: without the cap the loss is 7.39.
    t = Tokens(logp=torch.tensor([[2.0]]), entropy=torch.zeros(1, 1), old=torch.zeros(1, 1), behav=torch.zeros(1, 1),
               adv=-torch.ones(1, 1), mask=torch.ones(1, 1), seq_ids=torch.zeros(1, 1, dtype=torch.long), num_seqs=1)
    assert_close(make_loss(_lc(config.PPOLoss(dual_clip_c=0.0)))(t, G())[0], torch.tensor([[torch.e ** 2]]))
    assert_close(make_loss(_lc(config.PPOLoss(dual_clip_c=3.0)))(t, G())[0], torch.tensor([[3.0]]))
    # KL-Cov with a step-wide choice: the penalty kl_coef * |logp - old| = 0.5 * 2 lands on the chosen token.
    t = replace(t, choices=Choices(selected=torch.ones(1, 1, dtype=torch.bool)))
    assert_close(make_loss(_lc(config.KLCovLoss(kl_coef=0.5)))(t, G())[0], torch.tensor([[torch.e ** 2 + 1.0]]))


def test_step_sums_are_gathered_by_name():
    t = _tokens(1.0)
    metrics = {"pg_loss": t.mask * 2.0, "pg_clipfrac": t.mask * 0.5, "ppo_kl": t.mask, "is_weight": t.mask,
               "is_weight_clipfrac": torch.zeros(1, 12)}
    totals = {}
    accumulate(totals, micro_sums(t, metrics, entropy_before=torch.full((1, 12), 0.25), seq_tokens=13, seqs=2))
    accumulate(totals, micro_sums(t, metrics, entropy_before=torch.full((1, 12), 0.25), seq_tokens=13, seqs=2))
    totals["ranks"] = 1.0
    stats = StepStats(sums=sum_vector(totals), grad_norm=1.0, train_s=2.0, entropy_delta_logged=False, skipped=[False],
                      profile={"cov_sum": 3.0, "cov_top1_share": 0.5})
    s = stats.totals()
    # 10 valid tokens per micro-batch, two micro-batches; names absent from every micro-batch sum to 0.
    assert (s["tokens"], s["entropy"], s["pg_loss"], s["pg_clipfrac"], s["seq_tokens"]) == (20.0, 5.0, 40.0, 10.0, 26.0)
    assert s["cov_selected"] == s["kl_ref"] == s["entropy_after"] == 0.0
    m = step_metrics(stats)
    assert (m["actor/entropy"], m["actor/pg_loss"], m["actor/pg_clipfrac"], m["perf/learner_tokens_per_s"]) == \
        (0.25, 2.0, 0.5, 13.0)
    assert m["actor/entropy_per_response"] == 5.0 / 4  # summed token entropy over 4 responses
    assert (m["actor/cov_sum"], m["actor/cov_top1_share"]) == (3.0, 0.5)
    with pytest.raises(KeyError, match="'surprise'.*SUM_KEYS"):
        sum_vector(totals | {"surprise": 1.0})
