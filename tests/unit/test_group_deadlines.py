"""Every process group of a learner rank waits at most transport.learner_timeout_s (learner/trainer.py).

DeepSpeed makes its data-parallel groups with `new_group(ranks)`, and torch gives such a group its backend's default
timeout (30 min on gloo), not the world group's: a frozen rank once held the others 600 s past a 40 s deadline. Each
test runs torch.distributed in fresh processes (gloo on loopback), since a process has one world.
"""

import json
import os
import signal
import subprocess
import sys

from common.transport import free_port
from tests.helpers.paths import REPO

ONE_RANK = """
import datetime, json
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from learner.trainer import init_distributed
init_distributed(timeout_s=7)
dist.new_group([0])  # as DeepSpeed makes its groups: no timeout of its own
# torch's own account of each group's gloo deadline, read without learner/trainer.py's helpers
gloo = [pg._get_backend(torch.device("cpu")).options._timeout for pg in c10d._world.pg_map]
print("RESULT", json.dumps([t.total_seconds() for t in gloo]), flush=True)
from learner.trainer import bound_every_group, group_deadlines
dist.new_group([0], timeout=datetime.timedelta(seconds=999))  # one that asked for another deadline
print("RESULT", json.dumps({"set": bound_every_group(7), "bounded": group_deadlines()}))
"""

# Rank 1 freezes (SIGSTOP, as a hung rank does) once DeepSpeed-style group exists; rank 0 then reduces on that group.
TWO_RANKS = """
import json, os, signal, sys, time
import deepspeed, torch
import torch.distributed as dist
from learner.trainer import init_distributed
ready = sys.argv[1] + "/ready_" + os.environ["RANK"]
open(ready, "w").close()
while not all(os.path.exists(sys.argv[1] + "/ready_" + r) for r in "01"):  # imports done: meet within the deadline
    time.sleep(0.01)
rank, _ = init_distributed(timeout_s=5)
group = dist.new_group([0, 1])
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
    print("RESULT", json.dumps({"returned_after_s": time.monotonic() - t0}), flush=True)
except Exception as e:
    print("RESULT", json.dumps({"raised_after_s": time.monotonic() - t0, "error": type(e).__name__}), flush=True)
os._exit(0)  # not torch's teardown of a group whose peer is frozen (it may abort)
"""


def _results(out: str) -> list:
    """What the child printed as `RESULT <json>` lines (DeepSpeed logs on stdout too)."""
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT ")]


def _env(rank: int, world: int, port: int) -> dict:
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}


def test_groups_made_after_init_take_the_learner_deadline():
    proc = subprocess.run([sys.executable, "-c", ONE_RANK], cwd=REPO, env=_env(0, 1, free_port()),
                          capture_output=True, text=True, timeout=60)
    results = _results(proc.stdout)
    assert results, proc.stderr[-3000:]
    assert results[0] == [7.0, 7.0], "the world group and the one made like DeepSpeed's: 7 s each"
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results[1]
    # bound_every_group also bounds a group made with a deadline of its own; group_deadlines sees every backend.
    assert got["set"] == 3 and len(got["bounded"]) >= 3 and set(got["bounded"].values()) == {7.0}, got


def test_a_frozen_peer_fails_a_collective_on_a_deepspeed_style_group_within_the_deadline(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(tmp_path)], cwd=REPO, env=_env(r, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=20)  # imports ~3 s, the 5 s deadline, margin; 30 min without the fix
        assert procs[0].returncode == 0, err[-3000:]
        got = _results(out)[-1]
        assert "raised_after_s" in got, got
        assert 4.0 <= got["raised_after_s"] <= 5.0 + 3.0, got  # the 5 s deadline, not gloo's 30 min default
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate()

