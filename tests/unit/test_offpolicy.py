"""Off-policy corrections and diagnostics (learner/offpolicy.py, learner/losses.py m2po_*): M2PO's mask worked out
by hand, its independence from how a step is split over ranks and micro-batches (two real gloo ranks), the effective
sample size, and VCPO's ESS-scaled step on a one-parameter problem."""

import math
import multiprocessing
import os

import pytest
import torch
from torch.testing import assert_close

from learner import losses, offpolicy
from learner.tokens import Choices, Seen, Surveyed, Tokens
from tests.helpers.collectives import OneRank


def _mask_of(m2: list[float], threshold: float, mask: list[float] | None = None) -> list[float]:
    """m2po_mask on one row whose squared log ratios are `m2` (pi_behav = 1, log pi_prox = -sqrt(m))."""
    m = torch.tensor([m2], dtype=torch.float64)
    valid = torch.tensor([mask]) if mask is not None else torch.ones_like(m)
    return losses.m2po_mask(-m.sqrt(), torch.zeros_like(m), valid, threshold)[0].tolist()


def test_m2po_drops_the_largest_until_the_mean_of_the_rest_is_below_the_threshold():
    # mean 0.14 >= 0.04; without 0.5 the mean is 0.02 < 0.04: only 0.5 goes.
    assert _mask_of([0.01, 0.5, 0.02, 0.03], 0.04) == [1, 0, 1, 1]
    # 0.5 then 0.3 go (means 1/3, then 0.2 >= 0.04); the smallest value always stays.
    assert _mask_of([0.5, 0.3, 0.2], 0.04) == [0, 0, 1]
    # Padding (mask 0) neither counts in the mean nor is kept.
    assert _mask_of([0.5, 0.3, 0.2, 9.0], 0.04, mask=[1, 1, 1, 0]) == [0, 0, 1, 0]


def test_m2po_ties_all_equal_threshold_above_every_value_and_one_token():
    # Ties go together: dropping one 0.09 would do (mean 0.0367), but which one is arbitrary, so both go.
    assert _mask_of([0.09, 0.01, 0.09, 0.01], 0.04) == [0, 1, 0, 1]
    # All equal: no subset has a lower mean, and the tokens of the smallest value stay: all of them.
    assert _mask_of([0.1, 0.1, 0.1], 0.04) == [1, 1, 1]
    assert _mask_of([0.01, 0.03, 0.02], 1.0) == [1, 1, 1]  # threshold above every value: nothing dropped
    assert _mask_of([0.01, 0.03, 0.02], 0.02) == [1, 0, 1]  # mean exactly 0.02 is not below 0.02: 0.03 goes
    assert _mask_of([0.7], 0.04) == [1]  # one token is kept whatever its value


def test_m2po_cut_asks_for_more_values_until_it_can_decide():
    values = torch.tensor([0.9, 0.8, 0.8, 0.01, 0.01, 0.01], dtype=torch.float64)
    total, count = float(values.sum()), float(values.numel())
    assert torch.isnan(losses.m2po_cut(values[:2], total, count, 0.04, complete=False))  # 0.8's level may go on
    assert float(losses.m2po_cut(values[:4], total, count, 0.04, complete=False)) == pytest.approx(0.8)
    assert float(losses.m2po_cut(values, total, count, 10.0, complete=True)) == math.inf
    padded = torch.cat([values, torch.full((4,), float("-inf"), dtype=torch.float64)])  # fewer values than asked for
    assert float(losses.m2po_cut(padded, total, count, 0.001, complete=True)) == pytest.approx(0.8)


def _row(logp: list[float], behav: list[float], entropy: list[float], seq: list[int], mask: list[float] | None = None):
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    m = t(mask if mask is not None else [1.0] * len(logp))
    return Surveyed(old=t(logp), entropy=t(entropy), adv=torch.zeros_like(m), mask=m, behav=t(behav),
                    seq_ids=t(seq, torch.long), num_seqs=max(seq) + 1)


def _seen(e: Surveyed, clipped: torch.Tensor | None = None, masked: torch.Tensor | None = None) -> Seen:
    """`e` after a loss that chose nothing and cut `clipped` / `masked` (nothing by default)."""
    zero = torch.zeros_like(e.mask)
    return Seen(start=e, choices=Choices(), clipped=zero if clipped is None else clipped,
                masked=zero if masked is None else masked)


