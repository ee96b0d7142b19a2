"""Every stop the learners survive writes a checkpoint first (learner/loop.py), and run.checkpoint_every_s.

A stop (SIGTERM: `stop_requested`) while rank 0 waits for step k's batch, or that wait passing
transport.batch_timeout_s, checkpoints step k - 1 on every rank and ends the run (0, or EXIT_BATCH_TIMEOUT); a stop
while the publish of step k waits for generation publishes and checkpoints step k. Nothing is written twice, and
nothing when this launch trained no step. The hub's waits give up on the stop (broker/hub.py: `Stopped`).
"""

import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from broker.hub import Stopped
from common.config import from_dict
from common.transport import free_port
from learner.batch import batch_from_config
from learner.loop import DEADLINE, EXIT_BATCH_TIMEOUT, STOP, Agreed, Follower, Halt, Learner
from tests.helpers.learner_standins import Hub, OneRank, Publisher, Ready, Trainer, lead_learner
from tests.helpers.paths import REPO

KEY = b"k" * 32  # the `hub` fixture's (tests/unit/conftest.py): a real hub, no generators
HUB_SETTINGS = ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2"]

SETTINGS = {"run": {"steps": 5, "checkpoint_every_steps": 0, "checkpoint_every_s": 0.0},
            "rollout": {"groups_per_step": 2, "group_size": 2}, "eval": {"every_steps": 0}}
NO_BATCH = "no batch for step 3 after 600s: 0 groups ready, 0 in flight, 0 generators connected (target 1)"


def _stop_at(version: int, stop: threading.Event):
    """A hub wait for `version` that nothing ends but the stop, which arrives while it waits (SIGTERM): it gives up as
    the real hub does, and without the stop in hand, it waits out its deadline."""
    def wait(v, given):
        if v != version:
            return
        stop.set()
        if given is None or not given.is_set():
            raise TimeoutError(f"nothing for version {v} after 600s")
        raise Stopped("stop requested")
    return wait


def _run(settings=SETTINGS, *, on_take=None, on_done=None, stop=None, start=0):
    events, saves = [], []
    learner, sink = lead_learner(settings, events, saves, hub=Hub(events, on_take, on_done), start=start, stop=stop)
    return learner.run(start), events, saves, sink


def test_a_stop_while_waiting_for_a_batch_checkpoints_the_last_trained_step(caplog):
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="covrl.learner"):
        code, events, saves, _ = _run(on_take=_stop_at(2, stop), stop=stop)  # step 3's batch
    assert code == 0 and [s for s, _, _ in saves] == [2] and saves[0][1:] == (2, b"hub")
    assert ("train", 2) not in events and ("set_version", 3) not in events
    assert events[-3:] == [("publisher.stop",), ("hub.stop",), ("sink.close",)], "no wait for the last version"
    assert "stop requested: checkpoint of step 2 written; continue with covrl resume RUN" in caplog.text


def test_no_batch_within_the_deadline_checkpoints_the_last_trained_step_and_exits_4(caplog):
    def late(v, stop):
        if v == 2:
            raise TimeoutError(NO_BATCH)

    with caplog.at_level(logging.INFO, logger="covrl.learner"):
        code, events, saves, _ = _run(on_take=late)
    assert code == EXIT_BATCH_TIMEOUT == 4 and [s for s, _, _ in saves] == [2]
    assert ("train", 2) not in events
    error = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(error) == 1 and NO_BATCH in error[0] and "checkpoint of step 2 written" in error[0]


def test_a_stop_while_the_publish_waits_for_generation_publishes_and_checkpoints_that_step():
    stop = threading.Event()
    settings = {**SETTINGS, "eval": {"every_steps": 2}}  # version 2's row waits for its evaluation
    code, events, saves, sink = _run(settings, on_done=_stop_at(2, stop), stop=stop)  # the publish of step 3
    assert code == 0 and [s for s, _, _ in saves] == [3]
    after = events[events.index(("wait_version_done", 2)):]
    assert after[:3] == [("wait_version_done", 2), ("write", 2), ("set_version", 3)] and ("publish", 3) in after
    assert ("take_batch", 3) not in events
    assert "eval/arith/acc" not in sink.rows[2] and "actor/entropy" in sink.rows[2], "written, without the cut eval"


