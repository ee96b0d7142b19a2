"""A Ray autoscaling cluster on this machine for tests: a head whose real autoscaler adds and removes fake nodes."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.paths import REPO
from tests.helpers.ports import free_port
from tests.helpers.ray_nodes import RAY, stop_node, wait_started

FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
HEAD_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"  # the fake provider's fixed head node id
GEN_NODE = {"resources": {"CPU": 1, "covrl_gen": 1, "object_store_memory": 100 * 2**20},
            "node_config": {}, "min_workers": 0, "max_workers": 2}

_NODES_WITH = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("NODES " + json.dumps([n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(sys.argv[2], 0) > 0]))
"""


@dataclass
class AutoscalingRay:
    """A running cluster: `address` for `ray.init(address=...)` or `covrl run --ray`, and the `env` a client needs."""

    address: str
    env: dict[str, str]
    log: Path
    head: subprocess.Popen | None = None  # `ray start --head --block`, leader of the cluster's session

    def client_env(self) -> dict[str, str]:
        """This process's environment with the cluster's client variables: for a client subprocess."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        return {**env, **self.env}

    def run_client(self, script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """`python -c script ADDRESS *args` with the client environment. Fails the test if it exits non-zero, runs
        past `timeout`, or the head exits meanwhile (a client would otherwise wait for the GCS for minutes)."""
        argv, deadline = [sys.executable, "-c", script, self.address, *args], time.time() + timeout
        with subprocess.Popen(argv, cwd=REPO, env=self.client_env(), text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as p:
            while True:
                try:
                    out, err = p.communicate(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    if (self.head is not None and self.head.poll() is not None) or time.time() > deadline:
                        p.kill()
                        out, err = p.communicate()
                        head = self.log.read_text(errors="replace")[-3000:]
                        raise AssertionError(f"client ran {timeout:.0f}s or the head exited:\n{head}\n{err[-3000:]}")
        assert p.returncode == 0, f"client exited {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def nodes_with(self, resource: str) -> list[str]:
        """Ids of the alive nodes that offer `resource` (asked from a short-lived driver in a subprocess)."""
        out = self.run_client(_NODES_WITH, resource).stdout  # Ray may print its own lines there too
        return json.loads(out.split("NODES ")[-1].splitlines()[0])


def autoscaling_config(gcs_address: str, head_cpus: int, node_types: dict, idle_timeout_s: float) -> dict:
    """The autoscaler's cluster config for the fake provider (after Ray's fake_multi_node/example.yaml), v2."""
    # "external" with the fake provider's class is "fake_multinode" without the defaults file the wheel lacks.
    provider = {"type": "external", "module": FAKE_PROVIDER, "disable_node_updaters": True,
                "disable_launch_config_check": True, "gcs_address": gcs_address,
                "launch_multiple": True, "head_node_id": HEAD_ID}
    head = {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}
    return {"cluster_name": "covrl-fake", "provider": provider, "auth": {}, "docker": {},
            "max_workers": sum(t["max_workers"] for t in node_types.values()),
            "available_node_types": {**node_types, "ray.head.default": head}, "head_node_type": "ray.head.default",
            "upscaling_speed": 100.0, "idle_timeout_minutes": idle_timeout_s / 60,
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": []}


def start_head(tmp: Path, temp_dir: str, head_cpus: int = 2, node_types: dict | None = None,
               idle_timeout_s: float = 3.0) -> AutoscalingRay:
    """Start the head with its autoscaler; returns once the head is up (no worker node yet: min_workers 0). Tests take
    the `ray_autoscaling` fixture (tests/integration/conftest.py), which calls this.

    Ray's "fake_multinode" node provider makes each node the autoscaler launches a local raylet (started by the
    autoscaler's monitor process on the head), so scaling up and down runs through the real autoscaler, the real GCS
    and real raylets. `ray.cluster_utils.AutoscalingCluster` does the same but runs `ray stop --force` (which kills
    every Ray process of the user) and reads an example config that the wheel does not ship; this module builds the
    config itself and stops only the processes it started: the head runs `ray start --head --block` in a session of
    its own, the monitor and the fake nodes it launches stay in that session, and tear-down ends that session.

    Autoscaler v2 (RAY_enable_autoscaler_v2=1). v1 scales as fast here (a node in about 2 s; gone about 3 s after
    nothing needs it, with the 3 s idle timeout), but v1 removes an idle node by deregistering it outright, while v2 asks
    the node's raylet to drain and the raylet refuses if work has just landed there: with an idle timeout of seconds,
    that race is real. v2 is also where Ray is going.

    Token authentication is on, with a fresh token in the environment of the head (so of the monitor and the fake
    nodes) and in `env`, which a client process must have: `ray.init(address=...)` does not pick up a head's token by
    itself and is refused without it (see tests/integration/test_multihost.py). ~/.ray is neither read nor written.
    """
    import ray._private.services as services  # no ray.init here: only the address this machine's nodes will use

    ip = services.get_node_ip_address()
    address = f"{ip}:{free_port(ip)}"
    config = tmp / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(address, head_cpus, node_types or {"gen_node": GEN_NODE},
                                                    idle_timeout_s)))
    client = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    cluster = AutoscalingRay(address, client, tmp / "ray-head.log")
    env = {**cluster.client_env(), "OMP_NUM_THREADS": "1", "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": HEAD_ID,
           "RAY_OVERRIDE_NODE_ID_FOR_TESTING": HEAD_ID}
    argv = [RAY, "start", "--head", f"--node-ip-address={ip}", f"--port={address.split(':')[1]}",
            f"--num-cpus={head_cpus}", f"--object-store-memory={100 * 2**20}", "--include-dashboard=false",
            f"--ray-client-server-port={free_port(ip)}", f"--autoscaling-config={config}",
            f"--temp-dir={temp_dir}", "--block"]
    with open(cluster.log, "wb") as log:
        cluster.head = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
    try:
        wait_started(cluster.head, cluster.log, "the Ray head")
    except BaseException:
        stop_node(cluster.head)
        raise
    return cluster