# A step of 4 micro-batches: log pi_prox, log pi_behav, entropy, response of each token. Dyadic values, so the
# squared log ratios are exact: m = 0, 1, 1/64 | 1/4, 0, 0 | 9/16, 1/64, 0 | 1/64, 0, 1/4.
STEP = [
    ([-0.25, -2.0, -0.5], [-0.25, -1.0, -0.625], [0.2, 1.5, 0.4], [0, 0, 1]),
    ([-0.25, -0.25, -1.25], [-0.75, -0.25, -1.25], [0.9, 0.1, 1.1], [0, 1, 1]),
    ([-1.0, -0.375, -0.375], [-0.25, -0.5, -0.375], [1.3, 0.6, 0.3], [0, 0, 0]),
    ([-0.75, -0.0625, -2.5], [-0.625, -0.0625, -2.0], [0.7, 0.05, 2.0], [0, 1, 2]),
]


def _profile(entries, comm):
    keep = offpolicy.select_m2po(entries, comm, threshold=0.05, first=1)  # first=1: several gather rounds
    # stand-ins for a loss's clip flags, by entropy
    seen = [Seen(start=e, choices=Choices(m2po_keep=k), clipped=(e.entropy > 1.0).float(), masked=(1.0 - k) * e.mask)
            for e, k in zip(entries, keep)]
    return [k[0].tolist() for k in keep], offpolicy.offpolicy_profile(seen, comm)


def _rank_main(rank: int, port: int, out):
    import torch.distributed as dist

    from learner.trainer import DataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mine = [_row(*STEP[i]) for i in ((0, 1) if rank == 0 else (2, 3))]  # 2 ranks x 2 micro-batches
    out.put((rank, _profile(mine, DataParallel())))
    dist.destroy_process_group()


def test_m2po_and_the_profile_do_not_depend_on_how_the_step_is_split():
    """The same step on one rank in one micro-batch's worth of entries, and on two real gloo ranks with two
    micro-batches each: the same tokens are kept and every diagnostic agrees."""
    whole_keep, whole = _profile([_row(*s) for s in STEP], OneRank())
    # Sum 2.109375 over 12 tokens: mean 0.176 >= 0.05. Without 1: 0.101; without 9/16 too: 0.0547; then the two
    # tokens at 1/4 (one on each rank) go together: 0.0059 < 0.05. (One of them alone would have done: 0.033.)
    assert whole_keep == [[1, 0, 1], [0, 1, 1], [0, 1, 1], [1, 1, 0]]
    from common.transport import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got[0][0] + got[1][0] == whole_keep
    for rank in (0, 1):
        assert got[rank][1].keys() == whole.keys()
        for key, value in whole.items():
            assert got[rank][1][key] == pytest.approx(value, rel=1e-9), key


def test_effective_sample_size_of_equal_and_of_one_dominant_weight():
    n = 100
    equal = _row([-0.5] * n, [-0.5] * n, [1.0] * n, list(range(n)))
    prof = offpolicy.offpolicy_profile([_seen(equal)], OneRank())
    assert prof["ess_token"] == pytest.approx(1.0) and prof["ess_seq"] == pytest.approx(1.0)
    assert prof["m2"] == 0 and prof["kl_behav_prox"] == 0
    dominant = _row([9.5] + [-0.5] * (n - 1), [-0.5] * n, [1.0] * n, list(range(n)))  # one rho = e^10, the rest 1
    prof = offpolicy.offpolicy_profile([_seen(dominant)], OneRank())
    e10 = math.exp(10.0)
    assert prof["ess_token"] == pytest.approx((e10 + n - 1) ** 2 / (n * (e10 ** 2 + n - 1)))
    assert 1 / n < prof["ess_token"] < 1.02 / n
    assert prof["m2"] == pytest.approx(100 / n)
    assert prof["kl_behav_prox"] == pytest.approx((e10 - 1 - 10) / n)  # k3: rho - 1 - log rho, behav's samples
    # One response of all n tokens: a single weight, ESS 1 whatever it is.
    one_seq = _row([9.5] + [-0.5] * (n - 1), [-0.5] * n, [1.0] * n, [0] * n)
    assert offpolicy.offpolicy_profile([_seen(one_seq)], OneRank())["ess_seq"] == pytest.approx(1.0)