def test_the_publish_missing_its_deadline_publishes_checkpoints_that_step_and_exits_4(caplog):
    """transport.batch_timeout_s passing while the publish of step 3 waits for the generation at version 2 (every
    generator gone): the trained step is published and checkpointed, then the run stops with EXIT_BATCH_TIMEOUT."""
    def late(v, stop):
        if v == 2:
            raise TimeoutError("generation at version 2 not finished after 600s: 0 generators connected (target 1)")

    with caplog.at_level(logging.INFO, logger="covrl.learner"):
        code, events, saves, _ = _run(on_done=late)
    assert code == EXIT_BATCH_TIMEOUT and [s for s, _, _ in saves] == [3]
    assert ("set_version", 3) in events and ("take_batch", 3) not in events
    error = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("checkpoint of step 3 written" in e and "0 generators connected" in e for e in error), error


def test_a_stop_in_the_last_step_still_waits_for_the_final_evaluation():
    """The run is complete: a resume would not evaluate its last version again, so the stop does not cut that wait
    (a second Ctrl-C ends the launcher's wait instead)."""
    stop = threading.Event()

    def sigterm_during_the_last_step(v, given):
        if v == 4:
            stop.set()  # arrives while step 5's batch is being taken; the batch comes

    settings = {**SETTINGS, "eval": {"every_steps": 5}}
    code, events, saves, sink = _run(settings, on_take=sigterm_during_the_last_step, stop=stop)
    assert code == 0 and [s for s, _, _ in saves] == [5]
    assert ("wait_version_done", 5) in events and "eval/arith/acc" in sink.rows[5]


def test_a_deadline_in_the_last_steps_publish_completes_the_run():
    """batch_timeout_s passing in the last step's publish: the run trained every step and is checkpointed, so it is
    complete (exit 0; a resume would refuse it), the last row written without the evaluation it could not wait for."""
    def late(v, stop):
        if v == 4:
            raise TimeoutError("generation at version 4 not finished after 600s: 0 generators connected (target 1)")

    settings = {**SETTINGS, "eval": {"every_steps": 5}}
    code, events, saves, sink = _run(settings, on_done=late)
    assert code == 0 and [s for s, _, _ in saves] == [5]
    assert ("wait_version_done", 5) not in events and 5 in sink.rows and "eval/arith/acc" not in sink.rows[5]


@pytest.mark.parametrize("start, every, expected", [(0, 0, []), (3, 0, []), (0, 2, [2])])
def test_a_step_is_never_checkpointed_twice_nor_one_this_launch_did_not_train(start, every, expected):
    """A stop while waiting for the first batch of a launch writes nothing (step 0: the base model; a resumed launch:
    the checkpoint it resumed from); one right after a periodic checkpoint (every 2 steps: step 2) does not write that
    step again."""
    stop = threading.Event()
    settings = {**SETTINGS, "run": {**SETTINGS["run"], "checkpoint_every_steps": every}}
    code, events, saves, _ = _run(settings, on_take=_stop_at(max(start, 2 if every else 0), stop), stop=stop,
                                  start=start)
    assert code == 0 and [s for s, _, _ in saves] == expected


class Broadcast(OneRank):
    """A follower's view of `Ranks`: rank 0's batch of each step, or its halt at step `halt_at`; `due_after`: the
    step after which rank 0's clock says a checkpoint is due (its flag joins the follower's in `agree`)."""

    def __init__(self, cfg, halt=None, halt_at=0, due_after=0):
        self.cfg, self.halt, self.halt_at, self.due_after, self.step = cfg, halt, halt_at, due_after, 0

    def share(self, item):
        assert item is None, "a follower has no batch of its own"
        self.step += 1
        return super().share(self.halt if self.step == self.halt_at else _batch(self.cfg, self.step - 1))

    def agree(self, flags):
        return int(flags) | (Agreed.DUE if self.step == self.due_after else 0)


def _follower(cfg, ranks, events) -> Learner:
    return Learner(cfg, trainer=Trainer(events), ranks=ranks, role=Follower(Publisher(events, rank0=False)), world=1,
                   save=lambda step, state, blob: events.append(("save", step, state, blob)),
                   stop_requested=threading.Event(), run_dir="RUN", clock=None)  # no clock: rank 0's decides


@pytest.mark.parametrize("halt, code", [(Halt(STOP), 0), (Halt(DEADLINE, NO_BATCH), EXIT_BATCH_TIMEOUT)])
def test_a_follower_checkpoints_the_last_trained_step_on_rank_0s_halt(halt, code):
    cfg, events = from_dict(SETTINGS), []
    assert _follower(cfg, Broadcast(cfg, halt, halt_at=3), events).run(0) == code
    assert [e for e in events if e[0] == "save"] == [("save", 2, None, None)] and ("train", 2) not in events


