"""GPU placement: which GPUs each role sees on one node, apart or colocated."""

import pytest

from common.runfiles import (MEMORY_FRACTION_ENV, ClusterInfo, Placement, PlacementError, apply_memory_fraction,
                            check_colocation, colocated_memory_fractions, place_gpus)
from common.config import Config, GeneratorConfig


def test_eight_gpus_four_learners_four_generators():
    p = place_gpus(8, 4, 4, 1)
    assert p.learners == [[0], [1], [2], [3]] and p.generators == [[4], [5], [6], [7]] and not p.colocated


def test_tensor_parallel_generators_get_consecutive_gpus():
    p = place_gpus(8, 2, 3, 2)
    assert p.learners == [[0], [1]] and p.generators == [[2, 3], [4, 5], [6, 7]] and not p.colocated


def test_one_gpu_colocates_a_learner_and_a_generator():
    p = place_gpus(1, 1, 1, 1)
    assert p.learners == [[0]] and p.generators == [[0]] and p.colocated
    p = place_gpus(8, 4, 3, 2)  # 10 GPUs apart; sharing, every GPU holds at most one of each
    assert p.learners == [[0], [1], [2], [3]] and p.generators == [[0, 1], [2, 3], [4, 5]] and p.colocated


def test_cpu_only_and_too_many():
    assert place_gpus(0, 4, 4, 1) == Placement([[]] * 4, [[]] * 4)
    with pytest.raises(PlacementError, match="need 10 GPUs apart, or, sharing GPUs .* at most 4 learner ranks and 4 "
                                             "generator GPUs; this node has 4: lower --learners, --gens or --tp"):
        place_gpus(4, 4, 3, 2)
    with pytest.raises(PlacementError, match="at most 2 learner ranks"):
        place_gpus(2, 3, 1, 1)
    with pytest.raises(PlacementError, match="--tp 0"):
        place_gpus(8, 1, 1, 0)


def test_colocation_rules_name_the_fix():
    one = place_gpus(1, 1, 1, 1)
    check_colocation(one, GeneratorConfig(gpu_memory_utilization=0.35))
    check_colocation(place_gpus(2, 1, 1, 1), GeneratorConfig(weight_transport="nccl"))  # apart: NCCL is fine
    with pytest.raises(PlacementError, match="NCCL cannot put two ranks of one group on one GPU: set "
                                             "generator.weight_transport = \"rpc\""):
        check_colocation(one, GeneratorConfig(weight_transport="nccl", gpu_memory_utilization=0.35))
    with pytest.raises(PlacementError, match="gpu_memory_utilization=0.95 leaves the learner 0% of its GPU; set it to at most 0.9"):
        check_colocation(one, GeneratorConfig(gpu_memory_utilization=0.95))
    assert colocated_memory_fractions(0.35) == (0.6, 0.35)


def test_ipc_needs_every_generator_on_learner_rank_0s_gpu_and_says_so_in_one_line():
    """CUDA IPC maps memory within one GPU and learner rank 0 alone publishes: ipc is accepted colocated with every
    generator on exactly its GPU (--gpus 1 --gens 1 --tp 1, or more learner ranks beside it), and refused before
    anything starts otherwise, each time in one line with the fix."""
    ipc = GeneratorConfig(weight_transport="ipc", gpu_memory_utilization=0.35)
    check_colocation(place_gpus(1, 1, 1, 1), ipc)
    check_colocation(place_gpus(2, 2, 1, 1), ipc)  # learner rank 1 on GPU 1; the one generator on rank 0's GPU 0
    fix = r"run one generator with --tp 1 on learner rank 0's GPU \(e.g. --gpus 1 --gens 1 --tp 1\), or set " \
          r"generator.weight_transport = \"rpc\"$"
    for placement, why in [
        (place_gpus(2, 1, 1, 1), r"learner rank 0 is on GPU \[0\] and the generators on GPUs of their own \[\[1\]\]"),
        (place_gpus(2, 1, 1, 2), r"generator 0 spans 2 GPUs \[0, 1\] \(--tp 2; ipc maps the slots into one worker\)"),
        (place_gpus(2, 2, 2, 1), r"generator 1 is on GPU \[1\], not learner rank 0's \[0\]"),
        (place_gpus(0, 1, 1, 1), r"no role has a GPU \(--gpus 0, or Ray, which places every role itself, maybe "
                                    r"on other GPUs or hosts\)"),
    ]:
        head = r"^generator.weight_transport = \"ipc\" maps learner rank 0's GPU memory into a vLLM generator on"
        with pytest.raises(PlacementError, match=rf"{head} that GPU, but here {why}: {fix}") as e:
            check_colocation(placement, ipc)
        assert "\n" not in str(e.value)


def test_memory_fraction_is_read_checked_and_skipped_on_cpu(monkeypatch):
    import torch

    assert apply_memory_fraction("cpu", {}) is None
    assert apply_memory_fraction("cpu", {MEMORY_FRACTION_ENV: "0.5"}) is None  # no CUDA allocator to cap
    for bad in ("1.5", "0", "half", "-0.2"):
        with pytest.raises(ValueError, match=f"{MEMORY_FRACTION_ENV}='{bad}': a fraction of the GPU's memory in "
                                             "\\(0, 1\\].*unset it or give e.g. 0.5"):
            apply_memory_fraction("cpu", {MEMORY_FRACTION_ENV: bad})
    calls = []  # a CUDA process (faked): the cap goes to torch for the right device
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert apply_memory_fraction("cuda", {}) is None and calls == []  # no variable: not colocated, nothing capped
    assert apply_memory_fraction("cuda", {MEMORY_FRACTION_ENV: "0.35"}) == 0.35  # index-less: the current device
    assert apply_memory_fraction("cuda:1", {MEMORY_FRACTION_ENV: "0.5"}) == 0.5
    assert calls == [(0.35, torch.device("cuda", 0)), (0.5, torch.device("cuda", 1))]


