"""`make gpu-proof` is one command for the next GPU session: its whole logic (placement checks, the colocated
runs, checksums on both sides, checkpoint and resume, the throughput workers, the JSON it records) rehearsed on
the CPU at toy scale, so a GPU lease is never spent finding a bug in the script."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def rehearse(tmp_path, stages: str) -> tuple[dict, str]:
    """`make gpu-proof`'s stages as it runs them on a GPU machine (a module, from the repository root), on the CPU:
    (gpu_proof.json, stdout). The rehearsal is split for time: the throughput workers and the ZeRO-3 run are
    rehearsed by `make bench` (tests/bench/test_bench_gpu_rehearsal.py)."""
    out = subprocess.run([sys.executable, "-m", "hardware.proof", "--rehearse-cpu", "--stages", stages,
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    doc = json.loads((tmp_path / "out" / "gpu_proof.json").read_text())
    assert all(st["git_commit"] == doc["git_commit"] and st["date"] >= doc["date"] for st in doc["stages"].values())
    assert "ALL PASSED" in out.stdout
    return doc, out.stdout


def test_the_gpu_proof_passes_its_cpu_rehearsal(tmp_path):
    doc, _ = rehearse(tmp_path, "vllm-kit,vllm-tests,vllm-run,z1")
    z1 = doc["stages"]["z1"]
    assert z1["passed"], doc
    # vLLM's own stages need a GPU (skipped, not passed); vllm-run's checks rehearse with the torch engine.
    assert doc["stages"]["vllm-kit"]["skipped"] and doc["stages"]["vllm-tests"]["skipped"]
    run = doc["stages"]["vllm-run"]
    assert run["passed"] and run["figures"]["engine"] == "torch" and run["figures"]["full_run"]["checksums_equal"] == 4
    assert run["figures"]["is_weight_mean"] == [1.0] * 4  # fp32 on both sides, on-policy: the same logprobs
    assert run["figures"]["zero_stage"] == 1
    full, resume = z1["figures"]["full_run"], z1["figures"]["resume"]
    assert full["checksums_equal"] == full["steps_logged"] == 4 and full["checkpoints"] == [2, 4]
    assert resume["resumed_from"] == 2 and resume["checksums_equal_after_resume"] == 3  # version 2 again, then 3, 4


def test_run_as_a_file_it_refuses_in_one_line(tmp_path):
    """`python3 hardware/proof.py` puts hardware/ first on the import path, so covrl's packages are not importable:
    the proof says so in one line and how to run it, rather than failing on an import (its top level imports only
    the standard library)."""
    # -S: without site-packages, where .venv's editable install would make covrl importable from anywhere
    out = subprocess.run([sys.executable, "-S", os.path.join(REPO, "hardware", "proof.py"), "--rehearse-cpu",
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "python3 -m hardware.proof" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written
