"""Nothing waits on a generator: one frozen (SIGSTOP of its whole process group) and one whose engine hangs while
its heartbeat lives (tests/faults/sitecustomize.py), in the same run, on one machine and on a multi-node Ray
cluster; on one machine a third is SIGKILLed at the same moment (a generator that dies). The hub declares each
lost (`timeout`, `stuck`; the dead one as soon as its weight channel fails or its replacement says hello), drops
its weight channel and re-issues its work; the launcher stops the frozen and hung process groups and restarts all
three, each catching up on the latest weights; the run trains every step with nothing lost or trained twice. Each
test prints its times to recovery (`pytest -s`), the figures of docs/reliability.md's table."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from common.metrics import read_metrics
from tests.helpers.paths import REPO
from tests.helpers.run_records import placements
from tests.helpers.runs import SMALL, stop_gracefully

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # its timing assumes the machine to itself

STEPS = 28  # long enough for every replacement to start (a 2 s backoff, then a few seconds of start-up)
GENERATOR_TIMEOUT_S = 3.0
# Verdicts within seconds: heartbeats every 0.25 s, silent for 3 s is lost, a stuck generator is found after
# max(6 s, 4 x the slowest reply). The weight send deadline is longer than both, so it is the hub's verdict that
# frees a publish blocked on the frozen generator (the deadline itself: tests/unit/test_weights.py).
FAST = ["--set", "transport.heartbeat_s=0.25", "--set", f"transport.generator_timeout_s={GENERATOR_TIMEOUT_S}",
        "--set", "transport.generator_progress_floor_s=6", "--set", "transport.weight_send_timeout_s=20"]
FROZEN, HUNG, HANG_AFTER, KILLED = 1, 2, 2, 3  # generator 2's engine hangs on its 3rd generate call


def fault_env(tmp_path) -> dict[str, str]:
    """The launcher's environment with the hang fault armed for generator HUNG (its first incarnation only)."""
    faults = tmp_path / "faults"
    faults.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "faults", "sitecustomize.py"), faults)
    (faults / "hang.json").write_text(json.dumps({"gen_id": HUNG, "after": HANG_AFTER, "claim_dir": str(tmp_path)}))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(faults), os.environ.get("PYTHONPATH")]))}


