"""The staleness study's controls report (study/controls_report.py): each contrast's verdict follows its interval,
paired by seed, and can come out every way the amendment names."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

from study.controls_report import _contrast, render

WORDS = ("above", "includes", "below")


def arm(accs):
    return {s: (SimpleNamespace(acc=a), []) for s, a in enumerate(accs)}


def test_the_verdict_follows_the_paired_interval():
    acc = lambda r: r.acc  # noqa: E731
    assert _contrast("E", arm([0.7, 0.72, 0.71]), arm([0.5, 0.51, 0.52]), acc, WORDS).endswith("**above**")
    assert _contrast("E", arm([0.5, 0.51, 0.52]), arm([0.7, 0.72, 0.71]), acc, WORDS).endswith("**below**")
    assert _contrast("E", arm([0.6, 0.5, 0.7]), arm([0.55, 0.65, 0.6]), acc, WORDS).endswith("**includes**")
    assert "undetermined" in _contrast("E", arm([0.6]), arm([0.5]), acc, WORDS)
    text = _contrast("E", arm([0.7, 0.72, 0.71]), arm([0.5, 0.51, 0.52]), acc, WORDS)
    assert "97.5 %" in text and "MDE" in text and "seeds 0,1,2" in text


def test_the_report_names_missing_runs_instead_of_failing(tmp_path):
    text = render(str(tmp_path / "controls"), str(tmp_path / "study"), datetime.datetime(2026, 12, 7))
    assert "C1 0/3, C2 0/3 complete" in text and text.count("undetermined") == 3
