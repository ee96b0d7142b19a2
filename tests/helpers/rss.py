"""Peak resident memory of a run's roles, from /proc: a thread samples this process's descendants while a run goes on.

Each role is `python -m learner` or `python -m actors` (launch/roles.py), a child of the launcher. For each role
process the kernel's own high-water mark (`VmHWM` in /proc/<pid>/status: the peak RSS over the process's life, no
sampling gap) is read until the process exits; the role's whole tree (anything it spawned, reward workers say) is
also summed at each sample (`tree_peak`: a sampled peak, a lower bound on the true one).
"""

from __future__ import annotations

import os
import threading

import psutil

ROLE_MODULES = {"learner": "learner", "actors": "generator"}


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def role_of(p: psutil.Process) -> str | None:
    """"learner" or "generator" for a role's own process (`python -m learner|actors ...`), else None."""
    try:
        argv = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    for i, a in enumerate(argv[:-1]):
        if a == "-m" and argv[i + 1] in ROLE_MODULES:
            return ROLE_MODULES[argv[i + 1]]
    return None


class RoleRSS:
    """`with RoleRSS() as m: <run>`; then `m.peaks()`: {role: {"hwm_bytes", "tree_peak_bytes", "pids"}}.

    Roles are found among the descendants of `root` (default: this process), sampled every `interval_s`."""

    def __init__(self, root: int | None = None, interval_s: float = 0.05):
        self.root = psutil.Process(root or os.getpid())
        self.interval_s = interval_s
        self.hwm: dict[int, int] = {}  # pid -> last VmHWM read (KiB)
        self.role: dict[int, str] = {}
        self.tree_peak: dict[str, int] = {}  # role -> largest summed VmRSS of its tree at one sample (KiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "RoleRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        try:
            procs = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            if p.pid not in self.role:
                r = role_of(p)
                if r is None:
                    continue
                self.role[p.pid] = r
            hwm = _status_kib(p.pid, "VmHWM")
            if hwm:
                self.hwm[p.pid] = max(hwm, self.hwm.get(p.pid, 0))
            tree = [p]
            try:
                tree += p.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            total = sum(_status_kib(q.pid, "VmRSS") or 0 for q in tree)
            r = self.role[p.pid]
            self.tree_peak[r] = max(total, self.tree_peak.get(r, 0))

    def peaks(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for pid, r in self.role.items():
            d = out.setdefault(r, {"hwm_bytes": 0, "tree_peak_bytes": self.tree_peak.get(r, 0) * 1024, "pids": []})
            d["hwm_bytes"] = max(d["hwm_bytes"], self.hwm.get(pid, 0) * 1024)
            d["pids"].append(pid)
        return out
