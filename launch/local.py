"""The local backend: every role a child process of the launcher on this machine, on the GPUs the launch's one
placement gave it (`role_specs`, `local_generator`).

Each role runs in its own session (process group), so stopping a role also stops whatever it spawned (reward
workers), and nothing else on the machine. Logs go to RUN_DIR/logs/<role>.log; a restarted role appends.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from common.config import ConfigError
from common.data import REPO_ROOT
from common.lifeline import LIFELINE_ENV
from common.runfiles import (MEMORY_FRACTION_ENV, ClusterInfo, Placement, PlacementError,
                             colocated_memory_fractions, place_gpus)
from common.transport import free_port
from launch.process_group import signal_group
from launch.roles import RoleSpec, base_env, generator_spec, learner_specs


class LocalBackend:
    name = "local"

    def __init__(self, run_dir: str, cfg):
        self.run_dir = run_dir
        self.base = base_env(cfg)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}

    def start(self, spec: RoleSpec) -> None:
        log = self.logs.get(spec.name)
        if log is None:
            log = self.logs[spec.name] = open(os.path.join(self.run_dir, "logs", f"{spec.name}.log"), "ab")
        self.procs[spec.name] = subprocess.Popen(
            [sys.executable, "-m", spec.module, *spec.args], env=self.environment(spec), cwd=REPO_ROOT, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def environment(self, spec: RoleSpec) -> dict[str, str]:
        """The role's whole environment: ours, covrl's variables, its GPUs ("" on the CPU: none), its own."""
        return {**self.base, "CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.devices)), **spec.env,
                LIFELINE_ENV: str(os.getpid())}  # the role ends itself if the launcher dies (SIGKILL, lost terminal)

    def poll(self, spec: RoleSpec) -> int | None:
        p = self.procs[spec.name]
        code = p.poll()
        if code is not None:
            signal_group(p.pid, signal.SIGKILL)  # whatever it left in its group (reward workers) goes with it
        return code

    def stop_lost(self, spec: RoleSpec, pid: int) -> bool:
        """The hub declared generator `spec` lost: SIGKILL its process group if its process is `pid` (a stopped,
        frozen process dies too). False if this backend does not run that process (it was replaced already)."""
        p = self.procs.get(spec.name)
        if p is None or p.pid != pid or p.poll() is not None:
            return False
        signal_group(p.pid, signal.SIGKILL)
        return True

    def describe(self, spec: RoleSpec, code: int) -> str:
        return f"exited with code {code}"

    def pid(self, spec: RoleSpec) -> int | None:
        """The pid of the process this backend runs (or last ran) for `spec`, as the hub knows it (its Hello)."""
        p = self.procs.get(spec.name)
        return None if p is None else p.pid

    def placing(self, spec: RoleSpec) -> bool:
        """Whether `spec` is still waiting for room to start in: never here (its process starts at once)."""
        return False

    def signal(self, spec: RoleSpec, sig: int) -> None:
        p = self.procs.get(spec.name)
        if p is not None and p.poll() is None:
            signal_group(p.pid, sig)

    def terminate(self, specs: list[RoleSpec], grace_s: float) -> list[RoleSpec]:
        """SIGTERM each running role's group; wait up to `grace_s` in all. Returns those still running."""
        procs = {s.name: self.procs[s.name] for s in specs if s.name in self.procs}
        _term_and_wait(list(procs.values()), grace_s)
        return [s for s in specs if s.name in procs and procs[s.name].poll() is None]

    def release(self, spec: RoleSpec) -> None:
        """A drained generator has exited: forget its process (its log stays open for a later start)."""
        self.procs.pop(spec.name, None)

    def close(self, grace_s: float) -> None:
        """Stop every process group this backend started: SIGTERM, then SIGKILL what is left after `grace_s`."""
        procs = list(self.procs.values())
        _term_and_wait(procs, grace_s)
        for p in procs:
            signal_group(p.pid, signal.SIGKILL)  # also reaps children left in the group
            if p.poll() is None:
                p.wait()
        for log in self.logs.values():
            log.close()


def _term_and_wait(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each running process's group, then wait up to `grace_s` in all for them to exit."""
    for p in procs:
        if p.poll() is None:
            signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def visible_gpus(requested: int | None) -> int:
    if requested is not None:
        if requested < 0:
            raise ConfigError(f"--gpus {requested}: give a count, 0 for CPU only")
        return requested
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0  # no NVIDIA device on this host: skip importing torch (1-2 s) in the launcher
    import torch

    return torch.cuda.device_count()


class NodePlacement:
    """This node's GPU placement for each generator count of the run: the launch's own (checked before the run
    directory was written) and, computed once when first asked for, each count the run is scaled to. A count
    that would change the layout the run started with (and move running roles' GPUs) is refused."""

    def __init__(self, gpus: int, learners: int, tp: int, start: Placement):
        self.gpus, self.learners, self.tp, self.start = gpus, learners, tp, start
        self.by_count = {len(start.generators): start}

    def of(self, gens: int) -> Placement:
        if gens not in self.by_count:
            placement = place_gpus(self.gpus, self.learners, gens, self.tp)
            if self.gpus and placement.colocated != self.start.colocated:
                raise PlacementError(
                    f"{gens} generator(s) would place learners and generators "
                    f"{'together' if placement.colocated else 'apart'} on this node's {self.gpus} GPU(s), but the run "
                    f"started with them {'together' if self.start.colocated else 'apart'}; the running roles keep "
                    f"their GPUs, so scale within that layout")
            self.by_count[gens] = placement
        return self.by_count[gens]


def local_generator(run_dir: str, cfg, gen_id: int, placement: Placement) -> RoleSpec:
    """Generator `gen_id` of `placement`: its GPUs, and its memory share when colocated."""
    _, gen_share = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
    return generator_spec(run_dir, gen_id, devices=placement.generators[gen_id],
                          extra_env={MEMORY_FRACTION_ENV: str(gen_share)} if placement.colocated else None,
                          after_learners=placement.colocated)


def role_specs(run_dir: str, info: ClusterInfo, cfg, placement: Placement, resume: bool = False) -> list[RoleSpec]:
    """The roles of a run on this node: every learner rank, and generators 0 .. info.generators - 1."""
    all_learner_gpus = [g for ids in placement.learners for g in ids]  # one node: every rank sees them all
    # Colocated roles cap their own CUDA allocators at their share of the GPU they share.
    learner_share, _ = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
    learner_mem = {MEMORY_FRACTION_ENV: str(learner_share)} if placement.colocated else None
    specs = learner_specs(run_dir, info, ("127.0.0.1", free_port()), resume,
                          devices=[all_learner_gpus] * info.learners, extra_env=learner_mem)
    return specs + [local_generator(run_dir, cfg, i, placement) for i in range(info.generators)]


def placement_line(placement: Placement, cfg) -> str:
    """One line of the start banner: which GPUs each role got, and how colocated roles split their memory."""
    line = f"GPUs: learner ranks on {placement.learners}, generators on {placement.generators}"
    if placement.colocated:
        learner_share, gen_share = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
        line += (f" (colocated: each generator takes {gen_share:.0%} of its GPUs' memory, "
                 f"generator.gpu_memory_utilization; a learner rank at most {learner_share:.0%}; weights over "
                 f"{cfg.generator.weight_transport})")
    return line
