"""`covrl-cluster --ray ADDRESS` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
a head, and nodes started as separate raylets, each with its own resources).

The learner ranks are pinned to one node and the generators to another (custom resources in their bundles,
`--ray-learner-resources` / `--ray-generator-resources`). Mid-run the generators' node is removed: Ray restarts
them on a node added with room, the hub re-issues what they held, and the run completes every step with nothing
lost or trained twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from common.metrics import read_metrics
from tests.helpers.paths import REPO
from tests.helpers.run_records import placements
from tests.helpers.runs import SMALL, start, stop_gracefully, wait_for_steps

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # its timing assumes the machine to itself

pytest.importorskip("ray.cluster_utils")  # every test here needs Ray (`ray_cluster`: tests/integration/conftest.py)


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
            stop_gracefully(p)
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


def test_a_learner_rank_lost_on_ray_stops_the_run_and_resume_on_ray_continues_it(tmp_path, ray_cluster):
    """Learner rank 0's process is SIGKILLed after the step-2 checkpoint: the run stops and names the checkpoint
    and the command that continues it; that command (--resume on the same Ray cluster) ends every step."""
    ray_cluster.add_node(num_cpus=4)
    ray_cluster.wait_for_nodes()
    run = tmp_path / "ray"
    steps = 6
    p = start(run, "--gens", "1", "--learners", "2", "--steps", str(steps), *SMALL,
              "--set", "run.checkpoint_every_steps=2", "--ray", ray_cluster.address)
    try:
        wait_until(lambda: (run / "checkpoints" / "step_2" / "covrl_state.json").exists(), 300, "checkpoint step_2")
        actor = psutil.Process(next(e["pid"] for e in placements(run) if e["role"] == "learner0"))
        (role,) = [c for c in actor.children() if c.cmdline()[1:3] == ["-m", "learner"]]
        os.killpg(role.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1 and "learner0 exited with code -9" in err, err[-2000:]
    done = len(read_metrics(str(run)))
    assert 2 <= done < steps
    hint = f"(continue with covrl resume {run} --ray {ray_cluster.address})"
    assert hint in out, out

    p = start(run, "--resume", str(run), "--ray", ray_cluster.address)
    out, err = p.communicate(timeout=420)
    assert p.returncode == 0, f"resume exited {p.returncode}\n{out}\n{err}"
    assert "resuming from" in out and "on Ray" in out
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["hub/lost_prompts"] == 0 and rows[-1].get("hub/duplicate_trained_prompts", 0) == 0
    assert sum(1 for e in placements(run) if e["role"] == "learner0") == 2  # a new learner0 on Ray, not a restart


@pytest.mark.long  # make bench: the roles on Ray are the other tests'; this adds the instance covrl starts itself
def test_ray_without_an_address_starts_a_local_instance_and_stops_it(tmp_path):
    """`--ray` alone: covrl starts Ray on this machine, runs the roles on it and stops it at the end; nothing
    under that instance's directory is left running."""
    ray_tmp = tempfile.mkdtemp(prefix="covrl-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        run = tmp_path / "local"
        p = subprocess.Popen([sys.executable, "-m", "launch.cluster", "--run-dir", str(run), "--quiet", "--gens", "2",
                              "--learners", "1", "--steps", "3", *SMALL, "--ray"], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "RAY_TMPDIR": ray_tmp})
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"launcher exited {p.returncode}\n{out}\n{err}"
        assert "on Ray (a local instance)" in out
        assert [r["step"] for r in read_metrics(str(run))] == [1, 2, 3]
        assert {e["role"] for e in placements(run)} == {"learner0", "gen0", "gen1"}
        assert os.listdir(os.path.join(ray_tmp, "ray")), "Ray did not use RAY_TMPDIR: this test checks nothing"
        left = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(ray_tmp in a for a in proc.info["cmdline"] or ()):
                left.append((proc.info["pid"], " ".join(proc.info["cmdline"])[:200]))
        assert not left, f"processes of the local Ray instance still running: {left}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
