"""The loss library: hand-worked values and properties of every mode."""

import ast
import inspect
import math

import pytest
import torch
from torch.testing import assert_close

from learner import losses

G = lambda s=0: torch.Generator().manual_seed(s)  # noqa: E731


def _data(B=4, T=50, seed=0):
    g = G(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = (torch.rand(B, T, generator=g) > 0.1).float()
    return logp, old, adv, mask


MODES = {
    "ppo": lambda lp, o, a, m: losses.ppo_loss(lp, o, a, m, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0),
    "clip_cov": lambda lp, o, a, m: losses.clip_cov_loss(lp, o, a, m, clip_low=0.2, clip_high=0.28, cov_fraction=0.2,
                                                    cov_lb=-10.0, cov_ub=10.0, generator=G(1)),
    "kl_cov": lambda lp, o, a, m: losses.kl_cov_loss(lp, o, a, m, kl_fraction=0.2, kl_coef=1.0),
    "gspo": lambda lp, o, a, m: losses.gspo_loss(lp, o, a, m, clip_low=3e-4, clip_high=4e-4),
    "cispo": lambda lp, o, a, m: losses.cispo_loss(lp, o, a, m, clip_low=1.0, clip_high=0.28),
}


def test_every_registered_loss_has_its_library_cases():
    from learner.objective import LOSSES

    assert set(MODES) == set(LOSSES), "a loss in learner/objective.py LOSSES without a MODES entry here goes untested"


@pytest.mark.parametrize("mode", MODES)
def test_zero_advantages_give_zero_loss_and_gradient(mode):
    logp, old, adv, mask = _data()
    loss, _ = MODES[mode](logp, old, torch.zeros_like(adv), mask)
    losses.aggregate(loss, mask, "token-mean", global_tokens=mask.sum()).backward()
    assert_close(loss, torch.zeros_like(loss))
    assert_close(logp.grad, torch.zeros_like(logp))


def test_covariance_score_hand_computed():
    # logp = [-1, -2, -3, (masked 9)], A = [1, 0, -1, (5)]: means -2 and 0 -> Cov = [1*1, 0*0, -1*-1] = [1, 0, 1]
    logp = torch.tensor([-1.0, -2.0, -3.0, 9.0])
    adv = torch.tensor([1.0, 0.0, -1.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert_close(losses.covariance_score(logp, adv, mask), torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_clip_cov_zeroes_exactly_k_candidates():
    # 1000 valid tokens; covariance scores built so that exactly 300 lie in (1, 5).
    n = 1000
    adv = torch.zeros(n)
    logp = torch.zeros(n)
    # Pairs (x, -x) around zero keep both means at 0, so Cov_t = logp_t * A_t exactly.
    x = torch.cat([torch.full((150,), 2.0), torch.full((150,), 2.0), torch.full((350,), 0.1), torch.full((350,), 0.1)])
    sign = torch.cat([torch.ones(150), -torch.ones(150), torch.ones(350), -torch.ones(350)])
    logp, adv = x * sign, x * sign  # Cov = x^2: 4.0 for 300 tokens (inside), 0.01 for 700 (outside)
    mask = torch.ones(n)
    lp = logp.clone().requires_grad_()
    frac = 0.05  # k = int(0.05 * 1000) = 50
    loss, m = losses.clip_cov_loss(lp, logp, adv, mask, clip_low=1.0, clip_high=1.0, cov_fraction=frac, cov_lb=1.0,
                              cov_ub=5.0, generator=G(0))
    sel = m["cov_selected"].bool()
    assert int(sel.sum()) == 50
    assert (x[sel] == 2.0).all()  # only candidates inside (1, 5)
    losses.aggregate(loss, mask, "token-mean", global_tokens=mask.sum()).backward()
    assert (lp.grad[sel] == 0).all() and (lp.grad[~sel] != 0).all()
    # Same generator seed, same choice; another seed, another choice.
    _, m2 = losses.clip_cov_loss(lp, logp, adv, mask, clip_low=1.0, clip_high=1.0, cov_fraction=frac, cov_lb=1.0,
                            cov_ub=5.0, generator=G(0))
    _, m3 = losses.clip_cov_loss(lp, logp, adv, mask, clip_low=1.0, clip_high=1.0, cov_fraction=frac, cov_lb=1.0,
                            cov_ub=5.0, generator=G(1))
    assert torch.equal(m2["cov_selected"], m["cov_selected"]) and not torch.equal(m3["cov_selected"], m["cov_selected"])


def test_clip_cov_skips_ppo_clipped_tokens_and_takes_all_when_few():
    # Two candidates with Cov 4 inside (1, 5); one of them is already PPO-clipped (r = e, A = 2 > 0).
    logp = torch.tensor([2.0, -2.0, 0.0, 0.0])
    old = torch.tensor([1.0, -2.0, 0.0, 0.0])
    adv = torch.tensor([2.0, -2.0, 0.0, 0.0])
    mask = torch.ones(4)
    _, m = losses.clip_cov_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, cov_fraction=1.0, cov_lb=1.0,
                           cov_ub=5.0, generator=G(0))
    # Cov: means logp 0, A 0 -> [4, 4, 0, 0]; token 0 is clipped (r = e > 1.2, A > 0) -> only token 1.
    assert m["cov_selected"].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_kl_cov_hand_computed_and_reduces_to_pg():
    logp = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    old = torch.tensor([-1.5, -2.0, -2.0, -0.5])
    adv = torch.tensor([1.0, 0.0, -1.0, 0.0])
    mask = torch.ones(4)
    # Cov: mean logp = -1.625, mean A = 0 -> [0.625, 0, 1.375, 0]; k = max(1, int(0.25 * 4)) = 1 -> token 2.
    loss, m = losses.kl_cov_loss(logp, old, adv, mask, kl_fraction=0.25, kl_coef=1.0)
    r = (logp - old).exp()
    expected = -adv * r + torch.tensor([0.0, 0.0, 1.0, 0.0])  # |logp - old| = 1 on token 2
    assert_close(loss, expected)
    assert m["cov_selected"].tolist() == [0.0, 0.0, 1.0, 0.0]
    plain, _ = losses.kl_cov_loss(logp, old, adv, mask, kl_fraction=0.25, kl_coef=0.0)
    assert_close(plain, -adv * r)


def test_gspo_hand_computed():
    # One sequence of 2 tokens, log ratios 0.1 and -0.3: s = exp(-0.1) = 0.9048; A = 1, eps 0.2:
    # s inside [0.8, 1.2] -> loss per token = -s; gradient wrt logp_t = -s / (token count via agg).
    logp = torch.tensor([[0.1, -0.3]], requires_grad=True)
    old = torch.zeros(1, 2)
    loss, _ = losses.gspo_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    s = math.exp(-0.1)
    assert_close(loss, torch.tensor([[-s, -s]]))
    losses.aggregate(loss, torch.ones(1, 2), "seq-mean-token-mean", global_tokens=2.0, global_seqs=1.0).backward()
    assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2]]))


