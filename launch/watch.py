"""The launcher's watch on the learner ranks: a rank that has not moved on for transport.learner_timeout_s stops the
run in one line naming it, even where a library's own timeout fails (a collective with a deadline of its own, a
frozen process whose peers wait in C).

Each rank rewrites RUN_DIR/learners/rank_R.json (`common.runfiles.LearnerBeat`, written by `learner/beat.py`): a
heartbeat counter its own thread moves every few seconds, and the phase it is in. The watch compares what it reads
over time on its own clock (a rank's clock, on another node under Ray, never enters the verdict):
- frozen: the heartbeat has not moved for the deadline (SIGSTOP, a swapped-out or stalled node);
- stuck: the phase has not changed for the deadline while the heartbeat goes on (a hung collective, a wedged
  kernel). The deadline is already the bound on a phase's length: while one rank works (loads the model, writes
  its part of a checkpoint, trains a micro-batch), its peers wait for it in a collective that gives up after
  learner_timeout_s, and a wait for generation gives up after transport.batch_timeout_s, which the config keeps
  below it. A training step moves the phase at each micro-batch, so only one micro-batch, not a whole step, must
  fit the deadline. A single rank (no peer) is held to the same bound. Past its last collective a rank is exiting
  (`waits_on` "none"): not judged stuck.
A rank with no record yet (still importing) is not judged; a record from another process (a restart) starts over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.runfiles import LearnerBeat, beat_interval_s, read_learner_beat
from launch.progress import clock


@dataclass
class Seen:
    beat: LearnerBeat
    beat_t: float  # our clock when its heartbeat last moved
    phase_t: float  # our clock when its phase last changed


class LearnerWatch:
    def __init__(self, run_dir: str, deadline_s: float, now=time.monotonic):
        self.run_dir, self.deadline_s, self.now = run_dir, deadline_s, now
        self.seen: dict[int, Seen] = {}
        self.live: set[int] = set()  # the ranks last checked: running, not finished

    def look(self, ranks: list[int]) -> None:
        """Read each rank's record and note, on our clock, whether its heartbeat and phase moved."""
        now = self.now()
        for r in ranks:
            b = read_learner_beat(self.run_dir, r)
            if b is None:
                continue
            s = self.seen.get(r)
            if s is None or s.beat.pid != b.pid:
                self.seen[r] = Seen(b, now, now)
                continue
            if b.beat != s.beat.beat:
                s.beat_t = now
            if b.phase_seq != s.beat.phase_seq:
                s.phase_t = now
            s.beat = b

    def check(self, ranks: list[int]) -> str | None:
        """One line naming the rank that has not moved on for the deadline, or None. A frozen rank is named before
        ranks stuck waiting for it; among stuck ranks, the one whose phase is oldest (the others wait on it)."""
        self.look(ranks)
        self.live = set(ranks)
        now, live = self.now(), [self.seen[r] for r in ranks if r in self.seen]
        frozen = [s for s in live if now - s.beat_t > self.deadline_s]
        if frozen:
            s = min(frozen, key=lambda s: s.beat_t)
            return (f"learner{s.beat.rank} (pid {s.beat.pid}) is frozen: no heartbeat for {clock(now - s.beat_t)} "
                    f"(transport.learner_timeout_s={self.deadline_s:g}), last {self.doing(s.beat)}")
        stuck = [s for s in live if now - s.phase_t > self.deadline_s and s.beat.waits_on != "none"]
        if stuck:
            s = min(stuck, key=lambda s: s.phase_t)
            others = [f"learner{o.beat.rank}" for o in stuck if o is not s]
            return (f"learner{s.beat.rank} (pid {s.beat.pid}) has not moved on for {clock(now - s.phase_t)} "
                    f"(transport.learner_timeout_s={self.deadline_s:g}): still {self.doing(s.beat)}"
                    + (f"; {', '.join(others)} {'waits' if len(others) == 1 else 'wait'} as well" if others else ""))
        return None

    def suspect(self, failed: int) -> str:
        """When rank `failed` died (a collective's own timeout, often): another rank whose heartbeat had stopped,
        the likelier cause, in a few words; "" if none."""
        others = sorted(self.live - {failed})  # a rank that finished (exit 0) is no suspect
        self.look(others)
        now = self.now()
        late = [self.seen[r] for r in others
                if r in self.seen and now - self.seen[r].beat_t > max(3 * beat_interval_s(self.deadline_s), 1.0)]
        if not late:
            return ""
        s = min(late, key=lambda s: s.beat_t)
        return (f"learner{s.beat.rank} (pid {s.beat.pid}) had sent no heartbeat for {clock(now - s.beat_t)} (frozen?), "
                f"last {self.doing(s.beat)}")

    @staticmethod
    def doing(b: LearnerBeat) -> str:
        return f"{b.phase!r} at step {b.step}"

