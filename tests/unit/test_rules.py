"""The broker's rule set (broker/rules.py): admission, staleness, dynamic sampling, overlong shaping."""

import numpy as np

from broker.rules import GroupRules, overlong_penalty, scores, zero_spread
from common.config import from_dict
from tests.helpers.groups import rollout_group, sample


def _group(lengths, rewards, versions):
    """Response i: `lengths[i]` tokens, reward `rewards[i]`, every token sampled at version `versions[i]`."""
    return rollout_group([sample(np.arange(n), r, versions=v) for n, r, v in zip(lengths, rewards, versions)])


def _rules(**filter_):
    return GroupRules.of(from_dict({"run": {"steps": 10}, "rollout": {"groups_per_step": 4, "max_staleness_steps": 2,
                                                                      "max_new_tokens": 100},
                                    "learner": {"filter": filter_}}))


def test_overlong_penalty_and_zero_spread():
    # max 100, buffer 20: no penalty up to 80, -0.5 at 90, -1 at 100
    np.testing.assert_allclose(overlong_penalty(np.array([50, 80, 90, 100]), 100, 20, 1.0), [0, 0, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(np.array([100]), 100, 0, 1.0), [0.0])
    assert zero_spread([1.0, 1.0]) and not zero_spread([1.0, 0.0])


def test_admission_cap_and_staleness_floor():
    r = _rules()
    assert r.admit_cap(0) == (0 + 1 + 2) * 4
    assert r.admit_cap(9) == 10 * 4, "nothing is admitted past the run's last step"
    assert r.staleness_floor(5) == 3
    assert r.too_stale(_group([3, 3], [1, 0], [2, 5]), version=5)  # one token of version 2 < 3
    assert not r.too_stale(_group([3, 3], [1, 0], [3, 5]), version=5)


def test_dynamic_sampling_drops_agreeing_groups_within_the_step_budget():
    r = _rules(max_filtered_batches=2)
    same, spread = _group([3, 3], [1, 1], [0, 0]), _group([3, 3], [1, 0], [0, 0])
    assert r.filters_out(same, filtered_this_step=7) and not r.filters_out(spread, filtered_this_step=0)
    assert not r.filters_out(same, filtered_this_step=8), "the budget is max_filtered_batches * groups_per_step"
    assert not _rules(dynamic_sampling=False).filters_out(same, filtered_this_step=0)


def test_rewards_are_the_scores_shaped_by_the_overlong_penalty():
    g = [_group([50, 90, 100], [1, 0, 1], [0, 0, 0])]
    np.testing.assert_array_equal(_rules().rewards(g), scores(g))  # buffer 0: off
    np.testing.assert_allclose(_rules(overlong_buffer_tokens=20, overlong_penalty=2.0).rewards(g),
                               [[1.0, -1.0, -1.0]])