def test_cispo_hand_computed():
    # r = e^0.5 = 1.6487 clipped to 1.28; loss = -1.28 * A * logp, gradient -1.28 * A (the weight is detached).
    logp = torch.tensor([-0.5], requires_grad=True)
    loss, m = losses.cispo_loss(logp, torch.tensor([-1.0]), torch.tensor([2.0]), torch.ones(1), clip_low=1.0, clip_high=0.28)
    assert_close(loss, torch.tensor([-1.28 * 2.0 * -0.5]))
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([-1.28 * 2.0]))
    assert m["pg_clipfrac"].tolist() == [1.0]


def test_importance_none_with_equal_policies_is_on_policy_ppo():
    logp, old, adv, mask = _data()
    w, _ = losses.importance_weights(old, old, mask, kind="none")
    base, _ = losses.ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    assert_close(base * w, base)
    for kind in ("tis", "seq_tis", "mis", "geo_mask"):
        w, m = losses.importance_weights(old, old, mask, kind=kind, lo=0.999, hi=1.001)
        assert_close(w, mask)  # rho = 1 everywhere
        assert m["is_weight_clipfrac"].sum() == 0


def test_importance_variants_hand_computed():
    prox = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    behav = torch.tensor([[-1.0, 0.5], [0.2, 0.2]])  # log rho = [[1, -0.5], [-0.2, -0.2]]
    mask = torch.ones(2, 2)
    w, _ = losses.importance_weights(prox, behav, mask, kind="seq_tis", cap=2.0)
    # row 0: exp(0.5) = 1.6487 < 2; row 1: exp(-0.4) = 0.6703
    assert_close(w, torch.tensor([[math.exp(0.5)] * 2, [math.exp(-0.4)] * 2]))
    w, _ = losses.importance_weights(prox, behav, mask, kind="mis", lo=0.5, hi=2.0)
    # token rho: e = 2.718 (out), 0.6065, 0.8187, 0.8187 (in)
    assert_close(w, torch.tensor([[0.0, math.exp(-0.5)], [math.exp(-0.2)] * 2]))
    w, _ = losses.importance_weights(prox, behav, mask, kind="geo_mask", lo=0.9, hi=1.1)
    # geometric means: exp(0.25) = 1.28 (drop), exp(-0.2) = 0.8187 (drop)
    assert_close(w, torch.zeros(2, 2))
    # Packed rows: the same via seq_ids.
    w2, _ = losses.importance_weights(prox.reshape(1, 4), behav.reshape(1, 4), mask.reshape(1, 4), kind="seq_tis",
                                 seq_ids=torch.tensor([[0, 0, 1, 1]]), num_seqs=2)
    assert_close(w2.reshape(2, 2), torch.tensor([[math.exp(0.5)] * 2, [math.exp(-0.4)] * 2]))


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregation_invariant_to_split(mode):
    g = G(3)
    loss = torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    kw = dict(global_tokens=mask.sum(), global_seqs=6.0, norm_tokens=7.0)
    whole = losses.aggregate(loss, mask, mode, **kw)
    parts = sum(losses.aggregate(loss[i : i + 2], mask[i : i + 2], mode, **kw) for i in range(0, 6, 2))
    assert_close(parts, whole)
    if mode == "seq-mean-token-mean":
        assert_close(whole, ((loss * mask).sum(1) / mask.sum(1)).mean())


