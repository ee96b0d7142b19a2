"""Finding checkpoints, trimming metrics on resume, and the launcher's --resume checks (no processes started)."""

import json
import os

import pytest

from common.checkpoint_dirs import complete_checkpoints, latest_checkpoint
from common.metrics import keep_metrics, read_metrics
from launch import cluster


def _ckpt(root, name, complete=True):
    d = root / "checkpoints" / name
    (d / "deepspeed").mkdir(parents=True)
    if complete:
        (d / "covrl_state.json").write_text("{}")


def test_only_complete_checkpoints_count_in_step_order(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    for name in ("step_2", "step_10", "step_9"):
        _ckpt(tmp_path, name)
    _ckpt(tmp_path, "step_12.tmp")  # a write that died before its rename
    _ckpt(tmp_path, "step_11", complete=False)  # no state file
    _ckpt(tmp_path, "latest")
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [2, 9, 10]
    assert latest_checkpoint(str(tmp_path)) == (10, str(tmp_path / "checkpoints" / "step_10"))


def test_keep_metrics_drops_later_rows_and_a_torn_line(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(5):
            f.write(json.dumps({"step": s, "x": float(s)}) + "\n")
        f.write('{"step": 5, "x"')  # the dead writer's half line
    assert keep_metrics(str(tmp_path), lambda s: s <= 3 and s != 2) == 3
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 3]
    assert open(tmp_path / "metrics.jsonl").read().endswith("\n")


@pytest.fixture
def old_run(tmp_path):
    run = tmp_path / "run"
    cluster.prepare(cluster.parse_args(["--run-dir", str(run), "--learners", "2", "--gens", "1"]))
    return run


@pytest.mark.parametrize("argv, message", [
    (["--learners", "1"], "sharded over 2 learner ranks; resume with --learners 2"),
    (["--set", "run.seed=1"], "drop --config / --set"),
    (["--gens", "0"], "need at least one generator"),
])
def test_resume_refuses_what_it_cannot_honour(old_run, capsys, argv, message):
    assert cluster.main(["--resume", str(old_run), *argv]) == 2
    assert message in capsys.readouterr().err


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert cluster.main(["--resume", str(tmp_path)]) == 2
    assert "config.toml is missing, so this is not a covrl run directory" in capsys.readouterr().err


def test_resume_keeps_the_run_and_may_extend_it(old_run):
    before = json.load(open(old_run / "cluster.json"))
    (old_run / "progress.json").write_text('{"step": 49, "evaluating": [50]}')  # the dead run's last step
    run = cluster.prepare(cluster.parse_args(["--resume", str(old_run), "--steps", "250"]))
    run_dir, cfg, info = run.path, run.cfg, run.info
    assert not (old_run / "progress.json").exists()  # the progress line starts from the resumed learner's own
    assert run_dir == str(old_run) and info.run_id == before["run_id"] and info.learners == 2 and info.generators == 1
    assert cfg.run.steps == 250 and "steps = 250" in open(os.path.join(run_dir, "config.toml")).read()
