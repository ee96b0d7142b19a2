"""`covrl-cluster --ray ADDRESS` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
a head, and nodes started as separate raylets, each with its own resources).

The learner ranks are pinned to one node and the generators to another (custom resources in their bundles,
`--ray-learner-resources` / `--ray-generator-resources`). Mid-run the generators' node is removed: Ray restarts
them on a node added with room, the hub re-issues what they held, and the run completes every step with nothing
lost or trained twice.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from common.metrics import read_metrics
from tests.integration.test_cluster import SMALL, start, wait_for_steps

pytestmark = pytest.mark.slow

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")


@pytest.fixture
def ray_cluster():
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head runs no role
    try:
        yield c
    finally:
        c.shutdown()


def placements(run) -> list[dict]:
    path = run / "placement.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_generators_on_another_node_survive_its_loss(tmp_path, ray_cluster):
    learner_node = ray_cluster.add_node(num_cpus=2, resources={"covrl_learner": 2})
    gen_node = ray_cluster.add_node(num_cpus=3, resources={"covrl_gen": 3})
    ray_cluster.wait_for_nodes()
    run = tmp_path / "ray"
    steps = 14
    p = start(run, "--gens", "3", "--learners", "2", "--steps", str(steps), *SMALL,
              "--ray", ray_cluster.address, "--ray-learner-resources", '{"covrl_learner": 1}',
              "--ray-generator-resources", '{"covrl_gen": 1}')
    try:
        wait_for_steps(run, 3, timeout_s=300)
        first = {e["role"]: e["node_id"] for e in placements(run)}
        assert {first["learner0"], first["learner1"]} == {learner_node.node_id}
        assert {first[f"gen{i}"] for i in range(3)} == {gen_node.node_id}  # another node than the learners'
        spare = ray_cluster.add_node(num_cpus=3, resources={"covrl_gen": 3})
        ray_cluster.wait_for_nodes()
        at_loss = len(read_metrics(str(run)))
        ray_cluster.remove_node(gen_node)
        wait_until(lambda: {e["role"] for e in placements(run) if e["node_id"] == spare.node_id}
                   == {"gen0", "gen1", "gen2"}, 120, "the generators to come back on the spare node")
        out, err = p.communicate(timeout=420)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=60)
            except Exception:
                p.kill()
    assert p.returncode == 0, f"launcher exited {p.returncode}\n{out}\n{err}"
    assert at_loss < steps, "the run ended before the node was removed: make it longer"
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    assert last["hub/lost_prompts"] == 0 and last.get("hub/duplicate_trained_prompts", 0) == 0
    restarted = [e for e in placements(run) if e["node_id"] == spare.node_id]
    assert all(e["restarted"] for e in restarted)  # Ray's actor restarts, not new actors
    # The restarted generators rejoined and were sent the weights the learner published, checksum for checksum.
    learner_sums = {int(r["weights/version"]): r["weights/checksum"] for r in rows}
    for g in range(3):
        with open(run / "generators" / f"gen{g}.jsonl") as f:
            got = [json.loads(line) for line in f]
        assert len({e["channel"] for e in got}) >= 2, f"gen{g} never rejoined after its node was lost"
        assert all(e["checksum"] == learner_sums[e["version"]] for e in got)
    assert "on Ray" in out