def test_modifiers():
    assert_close(losses.par_weights(torch.tensor([1.0, -1.0, 0.0]), 0.3), torch.tensor([0.3, 1.0, 1.0]))
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -1.0])
    assert_close(losses.kl_penalty(lp, ref, "k1"), torch.tensor([1.0, 0.0]))
    assert_close(losses.kl_penalty(lp, ref, "k2"), torch.tensor([0.5, 0.0]))
    assert_close(losses.kl_penalty(lp, ref, "k3"), torch.tensor([math.exp(-1) + 1 - 1, 0.0]))
    ent = torch.tensor([0.1, 0.9, 0.5, 0.7, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    # top 50% of 4 valid tokens = 2: entropies 0.9 and 0.7, so the 2nd largest valid one, 0.7, is the threshold
    # (the masked 5.0 never counts, even above it)
    assert losses.high_entropy_count(4, 0.5) == 2 and losses.high_entropy_count(4, 0.2) == 1 and losses.high_entropy_count(10, 0.01) == 1
    assert losses.high_entropy_keep(ent, mask, ent[3].double()).tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_no_host_sync_or_unseeded_rng_in_losses():
    tree = ast.parse(inspect.getsource(losses))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("item", "cpu", "numpy", "tolist"):
            bad.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("manual_seed", "seed"):
            bad.append(f"line {node.lineno}: global seeding")
    assert not bad, bad
    src = inspect.getsource(losses.clip_cov_keys)
    assert "generator=generator" in src  # the only randomness takes the caller's generator
    with pytest.raises(ValueError, match="seeded torch.Generator"):
        losses.clip_cov_keys(torch.ones(3, dtype=torch.bool), None)
