import torch
from torch.testing import assert_close

from learner import losses


def test_ppo_loss_hand_computed():
    # r = exp(logp - old) = [e^0.1, e^-0.5, 1.0, e^1.0]; A = [1, 1, -1, -1]; eps 0.2 / 0.28; dual c = 3
    logp = torch.tensor([0.1, -0.5, 0.0, 1.0])
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4)
    loss, m = losses.ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    r = logp.exp()
    # token 0: r=1.105 inside [0.8, 1.28] -> -1.105
    # token 1: r=0.607, A>0: max(-0.607, -0.8) = -0.607 (not clipped: pessimistic side)
    # token 2: r=1, A<0 -> 1.0
    # token 3: r=2.718, A<0: max(2.718, 1.28) = 2.718, dual-clip min(2.718, 3) = 2.718
    expected = torch.tensor([-r[0], -r[1], 1.0, r[3]])
    assert_close(loss, expected)
    assert_close(m["pg_clipfrac"], torch.zeros(4))
    # A ratio far above 1+eps with A > 0 is clipped: loss = -1.28
    loss2, m2 = losses.ppo_loss(torch.tensor([1.0]), torch.zeros(1), torch.ones(1), torch.ones(1),
                                clip_low=0.2, clip_high=0.28, dual_clip_c=None)
    assert_close(loss2, torch.tensor([-1.28]))
    assert_close(m2["pg_clipfrac"], torch.ones(1))
    # Dual clip: A = -1, r = e^2 = 7.39 > c = 3 -> loss capped at 3
    loss3, _ = losses.ppo_loss(torch.tensor([2.0]), torch.zeros(1), -torch.ones(1), torch.ones(1),
                               clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    assert_close(loss3, torch.tensor([3.0]))


def test_ppo_zero_advantage_zero_loss_and_grad():
    logp = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    loss, _ = losses.ppo_loss(logp, logp.detach() + 0.3, torch.zeros(3, 5), torch.ones(3, 5),
                              clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    losses.token_mean(loss, torch.ones(3, 5), 15.0).backward()
    assert_close(loss, torch.zeros(3, 5))
    assert_close(logp.grad, torch.zeros(3, 5))


def test_on_policy_gradient_is_reinforce():
    # With old = logp.detach() the ratio is 1 and d(-A r)/dlogp = -A: plain policy gradient.
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    loss, _ = losses.ppo_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    losses.token_mean(loss, mask, 2.0).backward()
    assert_close(logp.grad, torch.tensor([-0.25, 0.5, 0.0]))


def test_importance_weights():
    prox = torch.tensor([0.0, 0.0, 0.0])
    behav = torch.tensor([0.0, -1.0, 1.0])  # rho = 1, e, 1/e
    mask = torch.ones(3)
    w, m = losses.importance_weights(prox, behav, mask, kind="tis", cap=2.0)
    assert_close(w, torch.tensor([1.0, 2.0, torch.e ** -1]))
    assert_close(m["is_weight_clipfrac"], torch.tensor([0.0, 1.0, 0.0]))
    w0, _ = losses.importance_weights(prox, behav, mask, kind="none", cap=2.0)
    assert_close(w0, torch.ones(3))


def test_token_mean_invariant_to_split():
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(10, generator=g)
    mask = (torch.rand(10, generator=g) > 0.3).float()
    total = mask.sum()
    whole = losses.token_mean(loss, mask, total)
    parts = sum(losses.token_mean(loss[i : i + 3], mask[i : i + 3], total) for i in range(0, 10, 3))
    assert_close(parts, whole)
    assert_close(whole, (loss * mask).sum() / mask.sum())


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert_close(losses.entropy_from_logits(logits), torch.tensor([torch.log(torch.tensor(4.0)).item(), 0.0]))
