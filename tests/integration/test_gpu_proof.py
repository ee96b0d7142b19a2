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


def test_the_gpu_proof_passes_its_cpu_rehearsal(tmp_path):
    # As `make gpu-proof` runs it on a GPU machine: a module, from the repository root.
    out = subprocess.run([sys.executable, "-m", "hardware.proof", "--rehearse-cpu",
                          "--stages", "vllm-kit,vllm-tests,vllm-run,z1,throughput,vllm-z3", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    doc = json.loads((tmp_path / "out" / "gpu_proof.json").read_text())
    z1, tput = doc["stages"]["z1"], doc["stages"]["throughput"]
    assert z1["passed"] and tput["passed"], doc
    # vLLM's own stages need a GPU (skipped, not passed); vllm-run's checks rehearse with the torch engine.
    assert doc["stages"]["vllm-kit"]["skipped"] and doc["stages"]["vllm-tests"]["skipped"]
    run = doc["stages"]["vllm-run"]
    assert run["passed"] and run["figures"]["engine"] == "torch" and run["figures"]["full_run"]["checksums_equal"] == 4
    assert run["figures"]["is_weight_mean"] == [1.0] * 4  # fp32 on both sides, on-policy: the same logprobs
    z3 = doc["stages"]["vllm-z3"]  # the same run and checks with the learner in ZeRO-3 (its own run directory)
    assert z3["passed"] and z3["figures"]["zero_stage"] == 3 and z3["figures"]["full_run"]["checksums_equal"] == 4
    assert run["figures"]["zero_stage"] == 1 and any("ZeRO-3" in line for line in z3["checks"])
    assert all(st["git_commit"] == doc["git_commit"] and st["date"] >= doc["date"] for st in doc["stages"].values())
    assert "ALL PASSED" in out.stdout
    full, resume = z1["figures"]["full_run"], z1["figures"]["resume"]
    assert full["checksums_equal"] == full["steps_logged"] == 4 and full["checkpoints"] == [2, 4]
    assert resume["resumed_from"] == 2 and resume["checksums_equal_after_resume"] == 3  # version 2 again, then 3, 4
    assert tput["figures"]["learner"]["tokens_per_s"] > 0 and tput["figures"]["generation"]["tokens_per_s"] > 0


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
