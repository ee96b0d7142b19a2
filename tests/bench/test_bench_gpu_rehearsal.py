"""The rest of `make gpu-proof`'s CPU rehearsal (tests/integration/test_gpu_proof.py rehearses the vLLM, ZeRO-1
and resume stages in `make test`): the throughput workers and the ZeRO-3 run with the vLLM run's checks. Here for
time (about 40 s); nothing is recorded, it passes or fails."""

from tests.helpers.gpu_rehearsal import rehearse


def test_the_gpu_proofs_throughput_and_zero3_stages_pass_their_cpu_rehearsal(tmp_path):
    doc, _ = rehearse(tmp_path, "throughput,vllm-z3")
    tput, z3 = doc["stages"]["throughput"], doc["stages"]["vllm-z3"]
    assert tput["passed"] and z3["passed"], doc
    assert tput["figures"]["learner"]["tokens_per_s"] > 0 and tput["figures"]["generation"]["tokens_per_s"] > 0
    # the vLLM run's checks with the learner in ZeRO-3 (its own run directory), rehearsed with the torch engine
    assert z3["figures"]["zero_stage"] == 3 and z3["figures"]["full_run"]["checksums_equal"] == 4
    assert any("ZeRO-3" in line for line in z3["checks"])
