import json
import math

import pytest

from common.lawfit import early_prediction, fit_law


def test_fit_recovers_known_law():
    a, b = 0.3, 0.9
    H = [0.05 * i for i in range(1, 30)]
    R = [-a * math.exp(h) + b for h in H]
    fit = fit_law(H, R)
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.b == pytest.approx(b, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.ceiling == pytest.approx(0.6)
    early, rmse = early_prediction(H, R)
    assert early.n == 4 and rmse < 1e-9


def test_fit_with_noise_and_bad_input():
    import random

    rng = random.Random(0)
    H = [0.02 * i for i in range(100)]
    R = [-0.5 * math.exp(h) + 1.2 + rng.gauss(0, 0.01) for h in H]
    fit = fit_law(H, R)
    assert abs(fit.a - 0.5) < 0.05 and abs(fit.b - 1.2) < 0.05 and fit.r2 > 0.9
    with pytest.raises(ValueError, match="same"):
        fit_law([0.1, 0.1], [0.2, 0.3])
    with pytest.raises(ValueError, match="at least 2"):
        fit_law([0.1], [0.2])


def test_cli_writes_fit(tmp_path):
    from launch.fit_law import main

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i in range(20):
            h = 0.5 - 0.02 * i
            f.write(json.dumps({"step": i + 1, "actor/entropy": h, "critic/score/mean": -0.2 * math.exp(h) + 0.8}) + "\n")
    assert main([str(tmp_path)]) == 0
    out = json.load(open(tmp_path / "law_fit.json"))
    assert out["a"] == pytest.approx(0.2) and out["ceiling"] == pytest.approx(0.6)
    assert main([str(tmp_path / "nothing")]) == 2
