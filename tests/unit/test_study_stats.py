import math

import numpy as np
import pytest

from study.stats import (betainc, correlation, diff_interval, linear_fit, linear_r2, min_detectable_effect,
                         permutation_p, sign_test, t_cdf, t_interval, t_quantile)


@pytest.mark.parametrize("p,df,expected", [
    # Table values (any t table): two-sided 95 % and 99 %, and the one-sided 80 % used for power.
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 4, 2.7764), (0.975, 10, 2.2281), (0.975, 30, 2.0423),
    (0.995, 5, 4.0321), (0.8, 2, 1.0607), (0.8, 4, 0.9410), (0.8, 10, 0.8791), (0.975, 1e6, 1.9600),
])
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-4)


def test_t_quantile_closed_forms():
    # df = 1 is the Cauchy: t = tan(pi (p - 1/2)); df = 2: t = (2p - 1) / sqrt(2 p (1 - p)).
    for p in (0.6, 0.9, 0.99):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-8)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-8)
    assert t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)
    assert t_quantile(0.5, 3) == 0.0
    assert t_cdf(t_quantile(0.97, 2.5), 2.5) == pytest.approx(0.97, abs=1e-10)  # fractional df (Welch)
    with pytest.raises(ValueError, match="p in"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df > 0"):
        t_quantile(0.9, 0)


def test_betainc_known_values():
    assert betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-4)  # 1 - sum_{k<2} C(4,k) .4^k .6^(4-k)
    assert betainc(0.5, 0.5, 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        betainc(1, 1, 1.5)


def test_t_interval_by_hand():
    # values 1, 2, 3: mean 2, sd 1, se 1/sqrt 3, t(0.975, 2) = 4.3027 -> half-width 2.4842.
    mean, lo, hi = t_interval([1, 2, 3])
    assert mean == 2 and hi - mean == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6) and lo == pytest.approx(4 - hi)
    mean, lo, hi = t_interval([0.4])
    assert mean == 0.4 and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="finite"):
        t_interval([1, float("nan")])


def test_diff_interval_paired_and_welch():
    a, b = [1.0, 2.0, 3.0], [0.5, 1.0, 2.5]  # paired differences 0.5, 1.0, 0.5
    assert diff_interval(a, b, paired=True) == t_interval([0.5, 1.0, 0.5])
    with pytest.raises(ValueError, match="equal lengths"):
        diff_interval(a, [1.0], paired=True)
    # Welch: var a = 1, var b = 1.0833, n = 3 each: se^2 = (1 + 1.0833) / 3 = 0.69444,
    # df = 0.69444^2 / ((1/3)^2 / 2 + (1.0833/3)^2 / 2) = 0.48225 / 0.12076 = 3.9936.
    diff, lo, hi = diff_interval(a, b, paired=False)
    va, vb = 1.0 / 3, np.var(b, ddof=1) / 3
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    assert df == pytest.approx(3.9936, abs=1e-4)
    assert diff == pytest.approx(2 / 3) and hi - diff == pytest.approx(t_quantile(0.975, df) * math.sqrt(va + vb))
    assert math.isnan(diff_interval([1.0], b, paired=False)[1])
    assert diff_interval([1.0, 1.0], [0.0, 0.0], paired=False) == (1.0, 1.0, 1.0)


def test_sign_test_exact_binomial():
    assert sign_test([1] * 11) == pytest.approx(2 / 2 ** 11)  # 11 of 11 one way: p = 0.000977
    assert sign_test([-1] * 11) == pytest.approx(2 / 2 ** 11)
    assert sign_test([1, -1, 1, -1]) == 1.0
    assert sign_test([1, 1, 1, 1, -1, 0, 0]) == pytest.approx(2 * 6 / 32)  # zeros dropped: n 5, 1 minus: 2 (1+5)/32
    assert sign_test([0, 0]) == 1.0
    assert sign_test([1, 1, 1, 1, 1]) == pytest.approx(0.0625)  # five of five cannot reach 0.05


def test_min_detectable_effect():
    # Paired, 3 seeds, sd 1: (4.3027 + 1.0607) / sqrt(3) = 3.0966.
    assert min_detectable_effect(1.0, 3) == pytest.approx((4.302653 + 1.060660) / math.sqrt(3), abs=1e-4)
    # Two groups of 3: df 4, (2.7764 + 0.9410) * sqrt(2/3) = 3.0353.
    assert min_detectable_effect(1.0, 3, paired=False) == pytest.approx((2.776445 + 0.940965) * math.sqrt(2 / 3), abs=1e-4)
    assert math.isnan(min_detectable_effect(1.0, 1))
    assert min_detectable_effect(0.0, 5) == 0.0
    assert min_detectable_effect(2.0, 5) == pytest.approx(2 * min_detectable_effect(1.0, 5))


def test_linear_fit_and_r2():
    slope, intercept, r2 = linear_fit([0, 1, 2, 3], [1, 3, 5, 7])
    assert (slope, intercept, r2) == pytest.approx((2.0, 1.0, 1.0))
    # y = 0, 1, 0, 1 on x = 0..3: slope 0.2, intercept 0.2, residuals -.2 .6 -.6 .2: SSres 0.8, SStot 1 -> R^2 0.2.
    assert linear_r2([0, 1, 2, 3], [0, 1, 0, 1]) == pytest.approx(0.2)
    assert math.isnan(linear_r2([0, 1, 2], [5, 5, 5]))
    with pytest.raises(ValueError, match="same"):
        linear_fit([1, 1], [0, 1])


def test_permutation_p_is_seeded_and_respects_groups():
    rng = np.random.default_rng(1)
    x = rng.normal(size=40)
    y_related = x + 0.3 * rng.normal(size=40)
    y_unrelated = rng.normal(size=40)
    r, p = permutation_p(x, y_related, n_perm=2000, seed=3)
    assert r > 0.9 and p == pytest.approx(1 / 2001)
    assert permutation_p(x, y_unrelated, n_perm=500, seed=3) == permutation_p(x, y_unrelated, n_perm=500, seed=3)
    assert permutation_p(x, y_unrelated, n_perm=2000, seed=3)[1] > 0.05
    # Within groups: y follows the group (shared offset) but not x inside a group. Shuffling within groups
    # keeps the group offsets, so the group-driven correlation is not significant.
    groups = np.repeat(np.arange(8), 5)
    xg = groups + 0.1 * rng.normal(size=40)
    yg = groups + 0.1 * rng.normal(size=40)
    assert correlation(xg, yg) > 0.9
    assert permutation_p(xg, yg, groups=groups, n_perm=2000, seed=0)[1] > 0.01
    assert permutation_p(xg, yg, n_perm=2000, seed=0)[1] < 0.01
    assert math.isnan(permutation_p([1, 2, 3], [1, 1, 1])[1])
