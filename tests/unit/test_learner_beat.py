"""Each learner rank's heartbeat and phase record (learner/beat.py): RUN_DIR/learners/rank_R.json, which the launcher's
watch reads. `beat` must move while the rank is blocked; `phase_seq` with every phase, one before every wait."""

import logging
import os
import threading
import time

import numpy as np

from common.config import from_dict
from common.runfiles import read_learner_beat
from learner.batch import batch_from_config
from learner.beat import Beat, beat_interval_s
from learner.loop import Follower, Learner
from tests.helpers.learner_standins import OneRank, Phases, Publisher, Ready, Trainer, lead_learner

SETTINGS = {"run": {"steps": 2, "checkpoint_every_steps": 0, "checkpoint_every_s": 0.0},
            "rollout": {"groups_per_step": 2, "group_size": 2}, "eval": {"every_steps": 0}}


def _until(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


def test_the_interval_is_a_tenth_of_the_learner_deadline_at_most_five_seconds():
    assert beat_interval_s(40.0) == 4.0 and beat_interval_s(2400.0) == 5.0


def test_the_record_is_there_at_once_and_beats_while_the_rank_is_blocked(tmp_path):
    beat = Beat(str(tmp_path), rank=1, interval_s=0.05, phase="joining the learner ranks")
    try:
        first = read_learner_beat(str(tmp_path), 1)
        assert first is not None, "written by the constructor, before anything slow"
        assert (first.rank, first.pid, first.beat, first.phase_seq, first.phase, first.waits_on) == (
            1, os.getpid(), 0, 0, "joining the learner ranks", "learners")
        threading.Event().wait(0.5)  # the rank's own thread blocked, as in a collective
        later = read_learner_beat(str(tmp_path), 1)
        assert later.beat >= 4 and later.phase_seq == 0 and later.phase == first.phase  # about 10 beats in 0.5 s
    finally:
        beat.close()
    stopped = read_learner_beat(str(tmp_path), 1).beat
    time.sleep(0.2)
    assert read_learner_beat(str(tmp_path), 1).beat == stopped, "closed: no more beats"


def test_a_phase_is_written_at_once_and_moves_phase_seq(tmp_path):
    beat = Beat(str(tmp_path), rank=0, interval_s=60.0)  # no beat within the test: only phases write
    try:
        beat.phase("waiting for step 3's batch", 3, waits_on="generators")
        got = read_learner_beat(str(tmp_path), 0)
        assert (got.phase_seq, got.phase, got.step, got.waits_on) == (1, "waiting for step 3's batch", 3, "generators")
        beat.phase("step 3: training", 3)
        got = read_learner_beat(str(tmp_path), 0)
        assert (got.phase_seq, got.phase, got.waits_on, got.beat) == (2, "step 3: training", "learners", 0)
    finally:
        beat.close()


def test_a_record_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path, caplog):
    blocked = tmp_path / "run"
    blocked.write_text("a file where RUN_DIR/learners/ should go")
    with caplog.at_level(logging.INFO, logger="covrl.learner"):
        beat = Beat(str(blocked), rank=0, interval_s=0.02)  # does not raise
        try:
            beat.phase("step 1: training", 1)
            time.sleep(0.2)  # about ten failed beats
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and "cannot write" in errors[0].getMessage()
            assert "rank_0.json" in errors[0].getMessage()
            blocked.unlink()
            blocked.mkdir()  # the disk is back
            assert _until(lambda: read_learner_beat(str(blocked), 0) is not None)
        finally:
            beat.close()
    assert read_learner_beat(str(blocked), 0).phase == "step 1: training"
    assert any("written again" in r.getMessage() for r in caplog.records)


def test_rank_0_enters_a_phase_before_every_wait_of_a_step():
    events, saves, phases = [], [], Phases()
    learner, _ = lead_learner(SETTINGS, events, saves, beat=phases)
    assert learner.run(0) == 0
    step2 = phases.seen[phases.seen.index(("waiting for step 2's batch", 2, "generators")):]
    assert step2 == [
        ("waiting for step 2's batch", 2, "generators"),
        ("step 2: sharing the batch", 2, "learners"),
        ("step 2: training", 2, "learners"),
        ("step 2: waiting for the generation at version 1", 2, "generators"),
        ("step 2: publishing version 2", 2, "learners"),
        ("step 2: recording", 2, "learners"),
        ("step 2: agreeing on a checkpoint", 2, "learners"),
        ("checkpoint step_2", 2, "learners"),
        ("closing: waiting for the generation at version 2", 2, "generators"),
    ]
    assert phases.seen[0] == ("waiting for step 1's batch", 1, "generators")
    assert [s for s, _, _ in saves] == [2]


def test_a_follower_waits_on_the_generators_while_rank_0_takes_the_batch():
    cfg = from_dict(SETTINGS)

    class Broadcast(OneRank):
        """Rank 0's batch of each step, as a follower receives it."""
        version = 0

        def share(self, item):
            assert item is None, "a follower has no batch of its own"
            groups = [Ready([1.0, 0.0]), Ready([0.0, 1.0])]
            batch = batch_from_config([g.group for g in groups], np.stack([g.rewards for g in groups]), cfg,
                                      version=self.version, ranks=1)
            self.version += 1
            return super().share(batch)

    events, phases = [], Phases()
    follower = Learner(cfg, trainer=Trainer(events), ranks=Broadcast(), role=Follower(Publisher(events, False), phases),
                       world=1, save=lambda step, state, blob: events.append(("save", step)),
                       stop_requested=threading.Event(), run_dir="RUN", beat=phases, clock=None)
    assert follower.run(0) == 0
    assert phases.seen[phases.seen.index(("receiving step 2's batch from rank 0", 2, "generators")):] == [
        ("receiving step 2's batch from rank 0", 2, "generators"),
        ("step 2: training", 2, "learners"),
        ("step 2: publishing version 2", 2, "learners"),
        ("step 2: recording", 2, "learners"),
        ("step 2: agreeing on a checkpoint", 2, "learners"),
        ("checkpoint step_2", 2, "learners"),
    ]


def test_a_micro_batch_moves_the_phase_with_the_next_beat(tmp_path):
    beat = Beat(str(tmp_path), rank=0, interval_s=0.05)
    try:
        beat.phase("step 1: training", 1)
        seq = read_learner_beat(str(tmp_path), 0).phase_seq
        beat.advance()  # not written by itself (one write per micro-batch would be many): the next beat carries it
        assert _until(lambda: read_learner_beat(str(tmp_path), 0).phase_seq == seq + 1)
        assert read_learner_beat(str(tmp_path), 0).phase == "step 1: training"
    finally:
        beat.close()
