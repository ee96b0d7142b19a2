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


# ---------------------------------------------------------------------------
# Judging the law against the clock, and the early prediction for bias
# ---------------------------------------------------------------------------

STEPS = range(0, 41, 4)  # 11 evals per run


def _points(run_offsets, acc, entropy):
    """{run: [EvalPoint]} for runs whose entropy at step s is entropy(s, offset) and accuracy acc(s, H, offset)."""
    from study.lawfit import EvalPoint

    out = {}
    for i, off in enumerate(run_offsets):
        pts = []
        for s in STEPS:
            h = entropy(s, off)
            pts.append(EvalPoint(f"run{i}", s, h, acc(s, h, off), 20.0 + s))
        out[f"run{i}"] = pts
    return out


def test_a_clock_with_unrelated_entropies_fails_the_law():
    """Accuracy follows the step only; each run's entropy is offset at every step by an amount that has nothing to do
    with its accuracy (a wobble uncorrelated with the run's accuracy offset). exp(H) still fits well, but a time-only
    model fits better and the across-run test at equal step finds nothing: the law does not hold."""
    from study.lawfit import judge_law

    offsets = [(-0.02, 0.01), (0.0, -0.01), (0.02, 0.0), (-0.01, -0.005), (0.01, 0.005)]  # (entropy, accuracy) offsets
    by_run = _points(offsets, acc=lambda s, h, off: 0.3 + 0.08 * math.sqrt(s) + off[1] * ((s // 4) % 2 * 2 - 1),
                     entropy=lambda s, off: 0.5 * math.exp(-s / 15) + 0.1 + off[0])
    j = judge_law(by_run)
    assert j.n == 55 and j.runs == 5 and j.within_steps == 11
    assert j.r2["time: sqrt(step)"] == pytest.approx(1.0, abs=0.01) and j.r2["exp(H)"] < j.r2["time: sqrt(step)"]
    assert not j.beats_clock and not j.holds
    assert abs(j.within_r) < 0.3 and j.within_p > 0.05
    assert j.r2["eval response length"] > 0.8  # length = 20 + step: a clock too


def test_accuracy_driven_by_entropy_across_runs_passes_the_law():
    """acc = -a exp(H) + b exactly, and H differs across runs at equal step (each run its own offset): exp(H) fits
    perfectly, beats every time-only model, and at equal step the lower-entropy run has the higher accuracy."""
    from study.lawfit import judge_law

    by_run = _points([-0.15, -0.05, 0.0, 0.08, 0.2], acc=lambda s, h, off: -0.3 * math.exp(h) + 1.2,
                     entropy=lambda s, off: 0.6 * math.exp(-s / 10) + 0.4 + off)
    j = judge_law(by_run)
    assert j.r2["exp(H)"] == pytest.approx(1.0) and j.beats_clock
    assert j.within_r == pytest.approx(-1.0) and j.within_p < 0.001 and j.holds
    # H spans [0.25, 1.2]: exp(H) and 1 + H differ by up to 1 - 2.2 e^-1.2 = 33.7 %: the form is tested.
    assert j.entropy_range[1] == pytest.approx(1.2) and j.exp_form_tested
    assert j.exp_linear_gap == pytest.approx(1 - 2.2 * math.exp(-1.2))


def test_the_exponential_form_is_untested_over_a_small_entropy_range():
    from study.lawfit import judge_law

    by_run = _points([0.0, 0.01, 0.02], acc=lambda s, h, off: -2 * math.exp(h) + 3,
                     entropy=lambda s, off: 0.1 * math.exp(-s / 10) + 0.02 + off)
    j = judge_law(by_run)
    # H in [0.02, 0.14]: 1 - 1.14 e^-0.14 = 0.89 % < 1 %.
    assert j.exp_linear_gap == pytest.approx(1 - 1.14 * math.exp(-0.14)) and not j.exp_form_tested


def test_shuffled_pairing_pairs_each_run_with_every_other_runs_entropy():
    from study.lawfit import EvalPoint, shuffled_r2

    # Two runs, three steps. Shift 1 pairs run a's accuracy with run b's entropy and vice versa.
    a = [EvalPoint("a", s, h, y, None) for s, h, y in ((0, 0.0, 1.0), (1, 0.5, 2.0), (2, 1.0, 3.0))]
    b = [EvalPoint("b", s, h, y, None) for s, h, y in ((0, 1.0, 1.0), (1, 0.5, 2.0), (2, 0.0, 3.0))]
    # Pairs: (exp(b's H), a's acc) = (e, 1), (e^.5, 2), (1, 3) and (exp(a's H), b's acc) = (1, 1), (e^.5, 2), (e, 3):
    # symmetric, so the pooled slope is 0 and R^2 = 0.
    assert shuffled_r2({"a": a, "b": b}) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(shuffled_r2({"a": a}))


def test_eval_lengths_and_run_points():
    from study.lawfit import eval_lengths, run_eval_points

    rows = [{"step": 0, "eval/x/acc": 0.5, "eval/x/response_length": 10.0, "eval/y/response_length": 20.0},
            {"step": 1, "actor/entropy": 0.3}]
    assert eval_lengths(rows) == {0: 15.0}
    (p,) = run_eval_points("r", rows)
    assert (p.run, p.step, p.entropy, p.acc, p.length) == ("r", 0, 0.3, 0.5, 15.0)


def _early_points(n_runs, final_shift):
    """Runs on acc = -0.3 exp(H) + 1.2 (H from 1.0 down by 0.04 per eval, each run offset), 21 evals; the final eval
    moved by final_shift(i)."""
    out = {}
    for i in range(n_runs):
        hs = [1.0 - 0.04 * v + 0.01 * i for v in range(21)]
        accs = [-0.3 * math.exp(h) + 1.2 for h in hs]
        accs[-1] += final_shift(i)
        out[f"run{i}"] = list(zip(hs, accs))
    return out


def test_an_unbiased_early_fit_passes():
    from study.lawfit import early_bias

    bias = early_bias(_early_points(8, lambda i: 0.01 if i % 2 else -0.01))  # symmetric noise on the finals
    assert len(bias.runs) == 8 and all(e.k == 4 and e.n == 21 for e in bias.runs)
    assert [round(e.error, 6) for e in bias.runs] == [-0.01, 0.01] * 4
    assert bias.mean == pytest.approx(0.0, abs=1e-9) and bias.mae == pytest.approx(0.01)
    assert bias.sign_p == 1.0 and bias.holds and not bias.biased
    assert bias.lo < 0 < bias.hi
    assert bias.pooled is not None and bias.runs[0].pooled_predicted == pytest.approx(bias.runs[0].predicted, abs=1e-6)


def test_a_biased_early_fit_fails_even_when_close():
    from study.lawfit import early_bias

    bias = early_bias(_early_points(8, lambda i: 0.015))  # every final above its prediction, by less than 0.02
    assert bias.mae == pytest.approx(0.015) and bias.sign_p == pytest.approx(2 / 2 ** 8)
    assert bias.biased and not bias.holds and bias.lo > 0
    far = early_bias(_early_points(8, lambda i: 0.05 if i % 2 else -0.05))  # unbiased but too far off
    assert not far.biased and not far.holds
    assert early_bias({"short": [(0.1, 0.2)] * 3}) is None
