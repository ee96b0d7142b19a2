"""Issue 6 (placement): which GPUs each role sees on one node."""

import pytest

from common.cluster import ClusterInfo, PlacementError, place_gpus
from common.config import Config


def test_eight_gpus_four_learners_four_generators():
    learners, gens = place_gpus(8, 4, 4, 1)
    assert learners == [[0], [1], [2], [3]] and gens == [[4], [5], [6], [7]]


def test_tensor_parallel_generators_get_consecutive_gpus():
    learners, gens = place_gpus(8, 2, 3, 2)
    assert learners == [[0], [1]] and gens == [[2, 3], [4, 5], [6, 7]]


def test_cpu_only_and_too_many():
    assert place_gpus(0, 4, 4, 1) == ([[]] * 4, [[]] * 4)
    with pytest.raises(PlacementError, match="need 10 GPUs and this node has 8; lower --learners, --gens or --tp"):
        place_gpus(8, 4, 3, 2)
    with pytest.raises(PlacementError, match="--tp 0"):
        place_gpus(8, 1, 1, 0)


def test_role_environment_carries_the_placement(tmp_path):
    from launch.cluster import role_specs

    info = ClusterInfo(run_id="r", hub_addr="127.0.0.1:1", weight_addr="127.0.0.1:2", generators=2, learners=2)
    specs = {s.name: s.env for s in role_specs(str(tmp_path), info, Config(), gpus=6, tp=2)}
    assert specs["learner0"]["CUDA_VISIBLE_DEVICES"] == "0,1" and specs["learner1"]["LOCAL_RANK"] == "1"
    assert specs["gen0"]["CUDA_VISIBLE_DEVICES"] == "2,3" and specs["gen1"]["CUDA_VISIBLE_DEVICES"] == "4,5"
    cpu = {s.name: s.env for s in role_specs(str(tmp_path), info, Config())}
    assert all(env["CUDA_VISIBLE_DEVICES"] == "" for env in cpu.values())  # --gpus 0: no role sees a GPU
