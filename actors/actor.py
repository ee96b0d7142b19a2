"""The generator process: ask the hub for work, generate groups, score them, send them back.

Four threads, one job each:
- main: the actor loop below: keep the engine full (ask for the free room, submit each group, collect each one the
  moment its samples end) and send each group once scored (`ActorLoop`, docs/DESIGN.md section 3, "a generator's
  room");
- scorer: decodes and scores finished groups through the reward pool (`Scorer`), so generation never waits for it;
- weights: blocks in the weight channel's broadcast and stages each version (`actors/weight_receiver.py`:
  `WeightReceiver`); the main thread swaps staged weights in before the next forward, so new
  weights take effect mid-generation and every token records its version;
- heartbeat: its own socket, so the hub knows this process is alive even
  while a long batch is generating.

The policy version has one owner in this process: the engine (`engine.version`, actors/engine.py), the version of
the weights it holds. Only the engine sets it, as it loads a version; it stamps every token, and evaluation
checks it (`evaluate`). The weight receiver keeps no version of its own: it holds vectors in transit, each
labelled with the version it carries (staged for the main thread, or being loaded by it), and what has
*arrived* (`WeightReceiver.received`) is the newest of those labels, else the engine's version. That is what
the heartbeat reports (`Heartbeat.policy_version`) and what `wait_for` waits for. A (re)started generator starts
from the base model, version 0, whatever the learner is at: the learner sends it the latest version first thing,
and work waits for the version it names.

The main loop only ever waits for the hub in one place, its `recv` between engine iterations, so a Stop reaches it there:
"training finished" at the end, or "drained" when the run was scaled below this generator's id (the hub sends it
only once every group and eval result this generator held is in), or "lost: <why>" when it asks again after the
hub gave up on it (it was frozen or stuck; its work went to others). It exits 0 at the end of training,
`EXIT_DRAINED` when drained and `EXIT_LOST` when lost, so the launcher's supervisor tells a finished generator from
a scaled-away one and restarts a lost one (if it has not stopped it already).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from actors.weight_receiver import WeightReceiver
from common import messages
from common import weights
from common.runfiles import EXIT_DRAINED, EXIT_LOST
from common.config import Config, generator_loop
from common.heldout import batch_groups
from common.rewards import RewardPool
from common.transport import GeneratorSocket

log = logging.getLogger("covrl.actor")


class Heartbeat(threading.Thread):
    def __init__(self, address: str, key: bytes, gen_id: int, incarnation: str, period_s: float, receiver):
        super().__init__(name="heartbeat", daemon=True)
        self.args = (address, key)
        self.gen_id, self.incarnation, self.period_s, self.receiver = gen_id, incarnation, period_s, receiver
        self.stop = threading.Event()

    def run(self) -> None:
        sock = GeneratorSocket(*self.args)
        try:
            while not self.stop.wait(self.period_s):
                sock.send(messages.Heartbeat(gen_id=self.gen_id, incarnation=self.incarnation,
                                      policy_version=self.receiver.received))
        finally:
            sock.close()


def make_reward_pool(cfg: Config) -> RewardPool:
    return RewardPool.from_config(cfg.reward)


def handshake(sock: GeneratorSocket, run_id: str, gen_id: int, incarnation: str, timeout_s: float) -> messages.Welcome:
    sock.send(messages.Hello(protocol_version=messages.PROTOCOL_VERSION, run_id=run_id, gen_id=gen_id, incarnation=incarnation, pid=os.getpid()))
    reply = sock.recv(timeout_s)
    if isinstance(reply, messages.Refused):
        raise SystemExit(f"generator {gen_id}: the hub refused us: {reply.reason}")
    if not isinstance(reply, messages.Welcome):
        raise SystemExit(f"generator {gen_id}: no welcome from the hub within {timeout_s:.0f}s (got {type(reply).__name__}); is the learner running?")
    return reply


def run_actor(cfg: Config, *, engine, tokenizer, hub_addr: str, key: bytes, run_id: str, gen_id: int, run_dir: str | None) -> int:
    """One generator process's life: handshake, the weight and heartbeat threads, then the actor loop until a Stop;
    returns the exit code."""
    incarnation = uuid.uuid4().hex
    sock = GeneratorSocket(hub_addr, key)
    welcome = handshake(sock, run_id, gen_id, incarnation, cfg.transport.welcome_timeout_s)
    log_path = _log_file(run_dir, f"gen{gen_id}.jsonl")
    receiver = WeightReceiver(welcome, engine, cfg.transport.weight_sync_timeout_s, log_path,
                              weights.pair_prefix(gen_id, incarnation))
    receiver.start()
    beat = Heartbeat(hub_addr, key, gen_id, incarnation, cfg.transport.heartbeat_s, receiver)
    beat.start()
    with make_reward_pool(cfg) as pool:
        try:
            loop = ActorLoop(cfg, sock=sock, engine=engine, tokenizer=tokenizer, pool=pool, receiver=receiver,
                             gen_id=gen_id, incarnation=incarnation,
                             eval_log=_log_file(run_dir, f"gen{gen_id}_eval.jsonl"))
            return loop.serve()
        finally:
            beat.stop.set()
            sock.close()


def _log_file(run_dir: str | None, name: str) -> str | None:
    """RUN_DIR/generators/<name> (its directory made), or None without a run directory."""
    if not run_dir:
        return None
    os.makedirs(os.path.join(run_dir, "generators"), exist_ok=True)
    return os.path.join(run_dir, "generators", name)


class Scorer(threading.Thread):
    """Decodes and scores finished groups off the main thread (the reward pool's workers do the scoring), so the
    engine keeps generating meanwhile; the main thread sends what comes out, in the order groups finished."""

    def __init__(self, tokenizer, pool: RewardPool, gen_id: int, incarnation: str):
        super().__init__(name="scorer", daemon=True)
        self.tokenizer, self.pool, self.gen_id, self.incarnation = tokenizer, pool, gen_id, incarnation
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.pending = 0  # groups put and not yet taken back (main thread only)
        self.error: BaseException | None = None

    def put(self, item: messages.WorkItem, comps) -> None:
        self.pending += 1
        self.inbox.put((item, comps))

    def ready(self) -> list[messages.RolloutGroup]:
        """The groups scored since the last call (main thread)."""
        if self.error is not None:
            raise RuntimeError("scoring rollouts failed") from self.error
        out = []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                self.pending -= len(out)
                return out

    def run(self) -> None:
        try:
            while (job := self.inbox.get()) is not None:
                self.outbox.put(score_group(*job, tokenizer=self.tokenizer, pool=self.pool, gen_id=self.gen_id,
                                            incarnation=self.incarnation))
        except BaseException as e:
            log.exception("scoring failed")
            self.error = e

    def close(self) -> None:
        self.inbox.put(None)


@dataclass
class ActorLoop:
    """The main thread's loop: keep the engine full, send each group the moment it is scored, until the hub says stop.

    Room: the engine's capacity in groups (`engine.max_num_seqs` sequences // group size; `rollout.groups_per_request`
    caps it when set). Every group received and not yet sent back counts against it, from the moment its Work
    arrives to the moment its RolloutGroup leaves (waiting for its weights, generating, scoring). The loop asks for
    the free room whenever it changes (and again every `transport.recv_timeout_s` while it stays free), saying how
    many groups it has received so far, so the hub never gives more than the room (broker/hub.py). A Work whose
    weights have not arrived waits, its groups counted, while the engine goes on with the others; it is submitted
    once they have (`transport.weight_sync_timeout_s` at most). Evaluation chunks are generated as one batch on the
    main thread, as before (the hub publishes nothing newer until they are back)."""

    cfg: Config
    sock: GeneratorSocket
    engine: object
    tokenizer: object
    pool: RewardPool
    receiver: WeightReceiver
    gen_id: int
    incarnation: str
    eval_log: str | None  # what this generator actually evaluated, one line per eval chunk
    sent: int = 0  # rollout groups sent back

    def capacity(self) -> int:
        """Groups this generator keeps in flight when full: what its engine holds (max_num_seqs // group size), at
        most rollout.groups_per_request, else at most one step's groups. More than a step would share the engine
        between two steps' groups, each progressing at the same rate, so the oldest step, the one the learner takes
        next, would finish later (on the heavy benchmark, 32 groups in flight made the learner wait 5.2 s a step
        against 1.2 s with 16, 2026-11-28)."""
        groups = max(1, self.engine.max_num_seqs // self.cfg.rollout.group_size)
        return min(groups, self.cfg.rollout.groups_per_request or self.cfg.rollout.groups_per_step)

    def serve(self) -> int:
        """Ask for work and answer it until a Stop; returns the exit code the Stop calls for."""
        if generator_loop(self.cfg, on_cpu=str(getattr(self.engine, "device", "cuda")).startswith("cpu")) == "batch":
            return self.serve_batches()
        scorer = Scorer(self.tokenizer, self.pool, self.gen_id, self.incarnation)
        scorer.start()
        try:
            return _Stream(self, scorer).run()
        finally:
            scorer.close()

    def serve_batches(self) -> int:
        """`generator.loop = "batch"`: one Work at a time (`batch_groups`: a step's groups unless
        rollout.groups_per_request says otherwise), generated as one static batch, scored, sent; then ask again."""
        room = batch_groups(self.cfg, self.capacity())
        while True:  # it holds nothing when it asks: one reply per request (received_groups not counted)
            self.sock.send(messages.WorkRequest(gen_id=self.gen_id, incarnation=self.incarnation, max_groups=room,
                                                capacity=room))
            msg = self.sock.recv(self.cfg.transport.recv_timeout_s)
            if isinstance(msg, messages.Stop):
                return self.stopped(msg)
            if isinstance(msg, messages.Work):
                for group in rollout(msg, engine=self.engine, tokenizer=self.tokenizer, pool=self.pool,
                                     receiver=self.receiver, gen_id=self.gen_id, incarnation=self.incarnation,
                                     wait_s=self.cfg.transport.weight_sync_timeout_s):
                    self.sock.send(group)
                    self.sent += 1
            elif isinstance(msg, messages.EvalWork):
                self.evaluate(msg)
            # None: no work yet (admission control holds it back): ask again

    def evaluate(self, work: messages.EvalWork) -> None:
        results = evaluate(work, engine=self.engine, tokenizer=self.tokenizer, pool=self.pool, receiver=self.receiver,
                           gen_id=self.gen_id, incarnation=self.incarnation,
                           wait_s=self.cfg.transport.weight_sync_timeout_s)
        if self.eval_log:
            with open(self.eval_log, "a") as f:
                f.write(json.dumps({"version": work.policy_version, "data_source": work.items[0].data_source,
                                    "temperature": work.sampling.temperature, "k": work.k,
                                    "prompts": len(work.items)}) + "\n")
        for res in results:
            self.sock.send(res)

    def stopped(self, msg: messages.Stop) -> int:
        """The exit code of a Stop: drained, lost, or the end of training."""
        if msg.reason == "drained":  # the run was scaled below this id; everything we held is in
            log.info("generator %d drained: the run's generator target no longer includes this id; "
                     "exiting after %d rollout groups", self.gen_id, self.sent)
            return EXIT_DRAINED
        if msg.reason.startswith("lost"):  # the hub gave up on this incarnation and re-issued its work
            log.error("generator %d: the hub declared this incarnation %s; exiting so that a fresh one "
                      "replaces it", self.gen_id, msg.reason)
            return EXIT_LOST
        log.info("generator %d: stop (%s) after %d rollout groups", self.gen_id, msg.reason, self.sent)
        return 0


@dataclass
class _Stream:
    """One `ActorLoop.serve`'s state: what it holds, what it asked for, and the generator's busy clock."""

    loop: ActorLoop
    scorer: Scorer
    held: int = 0  # groups received and not yet sent back
    received: int = 0  # training groups received by this incarnation
    asked: tuple[int, int, float] | None = None  # (free room, groups received, when) of the last request
    busy_s: float = 0.0  # seconds generating or scoring not yet attributed to a sent group
    clock: float = 0.0
    waiting: collections.deque = field(default_factory=collections.deque)  # (Work, arrival) awaiting weights

    def run(self) -> int:
        lp = self.loop
        room, poll = lp.capacity(), lp.cfg.transport.recv_timeout_s
        self.clock = time.monotonic()
        while True:
            self._send_scored()
            self._ask(room, poll)
            wait_s = 0.0 if lp.engine.in_flight else 0.02 if self._pending() else poll  # idle: up to recv_timeout_s
            msg = lp.sock.recv(wait_s)
            if isinstance(msg, messages.Stop):
                return lp.stopped(msg)
            if isinstance(msg, messages.Work):
                self.waiting.append((msg, time.monotonic()))
                self.received += len(msg.items)
                self.held += len(msg.items)
            elif isinstance(msg, messages.EvalWork):
                lp.evaluate(msg)
                self.asked = None  # the hub closed our room when it gave the chunk: ask again
            self._submit_ready()
            if lp.engine.in_flight:
                for (item, _), comps in lp.engine.collect(0.05, lp.receiver.apply):
                    self.scorer.put(item, comps)
            self._tick()

    def _pending(self) -> bool:
        return bool(self.waiting or self.scorer.pending)

    def _tick(self) -> None:
        """The busy clock: time with groups generating or scoring counts."""
        now = time.monotonic()
        if self.loop.engine.in_flight or self.scorer.pending:
            self.busy_s += now - self.clock
        self.clock = now

    def _ask(self, room: int, poll: float) -> None:
        """Ask for the free room when it is more than the hub still holds open for us (what we last asked for, less
        what has arrived since), and again every `poll` seconds while any is free."""
        free = room - self.held
        now = time.monotonic()
        if free <= 0:
            return
        if self.asked is not None:
            asked_free, asked_received, at = self.asked
            still_open = asked_free - (self.received - asked_received)
            if free <= still_open and now - at < poll:
                return
        lp = self.loop
        lp.sock.send(messages.WorkRequest(gen_id=lp.gen_id, incarnation=lp.incarnation, max_groups=free,
                                          received_groups=self.received, capacity=room))
        self.asked = (free, self.received, now)

    def _submit_ready(self) -> None:
        """Submit every waiting Work whose weights have arrived (oldest first); past the deadline, fail."""
        lp = self.loop
        while self.waiting:
            work, since = self.waiting[0]
            if lp.receiver.received < work.policy_version:
                if lp.receiver.error is not None:
                    raise RuntimeError("weight receiver failed") from lp.receiver.error
                if time.monotonic() - since > lp.cfg.transport.weight_sync_timeout_s:
                    raise TimeoutError(f"weights of version {work.policy_version} did not arrive within "
                                       f"{lp.cfg.transport.weight_sync_timeout_s:.0f}s")
                return
            self.waiting.popleft()
            lp.receiver.apply()  # the newest arrived weights, before these prompts start
            for it in work.items:
                prompt = messages.as_array(it.prompt_ids, messages.TOKEN_DTYPE).tolist()
                lp.engine.submit((it, id(work)), prompt, work.group_size, work.sampling, it.seed)

    def _send_scored(self) -> None:
        lp = self.loop
        for group in self.scorer.ready():
            self._tick()
            lp.sock.send(msgspec.structs.replace(group, gen_time_s=self.busy_s))
            self.busy_s = 0.0
            self.held -= 1
            lp.sent += 1


def score_group(item: messages.WorkItem, comps, *, tokenizer, pool: RewardPool, gen_id: int,
                incarnation: str) -> messages.RolloutGroup:
    """Decode and score one group's samples: its RolloutGroup (gen_time_s set by the sender)."""
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
    scores = pool.score_batch([(t, item.answer) for t in texts])
    samples = [messages.Sample(token_ids=messages.to_bytes(c.token_ids, messages.TOKEN_DTYPE),
                               logprobs=messages.to_bytes(c.logprobs, messages.LOGPROB_DTYPE),
                               versions=messages.to_bytes(c.versions, messages.VERSION_DTYPE), reward=float(s.reward),
                               finish_reason=c.finish_reason, score_status=s.status)
               for c, s in zip(comps, scores)]
    return messages.RolloutGroup(gen_id=gen_id, incarnation=incarnation, ticket=item.ticket, prompt_id=item.prompt_id,
                                 epoch=item.epoch, prompt_ids=item.prompt_ids, samples=samples, gen_time_s=0.0)


def rollout(work: messages.Work, *, engine, tokenizer, pool, receiver, gen_id: int, incarnation: str, wait_s: float) -> list[messages.RolloutGroup]:
    """Generate and score one Work message as one batch (the synchronous reference loop's step)."""
    if receiver is not None:
        receiver.wait_for(work.policy_version, wait_s)
    t0 = time.perf_counter()
    prompts = [messages.as_array(it.prompt_ids, messages.TOKEN_DTYPE).tolist() for it in work.items]
    hook = receiver.apply if receiver is not None else None
    groups = engine.generate(prompts, work.group_size, work.sampling, [it.seed for it in work.items], before_forward=hook)
    out = [score_group(it, comps, tokenizer=tokenizer, pool=pool, gen_id=gen_id, incarnation=incarnation)
           for it, comps in zip(work.items, groups)]
    gen_time = (time.perf_counter() - t0) / max(len(work.items), 1)
    return [msgspec.structs.replace(g, gen_time_s=gen_time) for g in out]


def evaluate(work: messages.EvalWork, *, engine, tokenizer, pool, receiver, gen_id: int, incarnation: str, wait_s: float) -> list[messages.EvalResult]:
    """Sample and score held-out prompts with weights of exactly work.policy_version.

    The hub publishes nothing newer until every eval item of this version is back, so
    the weights cannot change under us; no mid-generation swap hook is installed.
    """
    if receiver is not None:
        receiver.wait_for(work.policy_version, wait_s)
    if engine.version != work.policy_version:
        raise RuntimeError(f"eval of version {work.policy_version} asked, but the engine holds version {engine.version}: "
                           "the hub published newer weights before this eval finished (a hub bug)")
    prompts = [messages.as_array(it.prompt_ids, messages.TOKEN_DTYPE).tolist() for it in work.items]
    groups = engine.generate(prompts, work.k, work.sampling, [it.seed for it in work.items])
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
    scores = pool.score_batch(list(zip(texts, [it.answer for it in work.items for _ in range(work.k)])))
    out = []
    for i, (it, comps) in enumerate(zip(work.items, groups)):
        sc = scores[i * work.k:(i + 1) * work.k]
        out.append(messages.EvalResult(gen_id=gen_id, incarnation=incarnation, ticket=it.ticket, policy_version=engine.version,
                                rewards=[float(x.reward) for x in sc], lengths=[len(c.token_ids) for c in comps],
                                score_status=[x.status for x in sc],
                                entropies=[c.entropy for c in comps] if all(c.entropy is not None for c in comps) else [],
                                texts=texts[i * work.k:(i + 1) * work.k] if it.prompt_id < work.keep_texts else []))
    return out
