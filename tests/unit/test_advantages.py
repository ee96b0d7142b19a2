import numpy as np
import pytest

from common.config import ParConfig
from learner import advantages
from learner.par import ParSchedule


def test_estimators_hand_computed():
    r = np.array([[1.0, 0.0, 0.0, 0.0]])  # mean 0.25
    np.testing.assert_allclose(advantages.drgrpo(r), [[0.75, -0.25, -0.25, -0.25]])
    # RLOO: r_i - mean of the other three: 1 - 0 = 1; 0 - 1/3 = -1/3
    np.testing.assert_allclose(advantages.rloo(r), [[1.0, -1 / 3, -1 / 3, -1 / 3]])
    # GRPO: unbiased std of [1,0,0,0] = 0.5 -> (r - 0.25) / 0.5
    np.testing.assert_allclose(advantages.grpo(r), [[1.5, -0.5, -0.5, -0.5]], rtol=1e-5)
    # REINFORCE++ baseline: token-weighted whitening of r - mean_g over lengths [3, 1, 1, 1]
    a = advantages.reinforce_pp_baseline(r, np.array([[3, 1, 1, 1]]))
    tok = np.repeat(a[0], [3, 1, 1, 1])
    assert abs(tok.mean()) < 1e-9 and abs(tok.std(ddof=1) - 1.0) < 1e-5


def test_par_schedules():
    assert ParSchedule(ParConfig(), 10).value(3) == 1.0  # off: no reweighting
    assert ParSchedule(ParConfig(schedule="constant", lam=0.3), 10).value(7) == 0.3
    lin = ParSchedule(ParConfig(schedule="linear"), 10)
    assert [lin.value(s) for s in (1, 5, 6, 8, 10)] == [0.0, 0.0, 0.2, 0.6, 1.0]
    eg = ParSchedule(ParConfig(schedule="entropy_guided", lam=0.0, delta=0.05, target_entropy=0.2), 10)
    eg.observe(0.5)  # entropy above target: lambda up
    eg.observe(0.5)
    assert abs(eg.value(3) - 0.1) < 1e-12
    eg.observe(0.1)  # below target: down
    assert abs(eg.value(4) - 0.05) < 1e-12
    for _ in range(5):
        eg.observe(0.0)
    assert eg.value(5) == 0.0  # clipped at 0


def test_par_relative_target_follows_the_first_steps_entropy_and_survives_a_resume():
    cfg = ParConfig(schedule="entropy_guided", lam=0.0, delta=0.05, target_entropy=0.2, target_entropy_relative=0.8)
    eg = ParSchedule(cfg, 10)
    assert eg.target is None  # not known before the first step
    eg.observe(0.10)  # H_1 = 0.10: target 0.08, although every entropy here is below the absolute 0.2
    assert eg.target == pytest.approx(0.08) and eg.value(2) == pytest.approx(0.05)  # 0.10 >= 0.08: lambda up
    eg.observe(0.09)
    assert eg.value(3) == pytest.approx(0.10)
    again = ParSchedule(cfg, 10)
    again.load_state(eg.state())  # a resumed run keeps H_1, not the first entropy it sees after the resume
    again.observe(0.07)  # below 0.08: down
    assert again.target == pytest.approx(0.08) and again.value(4) == pytest.approx(0.05)
    old = ParSchedule(cfg, 10)
    old.load_state({"lam": 0.3})  # a checkpoint from before the relative target: H_1 is taken afresh
    assert old.first_entropy is None and old.value(1) == 0.3
