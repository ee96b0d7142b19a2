"""The local backend: every role a child process of the launcher on this machine.

Each role runs in its own session (process group), so stopping a role also stops whatever it spawned (reward
workers), and nothing else on the machine. Logs go to RUN_DIR/logs/<role>.log; a restarted role appends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from common.data import REPO_ROOT
from common.lifeline import LIFELINE_ENV
from launch.roles import RoleSpec, base_env


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
            _signal_group(p, signal.SIGKILL)  # whatever it left in its group (reward workers) goes with it
        return code

    def stop_lost(self, spec: RoleSpec, pid: int) -> bool:
        """The hub declared generator `spec` lost: SIGKILL its process group if its process is `pid` (a stopped,
        frozen process dies too). False if this backend does not run that process (it was replaced already)."""
        p = self.procs.get(spec.name)
        if p is None or p.pid != pid or p.poll() is not None:
            return False
        _signal_group(p, signal.SIGKILL)
        return True

    def describe(self, spec: RoleSpec, code: int) -> str:
        return f"exited with code {code}"

    def signal(self, spec: RoleSpec, sig: int) -> None:
        p = self.procs.get(spec.name)
        if p is not None and p.poll() is None:
            _signal_group(p, sig)

    def terminate(self, specs: list[RoleSpec], grace_s: float) -> list[RoleSpec]:
        """SIGTERM each running role's group; wait up to `grace_s` in all. Returns those still running."""
        procs = {s.name: self.procs[s.name] for s in specs if s.name in self.procs}
        for p in procs.values():
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [s for s in specs if s.name in procs and procs[s.name].poll() is None]

    def release(self, spec: RoleSpec) -> None:
        """A drained generator has exited: forget its process (its log stays open for a later start)."""
        self.procs.pop(spec.name, None)

    def close(self, grace_s: float) -> None:
        """Stop every process group this backend started: SIGTERM, then SIGKILL what is left after `grace_s`."""
        procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            _signal_group(p, signal.SIGKILL)  # also reaps children left in the group
            if p.poll() is None:
                p.wait()
        for log in self.logs.values():
            log.close()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the group id is the pid: start_new_session=True
    except ProcessLookupError:
        pass