def test_a_checkpoint_falls_due_by_rank_0s_clock():
    """run.checkpoint_every_s = 100 with steps of 40 s on rank 0's clock: due after step 3 (120 s), then after step 6
    (240 s, 120 s after the last); step 7 is the last step."""
    now = [0.0]
    for every_s, expected in ((100.0, [3, 6, 7]), (0.0, [7])):
        events, saves = [], []
        settings = {**SETTINGS, "run": {**SETTINGS["run"], "steps": 7, "checkpoint_every_s": every_s}}
        learner, _ = lead_learner(settings, events, saves, clock=lambda: now[0],
                                  tick=lambda: now.__setitem__(0, now[0] + 40.0))
        assert learner.run(0) == 0
        assert [s for s, _, _ in saves] == expected


def test_time_based_checkpoints_roll_and_never_remove_any_other(tmp_path):
    """A checkpoint written only because run.checkpoint_every_s passed is marked rolling and goes once a newer one is
    written (rank 0); the final, periodic and stop checkpoints stay: the time-based schedule adds at most one
    checkpoint on disk."""
    from common.checkpoint_dirs import DS_TAG, STATE_FILE, complete_checkpoints

    run = str(tmp_path)
    now, states = [0.0], []

    def save(step, state, blob):
        states.append((step, state["rolling"]))
        path = os.path.join(run, "checkpoints", f"step_{step}")
        os.makedirs(os.path.join(path, DS_TAG))
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump({"step": step, **state}, f)

    settings = {**SETTINGS, "run": {**SETTINGS["run"], "steps": 7, "checkpoint_every_s": 100.0,
                                    "checkpoint_every_steps": 5}}
    learner, _ = lead_learner(settings, [], [], clock=lambda: now[0], tick=lambda: now.__setitem__(0, now[0] + 40.0))
    learner.save, learner.run_dir = save, run
    assert learner.run(0) == 0
    assert states == [(3, True), (5, False), (7, False)]  # 5: periodic (and it resets the clock); 7: the last
    assert [s for s, _ in complete_checkpoints(run)] == [5, 7], "the rolling step_3 is superseded and removed"


def test_a_follower_follows_rank_0s_clock_through_agree():
    cfg = from_dict({**SETTINGS, "run": {**SETTINGS["run"], "steps": 3, "checkpoint_every_s": 100.0}})
    events = []
    assert _follower(cfg, Broadcast(cfg, due_after=2), events).run(0) == 0
    assert [e[1] for e in events if e[0] == "save"] == [2, 3]


def _batch(cfg, version):
    groups = [Ready([1.0, 0.0]), Ready([0.0, 1.0])]
    return batch_from_config([g.group for g in groups], np.stack([g.rewards for g in groups]), cfg, version=version,
                             ranks=1)


# ---- the hub's waits give up on a stop ----------------------------------------------------------------------------

@pytest.mark.parametrize("wait", ["take_batch", "wait_version_done"])
def test_the_hubs_waits_give_up_within_a_second_of_the_stop(hub, wait):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped) as raised:
        getattr(hub, wait)(0, timeout_s=30, stop=stop)  # no generators: neither the batch nor version 0 comes
    assert 0.2 <= time.monotonic() - t0 < 1.5
    assert isinstance(raised.value, InterruptedError), "what the learner catches (it does not import the broker)"


# ---- the collectives that carry it, in a world of two ranks -------------------------------------------------------

TWO_RANKS = """
import json
import torch.distributed as dist
from learner.loop import Agreed, DEADLINE, Halt, Ranks
from learner.trainer import init_distributed
rank, _ = init_distributed(timeout_s=30)
ranks = Ranks(rank)
got = ranks.share(Halt(DEADLINE, "no batch") if rank == 0 else None)
flags = ranks.agree(Agreed.DUE if rank == 0 else Agreed.STOP)
print("RESULT", json.dumps({"halt": [got.why, got.detail], "flags": int(flags)}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_halt_and_the_agreed_flags_reach_every_rank():
    """Rank 0's halt, with the hub's account, reaches rank 1; rank 0's DUE and rank 1's STOP reach both."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS], cwd=REPO, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err[-3000:]
        got = [json.loads(x.split(" ", 1)[1]) for x in out.splitlines() if x.startswith("RESULT ")][-1]
        assert got == {"halt": ["deadline", "no batch"], "flags": int(Agreed.STOP | Agreed.DUE)}
