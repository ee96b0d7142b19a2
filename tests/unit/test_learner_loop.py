"""The learner's step phases (learner/loop.py) driven with stand-in collaborators: no processes, no sockets.

What is checked is the order the phases run in and what rank 0 writes: the publish of version v + 1 waits for
the generation pinned to v, the hub moves to v + 1 before the weights leave, an evaluated version's row waits for
its eval results, checkpoints fall when due, a stop or a run of skipped steps ends the run with the right code.
"""

import inspect
import threading

import pytest
import torch

from broker.hooks import GeneratorHooks
from broker.hub import BrokerStats
from broker.hub import Hub as RealHub
from broker.rules import GroupRules
from common.config import eval_versions, from_dict
from learner.__main__ import GeneratorEvents
from learner.batch import batch_from_config, decode, encode
from learner.loop import Follower, Lead, Learner
from learner.ports import HubPort
from learner.par import ParSchedule
from learner.trainer import SUM_KEYS, StepStats
from tests.helpers.groups import rollout_group, sample
from tests.helpers.hooks import Hooks
from tests.helpers import learner_standins as standins

CFG = {"run": {"steps": 4, "checkpoint_every_steps": 3}, "rollout": {"groups_per_step": 2, "group_size": 2},
       "eval": {"every_steps": 2}, "learner": {"max_consecutive_skipped_steps": 2}}


def _group(rewards):
    return rollout_group([sample([5, 6, 7], r) for r in rewards])


class Hub(standins.Hub):
    def __init__(self, events):
        super().__init__(events)
        self.taken = 0

    def take_batch(self, version, timeout_s, stop=None):
        self.taken += 2
        return super().take_batch(version, timeout_s, stop)

    def stats(self):
        # Generation busy 1000 s per batch taken up to step 2, then never again: idle = the whole interval.
        return BrokerStats(filtered_groups=self.taken // 4, gen_tokens=6 * self.taken, counters={"hub/lost_prompts": 0.0},
                           gen_busy_s=1000.0 * min(self.taken, 4))

    def restore(self, blob):
        self.events.append(("hub.restore", blob))

    def lose(self, gen_id, incarnation, detail):
        self.events.append(("hub.lose", gen_id))

    def start(self):
        self.events.append(("hub.start",))


class Publisher(standins.Publisher):
    def counter_values(self):
        return {"weights/joins": 1.0}


class Sink:
    def __init__(self, events):
        self.events, self.rows, self.shown, self.histograms = events, [], [], []

    def write(self, step, metrics):
        self.events.append(("write", step))
        self.rows.append((step, dict(metrics)))

    def progress(self, step, row, evaluating, note=""):
        self.shown.append((step, list(evaluating)))

    def histogram(self, tag, values, step):
        self.histograms.append((tag, step, list(values)))

    def close(self):
        self.events.append(("sink.close",))


class Trainer:
    def __init__(self, events, skipped=frozenset()):
        self.events, self.skipped = events, skipped

    def train_step(self, batch, poison=False):
        self.events.append(("train", batch.version))
        sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        sums[SUM_KEYS.index("tokens")], sums[SUM_KEYS.index("entropy")] = 10.0, 3.0
        return StepStats(sums=sums, grad_norm=1.0, train_s=0.1, entropy_delta_logged=False,
                         skipped=[batch.version + 1 in self.skipped])


class Ranks:
    """One rank: the batch goes through the wire encoding, as the broadcast does."""

    def __init__(self, stop_at=None):
        self.stop_at, self.asked = stop_at, 0

    def share(self, batch):
        return decode(encode(batch))

    def agree(self, flag):
        self.asked += 1
        return flag or self.asked == self.stop_at


def _run(skipped=frozenset(), stop_at=None):
    cfg = from_dict(CFG)
    events, saves = [], []
    sink = Sink(events)
    lead = Lead(cfg, hub=Hub(events), publisher=Publisher(events), sink=sink, par=ParSchedule(cfg.learner.par, 4),
                world=1, held={0: {}})
    learner = Learner(cfg, trainer=Trainer(events, skipped), ranks=Ranks(stop_at), role=lead, world=1,
                      save=lambda step, state, blob: saves.append((step, state["version"], blob)),
                      stop_requested=threading.Event(), run_dir="RUN")
    _run.sink = sink
    return learner.run(0), events, sink.rows, saves


