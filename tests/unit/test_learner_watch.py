"""The launcher's watch on the learner ranks (launch/watch.py), on records written as the ranks write them and a
clock of our own: a frozen rank (its heartbeat stopped) and a stuck one (its phase unchanged) are named after the
deadline and not before; a restarted process starts over; a rank without a record is not judged."""

from common.runfiles import LearnerBeat, write_learner_beat
from launch.watch import LearnerWatch


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _beat(run, rank, beat, seq, phase="step 3: training", pid=None, waits_on="learners"):
    write_learner_beat(run, LearnerBeat(rank, pid or 100 + rank, beat, seq, phase, waits_on, 3, 0.0))


def test_a_frozen_rank_is_named_after_the_deadline_before_the_ranks_that_wait_for_it(tmp_path):
    run, clock = str(tmp_path), Clock()
    watch = LearnerWatch(run, 30.0, now=clock)
    _beat(run, 0, 1, 1)
    _beat(run, 1, 1, 1)
    assert watch.check([0, 1]) is None
    for t in range(1, 7):  # rank 0 lives on (its heartbeat moves) but waits in a collective; rank 1 is frozen
        clock.t = 5.0 * t
        _beat(run, 0, 1 + t, 2, phase="step 3: training")
        assert watch.check([0, 1]) is None, f"judged at {clock.t}s, before the 30 s deadline"
    clock.t = 31.0
    verdict = watch.check([0, 1])
    assert verdict.startswith("learner1 (pid 101) is frozen: no heartbeat for 31s (transport.learner_timeout_s=30)")
    assert "'step 3: training' at step 3" in verdict
    assert watch.suspect(0).startswith("learner1 (pid 101) had sent no heartbeat for 31s")


def test_a_rank_stuck_in_one_phase_is_named_the_oldest_first(tmp_path):
    run, clock = str(tmp_path), Clock()
    watch = LearnerWatch(run, 30.0, now=clock)
    _beat(run, 0, 1, 1, phase="checkpoint step_2")
    _beat(run, 1, 1, 1, phase="checkpoint step_2")
    watch.check([0, 1])
    clock.t = 10.0
    _beat(run, 1, 2, 2, phase="step 3: training")  # rank 1 moved on, then hangs there; rank 0 still checkpoints
    watch.check([0, 1])
    for t in range(11, 42, 5):
        clock.t = float(t)
        _beat(run, 0, t, 1, phase="checkpoint step_2")
        _beat(run, 1, t, 2, phase="step 3: training")
        if t <= 30:
            assert watch.check([0, 1]) is None
    verdict = watch.check([0, 1])
    assert verdict.startswith("learner0 (pid 100) has not moved on for 41s (transport.learner_timeout_s=30): "
                              "still 'checkpoint step_2' at step 3; learner1 waits as well")


def test_a_new_process_starts_over_and_a_rank_without_a_record_or_not_watched_is_not_judged(tmp_path):
    run, clock = str(tmp_path), Clock()
    watch = LearnerWatch(run, 30.0, now=clock)
    _beat(run, 0, 1, 1)
    watch.check([0, 1])  # rank 1 has no record yet (still importing torch)
    clock.t = 100.0
    _beat(run, 0, 1, 1, pid=555)  # the same counters from another process: a restart, seen fresh
    assert watch.check([0, 1]) is None
    clock.t = 200.0
    assert watch.check([1]) is None  # rank 0 finished (not live): not judged
    assert watch.check([0]).startswith("learner0 (pid 555) is frozen")


def test_an_exiting_rank_is_not_stuck_a_micro_batch_is_progress_and_a_finished_rank_is_no_suspect(tmp_path):
    run, clock = str(tmp_path), Clock()
    watch = LearnerWatch(run, 30.0, now=clock)
    _beat(run, 0, 1, 1, phase="exiting (exit code 0)", waits_on="none")
    _beat(run, 1, 1, 1, phase="step 3: training")
    watch.check([0, 1])
    for t in range(5, 100, 5):  # rank 0 waits in its interpreter's exit; rank 1 trains micro-batch after micro-batch
        clock.t = float(t)
        _beat(run, 0, 1 + t, 1, phase="exiting (exit code 0)", waits_on="none")
        _beat(run, 1, 1 + t, 1 + t, phase="step 3: training")
        assert watch.check([0, 1]) is None, f"a live run judged at {t}s"
    clock.t = 200.0  # rank 0 has finished (not live): its old heartbeat makes it no suspect for rank 1's failure
    watch.check([1])
    assert watch.suspect(1) == ""