def generator_pids(run, gen_id: int) -> list[int]:
    """Live processes of `python -m actors` for this run and generator id (local or under Ray: found by command)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if (p.info["status"] != psutil.STATUS_ZOMBIE and "actors" in cmd and str(run) in cmd
                and "--gen-id" in cmd and cmd[cmd.index("--gen-id") + 1] == str(gen_id)):
            out.append(p.pid)
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def run_with_faults(run, tmp_path, *args, kill: bool = False, timeout_s: float = 420):
    """Launch, freeze generator FROZEN once step 1 is in (and with `kill`, SIGKILL generator KILLED then too), let
    generator HUNG hang by itself; returns what the checks need. The frozen group is killed at the end whatever
    happened (a stopped process would outlive the test otherwise)."""
    gens = 4 if kill else 3
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run), "--quiet",
                          "--gens", str(gens), "--steps", str(STEPS), *SMALL, *FAST, *args], cwd=REPO,
                         env=fault_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen_pid = None
    try:
        deadline = time.time() + 300
        while len(read_metrics(str(run))) < 1 and p.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert len(read_metrics(str(run))) >= 1, f"the run never reached step 1 (launcher exit {p.poll()})"
        (frozen_pid,) = generator_pids(run, FROZEN)
        killed_pids = generator_pids(run, KILLED) if kill else []
        os.killpg(os.getpgid(frozen_pid), signal.SIGSTOP)  # the generator and its reward workers: a frozen node
        for pid in killed_pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # the generator and its reward workers: a dead process
        frozen_at, frozen_step = time.time(), len(read_metrics(str(run)))
        assert len(killed_pids) == (1 if kill else 0), killed_pids
        out, err = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            stop_gracefully(p)
        if frozen_pid is not None and not gone(frozen_pid):
            os.killpg(os.getpgid(frozen_pid), signal.SIGKILL)
    return p.returncode, out, err, frozen_pid, frozen_at, frozen_step, killed_pids[0] if kill else None


def check_recovery(run, tmp_path, code, out, err, frozen_pid, frozen_at, frozen_step, killed_pid,
                   ray: bool = False) -> dict[str, float]:
    assert code == 0, f"launcher exited {code}\n{out}\n{err[-3000:]}"
    assert frozen_step < STEPS, "the run ended before the freeze: make it longer"
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["hub/lost_prompts"] == 0 and r.get("hub/duplicate_trained_prompts", 0) == 0 for r in rows)
    hung_file = tmp_path / f"gen{HUNG}.hung"
    assert hung_file.exists(), "generator 2's engine never hung: the fault did not fire"
    hung_pid, hung_at = int(hung_file.read_text()), hung_file.stat().st_mtime
    # The hub's verdicts: exactly the two faults, each for its reason; no healthy generator was declared lost.
    with open(run / "generators_lost.jsonl") as f:
        verdicts = [json.loads(line) for line in f]
    # The launcher's own account (generators_launcher.jsonl): each faulty process's exit, which the hub takes as a
    # verdict at once unless it has one already (the frozen and hung ones: the launcher killed them on the hub's
    # verdict). Under Ray the launcher does not know a generator's pid (its actor runs it, on its node): none.
    with open(run / "generators_launcher.jsonl") as f:
        launcher = {(v["gen_id"], v["pid"], v["why"]) for v in map(json.loads, f) if v["why"] != "launch"}
    faulty = [(FROZEN, frozen_pid), (HUNG, hung_pid), *([(KILLED, killed_pid)] if killed_pid is not None else [])]
    assert launcher == (set() if ray else {(g, pid, "exited") for g, pid in faulty}), launcher
    # The dead one is lost once too, for whichever reason came first (the launcher's word that it exited, its weight
    # channel failing at a publish, its replacement's hello, or its silence).
    killed = [v for v in verdicts if v["gen_id"] == KILLED]
    assert len(killed) == (killed_pid is not None) and all(v["pid"] == killed_pid for v in killed), verdicts
    lost = {(v["gen_id"], v["pid"], v["why"]): v for v in verdicts if v["gen_id"] != KILLED}
    assert set(lost) == {(FROZEN, frozen_pid, "timeout"), (HUNG, hung_pid, "stuck")}, verdicts
    last = rows[-1]
    n_faults = 2 + len(killed)
    assert sum(v for k, v in last.items() if k.startswith("hub/generator_lost/")) == n_faults
    assert last["hub/generator_lost/stuck"] == 1 and last["hub/generator_lost/timeout"] >= 1
    assert last["weights/dropped_channels"] == n_faults and last["hub/reissued_prompts"] >= 1
    # The launcher stopped both process groups (a stopped process dies of SIGKILL too) and restarted each once.
    assert gone(frozen_pid) and gone(hung_pid)
    assert f"gen{FROZEN} (pid {frozen_pid}) is being stopped: the hub declared it lost (timeout" in err
    assert f"gen{HUNG} (pid {hung_pid}) is being stopped: the hub declared it lost (stuck" in err
    if killed_pid is not None:  # it had exited already: nothing to stop, a failure to restart
        assert f"gen{KILLED} (pid {killed_pid}) is being stopped" not in err
        assert f"gen{KILLED} exited with code -9; restart in 2s (failure 1 of 3 allowed" in err
        assert "killed by SIGKILL, not by this launcher" in err  # not its log's last line (a progress bar)
    # Each replacement (a new incarnation) caught up on the learner's weights before generating, then got every
    # later version, checksum for checksum. (The hung one may have received nothing: with run.deterministic the
    # learner's next publish waits for the work it held, so it comes only after the verdict.)
    gens = 3 + (killed_pid is not None)
    assert last["weights/joins"] == gens + n_faults
    sums = {int(r["weights/version"]): r["weights/checksum"] for r in rows}
    back = {}
    replaced = [(FROZEN, lost[(FROZEN, frozen_pid, "timeout")]), (HUNG, lost[(HUNG, hung_pid, "stuck")]), *(
        (KILLED, v) for v in killed)]
    for gen_id, v in replaced:
        with open(run / "generators" / f"gen{gen_id}.jsonl") as f:
            got = [json.loads(line) for line in f]
        assert all(e["checksum"] == sums[e["version"]] for e in got)  # what it holds is what the learner sent
        new = [e for e in got if e["channel"] == got[-1]["channel"]]
        assert new[0]["channel"] != f"gen{gen_id}/{v['incarnation']}", f"gen{gen_id} was never replaced"
        assert [e["version"] for e in new] == list(range(new[0]["version"], STEPS + 1))  # then every later version
        back[gen_id] = new[0]["t"]
        # Its first version is the learner's latest when it joined: caught up, not started from version 1 again.
        assert new[0]["version"] >= frozen_step, (gen_id, new[0], frozen_step)
    times = {
        **({"killed: replacement holds the latest weights after": back[KILLED] - frozen_at} if killed else {}),
        "frozen: verdict after": lost[(FROZEN, frozen_pid, "timeout")]["t"] - frozen_at,
        "frozen: replacement holds the latest weights after": back[FROZEN] - frozen_at,
        "hung: verdict after": lost[(HUNG, hung_pid, "stuck")]["t"] - hung_at,
        "hung: replacement holds the latest weights after": back[HUNG] - hung_at,
    }
    print({k: round(v, 1) for k, v in times.items()})
    assert times["frozen: verdict after"] < GENERATOR_TIMEOUT_S + 3, times
    assert times["hung: verdict after"] < 60, times
    return times


def test_frozen_hung_and_killed_generators_are_dropped_stopped_and_replaced(tmp_path):
    run = tmp_path / "run"
    t0 = time.time()
    got = run_with_faults(run, tmp_path, "--learners", "1", kill=True)
    check_recovery(run, tmp_path, *got)
    print(f"run: {time.time() - t0:.0f}s")


@pytest.mark.long  # make bench: the verdicts are test_frozen_hung_and_killed_...'s; this adds the Ray actor's kill path
def test_frozen_and_hung_generators_on_ray_are_dropped_stopped_and_replaced(tmp_path, ray_cluster):
    """The same faults under `--ray` on a multi-node Ray cluster (the learner on one node, the three generators on
    another): the launcher asks each lost generator's actor to SIGKILL its process group (`stop_lost`), and starts
    the generator again in the same actor, on the generators' node."""
    learner_node = ray_cluster.add_node(num_cpus=2, resources={"covrl_learner": 1})
    gen_node = ray_cluster.add_node(num_cpus=3, resources={"covrl_gen": 3})
    ray_cluster.wait_for_nodes()
    run = tmp_path / "run"
    t0 = time.time()
    got = run_with_faults(run, tmp_path, "--learners", "1", "--ray", ray_cluster.address,
                          "--ray-learner-resources", '{"covrl_learner": 1}',
                          "--ray-generator-resources", '{"covrl_gen": 1}')
    check_recovery(run, tmp_path, *got, ray=True)
    code, out, err = got[:3]
    assert "on Ray" in out, out
    starts = placements(run)
    assert {e["node_id"] for e in starts if e["role"] == "learner0"} == {learner_node.node_id}
    for gen_id, n in ((0, 1), (FROZEN, 2), (HUNG, 2)):
        mine = [e for e in starts if e["role"] == f"gen{gen_id}"]
        assert len(mine) == n, (gen_id, starts)
        assert {e["node_id"] for e in mine} == {gen_node.node_id}, (gen_id, starts)
        # restarted by the launcher in the same actor (the same worker process), not by Ray
        assert len({e["pid"] for e in mine}) == 1 and not any(e["restarted"] for e in mine), (gen_id, starts)
    print(f"run: {time.time() - t0:.0f}s")
