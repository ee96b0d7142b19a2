"""The learner's step, as named phases: take a batch, share it, train, publish, record, checkpoint.

`Learner` is handed its collaborators (`learner/__main__.py` builds the real ones), so a test drives it with
stand-ins and no processes:
- `trainer`: `train_step(batch, poison) -> StepStats` (learner/trainer.py);
- `ranks`: the collectives between learner ranks (`Ranks`: share a batch, agree on a flag);
- `role`: what this rank does besides training, the one place where rank 0 differs: `Lead` on rank 0 (the
  broker, the weight publisher and its channels, the metrics sink, the rows held for evaluation, the PAR
  schedule), `Follower` elsewhere (the publisher only: every rank publishes, ZeRO-3 gathers are collectives);
- `save`: `(step, state, hub_blob) -> None`, the checkpoint writer (a collective: every rank calls it);
- `beat`: this rank's heartbeat and phase record (learner/beat.py), entered before every wait.

Every stop the learners survive is checkpointed first. A stop (SIGTERM, Ctrl-C: `stop_requested`) between steps
finishes the step; one while rank 0 waits for step k's batch, or that wait passing transport.batch_timeout_s, ends
the run before step k: rank 0 shares a `Halt` in place of the batch and every rank checkpoints step k - 1 (unless
this launch trained nothing, or wrote it already), then exits 0, or `EXIT_BATCH_TIMEOUT` for the deadline. A stop
while the publish of step k waits for generation ends that wait: step k is published, checkpointed, and the run
exits 0 (`Lead.finish_version` says what that costs a resume).

The policy version has one owner on rank 0: the hub (`HubPort.set_version`; it stamps work with it, bounds
staleness by it and saves it in its snapshot). Step k trains on the batch of version k - 1 and makes version k;
`Lead.publish` is the one place the version moves, and everything else is handed it from there: the hub first,
then the weights, labelled with it (the publisher's host copy carries the version of its bits, nothing more).
That order is what makes runs reproducible: the publish of version v + 1 waits until the generation pinned to
version v is in (`wait_version_done`), and the hub moves to the new version before the weights leave, because a
token stamped with it may reach the hub the moment the broadcast lands (work for it just waits in the generator).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from common import messages
from common.checkpoint_dirs import remove_rolling
from common.config import Config, eval_versions
from learner.batch import StepBatch, batch_from_config
from learner.beat import NoBeat
from learner.ports import HubPort, ShapedGroup
from learner.trainer import step_metrics

log = logging.getLogger("covrl.learner")

EXIT_DIVERGED = 3  # learner.max_consecutive_skipped_steps optimizer steps in a row were skipped (non-finite)
EXIT_BATCH_TIMEOUT = 4  # no batch within transport.batch_timeout_s; the last trained step is checkpointed first

STOP, DEADLINE = "stop", "deadline"  # Halt.why


class Halt(msgspec.Struct, array_like=True, frozen=True):
    """Rank 0's word, shared in place of step k's batch, that the run ends before step k: `why` STOP (asked for) or
    DEADLINE (no batch within transport.batch_timeout_s; `detail`: the hub's account of what it waited for)."""
    why: str
    detail: str = ""


class Shared(msgspec.Struct, array_like=True, gc=False):
    """What `Ranks.share` broadcasts: step k's batch, or a `Halt`."""
    batch: StepBatch | None = None
    halt: Halt | None = None


_SHARED = msgspec.msgpack.Decoder(Shared)


def encode_shared(item: StepBatch | Halt) -> bytes:
    return msgspec.msgpack.encode(Shared(halt=item) if isinstance(item, Halt) else Shared(batch=item))


def decode_shared(buf: bytes) -> StepBatch | Halt:
    got = _SHARED.decode(buf)
    return got.halt if got.halt is not None else got.batch


class Agreed(enum.IntFlag):
    """The flags one `Ranks.agree` settles after each step, each set on every rank if it is set on any."""
    STOP = 1  # a rank was asked to stop (SIGTERM, Ctrl-C)
    DUE = 2  # run.checkpoint_every_s has passed on rank 0's clock since the last checkpoint (or the launch)
    DEADLINE = 4  # rank 0's publish gave up waiting for generation (transport.batch_timeout_s): checkpoint, stop


class Ranks:
    """The collectives between learner ranks (torch.distributed, already initialised)."""

    def __init__(self, rank: int):
        self.rank = rank

    def share(self, item: StepBatch | Halt | None) -> StepBatch | Halt:
        """Rank 0's batch, or its `Halt`, to every rank: msgpack bytes in a broadcast (no pickles of our structs)."""
        box = [encode_shared(item) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return decode_shared(box[0])

    def agree(self, flags: int) -> int:
        """Each bit of `flags` (`Agreed`; a bool is bit 0) set on every rank if it is set on any: one all_reduce."""
        t = torch.tensor([float(int(flags) >> i & 1) for i in range(len(Agreed))])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return sum(1 << i for i, v in enumerate(t.tolist()) if v)


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

    def __init__(self, publisher, beat=None):
        self.publisher = publisher  # learner/publisher.py, without a channel on these ranks
        self.beat = beat if beat is not None else NoBeat()
        self.missed = ""  # rank 0's alone (`Lead.missed`); the others learn it through `Ranks.agree`

    def take(self, step: int, stop: threading.Event | None = None) -> None:
        # The broadcast that follows waits for rank 0, which waits for the generators (transport.batch_timeout_s).
        self.beat.phase(f"receiving step {step}'s batch from rank 0", step, waits_on="generators")
        return None

    def publish(self, step: int, stop: threading.Event | None = None) -> None:
        self.beat.phase(f"step {step}: publishing version {step}", step)
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
                 start: int = 0, rollouts=None, autoscale=None, beat=None, set_aside=None):
        self.cfg, self.hub, self.publisher, self.sink, self.par, self.world = cfg, hub, publisher, sink, par, world
        self.beat = beat if beat is not None else NoBeat()  # learner/beat.py: this rank's phase record
        self.rollouts = rollouts  # learner/rollout_log.py: the readable rollouts (None: not written)
        self.autoscale = autoscale  # learner/autoscale.py: sets the generator target from each row (None: off)
        self.set_aside = set_aside  # () -> generator slots the launcher set aside (common.runfiles.SetAsideGenerators)
        self.evaluated = set(eval_versions(cfg))
        self.held = held  # version -> its row, written once the version's eval results are in
        self.wait_s = cfg.transport.batch_timeout_s
        self.extra: dict[str, float] = {}
        self.stale = np.zeros(0)  # the last batch's token lags: TensorBoard's staleness histogram
        self.last = hub.stats()
        self.last_t = time.perf_counter()
        self.batch_wait = 0.0
        self.trained, self.last_row = start, {}  # the newest step trained, its row: for the progress line
        self.missed = ""  # the hub's account, when a publish gave up waiting for generation (batch_timeout_s)
        self.show_progress()

    def take(self, step: int, stop: threading.Event | None = None) -> StepBatch | Halt:
        """Step `step`'s batch from the hub; a `Halt` when `stop` is set while it waits, or when none comes within
        transport.batch_timeout_s (the hub keeps what it holds, so a checkpoint now resumes this step exactly)."""
        version = step - 1
        t0 = time.perf_counter()
        self.beat.phase(f"waiting for step {step}'s batch", step, waits_on="generators")
        try:
            groups = self.hub.take_batch(version, timeout_s=self.wait_s, stop=stop)
        except InterruptedError:  # broker.hub.Stopped
            return Halt(STOP)
        except TimeoutError as e:  # the hub's account of what it waited for
            return Halt(DEADLINE, str(e))
        self.beat.phase(f"step {step}: sharing the batch", step)
        self.batch_wait = time.perf_counter() - t0
        self.stale = token_staleness(groups, version)
        self.extra = host_metrics(groups, self.stale)
        batch = batch_from_config([r.group for r in groups], np.stack([r.rewards for r in groups]), self.cfg,
                                  version=version, ranks=self.world, par_lambda=self.par.value(step))
        if self.rollouts is not None:
            self.rollouts.train(step, [r.group for r in groups], [s.advantage for s in batch.samples])
        return batch

    def finish_version(self, v: int, stop: threading.Event | None = None) -> float:
        """Wait for the generation pinned to version v; write its held row. Returns seconds waited.

        A set `stop`, or transport.batch_timeout_s passing (`missed` then holds the hub's account), ends the wait, and
        the caller goes on (publishes, checkpoints, exits). The generation pinned to v that is still out is then made
        again at the next version after the resume, so such a resume is not bit-exact with a run that was never
        stopped; v's row, if it was held for v's evaluation, goes out without eval metrics (the resume does not
        evaluate v again)."""
        t0 = time.perf_counter()
        try:
            waited, cut = self.hub.wait_version_done(v, timeout_s=self.wait_s, stop=stop), False
        except InterruptedError:  # broker.hub.Stopped
            waited, cut = time.perf_counter() - t0, True
            log.info("stop requested: not waiting for the rest of the generation at version %d", v)
        except TimeoutError as e:  # the trained step is published and checkpointed before the run stops
            waited, cut, self.missed = time.perf_counter() - t0, True, str(e)
            log.error("gave up waiting for the generation at version %d: %s", v, e)
        if v in self.held:
            metrics, texts = self.hub.take_eval(v)
            if cut:
                log.warning("the evaluation of version %d was cut short by the stop: its row has no eval metrics", v)
                metrics, texts = {}, []
            self.sink.write(v, {**self.held.pop(v), **metrics})
            if self.rollouts is not None and not cut:
                self.rollouts.evaluated(v, texts)
            self.show_progress()
        return waited

    def show_progress(self) -> None:
        note = self.autoscale.last.short() if self.autoscale is not None and self.autoscale.last else ""
        self.sink.progress(self.trained, self.last_row, sorted(self.held), note=note)

    def publish(self, step: int, stop: threading.Event | None = None) -> Published:
        """Make `step` the policy version: the one place it moves on rank 0 (see the module docstring)."""
        self.beat.phase(f"step {step}: waiting for the generation at version {step - 1}", step, waits_on="generators")
        waited = self.finish_version(step - 1, stop)
        self.beat.phase(f"step {step}: publishing version {step}", step)
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
            "cluster/generators_set_aside": float(self.set_aside() if self.set_aside is not None else 0),
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
        """A completed run waits for its last version's evaluation even after a stop (a resume would not evaluate it
        again; a second Ctrl-C ends the launcher's wait instead). Only when a publish already gave up on the
        generators (`missed`) does the last row go out without it."""
        if completed:
            last = self.cfg.run.steps
            if not self.missed:
                self.beat.phase(f"closing: waiting for the generation at version {last}", last, waits_on="generators")
                self.finish_version(last)
            elif last in self.held:
                log.warning("the evaluation of version %d was not waited for (the generators could not serve): its row "
                            "has no eval metrics", last)
                self.sink.write(last, self.held.pop(last))
        self.publisher.stop()
        self.hub.stop()
        self.sink.close()


class Learner:
    def __init__(self, cfg: Config, *, trainer, ranks: Ranks, role: Lead | Follower, world: int,
                 save: Callable[[int, dict | None, bytes | None], None], stop_requested: threading.Event,
                 run_dir: str, faults: set[int] = frozenset(), beat=None,
                 clock: Callable[[], float] | None = time.monotonic):
        """`clock`: what decides a time-based checkpoint (run.checkpoint_every_s): rank 0's, None on the others,
        which follow it through `Ranks.agree`."""
        self.cfg, self.trainer, self.ranks, self.role = cfg, trainer, ranks, role
        self.world, self.save, self.stop_requested, self.run_dir, self.faults = world, save, stop_requested, run_dir, faults
        self.beat = beat if beat is not None else NoBeat()
        self.clock = clock
        self.skipped_in_row = 0
        self.trained = self.saved = 0  # the newest step trained; checkpointed (or resumed from)
        self.saved_at = 0.0  # when, on `clock`

    def run(self, start: int) -> int:
        """Steps start + 1 .. run.steps, or until a stop, a missed batch or divergence. Returns the exit code (0,
        `EXIT_DIVERGED`, `EXIT_BATCH_TIMEOUT`)."""
        self.trained = self.saved = start  # the step resumed from is on disk already
        self.saved_at = self.clock() if self.clock else 0.0
        code = None
        for step in range(start + 1, self.cfg.run.steps + 1):
            code = self.step(step)
            if code is not None:
                break
        self.role.close(self.trained == self.cfg.run.steps and not code)
        return code or 0

    def step(self, step: int) -> int | None:
        """One learner step; an exit code when the run must stop here, else None."""
        t0 = time.perf_counter()
        batch = self.ranks.share(self.role.take(step, self.stop_requested))
        if isinstance(batch, Halt):
            return self.halt(step - 1, batch)
        self.beat.phase(f"step {step}: training", step)
        stats = self.trainer.train_step(batch, poison=step in self.faults)
        metrics = step_metrics(stats)
        self.skipped_in_row = self.skipped_in_row + len(stats.skipped) if all(stats.skipped) else 0
        published = self.role.publish(step, self.stop_requested)  # a stop ends its wait for generation, not the publish
        self.beat.phase(f"step {step}: recording", step)
        self.role.record(step, batch, metrics, published, t0)
        self.trained = step
        return self.checkpoint(step)

    def checkpoint(self, step: int) -> int | None:
        """Write a checkpoint when one is due (every N steps or run.checkpoint_every_s, the last step, a stop,
        divergence); stop if asked."""
        self.beat.phase(f"step {step}: agreeing on a checkpoint", step)
        asked = ((Agreed.STOP if self.stop_requested.is_set() else 0) | (Agreed.DUE if self.time_due() else 0)
                 | (Agreed.DEADLINE if self.role.missed else 0))
        agreed = Agreed(int(self.ranks.agree(asked)))
        every = self.cfg.run.checkpoint_every_steps
        diverged = self.skipped_in_row >= self.cfg.learner.max_consecutive_skipped_steps
        kept = step == self.cfg.run.steps or (every and step % every == 0) or agreed & ~Agreed.DUE or diverged
        if kept or Agreed.DUE in agreed:
            self.save_once(step, rolling=not kept)  # due by time alone: it replaces the last such checkpoint
        if diverged:
            log.error("stopping: the last %d optimizer steps had a non-finite loss or gradient and were skipped "
                      "(learner.max_consecutive_skipped_steps=%d); the weights are those of the last good step, saved "
                      "in %s/checkpoints/step_%d. Lower learner.lr, check the reward and data, or continue with "
                      "covrl resume %s", self.skipped_in_row, self.cfg.learner.max_consecutive_skipped_steps, self.run_dir,
                      step, self.run_dir)
            return EXIT_DIVERGED
        missed = self.role.missed or "learner rank 0's wait"  # the hub's account on rank 0 only
        if Agreed.DEADLINE in agreed and step == self.cfg.run.steps:  # trained to the end: complete, not resumable
            log.warning("the run is complete (checkpoint of step %d written), but the generation its publish waited for "
                        "did not finish within transport.batch_timeout_s: %s", step, missed)
            return 0
        if Agreed.DEADLINE in agreed:
            log.error("stopping (transport.batch_timeout_s passed while the publish waited for generation; checkpoint "
                      "of step %d written): %s; continue with covrl resume %s once generators can serve",
                      step, missed, self.run_dir)
            return EXIT_BATCH_TIMEOUT
        if Agreed.STOP in agreed:
            log.info("stop requested: checkpoint of step %d written; continue with covrl resume %s", step, self.run_dir)
            return 0
        return None

    def time_due(self) -> bool:
        """run.checkpoint_every_s (0: off) has passed on this rank's clock since the last checkpoint or the launch."""
        every_s = self.cfg.run.checkpoint_every_s
        return bool(every_s and self.clock and self.clock() - self.saved_at >= every_s)

    def halt(self, step: int, halt: Halt) -> int:
        """Rank 0 has no batch for step + 1 (a stop, or transport.batch_timeout_s passed): checkpoint `step`, the
        last trained, and end the run."""
        if self.save_once(step):
            kept = f"checkpoint of step {step} written"
        else:
            kept = f"no step trained since step {step}, which is checkpointed already" if step else "no step trained"
        if halt.why == STOP:
            log.info("stop requested: %s; continue with covrl resume %s", kept, self.run_dir)
            return 0
        log.error("stopping (transport.batch_timeout_s passed; %s): %s; continue with covrl resume %s once generators "
                  "can serve", kept, halt.detail, self.run_dir)
        return EXIT_BATCH_TIMEOUT

    def save_once(self, step: int, rolling: bool = False) -> bool:
        """Checkpoint `step` (a collective) unless it is on disk already: written by this launch, or the step it
        resumed from (or step 0, the base model). True if written. `rolling`: written only because
        run.checkpoint_every_s passed; each checkpoint written goes on to remove the older rolling ones (rank 0), so
        the time-based schedule adds at most one checkpoint on disk to what checkpoint_every_steps keeps."""
        if step == self.saved:
            return False
        self.beat.phase(f"checkpoint step_{step}", step)
        state, hub_blob = self.role.checkpoint_state(step, self.world)
        self.save(step, None if state is None else {**state, "rolling": rolling}, hub_blob)
        if state is not None:  # rank 0, which writes the run's state
            for old in remove_rolling(self.run_dir, before=step):
                log.info("removed checkpoint step_%d: a time-based one (run.checkpoint_every_s), superseded by step_%d",
                         old, step)
        self.saved, self.saved_at = step, self.clock() if self.clock else 0.0
        return True
