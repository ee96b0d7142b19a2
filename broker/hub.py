"""The hub: owns the prompt stream, issues work, collects rollouts (a thread of learner rank 0).

Invariants
- The hub owns the policy version on learner rank 0 (`version`): only `set_version` moves it (`learner/loop.py`:
  `Lead.publish`, before the weights of that version leave), and it is saved in the hub's snapshot.
- Every prompt issue gets a *slot*: its position in the training stream. A
  re-issue (dead generator, group too stale) keeps the slot, so the stream's
  order, and with it the batch composition, does not depend on timing.
- Admission control bounds staleness (`broker.rules.GroupRules`, like every rule on
  which groups are trained): a new slot is issued only while
  `slots - filtered < (v + 1 + max_staleness_steps) * groups_per_step`, v = learner
  version; groups dropped by dynamic sampling (no reward spread) free their place.
- The batch for step v+1 is the groups_per_step lowest ready slots, taken only
  once no group issued before version v - k is still in flight; a group whose
  oldest token is nonetheless more than k versions old is dropped and its prompt
  re-issued. So no trained token is more than k versions old, and k = 0 is
  synchronous on-policy training.
- Nothing is issued for slots the run will never train: the admission cap stops at
  `run.steps * groups_per_step` kept groups.
- Evaluation (`broker.evals.EvalSchedule`): at each evaluated version v the hub queues
  every held-out prompt (served before training work) and `wait_version_done(v)` holds
  the publish of v + 1 until all of them are scored, so every eval sample comes from exactly v.
  With `run.deterministic` or a `rollout.forced_lag` the same barrier also waits for all training work
  admissible at v, which makes every token's version a function of its slot:
  same seed, same numbers; with a forced lag k, slots are admitted k versions ahead, so every trained token is
  exactly min(v, k) versions old (`broker.rules.GroupRules`).
- A rollout is accepted only for a ticket that is in flight for that generator
  incarnation; anything else is dropped with a counted reason. Malformed or
  unauthenticated frames never raise out of the loop.
- Elastic generators: the run's generator *target* N (`generators()`, RUN_DIR/generators.json, which
  `covrl scale RUN_DIR --gens N` rewrites) is read again about every `target_poll_s`. Only ids 0..N-1 are
  welcomed; a connected generator whose id is >= N is *draining*: it gets no new work (training or eval), what it
  sends back for the tickets it holds is accepted as usual, and once it holds none the hub sends it
  `Stop(reason="drained")`, forgets it and calls `hooks.leave` (the publisher closes its weight channel). So a
  scale-down loses no prompt and trains none twice; a draining generator that dies instead is the ordinary
  timeout case (its tickets are re-issued with their slots). Raising N again before the drain completes makes it
  a full member again. The gauges `cluster/generators` (connected, not draining) and `cluster/generators_target`
  are read with the counters, never snapshotted.
- The hub is the one owner of the decision that a generator incarnation is *lost* (`_lose`, the one place), and
  everyone else follows it: its work is re-issued with its slots, `hooks.lost` drops its weight channel at once (a
  publish in progress stops waiting for it) and records the verdict for the launcher, which stops its process
  group and restarts it (RUN_DIR/generators_lost.jsonl), and a late message from it gets `Stop(reason="lost: ...")`.
  Why, counted under `hub/generator_lost/<why>`: `timeout` (silent for `transport.generator_timeout_s`: dead,
  frozen or cut off), `stuck` (it holds work, has the weights that work needs, and its main loop has sent nothing
  for the progress limit, whatever its heartbeat says: a hung engine), `weight_channel` (learner rank 0's weight
  channel to it failed or missed its deadline: `lose`), `restarted` (a new incarnation said hello), `exited` (the
  launcher saw its process exit: a line in RUN_DIR/generators_launcher.jsonl, `exited` in the constructor).
  The progress limit is `transport.generator_progress_timeout_s`, or when that is 0 max(floor, factor x the slowest
  reply seen), a reply's time running from when the generator was given work, or its previous message, with the
  clock held while its heartbeat says it is still waiting for the weights its work names.

The trainer thread talks to the hub only through `start`, `take_batch`, `set_version`, `wait_version_done`,
`take_eval`, `stats`, `snapshot` / `restore` and `stop`, and the weight publisher through `lose` (the port the
learner declares, `learner/ports.py`: `HubPort`), each under the hub's lock; the hub calls back through
`GeneratorHooks` (`broker/hooks.py`). The ZeroMQ socket belongs to the hub thread alone.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from broker import state
from broker.evals import EvalSchedule
from broker.hooks import GeneratorHooks
from broker.rules import GroupRules
from common import messages
from common.config import Config, publish_waits_for_generation
from common.data import Prompt, PromptSource
from common.seeds import prompt_seed
from common.transport import HubSocket

log = logging.getLogger("covrl.hub")


class Stopped(InterruptedError):
    """A learner's wait (`take_batch`, `wait_version_done`) given up because its `stop` was set: the run is asked to
    stop (SIGTERM, Ctrl-C). An InterruptedError, so the learner catches it without importing the broker."""


@dataclass
class Ticket:
    ticket: int
    slot: int
    prompt_id: int
    epoch: int
    gen_id: int
    incarnation: str
    policy_version: int  # the version its work was issued at (`Work.policy_version`)

    @classmethod
    def waiting(cls, slot: int, prompt_id: int, epoch: int) -> "Ticket":
        """A slot waiting for re-issue: no ticket number, generator or version yet."""
        return cls(-1, slot, prompt_id, epoch, -1, "", -1)


@dataclass
class Ready:
    slot: int
    policy_version: int  # its ticket's (saved as `ReadyState.issue_version`)
    group: messages.RolloutGroup


@dataclass(frozen=True)
class ShapedGroup:
    """One group of a batch as the hub hands it over: the group, and the rewards advantages are computed from
    (`GroupRules.rewards`: the scores plus the overlong shaping), decided here once."""
    slot: int
    group: messages.RolloutGroup
    rewards: np.ndarray  # [n] float64


@dataclass
class GenState:
    identity: bytes
    incarnation: str
    last_seen: float  # any message, heartbeats included: liveness
    pid: int = 0
    policy_version: int = 0  # the newest version that has arrived there (its heartbeat)
    wanted: int = 0  # groups asked for and not yet given
    issued: int = 0  # training groups sent to this incarnation (its requests say how many it has received)
    counted: bool = False  # its requests count what they received: its room stays open until filled
    capacity: int = 0  # the groups it keeps in flight when full (its requests say; 0: unknown)
    # The last sign of progress from its main loop (a request, a result) or the last time it was given work or
    # had to wait for weights: what the stuck check measures from.
    progress_at: float = 0.0


@dataclass(frozen=True)
class BrokerStats:
    """One consistent read of the hub's running totals (`Hub.stats`), all since the run began.

    filtered_groups: groups dropped by dynamic sampling; gen_tokens: tokens of every accepted group; gen_busy_s:
    generator seconds (generate + score, `RolloutGroup.gen_time_s`) behind every valid group received;
    counters: the `hub/...` metrics (rejections by reason, re-issues, stale drops, lost and drained generators,
    hub/filtered_groups and hub/lost_prompts, which must stay 0) and the gauges `cluster/generators` (connected and
    not draining), `cluster/generators_target` (the run's target now) and the weight lag of each connected generator
    (`perf/weight_lag/gen<id>`, versions behind the learner by its last heartbeat) and their maximum
    (`perf/weight_lag/max`).
    """
    filtered_groups: int
    gen_tokens: int
    counters: dict[str, float]
    gen_busy_s: float = 0.0


class Hub:
    def __init__(self, cfg: Config, *, run_id: str, key: bytes, host: str, port: int, source: PromptSource,
                 weight_addr: str, generators: Callable[[], int], eval_prompts: dict[str, list[Prompt]] | None = None,
                 hooks: GeneratorHooks | None = None, target_poll_s: float = 1.0,
                 exited: Callable[[], list[tuple[int, int, str]]] | None = None):
        """`host`, `port`: where the hub binds (cluster.json's hub_addr; port 0: a random one). `generators`: the
        run's generator target now, called here once and then by the hub thread every `target_poll_s`; it must not
        raise (an exception stops the hub like any hub-thread failure), so a reader of a file keeps its last good
        value (learner/__main__.py). `exited`: polled with it, the generator processes the launcher saw exit since
        the last call, as (gen_id, pid, how); the connected incarnation with that pid is lost at once (`exited`), so
        what it held is re-issued now rather than at its silence's timeout or its replacement's hello (a generator
        set aside has none). `hooks` (`broker/hooks.py`): told when a generator incarnation is welcomed, drained or
        declared lost, with the lock held; none of them may block."""
        self.cfg = cfg
        self.run_id = run_id
        self.sock = HubSocket(host, port, key)
        self.source = source
        self.weight_addr = weight_addr
        self.generators = generators
        self.target_poll_s = target_poll_s
        self.target = generators()  # ids 0 .. target - 1 are wanted; connected ones above it drain
        self.exited = exited
        self._target_read_at = time.monotonic()
        self.hooks = hooks
        # (gen_id, incarnation) -> the Stop reason it was given: drained or lost incarnations, whose late heartbeats
        # are expected and whose late requests get that Stop again (a few per run: restarts and drains are bounded).
        self.ended: dict[tuple[int, str], str] = {}
        self.slowest_reply_s = 0.0  # the longest a generator's main loop took to answer work (the progress limit)
        self._checked_at = 0.0
        self.rules = GroupRules.of(cfg)
        self.gps = cfg.rollout.groups_per_step
        r = cfg.rollout
        self.sampling = messages.SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                         forced_length_median=r.forced_length_median,
                                         forced_length_sigma=r.forced_length_sigma)
        self.cv = threading.Condition()
        self.version = 0
        self.slots = 0  # slots ever issued
        self.filtered = 0  # groups dropped by dynamic sampling (their slots do not count as admitted)
        self.filtered_this_step = 0
        self.next_ticket = 0
        self.epoch, self.pos = 0, 0
        self.order = source.order(0)
        self.in_flight: dict[int, Ticket] = {}
        self.ready: dict[int, Ready] = {}
        self.reissue: collections.deque[Ticket] = collections.deque()
        self.gens: dict[int, GenState] = {}
        self.counts: collections.Counter = collections.Counter()
        self.gen_tokens = 0
        self.gen_busy_s = 0.0
        # The ledger of settled slots (trained, or dropped by dynamic sampling): every slot below settled_floor,
        # plus the set above it, so it stays small however long the run.
        self.settled: set[int] = set()
        self.settled_floor = 0
        self.n_trained = 0
        self.evals = EvalSchedule(cfg, eval_prompts)
        self.evals.schedule(0)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hub", daemon=True)
        self.error: BaseException | None = None

    # ---- trainer-thread API ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def set_version(self, version: int) -> None:
        with self.cv:
            self.version = version
            self.evals.schedule(version)
            self.cv.notify_all()

    def wait_version_done(self, version: int, timeout_s: float, stop: threading.Event | None = None) -> float:
        """Block until the generation that must use exactly `version` is in (see the module
        docstring); call before publishing version + 1. Returns the seconds waited. `Stopped` within a second
        of `stop` being set."""
        t0 = time.monotonic()
        with self.cv:
            while not self._version_done(version):
                if self.error is not None:
                    raise RuntimeError("hub thread failed") from self.error
                if stop is not None and stop.is_set():
                    raise Stopped(f"stop requested while waiting for the generation at version {version}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(
                        f"generation at version {version} not finished after {timeout_s:.0f}s: "
                        f"{len(self.evals.pending)} eval prompts queued, {len(self.evals.in_flight)} eval and "
                        f"{len(self.in_flight)} training groups in flight, {len(self.gens)} generators connected "
                        f"(target {self.target})"
                    )
                self.cv.wait(0.5)
        return time.monotonic() - t0

    def take_eval(self, version: int) -> tuple[dict[str, float], list]:
        """Eval metrics of `version` (empty if it was not evaluated) and its results that carry response texts
        (`EvalSchedule.take`); call after wait_version_done."""
        with self.cv:
            return self.evals.take(version)

    def take_batch(self, version: int, timeout_s: float, stop: threading.Event | None = None) -> list[ShapedGroup]:
        """Block until the batch for the step that starts at `version` is ready; each group with its shaped
        rewards. `Stopped` within a second of `stop` being set, before a batch is taken (the hub keeps it)."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                if self.error is not None:
                    raise RuntimeError("hub thread failed") from self.error
                if stop is not None and stop.is_set():
                    raise Stopped(f"stop requested while waiting for step {version + 1}'s batch")
                batch = self._try_batch(version)
                if batch is not None:
                    return batch
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no batch for step {version + 1} after {timeout_s:.0f}s: {len(self.ready)} groups ready, "
                        f"{len(self.in_flight)} in flight, {len(self.gens)} generators connected (target {self.target}); "
                        f"are generators running and reaching the hub at {self.sock.address}?"
                    )
                self.cv.wait(min(left, 1.0))

    def lose(self, gen_id: int, incarnation: str, detail: str) -> None:
        """Learner rank 0's weight channel to this incarnation failed or missed its deadline (`learner/publisher.py`):
        declare it lost, unless it is gone already. Any thread; must not wait on the publisher (its `drop` only
        marks)."""
        with self.cv:
            gen = self.gens.get(gen_id)
            if gen is not None and gen.incarnation == incarnation:
                self._lose(gen_id, "weight_channel", detail)

    def progress_limit_s(self) -> float:
        """How long a generator holding work may go without a message from its main loop before it is stuck."""
        t = self.cfg.transport
        return t.generator_progress_timeout_s or max(t.generator_progress_floor_s,
                                                      t.generator_progress_factor * self.slowest_reply_s)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    def snapshot(self) -> bytes:
        """The hub's state as msgpack bytes, consistent under the lock (the hub thread keeps serving)."""
        with self.cv:
            counters = self._counted()
            pending = sorted({(t.slot, t.prompt_id, t.epoch) for t in [*self.in_flight.values(), *self.reissue]})
            saved = state.HubState(
                version=self.version, slots=self.slots, filtered=self.filtered, filtered_this_step=self.filtered_this_step,
                epoch=self.epoch, pos=self.pos, n_trained=self.n_trained, settled_floor=self.settled_floor,
                settled=sorted(self.settled), counters={k: float(v) for k, v in counters.items()},
                ready=[state.ReadyState(r.slot, r.policy_version, r.group) for _, r in sorted(self.ready.items())],
                pending=pending,
            )
        return state.encode(saved)

    def restore(self, blob: bytes) -> None:
        """Continue from `snapshot()` bytes; call before `start`. Work that was in flight is re-issued
        (same slots, same seeds), and the eval of the restored version is scheduled again."""
        st = state.decode(blob)
        with self.cv:
            self.version, self.slots, self.filtered = st.version, st.slots, st.filtered
            self.filtered_this_step = st.filtered_this_step
            self.epoch, self.pos, self.n_trained = st.epoch, st.pos, st.n_trained
            self.order = self.source.order(self.epoch)
            self.settled_floor, self.settled = st.settled_floor, set(st.settled)
            self.counts = collections.Counter(st.counters)
            self.ready = {r.slot: Ready(r.slot, r.issue_version, r.group) for r in st.ready}
            self.reissue = collections.deque(Ticket.waiting(*p) for p in st.pending)
            if st.pending:
                self.counts["hub/reissued_prompts"] += len(st.pending)
            self.evals.restart(self.version)

    # ---- called with self.cv held ------------------------------------------------

    def _version_done(self, version: int) -> bool:
        if self.evals.busy_through(version):
            return False
        if not publish_waits_for_generation(self.cfg):
            return True
        if self.reissue or any(t.policy_version <= version for t in self.in_flight.values()):
            return False
        return self.slots - self.filtered >= self.rules.admit_cap(version)

    def _try_batch(self, version: int) -> list[ShapedGroup] | None:
        floor = self.rules.staleness_floor(version)
        if any(t.policy_version < floor for t in self.in_flight.values()):
            return None  # a straggler could still land inside the bound: wait for it
        for slot in sorted(self.ready):
            r = self.ready[slot]
            if self.rules.too_stale(r.group, version):
                del self.ready[slot]
                self.counts["hub/stale_dropped_groups"] += 1
                self.reissue.append(Ticket.waiting(slot, r.group.prompt_id, r.group.epoch))
        if len(self.ready) < self.gps:
            return None
        slots = sorted(self.ready)[: self.gps]
        self.filtered_this_step = 0
        self._settle(slots)
        self.n_trained += len(slots)
        groups = [self.ready.pop(s).group for s in slots]
        return [ShapedGroup(s, g, row) for s, g, row in zip(slots, groups, self.rules.rewards(groups), strict=True)]

    def _settle(self, slots) -> None:
        """Record slots as done for good (trained, or dropped by dynamic sampling); counts any seen twice."""
        self.counts["hub/duplicate_trained_prompts"] += sum(s < self.settled_floor or s in self.settled for s in slots)
        self.settled.update(slots)
        while self.settled_floor in self.settled:  # keep only the slots above the contiguous settled prefix
            self.settled.discard(self.settled_floor)
            self.settled_floor += 1

    # ---- hub thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._turn()
            self._broadcast_stop("training finished")
        except BaseException as e:  # surfaced to the trainer thread by take_batch
            log.exception("hub thread crashed")
            with self.cv:
                self.error = e
                self.cv.notify_all()
        finally:
            self.sock.close()

    def _turn(self) -> None:
        """One turn of the hub thread: a message (if one came within 50 ms), then the periodic duties."""
        got = self.sock.recv(0.05)
        now = time.monotonic()
        target = self._poll_target(now)  # outside the lock: it may read a file
        exits = self.exited() if target is not None and self.exited is not None else []  # on the same cadence
        if got is not None:
            identity, msg = got
            with self.cv:
                self._handle(identity, msg, now)
        with self.cv:
            for gen_id, pid, how in exits:
                gen = self.gens.get(gen_id)
                if gen is not None and gen.pid == pid:
                    self._lose(gen_id, "exited", f"the launcher saw its process {how}")
            self._set_target(target)
            self._expire(now)
            self._drain()
            self._serve_wanted()

    def _handle(self, identity: bytes, msg, now: float) -> None:
        if isinstance(msg, messages.Hello):
            self._hello(identity, msg, now)
            return
        gen = self.gens.get(msg.gen_id)
        if gen is None or gen.incarnation != msg.incarnation:
            stop = self.ended.get((msg.gen_id, msg.incarnation))
            if stop is not None and isinstance(msg, (messages.WorkRequest, messages.Heartbeat)):
                # A drained one asked before our Stop reached it; a lost one came back (resumed, unwedged) and must
                # not go on: say it again.
                if isinstance(msg, messages.WorkRequest):
                    self.sock.send(identity, messages.Stop(reason=stop))
                return
            self.counts["hub/rejected/unknown_generator"] += 1
            return
        gen.last_seen = now
        if isinstance(msg, messages.WorkRequest):
            # Work goes back on the socket that asked: heartbeats come from another one.
            gen.identity = identity
            gen.capacity, gen.counted = max(0, msg.capacity), msg.received_groups >= 0
            on_wire = gen.issued - msg.received_groups if gen.counted else 0  # sent, not yet there when it asked
            gen.wanted = max(0, min(msg.max_groups - on_wire, 1024))
            if not self._holds(msg.gen_id):
                gen.progress_at = now  # an idle generator's request is progress; one holding work shows it by results
        elif isinstance(msg, messages.Heartbeat):
            gen.policy_version = msg.policy_version
        elif isinstance(msg, (messages.RolloutGroup, messages.EvalResult)):
            self.slowest_reply_s = max(self.slowest_reply_s, now - gen.progress_at)
            gen.progress_at = now
            if isinstance(msg, messages.RolloutGroup):
                self._rollout(msg)
            else:
                self._eval_result(msg)

    def _hello(self, identity: bytes, msg: messages.Hello, now: float) -> None:
        if msg.protocol_version != messages.PROTOCOL_VERSION or msg.run_id != self.run_id:
            reason = (
                f"protocol version {msg.protocol_version} != hub's {messages.PROTOCOL_VERSION}; run the same covrl version on both sides"
                if msg.protocol_version != messages.PROTOCOL_VERSION
                else f"run id {msg.run_id!r} is not this hub's run {self.run_id!r}; point the generator at its own run directory"
            )
            self.counts["hub/rejected/handshake"] += 1
            log.warning("refused generator %s (pid %s): %s", msg.gen_id, msg.pid, reason)
            self.sock.send(identity, messages.Refused(reason=reason))
            return
        if not 0 <= msg.gen_id < self.target:
            reason = (f"gen_id {msg.gen_id} is outside 0..{self.target - 1}: the run's generator target is {self.target} "
                      f"(RUN_DIR/generators.json)" + ("" if msg.gen_id < 0 else
                      f"; to run this generator, raise it with `covrl scale RUN_DIR --gens {msg.gen_id + 1}`"))
            self.counts["hub/rejected/handshake"] += 1
            log.warning("refused generator %s (pid %s): %s", msg.gen_id, msg.pid, reason)
            self.sock.send(identity, messages.Refused(reason=reason))
            return
        old = self.gens.get(msg.gen_id)
        if old is not None and old.incarnation != msg.incarnation:
            self._lose(msg.gen_id, "restarted", f"a new incarnation ({msg.incarnation}, pid {msg.pid}) said hello")
        self.gens[msg.gen_id] = GenState(identity, msg.incarnation, now, pid=msg.pid, progress_at=now)
        self.sock.send(
            identity,
            messages.Welcome(protocol_version=messages.PROTOCOL_VERSION, run_id=self.run_id,
                             weight_addr=self.weight_addr),
        )
        if self.hooks is not None:
            self.hooks.join(msg.gen_id, msg.incarnation)
        log.info("generator %d joined (pid %d)", msg.gen_id, msg.pid)

    def _rollout(self, g: messages.RolloutGroup) -> None:
        t = self.in_flight.get(g.ticket)
        if t is None or t.gen_id != g.gen_id or t.incarnation != g.incarnation:
            self.counts["hub/rejected/unknown_ticket"] += 1
            return
        reason = messages.check_rollout(
            g, group_size=self.cfg.rollout.group_size, max_version=self.version, max_tokens=self.sampling.max_new_tokens
        )
        if reason is None and (g.prompt_id != t.prompt_id or g.epoch != t.epoch):
            reason = "prompt_mismatch"
        if reason is not None:
            self.counts[f"hub/rejected/{reason}"] += 1
            log.warning("rejected group for ticket %d from generator %d: %s", g.ticket, g.gen_id, reason)
            del self.in_flight[g.ticket]
            self.reissue.append(t)
            return
        del self.in_flight[g.ticket]
        self.gen_tokens += sum(messages.n_tokens(s.token_ids) for s in g.samples)
        self.gen_busy_s += g.gen_time_s
        if self.rules.filters_out(g, self.filtered_this_step):
            # No reward spread, no advantage: drop it and let admission issue a replacement.
            self.filtered += 1
            self.filtered_this_step += 1
            self._settle([t.slot])
            return
        self.ready[t.slot] = Ready(t.slot, t.policy_version, g)
        self.cv.notify_all()

    def _eval_result(self, res: messages.EvalResult) -> None:
        reason = self.evals.accept(res)
        if reason is None:
            self.cv.notify_all()
            return
        self.counts[f"hub/rejected/{reason}"] += 1
        if reason != "unknown_ticket":
            log.warning("rejected eval result for ticket %d from generator %d: %s", res.ticket, res.gen_id, reason)

    def _expire(self, now: float) -> None:
        """Declare lost every generator silent for generator_timeout_s, and every one stuck: holding work, with the
        weights that work needs (its heartbeat says so), and no message from its main loop within the progress
        limit. Checked about every 0.25 s (one pass over the tickets in flight)."""
        if now - self._checked_at < 0.25:
            return
        self._checked_at = now
        silent_s = self.cfg.transport.generator_timeout_s
        needs: dict[int, int] = {}  # gen_id -> the newest version the work it holds was issued at
        for t in self.in_flight.values():
            needs[t.gen_id] = max(needs.get(t.gen_id, -1), t.policy_version)
        for gen_id, version in self.evals.versions_held().items():
            needs[gen_id] = max(needs.get(gen_id, -1), version)
        limit = self.progress_limit_s()
        for gen_id, gen in list(self.gens.items()):
            if now - gen.last_seen > silent_s:
                self._lose(gen_id, "timeout", f"silent for {now - gen.last_seen:.1f}s "
                                              f"(transport.generator_timeout_s = {silent_s:g})")
            elif gen_id not in needs:
                continue
            elif gen.policy_version < needs[gen_id]:
                gen.progress_at = now  # it waits for weights we send: not its fault
            elif now - gen.progress_at > limit:
                self._lose(gen_id, "stuck", f"it holds work and its main loop has sent nothing for "
                                            f"{now - gen.progress_at:.1f}s (progress limit {limit:.1f}s), its "
                                            f"heartbeat {now - gen.last_seen:.1f}s ago")

    def _poll_target(self, now: float) -> int | None:
        """The run's generator target when a read is due (hub thread, lock not held), else None."""
        if now - self._target_read_at < self.target_poll_s:
            return None
        self._target_read_at = now
        return self.generators()

    def _set_target(self, target: int | None) -> None:
        if target is None or target == self.target:
            return
        log.info("generator target %d -> %d%s", self.target, target,
                 f": draining ids {target}..{self.target - 1}" if target < self.target else "")
        self.target = target

    def _drain(self) -> None:
        """Stop and forget every generator at or above the target that holds nothing any more."""
        for gen_id in [g for g in self.gens if g >= self.target]:
            if any(t.gen_id == gen_id for t in self.in_flight.values()) or self.evals.holds(gen_id):
                continue  # it delivers what it holds first (or times out, and the work is re-issued)
            gen = self.gens.pop(gen_id)
            self.ended[(gen_id, gen.incarnation)] = "drained"
            if self.hooks is not None:  # before the Stop: the channel's end is then never taken for a failure
                self.hooks.leave(gen_id, gen.incarnation)
            self.sock.send(gen.identity, messages.Stop(reason="drained"))
            self.counts["hub/generators_drained"] += 1
            log.info("generator %d drained (target %d): stopped", gen_id, self.target)

    def _lose(self, gen_id: int, why: str, detail: str) -> None:
        """The one place a generator incarnation is declared lost (lock held): its work is re-issued with its slots,
        it is forgotten (a late request gets Stop), counted, logged with what it held, and `hooks.lost` tells the
        weight publisher and the launcher."""
        gen = self.gens.pop(gen_id)
        tickets = [t for t in self.in_flight.values() if t.gen_id == gen_id]
        for t in tickets:
            del self.in_flight[t.ticket]
            self.reissue.append(t)
        if tickets:  # a counter is only written once it counts something
            self.counts["hub/reissued_prompts"] += len(tickets)
        slots = sorted(t.slot for t in tickets)
        evals = self.evals.requeue(gen_id)
        if evals:
            self.counts["hub/reissued_eval_prompts"] += evals
        self.counts[f"hub/generator_lost/{why}"] += 1
        self.ended[(gen_id, gen.incarnation)] = f"lost: {why}"
        held = f"{len(slots)} groups" + (f" (slots {slots[0]}..{slots[-1]})" if slots else "") + f", {evals} eval prompts"
        log.warning("generator %d (pid %d, incarnation %s) lost (%s): %s; it held %s, re-issued", gen_id, gen.pid,
                    gen.incarnation, why, detail, held)
        if self.hooks is not None:
            self.hooks.lost(gen_id, gen.incarnation, gen.pid, why, f"{detail}; it held {held}")
        self.cv.notify_all()

    def _new_ticket(self) -> int:
        self.next_ticket += 1
        return self.next_ticket - 1

    def _holds(self, gen_id: int) -> bool:
        """This generator holds training groups or eval prompts (lock held)."""
        return any(t.gen_id == gen_id for t in self.in_flight.values()) or self.evals.holds(gen_id)

    def _serve_eval(self, gen_id: int, gen: GenState) -> bool:
        """Give this generator eval prompts, if any are queued: they go before training work."""
        idle = not self._holds(gen_id)
        work = self.evals.serve(gen_id, gen.incarnation, self._new_ticket, gen.capacity)
        if work is None:
            return False
        gen.wanted = 0  # it asks again once it has taken the eval chunk in
        if idle:
            gen.progress_at = time.monotonic()
        self.sock.send(gen.identity, work)
        return True

    def _serve_wanted(self) -> None:
        """Fill every generator's room from what admission allows, one group at a time in turn, so generators that
        ask together share it (a draining generator gets no new work)."""
        wanting = collections.deque(g for g, gen in self.gens.items()
                                    if g < self.target and gen.wanted > 0 and not self._serve_eval(g, gen))
        if not wanting or not self._admissible():
            return  # a counting generator's room stays open across passes: nothing to scan until admission opens
        holding = {t.gen_id for t in self.in_flight.values()}  # one pass over the tickets, not one per generator
        idle = {g: g not in holding and not self.evals.holds(g) for g in wanting}
        given: dict[int, list[messages.WorkItem]] = {g: [] for g in wanting}
        while wanting:
            g = wanting.popleft()
            t = self._next_ticket(g, self.gens[g].incarnation)
            if t is None:
                break  # admission control: the learner must catch up first
            given[g].append(self._work_item(t))
            if len(given[g]) < self.gens[g].wanted:
                wanting.append(g)
        for g, items in given.items():
            if items:
                self._send_work(g, self.gens[g], items, idle[g])

    def _send_work(self, gen_id: int, gen: GenState, items: list[messages.WorkItem], idle: bool) -> None:
        # A counting generator's room stays open until filled; a hand-written client gets one reply per request.
        gen.wanted = gen.wanted - len(items) if gen.counted else 0
        gen.issued += len(items)
        if idle:
            gen.progress_at = time.monotonic()  # its clock starts now, not when it asked
        self.sock.send(gen.identity, messages.Work(items=items, group_size=self.cfg.rollout.group_size,
                                                   sampling=self.sampling, policy_version=self.version))

    def _admissible(self) -> bool:
        """A ticket can be issued now: a re-issue waits, or admission control allows a new slot (lock held)."""
        return bool(self.reissue) or self.slots - self.filtered < self.rules.admit_cap(self.version)

    def _next_ticket(self, gen_id: int, incarnation: str) -> Ticket | None:
        if not self._admissible():
            return None  # admission control: the learner must catch up first
        if self.reissue:
            old = self.reissue.popleft()
            slot, prompt_id, epoch = old.slot, old.prompt_id, old.epoch
        else:
            if self.pos == len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = self.source.order(self.epoch)
            slot, prompt_id, epoch = self.slots, self.order[self.pos], self.epoch
            self.slots += 1
            self.pos += 1
        t = Ticket(self._new_ticket(), slot, prompt_id, epoch, gen_id, incarnation, self.version)
        self.in_flight[t.ticket] = t
        return t

    def _work_item(self, t: Ticket) -> messages.WorkItem:
        p = self.source[t.prompt_id]
        return messages.WorkItem(
            ticket=t.ticket,
            prompt_id=t.prompt_id,
            epoch=t.epoch,
            prompt_ids=messages.to_bytes(p.ids, messages.TOKEN_DTYPE),
            answer=p.answer,
            data_source=p.data_source,
            seed=prompt_seed(self.cfg.run.seed, t.epoch, t.prompt_id),
        )

    def _broadcast_stop(self, reason: str) -> None:
        for gen in self.gens.values():
            self.sock.send(gen.identity, messages.Stop(reason=reason))

    def stats(self) -> BrokerStats:
        """The running totals, read under the lock: the trainer turns their differences into per-step metrics."""
        with self.cv:
            # Every issued slot is trained, ready, in flight, waiting for re-issue or filtered; anything else is lost.
            accounted = (self.n_trained + self.filtered + len(self.ready) + len(self.reissue)
                         + len({t.slot for t in self.in_flight.values()}))
            counters = {**self._counted(), "hub/filtered_groups": self.filtered,
                        "hub/lost_prompts": float(self.slots - accounted),
                        "cluster/generators": float(sum(g < self.target for g in self.gens)),
                        "cluster/generators_target": float(self.target),
                        "perf/ready_groups": float(len(self.ready)), **self._weight_lag()}
            return BrokerStats(filtered_groups=self.filtered, gen_tokens=self.gen_tokens, counters=counters,
                               gen_busy_s=self.gen_busy_s)

    def _weight_lag(self) -> dict[str, float]:
        """How many versions each connected generator's newest arrived weights (its heartbeat) are behind the
        learner's version: `perf/weight_lag/gen<id>` each, and `perf/weight_lag/max` (lock held). Under `perf/`
        with the other wall-clock measurements: it depends on when the last heartbeat left, so two runs of one seed
        differ here and nowhere else."""
        lag = {f"perf/weight_lag/gen{g}": float(self.version - gen.policy_version) for g, gen in self.gens.items()}
        return {**lag, "perf/weight_lag/max": max(lag.values(), default=0.0)}

    def _counted(self) -> dict[str, float]:
        """The hub's counters plus the socket's rejections (lock held)."""
        out = dict(self.counts)
        for reason, n in self.sock.rejected.items():
            out[f"hub/rejected/{reason}"] = out.get(f"hub/rejected/{reason}", 0) + n
        return out
