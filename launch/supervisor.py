"""The supervisor: starts, restarts, scales and stops the roles of one run through a backend (`launch/local.py`,
`launch/ray_backend.py`), the same way on both:
- a generator that exits with an error is restarted (backoff 2, 4, 8 ... s); it rejoins with a weight channel of
  its own and catches up on the latest version. Under Ray, one whose node is lost is restarted by Ray on any node
  with room;
- a generator that fails more than cluster.generator_max_failures times within cluster.generator_failure_window_s
  is set aside: the run goes on with the others, says so once and records it (RUN_DIR/generators_launcher.jsonl,
  which the learner counts as `cluster/generators_set_aside`); its slot is tried again after
  cluster.generator_retry_after_s (doubled each time), or at once when the generator count is set again. Only when
  every generator the run wants is set aside does the run stop, and then as a graceful stop does: the learners
  write a checkpoint of their last step first (`drain`);
- a generator the hub declared lost (silent, stuck, or failing its weight channel: RUN_DIR/generators_lost.jsonl)
  is stopped, its whole process group, and handled as a failure: a frozen or hung process never holds up the run,
  even though it has not exited;
- the generator count follows RUN_DIR/generators.json (`covrl scale RUN_DIR --gens N`, `launch/scale.py`, or the
  autoscale policy, `learner/autoscale.py`, whose reason it repeats): missing ids are started; ids beyond it are
  drained by the hub and leave (exit code EXIT_DRAINED); one the backend could not place in time (NOT_PLACED) is
  said and asked for again;
- a learner rank that fails, or that has not moved on for transport.learner_timeout_s (frozen, or hung in a
  collective: `launch/watch.py`), stops the run in one line naming the rank; the last checkpoint stays intact, and
  `covrl resume RUN_DIR` continues from it.
A role that ends is explained in one line taken from its log (`log_cause`).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

from common.runfiles import (EXIT_DRAINED, EXITED, LAUNCH, LAUNCHER_FILE, NOT_PLACED, RELEASED, RETRIED, SET_ASIDE,
                             LostGenerator, LostGenerators, PlacementError, learners_ready, read_generator_target,
                             record_lost_generator)
from launch.progress import Progress, clock
from launch.roles import RoleSpec
from launch.watch import LearnerWatch

GRACE_S = 10.0
RESTART_BACKOFF_MAX_S = 60.0
RETRY_BACKOFF_MAX = 8  # a slot set aside again waits generator_retry_after_s x 2, 4, up to this factor


def due(spec: RoleSpec, run_dir: str) -> bool:
    """Whether a role that is not running should be started now."""
    return time.monotonic() >= spec.next_start and (not spec.after_learners or learners_ready(run_dir))


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_CAUSE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt)\b|\b(?:ERROR|CRITICAL)\b")


def log_cause(run_dir: str, name: str) -> str:
    """One line on why a role ended, pointing at its log: the log's last exception or ERROR line (the traceback
    stays in the log), else its last line."""
    path = os.path.join(run_dir, "logs", f"{name}.log")
    try:
        with open(path, "rb") as f:
            tail = [_RANK_PREFIX.sub("", ln.decode(errors="replace").rstrip()) for ln in f.readlines()[-200:]]
    except FileNotFoundError:
        return f"its log {path} is missing"
    tail = [ln for ln in tail if ln.strip()]
    causes = [ln for ln in tail if _CAUSE.search(ln) and not ln.startswith("Exception ignored")]  # shutdown noise
    cause = causes[-1] if causes else tail[-1] if tail else "its log is empty"
    return f"{cause[:300]} (full log: {path})"


def killed(code: int, run_dir: str, name: str) -> str:
    """A role killed by a signal that this launcher did not send says so (its log's last line, a progress bar
    often, would say nothing); "" for any other exit."""
    if code >= 0:
        return ""
    try:
        sig = signal.Signals(-code).name
    except ValueError:
        sig = f"signal {-code}"
    return (f"killed by {sig}, not by this launcher (the kernel's OOM killer, a preemption, a user?) "
            f"(its log: {os.path.join(run_dir, 'logs', name + '.log')})")


class Supervisor:
    """`poll` once per tick; a run ends when every learner rank has finished (0) or one failed (1)."""

    def __init__(self, backend, learners: list[RoleSpec], make_generator, run_dir: str, cfg, quiet: bool,
                 progress_every_s: float = 10.0):
        self.backend, self.learners, self.make_generator = backend, learners, make_generator
        self.run_dir, self.cfg = run_dir, cfg
        self.progress = Progress(run_dir, cfg.run.steps, cfg.rollout.max_staleness_steps, quiet=quiet,
                                 every_s=progress_every_s)
        self.gens: dict[int, RoleSpec] = {}
        self.target, self.revision = 0, None
        self.bad_target = ""
        self.unplaced = ""
        self.lost = LostGenerators(run_dir)  # the hub's verdicts, followed
        self.stopped: dict[str, str] = {}  # role -> why this supervisor stopped it (a verdict), said at its exit
        self.watch = LearnerWatch(run_dir, cfg.transport.learner_timeout_s)
        self.drain = ""  # why this supervisor ended the run with the learners alive: they checkpoint first
        self.done_at: float | None = None  # when the first learner rank finished the run (exit 0)
        self.record(None, LAUNCH, "a launch began: slots set aside before it are not any more")

    def roles(self) -> list[RoleSpec]:
        return [*self.learners, *self.gens.values()]

    def follow_target(self) -> None:
        """Follow generators.json: on a new count (or revision), forget the ids above it that are not running (the
        hub drains the running ones); on every tick, add the missing ids below it."""
        try:
            target = read_generator_target(self.run_dir)
        except (ValueError, OSError) as e:  # damaged by hand, or a shared filesystem hiccup: keep what we have
            if str(e) != self.bad_target:
                self.say(f"{e}; keeping {self.target} generator(s)")
                self.bad_target = str(e)
            return
        self.bad_target = ""
        if target is not None and (target.revision, target.generators) != (self.revision, self.target):
            if self.revision is not None:
                why = f": {target.reason}" if target.reason else ""
                self.say(f"scaling to {target.generators} generator(s) (was {self.target}){why}")
            changed = self.revision is not None
            self.target, self.revision = target.generators, target.revision
            for s in [s for s in self.gens.values()
                      if s.gen_id >= self.target and (not s.running or self.backend.placing(s))]:
                self.backend.release(s)  # waiting for a (re)start or for room, or finished: no longer wanted
                if s.set_aside_until:
                    self.record(s, RELEASED, f"scaled to {self.target} generator(s)")
                del self.gens[s.gen_id]
            for s in self.gens.values():  # the count was set again (covrl scale, autoscale): set-aside slots now
                if changed and s.set_aside_until:
                    s.set_aside_until = s.next_start = time.monotonic()
        self.add_missing()

    def add_missing(self) -> None:
        """Add the generators below the target that have no spec; one that cannot be placed is said once and tried
        again each tick."""
        for i in range(self.target):
            if i in self.gens:
                continue
            try:
                self.gens[i] = self.make_generator(i, self.target)
            except PlacementError as e:
                if str(e) != self.unplaced:
                    self.say(f"cannot start generator {i}: {e}; trying again while the run goes on")
                    self.unplaced = str(e)
                return
        self.unplaced = ""

    def follow_verdicts(self) -> None:
        """Stop the process group of every running generator the hub declared lost (matched by pid, so a verdict on
        an incarnation already replaced stops nothing); its exit is then handled as any failure: a restart."""
        for v in self.lost.new():
            if v.why in ("restarted", EXITED):  # replaced already, or it had exited
                continue
            s = self.gens.get(v.gen_id)
            if s is not None and s.running and self.backend.stop_lost(s, v.pid):
                self.stopped[s.name] = f"the hub declared it lost ({v.why}: {v.detail})"
                self.say(f"{s.name} (pid {v.pid}) is being stopped: {self.stopped[s.name]}")
        for line in self.lost.damaged:
            self.say(line)
        self.lost.damaged.clear()

    def start_due(self) -> None:
        for s in self.roles():
            if not s.running and not s.done and due(s, self.run_dir):
                if s.set_aside_until:
                    self.say(f"{s.name}: trying its slot again (set aside {s.set_aside} time(s))")
                    self.record(s, RETRIED, "tried again")
                    s.set_aside_until = 0.0
                self.backend.start(s)
                s.running = True

    def poll(self) -> int | None:
        """One tick: follow the target, (re)start what is due, react to exits. The run's exit code once it ends."""
        self.follow_target()
        self.follow_verdicts()
        self.start_due()
        for s in self.roles():
            if not s.running:
                continue
            code = self.backend.poll(s)
            if code is None:
                continue
            s.running = False
            if (stop := self._exited(s, code)) is not None:
                return stop
        live = [r for r, s in enumerate(self.learners) if s.running and not s.done]  # learner_specs: in rank order
        if (verdict := self.watch.check(live)) is not None:
            self.say(f"{verdict}; stopping the run (no checkpoint can be written without every rank): covrl resume "
                     f"{self.run_dir} continues from the newest checkpoint")
            return 1
        self.progress.update()
        if (late := self.late_learners()) is not None:
            return late
        if all(s.done for s in self.learners):
            # Learners finished: generators got Stop from the hub; give them a moment to exit.
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(s.running and self.backend.poll(s) is None
                                                      for s in self.gens.values()):
                time.sleep(0.2)
            return 0
        return None

    def late_learners(self) -> int | None:
        """A learner rank exits 0 only past the last collective, which every rank reaches together: the others have
        nothing left to do. One still running GRACE_S later (a hang in its interpreter's exit) is left to
        `backend.close`, and the run is complete (0)."""
        done = [s for s in self.learners if s.done]
        if not done or all(s.done for s in self.learners):
            return None
        if self.done_at is None:
            self.done_at = time.monotonic()
        if time.monotonic() - self.done_at <= GRACE_S:
            return None
        late = ", ".join(s.name for s in self.learners if not s.done)
        self.say(f"{late} did not exit within {GRACE_S:.0f}s after {done[0].name} finished the run; stopping it")
        return 0

    def _exited(self, s: RoleSpec, code: int) -> int | None:
        stopped = self.stopped.pop(s.name, None)  # killed on a verdict: say why rather than its log's last line
        if not s.is_generator:  # a learner rank: its failure ends the run
            if code != 0:
                suspect = self.watch.suspect(self.learners.index(s))
                self.say(f"{s.name} {self.backend.describe(s, code)}; stopping the run: {log_cause(self.run_dir, s.name)}"
                         + (f"; {suspect}" if suspect else ""))
                return 1
            s.done = True
        elif code == NOT_PLACED:  # never started (no room): its bundle is given back; a fresh one is asked for now
            self.say(f"{s.name} {self.backend.describe(s, code)}; asking again")
            del self.gens[s.gen_id]
        elif code == EXIT_DRAINED or (code != 0 and s.gen_id >= self.target):
            # Drained; or it ended (refused, killed) after the run was scaled below its id: it left, not failed.
            # A fresh one starts on the next tick if the target has grown past its id again.
            if code != EXIT_DRAINED:
                self.exited(s, code)  # a draining one that died: what it held is re-issued now
            self.backend.release(s)
            del self.gens[s.gen_id]
        elif code == 0:
            s.done = True
        else:
            self.exited(s, code)
            return self._failed(s, self.backend.describe(s, code), stopped or killed(code, self.run_dir, s.name)
                                or log_cause(self.run_dir, s.name))
        return None

    def _failed(self, s: RoleSpec, how: str, cause: str) -> int | None:
        """A generator failed: restarted after a backoff while its failures within the window stay within the limit,
        else set aside; a run whose every wanted generator is set aside stops, the learners checkpointing first."""
        c, now = self.cfg.cluster, time.monotonic()
        s.failures = [t for t in s.failures if now - t <= c.generator_failure_window_s] + [now]
        if len(s.failures) <= c.generator_max_failures:
            delay = min(2.0 ** len(s.failures), RESTART_BACKOFF_MAX_S)
            self.say(f"{s.name} {how}; restart in {delay:.0f}s (failure {len(s.failures)} of "
                     f"{c.generator_max_failures} allowed within {clock(c.generator_failure_window_s)}): {cause}")
            s.next_start = now + delay
            return None
        s.set_aside += 1
        wait = c.generator_retry_after_s * min(2 ** (s.set_aside - 1), RETRY_BACKOFF_MAX)
        s.set_aside_until = s.next_start = now + wait
        s.failures = []
        serving = [g for g in self.gens.values() if g.gen_id < self.target and not g.set_aside_until]
        detail = (f"failed {c.generator_max_failures + 1} times within {clock(c.generator_failure_window_s)} "
                  f"(cluster.generator_max_failures={c.generator_max_failures}); the last {how}: {cause}")
        self.record(s, SET_ASIDE, detail)
        if not serving:
            self.drain = f"no generator can serve: all {self.target} set aside after failing"
            self.say(f"{s.name} set aside: {detail}; {self.drain}")
            return 1
        self.say(f"{s.name} set aside: {detail}; the run goes on with {len(serving)} generator(s), and tries its slot "
                 f"again in {clock(wait)} or when the generator count is set (covrl scale)")
        return None

    def exited(self, s: RoleSpec, code: int) -> None:
        """Generator `s`'s process exited with an error: the hub is told which process (its pid, where the backend
        knows it), and re-issues what it held now rather than at its silence's timeout or its replacement's hello (a
        generator set aside has no replacement)."""
        if (pid := self.backend.pid(s)) is not None:
            self.record(s, EXITED, self.backend.describe(s, code), pid)

    def record(self, s: RoleSpec | None, why: str, detail: str, pid: int = 0) -> None:
        """A line of RUN_DIR/generators_launcher.jsonl (`common/runfiles.py`, LAUNCHER_FILE): a launch began, a
        generator process exited with an error, a slot set aside, tried again or released (learner rank 0 counts
        them: `cluster/generators_set_aside`)."""
        gen_id = -1 if s is None else s.gen_id
        try:
            record_lost_generator(self.run_dir, LostGenerator(gen_id, "", pid, why, detail, time.time()), LAUNCHER_FILE)
        except OSError as e:  # the run goes on; the hub and the metric then miss this line
            self.say(f"could not record {why} of generator {gen_id} in {self.run_dir}/{LAUNCHER_FILE}: {e}")

    def say(self, message: str) -> None:
        """A message on stderr, on a line of its own (the progress line is ended first)."""
        self.progress.interrupt()
        print(message, file=sys.stderr)

    def run(self, stop: threading.Event) -> int | None:
        """Supervise until the run ends (its exit code) or `stop` is set (None): a stop is taken here, between two
        polls, never in the middle of a backend's call (a KeyboardInterrupt raised inside Ray's client can be lost,
        and the run then went on after a Ctrl-C)."""
        while not stop.is_set():
            if (code := self.poll()) is not None:
                return code
            stop.wait(0.5)
        return None

    def drain_learners(self, grace_s: float) -> None:
        """Graceful stop: SIGTERM the learner ranks (they finish the step, checkpoint and exit) while the
        generators keep serving them; wait up to `grace_s`."""
        for s in self.backend.terminate([s for s in self.learners if s.running], grace_s):
            print(f"{s.name} did not finish within run.stop_grace_s={grace_s:.0f}s; stopping it without a final "
                  f"checkpoint", file=sys.stderr)


