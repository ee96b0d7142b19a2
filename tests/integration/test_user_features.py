"""What users bring from verl and TRL, on one real run started with the `covrl` command: a Hub model id resolved
from the Hugging Face cache, readable rollouts (train and eval) with TensorBoard text, and W&B in offline mode
logging the same keys as metrics.jsonl with the config, hardware and git revision."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from common.metrics import read_metrics
from tests.helpers.paths import HUB_SHA, REPO
from tests.helpers.runs import EVAL, SMALL, launch

pytestmark = pytest.mark.slow

TRAIN_FIELDS = {"step", "policy_version", "group", "generator", "prompt_id", "epoch", "data_source", "prompt",
                "ground_truth", "sample", "response", "reward", "answer", "advantage", "length", "finish_reason",
                "score_status", "token_versions", "staleness"}
EVAL_FIELDS = {"step", "policy_version", "data_source", "prompt_id", "prompt", "ground_truth", "sample", "response",
               "reward", "answer", "length", "score_status"}


def wandb_records(path: str):
    """The protobuf records of a W&B run file (`run-*.wandb`): a 7-byte header, then the LevelDB log format
    (32 KiB blocks of records with a 7-byte header: checksum, length, type FULL/FIRST/MIDDLE/LAST)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


def wandb_run(run_dir: str) -> tuple[set[str], list[int], dict]:
    """(history keys, the `step` of each history row, config) of the run's offline W&B run."""
    from wandb.proto import wandb_internal_pb2

    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    keys, steps, config = set(), [], {}
    for data in wandb_records(files[0]):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            # a table is logged as nested keys under its tag: (tag, "path"), (tag, "_type"), ...
            row = {(it.key or it.nested_key[0]): it.value_json for it in rec.history.item}
            keys |= set(row)
            steps.append(json.loads(row["step"]))
        elif kind in ("run", "config"):
            update = rec.run.config.update if kind == "run" else rec.config.update
            config.update({it.key: json.loads(it.value_json) for it in update})
    return keys, steps, config


def test_hub_id_rollouts_tensorboard_text_and_wandb_offline(tmp_path, hub_cache):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}
    covrl = [sys.executable, "-m", "launch.covrl"]
    p = subprocess.run([*covrl, "run", "--run-dir", str(run), "--quiet", "--steps", "4", *EVAL,
                        "--set", 'model.path="acme/arith-base"', "--set", 'logging.wandb.project="covrl-test"',
                        "--set", 'logging.wandb.mode="offline"'], capture_output=True, text=True, timeout=600,
                       cwd=REPO, env=env)
    assert p.returncode == 0, p.stdout + p.stderr + open(run / "logs" / "learner0.log").read()[-3000:]

    # The Hub id was resolved once, by the launcher: the roles were given the snapshot's local path.
    snapshot = str(hub_cache / "models--acme--arith-base" / "snapshots" / HUB_SHA)
    assert f"model: acme/arith-base@{HUB_SHA} from the Hugging Face cache ({snapshot})" in p.stdout
    assert f'path = "{snapshot}"' in (run / "config.toml").read_text()

    # Training rollouts: logging.rollouts = "sample" writes 2 groups of each step, every response of them.
    rows = {r["step"]: r for r in read_metrics(str(run))}
    for step in range(1, 5):
        recs = [json.loads(line) for line in open(run / "rollouts" / f"step_{step}.jsonl")]
        assert len(recs) == 2 * 4 and all(set(r) == TRAIN_FIELDS for r in recs)
        assert {r["step"] for r in recs} == {step} and {r["policy_version"] for r in recs} == {step - 1}
        for r in recs:
            assert r["staleness"] == step - 1 - r["token_versions"][0] <= 1  # rollout.max_staleness_steps = 1
            assert r["prompt"].startswith("Question: ") and r["length"] > 0 and r["finish_reason"] in ("stop", "length")
            assert r["reward"] in (0.0, 1.0) and (r["reward"] == 0.0 or r["answer"] is not None)
        for g in {r["group"] for r in recs}:  # GRPO: a group's advantages sum to 0
            assert abs(sum(r["advantage"] for r in recs if r["group"] == g)) < 1e-5
        assert rows[step]["staleness/max"] >= max(r["staleness"] for r in recs)

    # Eval samples: the first 2 prompts of each data source, k = 4 responses each, at versions 0, 2 and 4.
    for version in (0, 2, 4):
        recs = [json.loads(line) for line in open(run / "rollouts" / f"eval_step_{version}.jsonl")]
        assert all(set(r) == EVAL_FIELDS and r["policy_version"] == version for r in recs)
        by_source = {(r["data_source"], r["prompt_id"]) for r in recs}
        assert by_source == {(ds, i) for ds in ("arith_easy", "arith_hard") for i in (0, 1)}
        easy = [r for r in recs if r["data_source"] == "arith_easy"]
        assert len(easy) == 2 * 4
        hard = [r for r in recs if r["data_source"] == "arith_hard"]
        assert len(hard) == 2  # eval.temperatures.arith_hard = 0: greedy, one sample per prompt

    # A few samples per step as TensorBoard text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    assert {"rollouts/train/text_summary", "rollouts/eval/text_summary"} <= set(tb.Tags()["tensors"])

    # W&B offline: every metrics.jsonl key under its TensorBoard tag, against `step`; config, hardware, revision.
    keys, steps, config = wandb_run(str(run))
    logged = {k for r in read_metrics(str(run)) for k, v in r.items() if v is not None}
    assert logged <= keys and {"rollouts/train", "rollouts/eval"} <= keys
    assert set(steps) == {0, 1, 2, 3, 4}
    assert config["learner"]["loss"]["type"] == "ppo" and config["model"]["path"] == snapshot
    assert len(config["covrl"]["git_revision"].split("+")[0]) in (40, len("unknown"))
    assert config["covrl"]["hardware"]["cpus"] == os.cpu_count()


def test_rollouts_off_writes_none_and_all_writes_every_group(tmp_path):
    launch(tmp_path / "off", "--steps", "1", *SMALL, "--set", 'logging.rollouts="off"')
    assert not (tmp_path / "off" / "rollouts").exists()
    launch(tmp_path / "all", "--steps", "1", *SMALL, "--set", 'logging.rollouts="all"')
    recs = [json.loads(line) for line in open(tmp_path / "all" / "rollouts" / "step_1.jsonl")]
    assert len(recs) == 8 * 4 and {r["group"] for r in recs} == set(range(8))  # rollout.groups_per_step = 8
