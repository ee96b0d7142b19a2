"""Bad input is stopped at the door: every command, given one mistake a user makes, exits with status 2 and one
line on stderr that names what is wrong (file, row and field, or config key) and says how to fix it; no
traceback, and no run directory left behind.

Each case is a real command line run as a user runs it (a subprocess), on files written here; two run at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.helpers.paths import BASE_MODEL, REPO

pytestmark = pytest.mark.slow

GOOD = {"prompt": "What is 2 + 3?", "answer": "5"}


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _files(d):
    """The inputs the cases use, keyed by name."""
    f = {
        "good": _jsonl(d / "good.jsonl", [GOOD, GOOD]),
        "no_answer": _jsonl(d / "no_answer.jsonl", [GOOD, {"prompt": "What is 1 + 1?"}]),
        "number_prompt": _jsonl(d / "number_prompt.jsonl", [GOOD, {"prompt": 7, "answer": "7"}]),
        "bad_json": _jsonl(d / "bad_json.jsonl", [GOOD, '{"prompt": "x", "answer": '] ),
        "list_row": _jsonl(d / "list_row.jsonl", [GOOD, "[1, 2]"]),
        "empty": _jsonl(d / "empty.jsonl", []),
        "no_prompt_col": _parquet(d / "no_prompt_col.parquet", [{"question": "What is 2 + 3?", "answer": "5"}]),
        "parquet_no_answer": _parquet(d / "parquet_no_answer.parquet", [{"prompt": "What is 2 + 3?", "answer": None}]),
        "long_prompt": _jsonl(d / "long_prompt.jsonl", [GOOD, {"prompt": "What is " + " + ".join(["1"] * 400) + "?",
                                                               "answer": "400"}]),
    }
    (d / "latin1.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "caf\xe9 + 1?", "answer": "1"}\n')
    f["latin1"] = str(d / "latin1.jsonl")
    (d / "not.parquet").write_text("prompt,answer\n1+1,2\n")
    f["not_parquet"] = str(d / "not.parquet")
    (d / "data.csv").write_text("prompt,answer\n1+1,2\n")
    f["csv"] = str(d / "data.csv")
    (d / "bad.toml").write_text("[rollout\ngroup_size = 4\n")
    f["bad_toml"] = str(d / "bad.toml")
    for name, files in (("no_config", ["model.safetensors", "tokenizer.json"]), ("broken_config", []),
                        ("no_weights", ["config.json", "tokenizer.json"]), ("no_tokenizer", ["config.json", "model.safetensors"])):
        os.makedirs(d / name)
        for file in files:
            shutil.copy(os.path.join(BASE_MODEL, file), d / name / file)
        f[name] = str(d / name)
    (d / "broken_config" / "config.json").write_text("{ not json")
    os.makedirs(d / "a_run")  # a finished run's directory (metrics.jsonl): may not be reused
    (d / "a_run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/entropy": 0.5}) + "\n")
    f["a_run"] = str(d / "a_run")
    os.makedirs(d / "not_a_run")
    f["not_a_run"] = str(d / "not_a_run")
    os.makedirs(d / "someones_files")  # a directory of other files: a run is not written into it
    (d / "someones_files" / "notes.txt").write_text("not a run\n")
    f["someones_files"] = str(d / "someones_files")
    return f


def _files_set(name):
    return ["--set", "data.task=\"files\"", "--set", f"data.train_files=[\"{{{name}}}\"]"]


RUN = ["-m", "launch.cluster", "--run-dir", "{run}", "--quiet"]
EVALUATE = ["-m", "launch.evaluate"]
# (case id, argv after python, what the one error line must say)
CASES = [
    # training files, jsonl
    ("row without an answer", RUN + _files_set("no_answer"), "no_answer.jsonl: row 1: no reference answer"),
    ("prompt is a number", RUN + _files_set("number_prompt"), "number_prompt.jsonl: row 1: field prompt"),
    ("row not valid JSON", RUN + _files_set("bad_json"), "bad_json.jsonl: row 1: not valid JSON"),
    ("row not an object", RUN + _files_set("list_row"), "list_row.jsonl: row 1: a JSON object is needed"),
    ("empty file", RUN + _files_set("empty"), "empty.jsonl: the file has no rows"),
    ("not UTF-8", RUN + _files_set("latin1"), "latin1.jsonl: row 1: not UTF-8 (byte 0xe9"),
    ("missing file", RUN + ["--set", "data.task=\"files\"", "--set", "data.train_files=[\"{tmp}/nowhere.jsonl\"]"],
     "nowhere.jsonl' does not exist"),
    ("unsupported type", RUN + _files_set("csv"), "data.csv: unsupported file type"),
    # training files, parquet
    ("parquet without prompt", RUN + _files_set("no_prompt_col"), "no_prompt_col.parquet: no column prompt (columns: "
                                                                   "question, answer)"),
    ("parquet row without answer", RUN + _files_set("parquet_no_answer"),
     "parquet_no_answer.parquet: row 0: no reference answer"),
    ("not a parquet file", RUN + _files_set("not_parquet"), "not.parquet: not a readable parquet file"),
    # eval files, prompt lengths
    ("bad eval row", RUN + _files_set("good") + ["--set", "data.eval_files=[\"{no_answer}\"]"],
     "no_answer.jsonl: row 1: no reference answer"),
    ("prompt too long, truncation error", RUN + _files_set("long_prompt") + ["--set", "data.truncation=\"error\""],
     "long_prompt.jsonl: row 1: prompt has"),
    # model directories
    ("model path missing", RUN + ["--set", "model.path=\"{tmp}/nomodel\""], "nomodel' is not a directory"),
    ("model without config.json", RUN + ["--set", "model.path=\"{no_config}\""], "no_config' has no config.json"),
    ("model config not JSON", RUN + ["--set", "model.path=\"{broken_config}\""], "config.json is not a JSON object"),
    ("Hub id not in the cache", RUN + ["--set", "model.path=\"acme/not-cached\""],
     "model.path 'acme/not-cached' is not in the Hugging Face cache and HF_HUB_OFFLINE=1; fetch it"),
    ("W&B online without credentials", RUN + ["--set", "logging.wandb.project=\"p\""], "no W&B credentials"),
    ("model without weights", RUN + ["--set", "model.path=\"{no_weights}\""], "no_weights' has no weights"),
    ("model without tokenizer", RUN + ["--set", "model.path=\"{no_tokenizer}\""], "no_tokenizer' has no tokenizer"),
    # the config
    ("bad TOML syntax", RUN + ["--config", "{bad_toml}"], "bad.toml' is not valid TOML"),
    ("config file missing", RUN + ["--config", "{tmp}/none.toml"], "none.toml' does not exist"),
    ("unknown key", RUN + ["--set", "rollout.group_sizee=4"], "did you mean rollout.group_size?"),
    ("invalid enum", RUN + ["--set", "learner.loss.type=\"klcov\""],
     "learner.loss.type = 'klcov' is not one of \"ppo\", \"clip_cov\", \"kl_cov\", \"gspo\", \"cispo\""),
    ("invalid enum, plain field", RUN + ["--set", "learner.advantage=\"grp\""], "\"grpo\""),
    ("another variant's field", RUN + ["--set", "learner.loss.kl_fraction=0.1"],
     "belongs to type = \"kl_cov\": set learner.loss.type = \"kl_cov\" as well"),
    ("wrong type", RUN + ["--set", "rollout.group_size=\"four\""], "Expected `int`, got `str` - at `rollout.group_size`"),
    ("out of range", RUN + ["--set", "rollout.group_size=1"], "at `rollout.group_size`"),
    ("no learners", RUN + ["--learners", "0"], "need at least one of each"),
    # run directories
    ("existing run directory", ["-m", "launch.cluster", "--run-dir", "{a_run}", "--quiet"], "already holds a run"),
    ("resume of a non-run", ["-m", "launch.cluster", "--resume", "{not_a_run}"], "not a covrl run directory"),
    ("run directory of other files", ["-m", "launch.cluster", "--run-dir", "{someones_files}", "--quiet"],
     "is not empty and not a covrl run (it holds notes.txt)"),
    ("tensor parallel without GPUs", RUN + ["--tp", "2", "--gpus", "0"], "--tp 2 splits each generator over 2 GPUs"),
    # the other commands
    ("evaluate: no model", EVALUATE + ["--model", "{tmp}/nomodel"], "--model '"),
    ("evaluate: bad data row", EVALUATE + ["--model", BASE_MODEL, "--data", "{no_answer}"],
     "no_answer.jsonl: row 1: no reference answer"),
    ("evaluate: bad enum", EVALUATE + ["--model", BASE_MODEL, "--set", "eval.k=0"], "at `eval.k`"),
    ("fit_law: not a run", ["-m", "study.fit_law", "{not_a_run}"], "no metrics.jsonl"),
    ("fit_law: too few points", ["-m", "study.fit_law", "{a_run}"], "gives 0 train points"),
    ("prepare_data: wrong key", ["-m", "launch.prepare_data", "{good}", "{tmp}/out.parquet", "--prompt-key", "problem"],
     "good.jsonl: row 0: no field 'problem'"),
    ("prepare_data: bad source", ["-m", "launch.prepare_data", "{latin1}", "{tmp}/out.jsonl", "--prompt-key", "prompt"],
     "latin1.jsonl: row 1: not UTF-8"),
    ("study: bad enum", ["-m", "study.runs", "--methods", "grpo", "--study-dir", "{run}", "--set",
                         "learner.loss.type=\"klcov\""], "run grpo: invalid config"),
    ("scale: not a run", ["-m", "launch.scale", "{not_a_run}", "--gens", "2"], "not a covrl run directory"),
    ("plots: not a run", ["-m", "study.plots", "{not_a_run}"], "metrics.jsonl is missing"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    return {**_files(d), "tmp": str(d)}


def _run(argv, inputs, run) -> subprocess.CompletedProcess:
    cmd = [sys.executable] + [a.format(**inputs, run=str(run)) for a in argv]
    env = {**os.environ, "PYTHONPATH": REPO, "HOME": inputs["tmp"], "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": os.path.join(inputs["tmp"], "hub")}  # no W&B login, an empty Hub cache, offline
    env.pop("WANDB_API_KEY", None)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:  # this case fails, the others still report
        return subprocess.CompletedProcess(cmd, -1, "", f"timed out after {e.timeout}s")


@pytest.fixture(scope="module")
def outcomes(inputs, tmp_path_factory):
    """Every case's command line, run two at a time (each is mostly Python's start-up on one core; two cores here):
    the existing directories before any ran, and {case: (its run directory, the finished process)}."""
    from concurrent.futures import ThreadPoolExecutor

    before = {p: sorted(os.listdir(inputs[p])) for p in ("a_run", "not_a_run", "someones_files")}
    root = tmp_path_factory.mktemp("runs")
    with ThreadPoolExecutor(2) as pool:
        started = {case: (root / f"{i}" / "run", argv) for i, (case, argv, _) in enumerate(CASES)}
        futures = {case: (run, pool.submit(_run, argv, inputs, run)) for case, (run, argv) in started.items()}
        return before, {case: (run, f.result()) for case, (run, f) in futures.items()}


@pytest.mark.parametrize("case, argv, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_left(case, argv, needle, inputs, outcomes):
    before, done = outcomes
    run, p = done[case]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, f"{case}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1 and "error: " in lines[0], f"{case}: not one error line:\n{p.stderr}"
    assert needle.format(**inputs, run=str(run)) in lines[0], f"{case}: {lines[0]!r} does not say {needle!r}"
    assert not run.exists(), f"{case}: left {sorted(os.listdir(run))} in the run directory"
    assert before == {p: sorted(os.listdir(inputs[p])) for p in before}, "an existing directory changed"
    assert not any(os.path.exists(os.path.join(inputs["tmp"], f"out.{x}")) for x in ("parquet", "jsonl"))


def test_there_are_at_least_25_cases_over_every_command():
    commands = {next(a for a in argv if a.startswith(("launch.", "study."))) for _, argv, _ in CASES}
    assert len(CASES) >= 25
    assert commands == {"launch.cluster", "launch.evaluate", "study.fit_law", "launch.prepare_data", "study.runs",
                        "launch.scale", "study.plots"}
