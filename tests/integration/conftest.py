"""Fixtures of the integration tests that start Ray clusters on this machine (several modules take them), and the
order in which `make test` hands the modules to its two workers."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.helpers.ray_autoscaling import start_head
from tests.helpers.ray_nodes import RAY, stop_node

# The longest modules (about 5, 5, 2.5, 2 and 1.5 minutes here, alone), started first: `make test` gives whole modules
# to its two workers (`--dist loadfile`) in collection order, and a long module taken last would leave one worker
# idle. A scheduling hint only: a module missing here runs after these, nothing else changes.
LONGEST_FIRST = ("test_resume", "test_cluster", "test_gpu_proof", "test_study", "test_user_features",
                 "test_recorded_runs", "test_loss_modes", "test_files_and_evaluate", "test_learner_options")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable: order kept


@pytest.fixture
def ray_cluster():
    """A multi-node Ray cluster in this process (`ray.cluster_utils.Cluster`): a head that runs no role; the test
    adds the nodes it needs. Skips the test where Ray is not installed."""
    ray_cluster_utils = pytest.importorskip("ray.cluster_utils")
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head runs no role
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def ray_autoscaling(tmp_path):
    """An autoscaling cluster: head with 2 CPUs; node type gen_node ({"CPU": 1, "covrl_gen": 1}, 0 to 2 nodes)
    that the autoscaler adds on demand and removes after 3 s idle. Tear-down ends every process it started."""
    if shutil.which(RAY) is None:
        pytest.skip(f"Ray's command line is not installed ({RAY})")
    temp = tempfile.mkdtemp(prefix="covrl-ray-")  # short: Ray's socket paths must fit in 107 characters
    cluster = None
    try:
        cluster = start_head(tmp_path, temp)
        yield cluster
    finally:
        if cluster is not None:
            stop_node(cluster.head)
        shutil.rmtree(temp, ignore_errors=True)
