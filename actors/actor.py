"""The generator process: ask the hub for work, generate groups, score them, send them back.

Three threads, one job each:
- main: the actor loop below (request -> generate -> score -> send);
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

The main loop only ever waits for the hub in one place, its `recv` between requests, so a Stop reaches it there:
"training finished" at the end, or "drained" when the run was scaled below this generator's id (the hub sends it
only once every group and eval result this generator held is in), or "lost: <why>" when it asks again after the
hub gave up on it (it was frozen or stuck; its work went to others). It exits 0 at the end of training,
`EXIT_DRAINED` when drained and `EXIT_LOST` when lost, so the launcher's supervisor tells a finished generator from
a scaled-away one and restarts a lost one (if it has not stopped it already).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

from actors.weight_receiver import WeightReceiver
from common import messages
from common import weights
from common.runfiles import EXIT_DRAINED, EXIT_LOST
from common.config import Config
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


@dataclass
class ActorLoop:
    """The main thread's loop: request -> generate -> score -> send, until the hub says stop."""

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

    def serve(self) -> int:
        """Ask for work and answer it until a Stop; returns the exit code the Stop calls for."""
        while True:
            self.sock.send(messages.WorkRequest(gen_id=self.gen_id, incarnation=self.incarnation,
                                         max_groups=self.cfg.rollout.groups_per_request))
            msg = self.sock.recv(self.cfg.transport.recv_timeout_s)
            if isinstance(msg, messages.Stop):
                return self.stopped(msg)
            if isinstance(msg, messages.Work):
                self.train(msg)
            elif isinstance(msg, messages.EvalWork):
                self.evaluate(msg)
            # None: no work yet (admission control holds it back): ask again

    def train(self, work: messages.Work) -> None:
        for group in rollout(work, engine=self.engine, tokenizer=self.tokenizer, pool=self.pool,
                             receiver=self.receiver, gen_id=self.gen_id, incarnation=self.incarnation,
                             wait_s=self.cfg.transport.weight_sync_timeout_s):
            self.sock.send(group)
            self.sent += 1

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


def rollout(work: messages.Work, *, engine, tokenizer, pool, receiver, gen_id: int, incarnation: str, wait_s: float) -> list[messages.RolloutGroup]:
    """Generate and score one Work message: the named steps of the actor loop."""
    if receiver is not None:
        receiver.wait_for(work.policy_version, wait_s)
    t0 = time.perf_counter()
    prompts = [messages.as_array(it.prompt_ids, messages.TOKEN_DTYPE).tolist() for it in work.items]
    hook = receiver.apply if receiver is not None else None
    groups = engine.generate(prompts, work.group_size, work.sampling, [it.seed for it in work.items], before_forward=hook)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
    answers = [it.answer for it in work.items for _ in range(work.group_size)]
    scores = pool.score_batch(list(zip(texts, answers)))
    gen_time = (time.perf_counter() - t0) / max(len(work.items), 1)
    out = []
    for i, (it, comps) in enumerate(zip(work.items, groups)):
        samples = []
        for j, c in enumerate(comps):
            s = scores[i * work.group_size + j]
            samples.append(messages.Sample(
                token_ids=messages.to_bytes(c.token_ids, messages.TOKEN_DTYPE), logprobs=messages.to_bytes(c.logprobs, messages.LOGPROB_DTYPE),
                versions=messages.to_bytes(c.versions, messages.VERSION_DTYPE), reward=float(s.reward),
                finish_reason=c.finish_reason, score_status=s.status,
            ))
        out.append(messages.RolloutGroup(gen_id=gen_id, incarnation=incarnation, ticket=it.ticket, prompt_id=it.prompt_id,
                                  epoch=it.epoch, prompt_ids=it.prompt_ids, samples=samples, gen_time_s=gen_time))
    return out


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