def test_entropy_quintiles_locate_the_cuts():
    ent = [0.1 * (i + 1) for i in range(10)]  # quintiles: two tokens each, q5 = the two largest
    e = _row([-0.5] * 10, [-0.5] * 10, ent, list(range(10)))
    clipped = torch.tensor([[0.0] * 8 + [1.0, 0.0]])  # one of q5's two tokens clipped
    masked = torch.tensor([[1.0, 1.0] + [0.0] * 8])  # both of q1's masked
    q = offpolicy.quintile_cuts([_seen(e, clipped, masked)], OneRank())
    assert [q[f"clipped_q{i}"] for i in range(1, 6)] == [0, 0, 0, 0, 0.5]
    assert [q[f"masked_q{i}"] for i in range(1, 6)] == [1, 0, 0, 0, 0]


def test_entropy_quintiles_are_fifths_of_the_tokens_even_when_most_entropies_are_near_zero():
    """Half the tokens under 1e-3 nats and the other half spread to 2 nats: each quintile still holds a fifth of them
    (a histogram up to the largest entropy would put the whole near-zero half in its first bin, q1 = the bottom
    half), and a quintile left empty by ties reads NaN, not 0."""
    ent = [1e-4 * (i + 1) for i in range(50)] + [0.04 * (i + 1) for i in range(50)]
    e = _row([-0.5] * 100, [-0.5] * 100, ent, list(range(100)))
    edges = offpolicy.quintile_edges(torch.tensor(ent, dtype=torch.float64), OneRank())
    assert edges.tolist() == pytest.approx([ent[19], ent[39], ent[59], ent[79]])
    q = offpolicy.quintile_cuts([_seen(e, torch.ones(1, 100), torch.zeros(1, 100))], OneRank())
    assert [q[f"clipped_q{i}"] for i in range(1, 6)] == [1, 1, 1, 1, 1]
    tied = _row([-0.5] * 10, [-0.5] * 10, [0.3] * 10, list(range(10)))  # all tied: one quintile holds them all
    q = offpolicy.quintile_cuts([_seen(tied)], OneRank())
    assert q["clipped_q1"] == 0 and all(math.isnan(q[f"clipped_q{i}"]) for i in range(2, 6))


@pytest.mark.parametrize("rule, ratio, factor", [("off", 0.25, 1.0), ("linear", 0.25, 0.25), ("sqrt", 0.25, 0.5),
                                                 ("sqrt", 0.9, 1.0), ("linear", 0.3, 0.6)])
def test_ess_lr_factor(rule, ratio, factor):
    base = 0.5 if (rule, ratio) in (("sqrt", 0.9), ("linear", 0.3)) else 1.0
    assert offpolicy.ess_lr_factor(ratio, base, rule) == pytest.approx(factor)


def test_ess_scaled_step_on_one_parameter():
    """Two responses with weights 1 and 3 (ESS (1+3)^2 / (2 (1+9)) = 0.8): SGD moves the one parameter by
    lr * sqrt(0.8) * gradient, Adam's first step by lr * sqrt(0.8); the learning rate is restored after."""
    t = Tokens(logp=torch.tensor([[0.0, math.log(3.0)]]), entropy=torch.zeros(1, 2), old=torch.zeros(1, 2),
               behav=torch.zeros(1, 2), adv=torch.zeros(1, 2), mask=torch.ones(1, 2),
               seq_ids=torch.tensor([[0, 1]]), num_seqs=2)
    scale = offpolicy.EssStepScale("sqrt", 1.0)
    scale.add(t)
    factor = scale.factor(OneRank())
    assert factor == pytest.approx(0.8 ** 0.5)
    assert offpolicy.EssStepScale("sqrt", 1.0).factor(OneRank()) == 1.0  # nothing added: ESS undefined, no scaling
    for make, moved in ((lambda p: torch.optim.SGD([p], lr=0.1), 0.1 * 2.0 * factor),
                        (lambda p: torch.optim.Adam([p], lr=0.1), 0.1 * factor)):
        w = torch.nn.Parameter(torch.tensor(1.0))
        opt = make(w)
        (2.0 * w).backward()  # gradient 2
        with offpolicy.scaled_lr(opt, factor):
            opt.step()
        assert_close(w.detach(), torch.tensor(1.0 - moved), atol=1e-6, rtol=0)
        assert opt.param_groups[0]["lr"] == 0.1
