"""Generators on Ray's autoscaler: a covrl run on an autoscaling cluster (tests/helpers/ray_autoscaling.py: a
head whose real autoscaler, v2, adds and removes local raylets as nodes; a node type with one generator's room).

The learner rank runs on the head; each generator needs `covrl_gen`, which only the autoscaler's nodes offer. The
run starts with 1 generator: the autoscaler adds a node for it. Scaled to 3 (the path the autoscale policy takes,
RUN_DIR/generators.json), it adds a second node, has no room for a third (max 2 nodes): that generator is said to
be waiting, then given up after cluster.placement_timeout_s with the cluster's free resources, and asked for again.
Scaled to 1, the drained generator's bundle and the waiting one are let go, and the autoscaler removes the idle
node. covrl's request to the autoscaler (`request_resources`) is the generators waiting for room: gen2's bundle
while it waits, nothing once every generator is placed or let go (Ray's v2 autoscaler keeps nodes for a request on
top of what runs, so a request that still counted placed generators would keep the idle node).
Nothing is lost or trained twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from common.metrics import read_metrics
from launch import scale
from tests.helpers.paths import REPO
from tests.helpers.runs import SMALL, stop_gracefully

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # its timing assumes the machine to itself

GEN = {"CPU": 1.0, "covrl_gen": 1.0}

# The autoscaler's view: what covrl asked it for (its cluster constraint), from a short-lived driver.
_ASKED = """
import json, sys, ray
from ray.autoscaler.v2.sdk import get_cluster_status
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
demand = get_cluster_status(sys.argv[1]).resource_demands.cluster_constraint_demand
print("ASKED " + json.dumps([[b.bundle, b.count] for d in demand for b in d.bundles_by_count]))
"""


# What the autoscaler sees, for a failure's message.
_STATUS = """
import sys, ray
from ray.autoscaler.v2.sdk import get_cluster_status
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
s = get_cluster_status(sys.argv[1])
print("active", [(n.node_id[-5:], n.resource_usage.usage if n.resource_usage else None) for n in s.active_nodes])
print("idle", [(n.node_id[-5:], n.resource_usage.idle_time_ms if n.resource_usage else None) for n in s.idle_nodes])
print("demand", s.resource_demands)
print("pgs", ray.util.placement_group_table())
"""


def asked(cluster) -> list[tuple[str, int]]:
    got = json.loads(cluster.run_client(_ASKED).stdout.split("ASKED ")[-1].splitlines()[0])
    return sorted((json.dumps(bundle, sort_keys=True), count) for bundle, count in got)


def bundles(*counts: tuple[dict, int]) -> list[tuple[str, int]]:
    return sorted((json.dumps(bundle, sort_keys=True), count) for bundle, count in counts)


def wait_until(cond, timeout_s: float, what: str, p) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert p.poll() is None, f"the launcher exited {p.returncode} while waiting for {what}"
        assert time.time() < deadline, f"no {what} after {timeout_s:.0f}s"
        time.sleep(0.5)


def test_the_autoscaler_adds_a_node_per_new_generator_and_removes_it_after_a_scale_down(tmp_path, ray_autoscaling):
    cluster, run, err_path = ray_autoscaling, tmp_path / "run", tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        p = subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run),
                              "--quiet", "--gens", "1", "--learners", "1", "--steps", "1000", *SMALL,
                              "--ray", cluster.address, "--ray-generator-resources", '{"covrl_gen": 1}',
                              "--set", "cluster.placement_timeout_s=10"],
                             cwd=REPO, env=cluster.client_env(), stdout=subprocess.DEVNULL, stderr=err, text=True)
    said = lambda text: text in err_path.read_text()  # noqa: E731
    gens = lambda: read_metrics(str(run))[-1]["cluster/generators"] if read_metrics(str(run)) else 0  # noqa: E731
    try:
        wait_until(lambda: len(read_metrics(str(run))) >= 2, 180, "step 2", p)
        first = cluster.nodes_with("covrl_gen")
        assert len(first) == 1  # added by the autoscaler for generator 0
        assert asked(cluster) == []  # placed: nothing more asked for
        assert scale.main([str(run), "--gens", "3"]) == 0
        wait_until(lambda: gens() == 2 and len(cluster.nodes_with("covrl_gen")) == 2, 120, "a node for gen1", p)
        wait_until(lambda: said("gen2 could not be placed: no Ray node had room for its bundle"), 90,
                   "the message that gen2 has no room", p)
        assert said("gen2 is waiting for room on the Ray cluster")
        # gen2's bundle, while it waits (for a tick after each give-up it is not asked for: wait for the next ask)
        wait_until(lambda: asked(cluster) == bundles((GEN, 1)), 30, "the request for gen2's bundle", p)
        assert scale.main([str(run), "--gens", "1"]) == 0
        try:
            wait_until(lambda: cluster.nodes_with("covrl_gen") == first, 60, "the idle node's removal", p)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{cluster.run_client(_STATUS).stdout}") from None
        assert asked(cluster) == []
        at_end = len(read_metrics(str(run)))
    finally:
        stop_gracefully(p, timeout_s=120)  # the learner finishes its step and checkpoints
    assert p.returncode == 130, err_path.read_text()[-3000:]
    rows = read_metrics(str(run))
    assert len(rows) >= at_end and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    last = rows[-1]
    assert last["hub/lost_prompts"] == 0 and last.get("hub/duplicate_trained_prompts", 0) == 0
    assert last["hub/generators_drained"] == 1 and last["cluster/generators"] == 1
    placed = [json.loads(line) for line in open(run / "placement.jsonl")]
    nodes = {e["role"]: e["node_id"] for e in placed}
    assert nodes["gen1"] != nodes["gen0"] and nodes["gen0"] in first  # one generator per autoscaled node
    assert "gen2" not in nodes  # never placed
