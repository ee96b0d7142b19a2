"""A parquet dataset through the real pipeline, evaluated per data source at the
configured temperature; the standalone evaluator reports what the in-training evaluation logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.arith import ArithTask
from common.metrics import read_metrics
from tests.helpers.paths import BASE_MODEL, REPO
from tests.helpers.runs import launch

pytestmark = pytest.mark.slow


def _dataset(path) -> None:
    """20 rows in the common RL layout: plain-text prompts (the base model has no chat template),
    reward_model.ground_truth, two data sources."""
    problems = ArithTask(seed=5, train_size=200, eval_size=1).train()
    easy = [p for p in problems if p.level == 1][:10]
    hard = [p for p in problems if p.level == 2][:10]
    rows = [{"prompt": p.question, "reward_model": {"ground_truth": p.answer},
             "data_source": source} for source, ps in (("sums", easy), ("mixed", hard)) for p in ps]
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), str(path))


def test_parquet_trains_evaluates_per_source_and_matches_standalone_evaluation(tmp_path):
    data = tmp_path / "math.parquet"
    _dataset(data)
    run = tmp_path / "run"
    sets = ["data.task=files", f"data.train_files=['{data}']", f"data.eval_files=['{data}']",
            "eval.every_steps=1", "eval.k=2", "eval.temperature=0.7", "eval.temperatures.mixed=0",
            "rollout.groups_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=24",
            "learner.filter.dynamic_sampling=false"]
    launch(run, "--gens", "1", "--learners", "1", "--steps", "2", *[a for kv in sets for a in ("--set", kv)])
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for ds in ("sums", "mixed"):
            assert 0 <= r[f"eval/{ds}/acc"] <= r[f"eval/{ds}/pass@k"] <= 1
    # What the generator actually ran: each source at its configured temperature (greedy takes one sample).
    ran = [json.loads(line) for line in open(run / "generators" / "gen0_eval.jsonl")]
    by_source = {(e["data_source"], e["temperature"], e["k"]) for e in ran}
    assert by_source == {("sums", 0.7, 2), ("mixed", 0.0, 1)}
    assert sorted({e["version"] for e in ran}) == [0, 1, 2]
    assert sum(e["prompts"] for e in ran if e["version"] == 0) == 20
    assert rows[0]["eval/sums/acc"] > 0, "the base model solves one-digit sums: the rendering or scoring is off"
    # The standalone evaluator on the same model, data and config gives the same numbers.
    for model, row in ((BASE_MODEL, rows[0]), (str(run / "checkpoints" / "step_2"), rows[2])):
        out = tmp_path / "eval.json"
        p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "evaluate.py"), "--model", model,
                            "--config", str(run / "config.toml"), "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        got = json.load(open(out))
        assert got == {k: v for k, v in row.items() if k.startswith("eval/")}, model


def test_evaluate_reports_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?"}\n')
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "evaluate.py"), "--model", BASE_MODEL,
                        "--data", str(bad)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"{bad}: row 1: no reference answer" in p.stderr
