"""Held-out metrics from generators' EvalResults (common/heldout.py)."""

import pytest

from common import messages
from common.heldout import eval_metrics


def _result(ticket, rewards, lengths, entropies=()):
    return messages.EvalResult(gen_id=0, incarnation="a", ticket=ticket, policy_version=3, rewards=rewards,
                               lengths=lengths, score_status=["ok"] * len(rewards), entropies=list(entropies))


def test_on_policy_entropy_is_token_mean_and_per_response_over_every_sample():
    out = eval_metrics({"easy": [_result(0, [1.0, 0.0], [2, 4], [1.0, 2.0]), _result(1, [1.0, 1.0], [3, 1], [0.6, 0.4])]})
    assert out["eval/easy/entropy"] == pytest.approx((1.0 + 2.0 + 0.6 + 0.4) / (2 + 4 + 3 + 1))
    assert out["eval/easy/entropy_per_response"] == pytest.approx(1.0)
    assert out["eval/easy/acc"] == pytest.approx(0.75)


def test_entropy_is_left_out_unless_every_sample_measured_it():
    """vLLM does not measure it; a mix (a generator of each engine) would average a part as if it were the whole."""
    assert "eval/easy/entropy" not in eval_metrics({"easy": [_result(0, [1.0], [2])]})
    mixed = eval_metrics({"easy": [_result(0, [1.0], [2], [0.5]), _result(1, [1.0], [2])]})
    assert "eval/easy/entropy" not in mixed and "eval/easy/entropy_per_response" not in mixed
