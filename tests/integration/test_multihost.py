"""Multi-host: a generator in another network namespace reaches the hub and the weight channel
over a veth pair, as a generator on another host would. Needs root and `ip netns`; skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from common.metrics import read_metrics
from tests.conftest import REPO
from tests.integration.test_cluster import SMALL, start

pytestmark = pytest.mark.slow


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


def test_generator_in_another_network_namespace_trains_with_the_hub(tmp_path, netns):
    ns, host_addr, _ = netns
    run = tmp_path / "multihost"
    p = start(run, "--gens", "2", "--remote-gens", "1", "--learners", "1", "--steps", "4", *SMALL,
              "--set", f"transport.host={host_addr}")
    remote = None
    try:
        deadline = time.time() + 60
        while not (run / "cluster.json").exists():
            assert time.time() < deadline and p.poll() is None, "the launcher never wrote cluster.json"
            time.sleep(0.2)
        log = open(tmp_path / "remote-gen1.log", "wb")
        remote = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actors", "--run-dir", str(run),
                                   "--gen-id", "1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        out, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-3000:]
        assert remote.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        if remote is not None and remote.poll() is None:
            os.killpg(remote.pid, signal.SIGKILL)  # its own session: the generator and its reward workers
    text = (tmp_path / "remote-gen1.log").read_text()
    sent = int(text.split("after ")[-1].split(" rollout groups")[0])
    assert sent > 0, text[-2000:]  # it generated for the run, from the other namespace
    # Its weight channel crossed the veth pair too: from its join on, it holds what the learner published.

    with open(run / "generators" / "gen1.jsonl") as f:
        got = {e["version"]: e["checksum"] for e in map(json.loads, f)}
    published = {int(r["weights/version"]): r["weights/checksum"] for r in read_metrics(str(run))}
    assert got and max(got) == 4 and all(published[v] == c for v, c in got.items()), (got, published)
