"""The learner's step, as named phases: take a batch, share it, train, publish, record, checkpoint.

`Learner` is handed its collaborators (`learner/__main__.py` builds the real ones), so a test drives it with
stand-ins and no processes:
- `trainer`: `train_step(batch, poison) -> StepStats` (learner/trainer.py);
- `ranks`: the collectives between learner ranks (`Ranks`: share a batch, agree on a flag);
- `role`: what this rank does besides training, the one place where rank 0 differs: `Lead` on rank 0 (the
  broker, the weight publisher and its channels, the metrics sink, the rows held for evaluation, the PAR
  schedule), `Follower` elsewhere (the publisher only: every rank publishes, ZeRO-3 gathers are collectives);
- `save`: `(step, state, hub_blob) -> None`, the checkpoint writer (a collective: every rank calls it).

The policy version has one owner on rank 0: the hub (`HubPort.set_version`; it stamps work with it, bounds
staleness by it and saves it in its snapshot). Step k trains on the batch of version k - 1 and makes version k;
`Lead.publish` is the one place the version moves, and everything else is handed it from there: the hub first,
then the weights, labelled with it (the publisher's host copy carries the version of its bits, nothing more).
That order is what makes runs reproducible: the publish of version v + 1 waits until the generation pinned to
version v is in (`wait_version_done`), and the hub moves to the new version before the weights leave, because a
token stamped with it may reach the hub the moment the broadcast lands (work for it just waits in the generator).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from common import messages
from common.config import Config, eval_versions
from learner.batch import StepBatch, batch_from_config, decode, encode
from learner.ports import HubPort, ShapedGroup
from learner.trainer import step_metrics

log = logging.getLogger("covrl.learner")


class Ranks:
    """The collectives between learner ranks (torch.distributed, already initialised)."""

    def __init__(self, rank: int):
        self.rank = rank

    def share(self, batch: StepBatch | None) -> StepBatch:
        """Rank 0's batch to every rank: msgpack bytes in a broadcast (no pickles of our structs)."""
        box = [encode(batch) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return decode(box[0])

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any."""
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


# The bins of the staleness histogram in metrics.jsonl (`staleness/share_lag_<bin>`): lags 0 and 1, then powers of two.
STALENESS_BINS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, None))


def token_staleness(groups: list[ShapedGroup], version: int) -> np.ndarray:
    """Every trained token's lag: the learner's version minus the version that sampled it."""
    samples = [s for r in groups for s in r.group.samples]
    return np.concatenate([version - messages.as_array(s.versions, messages.VERSION_DTYPE) for s in samples])


def staleness_shares(stale: np.ndarray) -> dict[str, float]:
    """The share of the step's tokens in each `STALENESS_BINS` bin (all eight, summing to 1)."""
    out = {}
    for lo, hi in STALENESS_BINS:
        inside = (stale >= lo) if hi is None else ((stale >= lo) & (stale <= hi))
        name = f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")
        out[f"staleness/share_lag_{name}"] = float(inside.mean())
    return out


def host_metrics(groups: list[ShapedGroup], stale: np.ndarray) -> dict[str, float]:
    """What rank 0 can read off the rollouts themselves; `stale`: their tokens' lags (`token_staleness`)."""
    samples = [s for r in groups for s in r.group.samples]
    return staleness_shares(stale) | {
        "critic/score/mean": float(np.mean([s.reward for s in samples])),
        "response_length/mean": float(np.mean([messages.n_tokens(s.token_ids) for s in samples])),
        "response_length/max": float(max(messages.n_tokens(s.token_ids) for s in samples)),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "staleness/min": float(stale.min()),
        "reward/timeouts": float(sum(s.score_status == "timeout" for s in samples)),
        "reward/errors": float(sum(s.score_status == "error" for s in samples)),
    }


def fault_steps() -> set[int]:
    """COVRL_FAULT_NONFINITE_STEPS="3,5-6": steps whose loss is made NaN (fault-injection tests only)."""
    out: set[int] = set()
    for part in filter(None, os.environ.get("COVRL_FAULT_NONFINITE_STEPS", "").split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class Published:
    seconds: float
    nbytes: int
    checksum: float
    waited_s: float  # for the generation of the previous version, before the publish could start


class Follower:
    """Ranks 1..: train on rank 0's batch and take part in every collective; nothing to take, send or write."""

    def __init__(self, publisher):
        self.publisher = publisher  # learner/publisher.py, without a channel on these ranks

    def take(self, step: int) -> None:
        return None

    def publish(self, step: int) -> None:
        self.publisher.publish(step)  # under ZeRO-3 this rank's shards join each bucket's gather

    def record(self, step: int, batch: StepBatch, metrics: dict[str, float], published, t0: float) -> None:
        pass

    def checkpoint_state(self, step: int, world: int) -> tuple[None, None]:
        return None, None

    def close(self, completed: bool) -> None:
        pass


class Lead:
    """Rank 0: takes each batch from the broker, publishes once the version's generation is in, writes the rows.

    The row of an evaluated version waits (`held`) for its eval results, so metrics.jsonl keeps one row per step
    (step 0: the base model's evaluation) and rows stay in step order.
    """

    def __init__(self, cfg: Config, *, hub: HubPort, publisher, sink, par, world: int, held: dict[int, dict[str, float]],
                 start: int = 0, rollouts=None, autoscale=None):
        self.cfg, self.hub, self.publisher, self.sink, self.par, self.world = cfg, hub, publisher, sink, par, world
        self.rollouts = rollouts  # learner/rollout_log.py: the readable rollouts (None: not written)
        self.autoscale = autoscale  # learner/autoscale.py: sets the generator target from each row (None: off)
        self.evaluated = set(eval_versions(cfg))
        self.held = held  # version -> its row, written once the version's eval results are in
        self.wait_s = cfg.transport.batch_timeout_s
        self.extra: dict[str, float] = {}
        self.stale = np.zeros(0)  # the last batch's token lags: TensorBoard's staleness histogram
        self.last = hub.stats()
        self.last_t = time.perf_counter()
        self.batch_wait = 0.0
        self.trained, self.last_row = start, {}  # the newest step trained, its row: for the progress line
        self.show_progress()

    def take(self, step: int) -> StepBatch:
        version = step - 1
        t0 = time.perf_counter()
        groups = self.hub.take_batch(version, timeout_s=self.wait_s)
        self.batch_wait = time.perf_counter() - t0
        self.stale = token_staleness(groups, version)
        self.extra = host_metrics(groups, self.stale)
        batch = batch_from_config([r.group for r in groups], np.stack([r.rewards for r in groups]), self.cfg,
                                  version=version, ranks=self.world, par_lambda=self.par.value(step))
        if self.rollouts is not None:
            self.rollouts.train(step, [r.group for r in groups], [s.advantage for s in batch.samples])
        return batch

    def finish_version(self, v: int) -> float:
        """Wait for the generation pinned to version v; write its held row. Returns seconds waited."""
        waited = self.hub.wait_version_done(v, timeout_s=self.wait_s)
        if v in self.held:
            metrics, texts = self.hub.take_eval(v)
            self.sink.write(v, {**self.held.pop(v), **metrics})
            if self.rollouts is not None:
                self.rollouts.evaluated(v, texts)
            self.show_progress()
        return waited

    def show_progress(self) -> None:
        note = self.autoscale.last.short() if self.autoscale is not None and self.autoscale.last else ""
        self.sink.progress(self.trained, self.last_row, sorted(self.held), note=note)

    def publish(self, step: int) -> Published:
        """Make `step` the policy version: the one place it moves on rank 0 (see the module docstring)."""
        waited = self.finish_version(step - 1)
        self.hub.set_version(step)  # the owner moves first: work for `step` just waits in the generator
        return Published(*self.publisher.publish(step), waited_s=waited)  # then the weights, labelled `step`

    def record(self, step: int, batch: StepBatch, metrics: dict[str, float], published: Published,
               t0: float) -> None:
        now = time.perf_counter()
        stats = self.hub.stats()
        metrics.update(self.extra)
        metrics.update(stats.counters)
        metrics.update(self.publisher.counter_values())
        self.par.observe(metrics["actor/entropy"])
        interval = max(now - self.last_t, 1e-9)
        busy_s = (stats.gen_busy_s - self.last.gen_busy_s) / max(stats.counters.get("cluster/generators", 1.0), 1.0)
        idle_s = max(0.0, interval - busy_s)
        metrics.update({
            "actor/par_lambda": batch.par_lambda,
            "filter/dropped_groups": float(stats.filtered_groups - self.last.filtered_groups),
            "critic/advantages/mean": float(np.mean([s.advantage for s in batch.samples])),
            "perf/gen_tokens_per_s": (stats.gen_tokens - self.last.gen_tokens) / max(now - self.last_t, 1e-9),
            "timing_s/step": now - t0,
            "timing_s/weight_sync": published.seconds,
            "timing_s/publish_wait": published.waited_s,
            "timing_s/batch_wait": self.batch_wait,
            # Seconds each live generator spent neither generating nor scoring since the last row (waiting for
            # work under admission control, or for the weights its work is pinned to); the mean over generators.
            "timing_s/gen_idle": idle_s,
            # What the autoscale policy reads (learner/autoscale.py), for every run: the shares of the step the
            # learner waited for generation and the generators were idle, and trained samples per second.
            "perf/learner_wait_share": min(1.0, (self.batch_wait + published.waited_s) / max(now - t0, 1e-9)),
            "perf/gen_idle_share": min(1.0, idle_s / interval),
            "perf/samples_per_s": len(batch.samples) / interval,
            "weights/bytes": float(published.nbytes),
            "weights/checksum": published.checksum,
            "weights/version": float(step),
        })
        self.last, self.last_t = stats, now
        if self.autoscale is not None:
            metrics.update(self.autoscale.observe(step, metrics))
        self.sink.histogram("staleness/tokens", self.stale, step)
        if step in self.evaluated:
            self.held[step] = metrics
        else:
            self.sink.write(step, metrics)
        self.trained, self.last_row = step, metrics
        self.show_progress()

    def checkpoint_state(self, step: int, world: int) -> tuple[dict, bytes]:
        state = {"version": step, "par": self.par.state(), "held": {str(k): v for k, v in self.held.items()},
                 "learners": world}
        if self.autoscale is not None:
            state["autoscale"] = self.autoscale.policy.state()
        return state, self.hub.snapshot()

    def close(self, completed: bool) -> None:
        if completed:
            self.finish_version(self.cfg.run.steps)
        self.publisher.stop()
        self.hub.stop()
        self.sink.close()


class Learner:
    def __init__(self, cfg: Config, *, trainer, ranks: Ranks, role: Lead | Follower, world: int,
                 save: Callable[[int, dict | None, bytes | None], None], stop_requested: threading.Event,
                 run_dir: str, faults: set[int] = frozenset()):
        self.cfg, self.trainer, self.ranks, self.role = cfg, trainer, ranks, role
        self.world, self.save, self.stop_requested, self.run_dir, self.faults = world, save, stop_requested, run_dir, faults
        self.skipped_in_row = 0

    def run(self, start: int) -> int:
        """Steps start + 1 .. run.steps, or until a stop or divergence. Returns the exit code (3: diverged)."""
        step, code = start, None
        for step in range(start + 1, self.cfg.run.steps + 1):
            code = self.step(step)
            if code is not None:
                break
        self.role.close(step == self.cfg.run.steps and not code)
        return code or 0

    def step(self, step: int) -> int | None:
        """One learner step; an exit code when the run must stop here, else None."""
        t0 = time.perf_counter()
        batch = self.ranks.share(self.role.take(step))
        stats = self.trainer.train_step(batch, poison=step in self.faults)
        metrics = step_metrics(stats)
        self.skipped_in_row = self.skipped_in_row + len(stats.skipped) if all(stats.skipped) else 0
        published = self.role.publish(step)
        self.role.record(step, batch, metrics, published, t0)
        return self.checkpoint(step)

    def checkpoint(self, step: int) -> int | None:
        """Write a checkpoint when one is due (every N steps, the last step, a stop, divergence); stop if asked."""
        stop = self.ranks.agree(self.stop_requested.is_set())
        every = self.cfg.run.checkpoint_every_steps
        diverged = self.skipped_in_row >= self.cfg.learner.max_consecutive_skipped_steps
        if step == self.cfg.run.steps or (every and step % every == 0) or stop or diverged:
            self.save(step, *self.role.checkpoint_state(step, self.world))
        if diverged:
            log.error("stopping: the last %d optimizer steps had a non-finite loss or gradient and were skipped "
                      "(learner.max_consecutive_skipped_steps=%d); the weights are those of the last good step, saved "
                      "in %s/checkpoints/step_%d. Lower learner.lr, check the reward and data, or continue with "
                      "covrl resume %s", self.skipped_in_row, self.cfg.learner.max_consecutive_skipped_steps, self.run_dir,
                      step, self.run_dir)
            return 3
        if stop:
            log.info("stop requested: checkpoint of step %d written; continue with covrl resume %s", step, self.run_dir)
            return 0
        return None
