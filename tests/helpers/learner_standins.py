"""Stand-ins for the learner loop's collaborators (learner/loop.py), for tests that drive `Learner` with no processes:
a hub whose waits can be scripted per version, a publisher, a metrics sink, a trainer, one rank's collectives, and
a phase recorder in place of learner/beat.py's `Beat`. Each appends what it is asked to a shared `events` list."""

from __future__ import annotations

import threading

import numpy as np
import torch

from broker.hub import BrokerStats
from common.config import from_dict
from learner.loop import Lead, Learner, decode_shared, encode_shared
from learner.par import ParSchedule
from learner.trainer import SUM_KEYS, StepStats
from tests.helpers.groups import rollout_group, sample


class Ready:
    def __init__(self, rewards):
        self.group = rollout_group([sample([5, 6, 7], r) for r in rewards])
        self.rewards = np.array(rewards, dtype=np.float64)


class Hub:
    """`HubPort` whose batches are always ready and whose versions are always done, unless `on_take` / `on_done`
    (version, stop) -> None, called first, raises as the real hub would (TimeoutError; InterruptedError, the hub's
    `Stopped`, once `stop` is set)."""

    def __init__(self, events, on_take=None, on_done=None):
        self.events, self.on_take, self.on_done = events, on_take, on_done

    def take_batch(self, version, timeout_s, stop=None):
        self.events.append(("take_batch", version))
        if self.on_take is not None:
            self.on_take(version, stop)
        return [Ready([1.0, 0.0]), Ready([0.0, 1.0])]

    def wait_version_done(self, version, timeout_s, stop=None):
        self.events.append(("wait_version_done", version))
        if self.on_done is not None:
            self.on_done(version, stop)
        return 0.25

    def set_version(self, version):
        self.events.append(("set_version", version))

    def take_eval(self, version):
        return {"eval/arith/acc": version / 10}, []

    def stats(self):
        return BrokerStats(filtered_groups=0, gen_tokens=0, counters={}, gen_busy_s=0.0)

    def snapshot(self):
        return b"hub"

    def restore(self, blob):
        pass

    def lose(self, gen_id, incarnation, detail):
        pass

    def start(self):
        pass

    def stop(self):
        self.events.append(("hub.stop",))


class Publisher:
    def __init__(self, events, rank0=True):
        self.events, self.rank0 = events, rank0

    def publish(self, version):
        self.events.append(("publish", version))
        return (0.5, 1024, float(version)) if self.rank0 else None

    def counter_values(self):
        return {}

    def stop(self):
        self.events.append(("publisher.stop",))


class Sink:
    def __init__(self, events):
        self.events, self.rows = events, {}

    def write(self, step, metrics):
        self.events.append(("write", step))
        self.rows[step] = dict(metrics)

    def progress(self, step, row, evaluating, note=""):
        pass

    def histogram(self, tag, values, step):
        pass

    def close(self):
        self.events.append(("sink.close",))


class Trainer:
    """Trains instantly; `tick` (if given) is called once per step: a test's clock moves with it."""

    def __init__(self, events, tick=None):
        self.events, self.tick = events, tick

    def train_step(self, batch, poison=False):
        self.events.append(("train", batch.version))
        if self.tick is not None:
            self.tick()
        sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        sums[SUM_KEYS.index("tokens")], sums[SUM_KEYS.index("entropy")] = 10.0, 3.0
        return StepStats(sums=sums, grad_norm=1.0, train_s=0.1, entropy_delta_logged=False, skipped=[False])


class OneRank:
    """`Ranks` of a world of one: what is shared goes through the broadcast's wire encoding."""

    rank = 0

    def share(self, item):
        return decode_shared(encode_shared(item))

    def agree(self, flags):
        return int(flags)


class Phases:
    """Records `Beat.phase` calls as (text, step, waits_on)."""

    def __init__(self):
        self.seen = []

    def phase(self, text, step, waits_on="learners"):
        self.seen.append((text, step, waits_on))

    def close(self):
        pass


def lead_learner(settings: dict, events: list, saves: list, *, hub=None, start=0, ranks=None, beat=None, clock=None,
                 tick=None, stop=None) -> tuple[Learner, Sink]:
    """Rank 0's `Learner` over these stand-ins; `saves` gets (step, state's version, hub blob) per checkpoint."""
    cfg = from_dict(settings)
    sink = Sink(events)
    lead = Lead(cfg, hub=hub or Hub(events), publisher=Publisher(events), sink=sink,
                par=ParSchedule(cfg.learner.par, cfg.run.steps), world=1, held={}, start=start, beat=beat)
    learner = Learner(cfg, trainer=Trainer(events, tick), ranks=ranks or OneRank(), role=lead, world=1,
                      save=lambda step, state, blob: saves.append((step, state["version"], blob)),
                      stop_requested=stop or threading.Event(), run_dir="RUN", beat=beat, clock=clock)
    return learner, sink
