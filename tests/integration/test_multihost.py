"""Multi-host through Ray: generators on another host reach the hub and the weight channel over a real network.

A network namespace behind a veth pair stands in for the other host. A Ray head runs on this side, bound to the
veth's host-side address, and offers the learner's resource; a Ray worker node runs inside the namespace, bound to
the address there, and offers the generators'. `covrl-cluster --ray HOST:PORT` pins learner rank 0 to the head
(so the hub, the weight channel's store and the rendezvous bind the host-side address) and both generators to the
namespace node: every rollout and every weight version crosses the veth pair. The test checks where Ray put each
role (RUN_DIR/placement.jsonl), that the run completes, that every version each generator holds carries the
learner's checksum, and that what the generators sent was trained with nothing lost.

Needs root and `ip netns` (skipped otherwise, with the reason). RUN_DIR is on this machine's filesystem, which the
namespace shares, as a cluster's shared directory would be.

Ray's token authentication (Ray 2.60) must be set the same way on every node and on the driver: `ray start --head`
turns it on by itself when RAY_AUTH_MODE is unset and ~/.ray/auth_token exists, but `ray start --address=...` (a
worker node) and `ray.init(address=HOST:PORT)` (the launcher) never do: they connect with auth disabled and the
head refuses them ("InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'"). So the test sets
RAY_AUTH_MODE=token and a fresh RAY_AUTH_TOKEN in the environment that the head, the worker node and the launcher
inherit, as a real cluster's nodes and its driver would all be given: ~/.ray is neither read nor written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile

import pytest

from common.metrics import read_metrics
from tests.helpers.ports import free_port
from tests.helpers.ray_nodes import RAY, start_node, stop_node, wait_started
from tests.helpers.runs import SMALL, start, stop_gracefully

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # its timing assumes the machine to itself


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def netns():
    """A namespace with one end of a veth pair: (namespace, address on this side, address inside)."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    tag = os.getpid() % 10000
    ns, host_if, ns_if = f"covrl{tag}", f"cvh{tag}", f"cvn{tag}"
    net = f"10.{200 + tag % 50}.{tag % 250}"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here ({made.stderr.strip()}); needs root / CAP_NET_ADMIN")
    try:
        for cmd in (["link", "add", host_if, "type", "veth", "peer", "name", ns_if],
                    ["link", "set", ns_if, "netns", ns],
                    ["addr", "add", f"{net}.1/24", "dev", host_if],
                    ["link", "set", host_if, "up"],
                    ["netns", "exec", ns, "ip", "addr", "add", f"{net}.2/24", "dev", ns_if],
                    ["netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
                    ["netns", "exec", ns, "ip", "link", "set", "lo", "up"]):
            r = _ip(*cmd)
            assert r.returncode == 0, f"ip {' '.join(cmd)}: {r.stderr}"
        yield ns, f"{net}.1", f"{net}.2"
    finally:
        _ip("link", "del", host_if)  # removes both ends
        _ip("netns", "del", ns)


@pytest.mark.long  # make bench, for time: Ray across local nodes is test_ray.py's; this adds a real network between them
def test_generators_on_a_ray_node_in_another_network_namespace_train_with_the_hub(tmp_path, netns, monkeypatch):
    ns, host_addr, ns_addr = netns
    if shutil.which(RAY) is None:
        pytest.skip(f"Ray's command line is not installed ({RAY})")
    # One token for the whole cluster, in the environment of both nodes and of the launcher (see the docstring).
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = free_port(host_addr)
    temp = tempfile.mkdtemp(prefix="covrl-ray-")  # short: Ray's socket paths must fit in 107 characters
    head_log, worker_log = tmp_path / "ray-head.log", tmp_path / "ray-worker.log"
    nodes: list[subprocess.Popen] = []
    p = None
    run = tmp_path / "multihost"
    try:
        nodes.append(start_node([RAY, "start", "--head", f"--node-ip-address={host_addr}", f"--port={port}",
                                 "--num-cpus=2", '--resources={"covrl_learner": 2}', "--include-dashboard=false",
                                 f"--temp-dir={temp}/head", "--block"], head_log))
        wait_started(nodes[0], head_log, "the Ray head")
        nodes.append(start_node(["ip", "netns", "exec", ns, RAY, "start", f"--address={host_addr}:{port}",
                                 f"--node-ip-address={ns_addr}", "--num-cpus=2", '--resources={"covrl_gen": 2}',
                                 f"--temp-dir={temp}/worker", "--block"], worker_log))
        wait_started(nodes[1], worker_log, "the Ray worker node in the namespace")
        p = start(run, "--gens", "2", "--learners", "1", "--steps", "4", *SMALL, "--ray", f"{host_addr}:{port}",
                  "--ray-learner-resources", '{"covrl_learner": 1}', "--ray-generator-resources", '{"covrl_gen": 1}')
        out, err = p.communicate(timeout=420)
        logs = "".join(f"\n--- {f}\n" + (run / "logs" / f).read_text(errors="replace")[-3000:]
                       for f in sorted(os.listdir(run / "logs"))) if (run / "logs").is_dir() else ""
        assert p.returncode == 0, f"launcher exited {p.returncode}\n{out}\n{err[-3000:]}{logs}"
    finally:
        if p is not None and p.poll() is None:
            stop_gracefully(p)
        for node in reversed(nodes):  # the worker node first, then the head
            stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)

    # Where Ray put each role: the learner on the head (this side), both generators on the namespace's node.
    with open(run / "placement.jsonl") as f:
        placed = [json.loads(line) for line in f]
    where = {e["role"]: e for e in placed}
    assert len(placed) == 3 and not any(e["restarted"] for e in placed), placed  # each started once, where it stayed
    assert where["learner0"]["ip"] == host_addr, where
    assert where["gen0"]["ip"] == where["gen1"]["ip"] == ns_addr, where
    assert where["gen0"]["node_id"] == where["gen1"]["node_id"] != where["learner0"]["node_id"], where
    assert f"hub on {host_addr}:" in out, out

    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    assert last["hub/lost_prompts"] == 0 and last.get("hub/duplicate_trained_prompts", 0) == 0, last
    # The weight channel crossed the veth pair: every version each generator holds is what the learner published.
    published = {int(r["weights/version"]): r["weights/checksum"] for r in rows}
    assert len(set(published.values())) > 1, "weights never changed: nothing was trained"
    for g in (0, 1):
        with open(run / "generators" / f"gen{g}.jsonl") as f:
            got = {e["version"]: e["checksum"] for e in map(json.loads, f)}
        assert sorted(got) == [1, 2, 3, 4] and all(published[v] == c for v, c in got.items()), (g, got, published)
    # What they generated, from the other namespace, was trained: they are the run's only generators, both joined
    # the weight channels, every step trained generated tokens, and together they sent at least the
    # 4 steps x 8 groups that were trained (some more, dropped by the filter).
    assert all(r["weights/joins"] == 2 and r["learner/ranks_participating"] == 1 and r["response_length/mean"] > 0
               for r in rows), rows
    sent = []
    for g in (0, 1):
        text = (run / "logs" / f"gen{g}.log").read_text(errors="replace")
        sent.append(int(text.split("after ")[-1].split(" rollout groups")[0]))
        assert sent[-1] > 0, text[-2000:]
    assert sum(sent) >= 4 * 8, sent
