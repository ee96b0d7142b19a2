"""The rest of `make gpu-proof`'s CPU rehearsal (tests/integration/test_gpu_proof.py rehearses the vLLM, ZeRO-1
and resume stages in `make test`): the throughput workers, the ZeRO-3 run with the vLLM run's checks, and the
generation stage with the torch engine standing in for vLLM. Here for time (about 40 s, and 30-60 s for generation);
nothing is recorded, it passes or fails."""

from tests.helpers.gpu_rehearsal import rehearse


def test_the_gpu_proofs_throughput_and_zero3_stages_pass_their_cpu_rehearsal(tmp_path):
    doc, _ = rehearse(tmp_path, "throughput,vllm-z3,generation")
    tput, z3 = doc["stages"]["throughput"], doc["stages"]["vllm-z3"]
    assert tput["passed"] and z3["passed"], doc
    assert tput["figures"]["learner"]["tokens_per_s"] > 0 and tput["figures"]["generation"]["tokens_per_s"] > 0
    # the vLLM run's checks with the learner in ZeRO-3 (its own run directory), rehearsed with the torch engine
    assert z3["figures"]["zero_stage"] == 3 and z3["figures"]["full_run"]["checksums_equal"] == 4
    assert any("ZeRO-3" in line for line in z3["checks"])
    gen = doc["stages"]["generation"]
    assert gen["passed"] and not gen.get("skipped"), gen["checks"]
    fig = gen["figures"]
    for wl in ("heavy", "fixed"):  # the torch engine's runs; the bare vLLM ones are skipped, with the reason
        runs = fig["runs"]["eager"][wl]
        assert runs["loop"]["status"] == runs["engine"]["status"] == "measured", runs
        assert runs["bare"]["status"] == runs["bare-covrl-params"]["status"] == "skipped", runs
    assert fig["engines"]["graphs"]["status"] == "skipped"
    kv = fig["engines"]["eager"]["kv_cache"]  # the plan's KV cache for the stage's engine; nothing measured on CPU
    assert kv["plan"]["kv_tokens"] > 0 and kv["plan"]["kv_cache_bytes"] > 0 and kv["plan"]["gpu_bytes"] > 0, kv
    assert kv["kv_tokens"] is None and kv["within_tolerance"] is None and "CPU rehearsal" in kv["no_verdict"]
    assert fig["memory_plan"]["within"] == {"eager KV cache": None}
    assert fig["publish"]["rpc"]["status"] == "measured" and fig["publish"]["nccl"]["status"] == "not_run"
    assert fig["goals"]["loop"]["by_engine"]["eager"]["met"] is None  # a stand-in reference: no verdict on CPU
