"""launch/slurm/covrl.sbatch submitted to a real Slurm: Ray started over the allocation, a tiny covrl run on it,
Ray stopped afterwards; resubmitting the same RUN_DIR resumes the run.

Needs `sbatch` and a controller that answers (`scontrol ping` says UP); otherwise the tests skip, saying which.
On one machine: `launch/slurm/local_test_cluster.sh start DIR 2` (a controller and two emulated nodes on this
host), then `export SLURM_CONF=DIR/slurm.conf`. The two-node test needs two idle nodes.

On a real cluster: COVRL_SLURM_TEST_DIR = a directory every node sees (the run directories and job logs go
there; default: pytest's tmp_path, which only this machine sees), COVRL_SLURM_TEST_SBATCH_ARGS = extra sbatch
options (partition, account, ...). The checks that no Ray process is left look at this machine only; the
other checks (the job's exit code and log, the run's metrics, the Ray head's port closed) hold anywhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from common.metrics import read_metrics
from common.transport import free_port
from tests.helpers.paths import REPO
from tests.helpers.runs import SMALL

pytestmark = pytest.mark.slow

SBATCH = os.path.join(REPO, "launch", "slurm", "covrl.sbatch")
JOB_TIMEOUT_S = 420
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def slurm_missing() -> str | None:
    """Why no job can be submitted here, or None."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return ("no Slurm client (sbatch/scontrol not on PATH); launch/slurm/local_test_cluster.sh starts a "
                "Slurm on this machine")
    try:
        p = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`scontrol ping` failed: {e}"
    if p.returncode != 0 or " is UP" not in p.stdout:
        said = " ".join((p.stdout + p.stderr).split())
        return f"no reachable Slurm controller: `scontrol ping` exited {p.returncode}: {said}"
    return None


def idle_nodes() -> int:
    p = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], capture_output=True, text=True, timeout=30)
    return sum(int(x) for x in p.stdout.split() if x.isdigit())


@pytest.fixture
def slurm():
    why = slurm_missing()
    if why:
        pytest.skip(why)


@pytest.fixture
def base(tmp_path):
    """Where the run directories and job logs go: a directory every node sees."""
    shared = os.environ.get("COVRL_SLURM_TEST_DIR")
    d = tempfile.mkdtemp(prefix="covrl-slurm-test-", dir=shared) if shared else None
    yield pathlib.Path(d) if d else tmp_path
    if d:
        shutil.rmtree(d, ignore_errors=True)


