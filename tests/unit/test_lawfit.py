import json
import math

import pytest

from study.lawfit import early_prediction, fit_law


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
    from study.fit_law import main

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i in range(20):
            h = 0.5 - 0.02 * i
            f.write(json.dumps({"step": i + 1, "actor/entropy": h, "critic/score/mean": -0.2 * math.exp(h) + 0.8}) + "\n")
    assert main([str(tmp_path)]) == 0
    out = json.load(open(tmp_path / "law_fit_train.json"))
    assert out["a"] == pytest.approx(0.2) and out["ceiling"] == pytest.approx(0.6)
    assert main([str(tmp_path / "nothing")]) == 2


def test_eval_points_pair_the_evaluated_versions_entropy():
    from study.lawfit import eval_points

    rows = [
        {"step": 0, "eval/a/acc": 0.2, "eval/b/acc": 0.4},  # version 0: entropy from row 1 (before its update)
        {"step": 1, "actor/entropy": 0.9, "actor/entropy_delta": -0.1},
        {"step": 2, "actor/entropy": 0.8, "actor/entropy_delta": -0.2, "eval/a/acc": 0.5, "eval/b/acc": None},
        {"step": 3, "actor/entropy": 0.6, "actor/entropy_delta": -0.1},
        {"step": 3, "eval/a/acc": 0.7, "eval/b/acc": 0.9},  # same step twice: merged
        {"step": 5, "actor/entropy": 0.3, "eval/a/acc": 0.1},  # no row 6 and no delta: skipped
    ]
    # v0: row 1's 0.9, mean(0.2, 0.4) = 0.3; v2: row 3's 0.6, only a non-null source: 0.5;
    # v3: no row 4, so row 3's 0.6 + (-0.1) = 0.5, mean(0.7, 0.9) = 0.8.
    pts = eval_points(rows)
    assert [p[0] for p in pts] == [0, 2, 3]
    for (_, h, r), (eh, er) in zip(pts, [(0.9, 0.3), (0.6, 0.5), (0.5, 0.8)]):
        assert h == pytest.approx(eh) and r == pytest.approx(er)


def test_train_points_and_pearson():
    from study.lawfit import pearson, train_points

    rows = [{"step": 2, "actor/entropy": 0.5, "critic/score/mean": 0.1}, {"step": 1, "actor/entropy": 0.6},
            {"step": 1, "critic/score/mean": 0.05}, {"step": 3, "actor/entropy": None, "critic/score/mean": 0.2}]
    assert train_points(rows) == [(1, 0.6, 0.05), (2, 0.5, 0.1)]
    assert pearson([1, 2, 3], [6, 4, 2]) == pytest.approx(-1.0)
    # x = 1, 2, 3, 4; y = 1, 3, 2, 4: deviations (-1.5, -.5, .5, 1.5) and (-1.5, .5, -.5, 1.5):
    # sxy = 2.25 - .25 - .25 + 2.25 = 4, sxx = syy = 5, r = 0.8.
    assert pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert pearson([1, 2], [1, 2]) is None and pearson([1, 1, 1], [1, 2, 3]) is None


def _eval_run(path, versions=9):
    """Steps 0..versions*2 with eval every 2 steps on acc = -0.25 exp(H) + 1.0, H(v) = 1 - 0.02 v."""
    H = lambda v: 1.0 - 0.02 * v  # noqa: E731
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(0, 2 * versions + 1):
            row = {"step": s}
            if s:
                row.update({"actor/entropy": H(s - 1), "actor/entropy_delta": H(s) - H(s - 1), "critic/score/mean": 0.5})
            if s % 2 == 0:
                row["eval/x/acc"] = -0.25 * math.exp(H(s)) + 1.0
            f.write(json.dumps(row) + "\n")


def test_cli_on_eval_writes_plot(tmp_path, capsys):
    from study.fit_law import main

    _eval_run(tmp_path)
    assert main([str(tmp_path)]) == 0  # eval points exist, so eval is the default
    assert "fitting on eval points" in capsys.readouterr().out
    out = json.load(open(tmp_path / "law_fit_eval.json"))
    assert out["source"] == "eval" and out["points"] == 10
    assert out["a"] == pytest.approx(0.25) and out["b"] == pytest.approx(1.0)
    assert out["plot"] == str(tmp_path / "law_fit_eval.png")
    assert open(tmp_path / "law_fit_eval.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    plot = tmp_path / "custom.png"
    assert main([str(tmp_path), "--on", "eval", "--plot", str(plot)]) == 0 and plot.stat().st_size > 5000
    # train mode on a constant reward is still a valid (flat) fit; --reward with --on eval is refused.
    assert main([str(tmp_path), "--on", "eval", "--reward", "critic/score/mean"]) == 2
    assert "--on train" in capsys.readouterr().err


def test_cli_on_eval_too_few_points(tmp_path, capsys):
    from study.fit_law import main

    _eval_run(tmp_path, versions=1)  # versions 0, 1 -> 2 eval points
    assert main([str(tmp_path), "--on", "eval"]) == 2
    assert "gives 2 eval points" in capsys.readouterr().err


def test_the_law_is_printed_with_the_signs_a_reader_writes():
    from study.lawfit import LawFit

    assert LawFit(a=0.2588, b=0.5, r2=1, n=3).formula() == "R = -0.2588 exp(H) + 0.5000"
    assert LawFit(a=-0.2588, b=-0.5, r2=1, n=3).formula() == "R = 0.2588 exp(H) - 0.5000"


def test_the_early_interval_widens_as_its_points_get_fewer():
    from study.lawfit import prediction_interval

    noise = [0.01, -0.02, 0.015, -0.01, 0.02, -0.015, 0.005, -0.005, 0.01, -0.01]
    H = [1.0 - 0.05 * i for i in range(10)]
    R = [-0.3 * math.exp(h) + 1.0 + e for h, e in zip(H, noise)]
    widths = []
    for k in (3, 5, 10):
        fit = fit_law(H[:k], R[:k])
        widths.append(prediction_interval(H[:k], R[:k], fit, H[-1]))
    assert widths[0] > widths[1] > widths[2] > 0
    assert prediction_interval(H[:2], R[:2], fit_law(H[:2], R[:2]), H[-1]) is None


def test_each_point_source_writes_its_own_files_and_few_early_points_warn(tmp_path, capsys):
    from study.fit_law import main

    _eval_run(tmp_path, versions=9)  # 10 eval points: the early fit has 2 of them
    assert main([str(tmp_path), "--on", "eval"]) == 0
    out = capsys.readouterr()
    assert "warning: the early prediction rests on 2 points" in out.err and "no interval" in out.out
    assert "R = -0.2500 exp(H) + 1.0000" in out.out
    assert main([str(tmp_path), "--on", "train"]) == 0
    capsys.readouterr()
    ev, tr = (json.load(open(tmp_path / f"law_fit_{s}.json")) for s in ("eval", "train"))
    assert ev["source"] == "eval" and tr["source"] == "train"  # train did not overwrite eval's fit
    assert (tmp_path / "law_fit_eval.png").exists() and (tmp_path / "law_fit_train.png").exists()
    assert ev["early_prediction"]["interval_95"] is None and ev["early_prediction"]["step"] == 18