def _environments(run_dir, info, cfg, **kw) -> dict[str, dict[str, str]]:
    """Each role's whole environment as the local backend starts it."""
    from launch.local import LocalBackend, role_specs

    backend = LocalBackend(run_dir, cfg)
    return {s.name: backend.environment(s) for s in role_specs(run_dir, info, cfg, _placement(info, **kw))}


def _placement(info, gpus=0, tp=1):
    return place_gpus(gpus, info.learners, info.generators, tp)


def test_role_environment_carries_the_placement(tmp_path):
    info = ClusterInfo(run_id="r", hub_addr="127.0.0.1:1", weight_addr="127.0.0.1:2", generators=2, learners=2)
    specs = _environments(str(tmp_path), info, Config(), gpus=6, tp=2)
    assert specs["learner0"]["CUDA_VISIBLE_DEVICES"] == "0,1" and specs["learner1"]["LOCAL_RANK"] == "1"
    assert specs["gen0"]["CUDA_VISIBLE_DEVICES"] == "2,3" and specs["gen1"]["CUDA_VISIBLE_DEVICES"] == "4,5"
    cpu = _environments(str(tmp_path), info, Config())
    assert all(env["CUDA_VISIBLE_DEVICES"] == "" for env in cpu.values())  # --gpus 0: no role sees a GPU


def test_colocated_roles_share_one_gpu_and_split_its_memory(tmp_path):
    from launch.local import placement_line

    info = ClusterInfo(run_id="r", hub_addr="127.0.0.1:1", weight_addr="127.0.0.1:2", generators=1, learners=1)
    cfg = Config(generator=GeneratorConfig(gpu_memory_utilization=0.35))
    specs = _environments(str(tmp_path), info, cfg, gpus=1)
    assert specs["learner0"]["CUDA_VISIBLE_DEVICES"] == specs["gen0"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert specs["learner0"][MEMORY_FRACTION_ENV] == "0.6" and specs["gen0"][MEMORY_FRACTION_ENV] == "0.35"
    apart = _environments(str(tmp_path), info, cfg, gpus=2)
    assert MEMORY_FRACTION_ENV not in apart["learner0"] and MEMORY_FRACTION_ENV not in apart["gen0"]
    line = placement_line(place_gpus(1, 1, 1, 1), cfg)
    assert "learner ranks on [[0]], generators on [[0]] (colocated: each generator takes 35%" in line


def test_the_one_gpu_recipe_is_accepted_on_one_gpu(tmp_path, tiny_model_dir):
    """`--gens 1 --learners 1 --gpus 1` with the 1-GPU recipe passes every launcher check (colocated)."""
    import os

    from launch import cluster

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "recipes", "qwen2.5-1.5b-1gpu-kl-cov.toml")
    model = tiny_model_dir  # the launcher loads its tokenizer and every data row before anything starts
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    args = cluster.parse_args(["--gens", "1", "--learners", "1", "--gpus", "1", "--config", recipe, "--run-dir",
                               str(tmp_path / "run"), "--set", f'model.path="{model}"', "--set",
                               f'data.train_files=["{data}"]', "--set", "data.eval_files=[]"])
    run = cluster.prepare(args, gpus=1)
    assert run.placement == place_gpus(1, run.info.learners, run.info.generators, 1) and run.placement.colocated
    assert run.cfg.generator.weight_transport == "rpc" and run.cfg.generator.gpu_memory_utilization <= 0.9


def test_colocated_generators_start_after_the_learners_are_built(tmp_path):
    """vLLM fails at start-up if another process frees GPU memory while it measures it: a generator that shares a
    GPU with a learner rank waits for RUN_DIR/learners.ready (written by learner rank 0 after every rank's engine
    is built); generators on GPUs of their own, and CPU runs, start at once."""
    from common.runfiles import READY_FILE, clear_learners_ready, mark_learners_ready
    from launch.local import role_specs
    from launch.supervisor import due

    info = ClusterInfo(run_id="r", hub_addr="127.0.0.1:1", weight_addr="127.0.0.1:2", generators=1, learners=1)
    cfg = Config(generator=GeneratorConfig(gpu_memory_utilization=0.35))
    shared = {s.name: s for s in role_specs(str(tmp_path), info, cfg, _placement(info, gpus=1))}
    apart = {s.name: s for s in role_specs(str(tmp_path), info, cfg, _placement(info, gpus=2))}
    assert due(shared["learner0"], str(tmp_path)) and not due(shared["gen0"], str(tmp_path))
    assert due(apart["gen0"], str(tmp_path))
    mark_learners_ready(str(tmp_path))
    assert (tmp_path / READY_FILE).exists() and due(shared["gen0"], str(tmp_path))
    clear_learners_ready(str(tmp_path))  # a launch (or a resume) starts from no marker
    assert not due(shared["gen0"], str(tmp_path))
