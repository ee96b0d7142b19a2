"""Each learner rank's heartbeat and phase: RUN_DIR/learners/rank_R.json (`common.runfiles.LearnerBeat`).

The launcher's watch reads it to tell a rank that is alive and waiting (on the generators, or on another rank) from
one that is frozen or dead, and to name what a stalled run waits on. So `beat` moves on a thread of its own, which
a rank blocked in a collective or in the hub does not hold up, and the rank enters a phase before each wait
(`Beat.phase`, written at once). The first record is written before anything slow (model load, engine build).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import msgspec

from common.runfiles import LearnerBeat, beat_interval_s, learner_beat_path, write_learner_beat

log = logging.getLogger("covrl.learner")

__all__ = ["Beat", "NoBeat", "beat_interval_s"]


class Beat:
    """Rank `rank`'s record, rewritten every `interval_s` (`beat` + 1) and at each `phase` (`phase_seq` + 1).

    A record that cannot be written (disk full, directory gone) never stops training: the first failure is logged
    with the reason, the next ones only once the record is written again."""

    def __init__(self, run_dir: str, rank: int, interval_s: float, phase: str = "starting"):
        self.run_dir, self.interval_s = run_dir, interval_s
        self.lock = threading.Lock()  # the beat thread and the rank's own thread write the same file
        self.failing = False
        self.record = LearnerBeat(rank=rank, pid=os.getpid(), beat=0, phase_seq=0, phase=phase, waits_on="learners",
                                  step=0, t=time.time())
        self._write()  # before the thread starts: nothing else writes yet
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"learner-beat-{rank}", daemon=True)
        self._thread.start()

    def phase(self, text: str, step: int, waits_on: str = "learners") -> None:
        """Enter a phase: what the rank does now, the step it is on, and whom it waits on ("generators" or
        "learners", as `LearnerBeat` says)."""
        with self.lock:
            r = self.record
            self.record = msgspec.structs.replace(r, phase_seq=r.phase_seq + 1, phase=text, waits_on=waits_on,
                                                  step=step, t=time.time())
            self._write()

    def advance(self) -> None:
        """Progress within the phase (a micro-batch trained): `phase_seq` + 1, written with the next beat, so a long
        step is never taken for a stuck one."""
        with self.lock:
            self.record = msgspec.structs.replace(self.record, phase_seq=self.record.phase_seq + 1)

    def close(self) -> None:
        """Stop beating (the record stays, with its last phase)."""
        self._closed.set()
        self._thread.join(timeout=self.interval_s + 1.0)

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            with self.lock:
                self.record = msgspec.structs.replace(self.record, beat=self.record.beat + 1, t=time.time())
                self._write()

    def _write(self) -> None:
        """Under `lock`."""
        try:
            write_learner_beat(self.run_dir, self.record)
        except OSError as e:
            if not self.failing:
                log.error("cannot write %s (%s): training goes on, but the launcher's watch cannot see that this rank "
                          "is alive or what it waits on", learner_beat_path(self.run_dir, self.record.rank), e)
            self.failing = True
            return
        if self.failing:
            log.info("%s is written again", learner_beat_path(self.run_dir, self.record.rank))
        self.failing = False


class NoBeat:
    """A learner without a record (tests that do not look at phases)."""

    def phase(self, text: str, step: int, waits_on: str = "learners") -> None:
        pass

    def advance(self) -> None:
        pass

    def close(self) -> None:
        pass