def test_phases_in_order_and_rows_in_step_order():
    code, events, rows, saves = _run()
    assert code == 0
    step2 = events[events.index(("take_batch", 1)):events.index(("take_batch", 2))]
    assert step2 == [("take_batch", 1), ("train", 1), ("wait_version_done", 1), ("set_version", 2), ("publish", 2)]
    assert events[-5:] == [("wait_version_done", 4), ("write", 4), ("publisher.stop",), ("hub.stop",), ("sink.close",)]
    assert [s for s, _ in rows] == [0, 1, 2, 3, 4], "one row per step, in step order"
    by_step = dict(rows)
    assert by_step[0] == {"eval/arith/acc": 0.0}, "step 0's row is the base model's evaluation"
    # Evaluated versions (2, 4: every 2 and the last) are written once their eval results are in, after the next publish.
    assert by_step[2]["eval/arith/acc"] == 0.2 and by_step[4]["eval/arith/acc"] == 0.4
    assert "eval/arith/acc" not in by_step[1] and "eval/arith/acc" not in by_step[3]
    assert events.index(("write", 2)) > events.index(("publish", 2)) and events.index(("write", 2)) < events.index(("publish", 3))
    r = by_step[3]
    assert r["actor/entropy"] == 0.3 and r["weights/version"] == 3.0 and r["weights/checksum"] == 3.0
    assert r["timing_s/publish_wait"] == 0.25 and r["weights/bytes"] == 1024 and r["weights/joins"] == 1.0
    assert by_step[2]["timing_s/gen_idle"] == 0.0  # busy beyond the interval: not idle at all
    assert 0.0 < by_step[3]["timing_s/gen_idle"] == pytest.approx(by_step[3]["timing_s/step"], abs=0.05)
    assert all(0.0 <= by_step[s]["timing_s/batch_wait"] <= by_step[s]["timing_s/step"] for s in (1, 2, 3, 4))
    assert [by_step[s]["filter/dropped_groups"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]  # differences
    assert r["critic/score/mean"] == 0.5 and r["staleness/max"] == 2.0 and r["critic/advantages/mean"] == 0.0
    assert [s for s, _, _ in saves] == [3, 4] and all(v == s and blob == b"hub" for s, v, blob in saves)


def test_a_stop_checkpoints_and_leaves_without_waiting_for_the_last_version():
    code, events, rows, saves = _run(stop_at=2)
    assert code == 0 and [s for s, _, _ in saves] == [2]
    assert ("take_batch", 2) not in events and ("wait_version_done", 2) not in events
    assert events[-3:] == [("publisher.stop",), ("hub.stop",), ("sink.close",)]


def test_consecutive_skipped_steps_stop_the_run_with_code_3():
    code, events, rows, saves = _run(skipped={2, 3})
    assert code == 3 and [s for s, _, _ in saves] == [3]  # max_consecutive_skipped_steps = 2: steps 2 and 3
    assert ("take_batch", 3) not in events


def test_a_follower_trains_and_publishes_every_step_and_writes_nothing():
    cfg = from_dict(CFG)
    events, saves = [], []
    lead_batches = []

    class Broadcast(Ranks):
        def share(self, batch):
            assert batch is None, "a follower has no batch of its own"
            groups = [_group([1, 0]), _group([0, 1])]
            b = batch_from_config(groups, GroupRules.of(cfg).rewards(groups), cfg, version=len(lead_batches), ranks=1)
            lead_batches.append(b)
            return b

    learner = Learner(cfg, trainer=Trainer(events), ranks=Broadcast(), role=Follower(Publisher(events, rank0=False)),
                      world=1, save=lambda step, state, blob: saves.append((step, state, blob)),
                      stop_requested=threading.Event(), run_dir="RUN")
    assert learner.run(0) == 0
    assert [e for e in events if e[0] == "publish"] == [("publish", s) for s in (1, 2, 3, 4)]
    assert saves == [(3, None, None), (4, None, None)]


def test_progress_shows_each_trained_step_and_the_versions_still_evaluating():
    _run()
    shown = _run.sink.shown
    cfg = from_dict(CFG)
    evaluated = set(eval_versions(cfg))
    assert shown[0] == (0, [0])  # before step 1: the base model's evaluation runs
    steps = [s for s, _ in shown]
    assert steps == sorted(steps) and steps[-1] == cfg.run.steps
    for s in evaluated - {0}:  # a step whose version is evaluated shows it until its row is written
        assert (s, [s]) in shown
    assert shown[-1] == (cfg.run.steps, [])


def _methods(cls) -> dict[str, list[str]]:
    """Public method -> its parameter names (self left out)."""
    return {name: list(inspect.signature(fn).parameters)[1:] for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


@pytest.mark.parametrize("port, implementations", [
    (HubPort, [RealHub, Hub]),
    (GeneratorHooks, [GeneratorEvents, Hooks]),
])
def test_the_hub_its_hooks_and_their_stand_ins_follow_the_declared_protocols(port, implementations):
    """The port the learner declares (learner/ports.py) and the hooks the hub calls (broker/hooks.py): the real
    classes and the test stand-ins have every method of the protocol, with the same parameter names, so a drift on
    either side fails here."""
    declared = _methods(port)
    assert declared, "the protocol declares no methods"
    for impl in implementations:
        have = _methods(impl)
        assert {name: have.get(name) for name in declared} == declared, impl.__qualname__
