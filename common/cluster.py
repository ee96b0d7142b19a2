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


class PlacementError(ValueError):
    """More GPUs asked for than the node has; the message says how to fit."""


def place_gpus(gpus: int, learners: int, gens: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """GPU indices of each learner rank and each generator on one node: learners take the first `learners`
    GPUs (one each), then each generator takes `tp` consecutive GPUs (its tensor-parallel group).
    No GPUs (`gpus == 0`): every role runs on the CPU and every list is empty."""
    if gpus == 0:
        return [[] for _ in range(learners)], [[] for _ in range(gens)]
    if tp < 1:
        raise PlacementError(f"--tp {tp}: each generator needs at least one GPU")
    need = learners + gens * tp
    if need > gpus:
        raise PlacementError(f"{learners} learner rank(s) + {gens} generator(s) x {tp} GPU(s) need {need} GPUs and "
                             f"this node has {gpus}; lower --learners, --gens or --tp")
    return [[r] for r in range(learners)], [list(range(learners + g * tp, learners + (g + 1) * tp)) for g in range(gens)]


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
