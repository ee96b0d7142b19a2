"""RUN_DIR/cluster.json: where the roles of one run find each other.

Written once by the launcher before any role starts; read by learners and
generators. Remote generators need only this file and the secret.
"""

from __future__ import annotations

import json
import os

import msgspec


class ClusterInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: str
    hub_addr: str  # host:port the hub binds (learner rank 0)
    weight_addr: str  # host:port of the weight channel's TCPStore (learner rank 0)
    generators: int
    learners: int


def write_cluster(run_dir: str, info: ClusterInfo) -> None:
    tmp = os.path.join(run_dir, "cluster.json.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(info))
    os.replace(tmp, os.path.join(run_dir, "cluster.json"))


def read_cluster(run_dir: str) -> ClusterInfo:
    path = os.path.join(run_dir, "cluster.json")
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=ClusterInfo)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: start the run with launch/cluster.py, which writes it") from None


def read_run_config(run_dir: str):
    from common.config import load_config

    return load_config(os.path.join(run_dir, "config.toml"))


def json_dump_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
