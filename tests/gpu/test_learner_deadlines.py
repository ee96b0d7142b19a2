"""The learner deadline on a GPU's NCCL groups (learner/trainer.py), which the CPU cannot show: a 1-rank
`cpu:gloo,cuda:nccl` world, a group made as DeepSpeed makes its own (no timeout), `bound_every_group`; every group's
NCCL backend must read the deadline, and `unbounded_groups` must read NCCL's timeout at all (else the learner warns
for nothing). The gloo side and a frozen peer: tests/unit/test_group_deadlines.py. A frozen NCCL peer needs two GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from common.transport import free_port
from tests.helpers.paths import REPO

pytestmark = pytest.mark.gpu

ONE_RANK_CUDA = """
import json
import torch.distributed as dist
from learner.trainer import bound_every_group, group_deadlines, init_distributed, unbounded_groups
init_distributed(timeout_s=7)
dist.new_group([0])
bound_every_group(7)
print("RESULT", json.dumps({"deadlines": group_deadlines(), "unbounded": unbounded_groups(7)}), flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_group_has_the_learner_deadline_on_nccl_too():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", ONE_RANK_CUDA], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    import json

    got = json.loads(lines[0].split(" ", 1)[1])
    assert any(k.endswith("/cuda") for k in got["deadlines"]), got  # NCCL backends are seen
    assert got["unbounded"] == {} and set(got["deadlines"].values()) == {7.0}, got