class Job:
    """One submission of covrl.sbatch, waited for."""

    def __init__(self, base, run_dir, nodes: int, args: list[str] = (), resume_args: list[str] = (),
                 head_args: str = "", worker_args: str = ""):
        self.ray_tmp = tempfile.mkdtemp(prefix="covrl-ray-", dir="/tmp")  # short: Ray's socket paths have a limit
        os.rmdir(self.ray_tmp)  # each node's Ray creates its own
        self.port = free_port("0.0.0.0")
        env = {k: v for k, v in os.environ.items() if not k.startswith("COVRL_")}
        env.update(COVRL_REPO=REPO, VENV=sys.prefix, RUN_DIR=str(run_dir), COVRL_ARGS=shlex.join(args),
                   COVRL_RESUME_ARGS=shlex.join(resume_args), COVRL_RAY_PORT=str(self.port),
                   COVRL_RAY_TMP=self.ray_tmp, COVRL_RAY_WAIT_S="120", COVRL_RAY_WORKER_ARGS=worker_args,
                   # no dashboard, and the client server off the default 10001: other Ray instances may be here
                   COVRL_RAY_HEAD_ARGS=f"--include-dashboard=false --ray-client-server-port={free_port('0.0.0.0')} "
                                       + head_args)
        cmd = ["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", "--time=20", "--job-name=covrl-test",
               f"--output={base}/slurm-%j.out", *shlex.split(os.environ.get("COVRL_SLURM_TEST_SBATCH_ARGS", "")),
               SBATCH]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert p.returncode == 0, f"sbatch failed: {p.stdout}{p.stderr}"
        self.id = p.stdout.strip().split(";")[0]
        self.log_path = os.path.join(str(base), f"slurm-{self.id}.out")
        self.info = self.wait()

    def wait(self) -> dict[str, str]:
        deadline = time.time() + JOB_TIMEOUT_S
        info: dict[str, str] = {}
        while time.time() < deadline:
            p = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True, timeout=30)
            info = dict(f.split("=", 1) for f in p.stdout.split() if "=" in f)
            if info.get("JobState") in ENDED:
                return info
            time.sleep(1)
        subprocess.run(["scancel", self.id], timeout=30)
        raise AssertionError(f"job {self.id} did not end within {JOB_TIMEOUT_S}s (state {info.get('JobState')}, "
                             f"reason {info.get('Reason')})\n{self.log()[-4000:]}")

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError as e:
            return f"(no job log: {e})"

    def check_ok_and_ray_stopped(self, run_dir, nodes: int) -> None:
        log = self.log()
        logs = "".join(f"\n== {f}\n" + open(os.path.join(run_dir, "logs", f)).read()[-2000:]
                       for f in sorted(os.listdir(os.path.join(run_dir, "logs")))) if (run_dir / "logs").exists() else ""
        assert self.info.get("ExitCode") == "0:0", f"job {self.id}: {self.info.get('JobState')} " \
                                                   f"exit {self.info.get('ExitCode')}\n{log[-6000:]}{logs}"
        assert f"Ray cluster up: {nodes} node(s)" in log
        assert f"Ray stopped on {nodes} node(s)" in log, log[-3000:]
        # `ray start` stopped its own processes: the sweep for leftovers found nothing to kill
        assert "left over" not in log, log[-3000:]
        assert not ray_processes(self.ray_tmp), f"Ray processes left: {ray_processes(self.ray_tmp)}"
        head = re.search(r"Ray head on \S+ at (\S+):(\d+)", log)
        assert head and int(head.group(2)) == self.port
        with pytest.raises(OSError):  # nothing listens where the Ray head was
            socket.create_connection((head.group(1), self.port), timeout=5).close()


def ray_processes(ray_tmp: str) -> list[str]:
    """Processes on this machine whose command line names the job's Ray directory."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ray_tmp + "/" in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


def test_sbatch_runs_then_resumes_on_one_node(slurm, base):
    """A one-node allocation (the Ray head alone): the run completes; resubmitted, it resumes and extends."""
    run = base / "run"
    first = Job(base, run, 1, ["--gens", "1", "--learners", "1", "--steps", "3", "--quiet", *SMALL])
    first.check_ok_and_ray_stopped(run, 1)
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["hub/lost_prompts"] == 0
    assert "--ray " in first.log() and "on Ray (" in first.log()  # the real launcher, placed by Ray
    roles = {json.loads(line)["role"] for line in open(run / "placement.jsonl")}
    assert roles == {"learner0", "gen0"}

    second = Job(base, run, 1, ["--gens", "1", "--steps", "99"], resume_args=["--steps", "5"])
    second.check_ok_and_ray_stopped(run, 1)
    assert f"--resume {run}" in second.log() and "resuming from" in second.log()
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["hub/lost_prompts"] == 0


def test_sbatch_places_roles_on_two_nodes(slurm, base):
    """Two nodes: the Ray head on the first, a Ray worker on the second; the learner is pinned to the head's node
    and the generators to the other (custom resources given per node kind)."""
    if idle_nodes() < 2:
        pytest.skip(f"needs 2 idle Slurm nodes; sinfo shows {idle_nodes()} "
                    f"(launch/slurm/local_test_cluster.sh start DIR 2 emulates two)")
    run = base / "run"
    job = Job(base, run, 2, ["--gens", "2", "--learners", "1", "--steps", "3", "--quiet", *SMALL,
                             "--ray-learner-resources", '{"covrl_learner": 1}',
                             "--ray-generator-resources", '{"covrl_gen": 1}'],
              head_args="--resources='{\"covrl_learner\": 1}'", worker_args="--resources='{\"covrl_gen\": 2}'")
    job.check_ok_and_ray_stopped(run, 2)
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["hub/lost_prompts"] == 0
    where = {e["role"]: e["node_id"] for e in map(json.loads, open(run / "placement.jsonl"))}
    assert set(where) == {"learner0", "gen0", "gen1"}
    assert where["gen0"] == where["gen1"] != where["learner0"]
