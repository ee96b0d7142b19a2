"""No call in learner/, broker/ or actors/ that waits on another process lacks a deadline.

The rule covers the common/ helpers those packages wait through too (HELPERS). The check is static and
deliberately conservative. A call whose name is in BLOCKING, or in RECEIVER_SCOPED with a receiver that looks
like a store, queue, thread, socket or engine, and every `with <lock>:`, must do one of two things. It can pass a
timeout: a keyword whose name contains "timeout", or the positional argument that API documents as its timeout,
where that argument reads like a duration and is not a parameter that defaults to None. Or it can be listed in
ALLOWED with a one-line reason that names where its deadline comes from. A call with no deadline at all is never
listed; fix the call instead. The scanner is tested on synthetic sources (test_scanner_*), so a scanner that
stops seeing calls cannot pass silently.
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("learner", "broker", "actors")
HELPERS = ("common/weights.py", "common/transport.py", "common/rewards.py", "common/vllm_weights.py",
           "common/ipc_weights.py", "hardware/check_learner.py")

# Calls that wait on another process whatever their receiver -> index of the positional argument the API documents
# as its timeout, or None when only a keyword (a name containing "timeout") can carry one.
BLOCKING: dict[str, int | None] = {
    # torch.distributed, DeepSpeed, NCCL: no per-call timeout; their deadline is their process group's
    "barrier": None, "monitored_barrier": None, "broadcast": None, "broadcast_object_list": None,
    "all_reduce": None, "all_gather": None, "all_gather_object": None, "all_gather_into_tensor": None,
    "reduce_scatter": None, "reduce_scatter_tensor": None, "all_to_all": None, "init_process_group": None,
    "new_group": None, "new_subgroups": None, "new_subgroups_by_enumeration": None, "split_group": None,
    "init_distributed": None, "destroy_process_group": None, "TCPStore": 4,
    "ProcessGroupGloo": None, "GatheredParameters": None, "synchronize": None, "trainer_init": None,
    "PyNcclCommunicator": None,
    # futures, events, conditions, stores, subprocesses, ZeroMQ
    "result": 0, "recv": 0, "recv_multipart": None, "recv_string": None, "recv_pyobj": None, "recv_json": None,
    "poll": 0, "communicate": None, "check_output": None, "check_call": None, "acquire": 1,
    # vLLM: building an AsyncLLM (blocking) and its coroutine methods (see AWAITED_ONLY)
    "from_engine_args": None, "pause_generation": None, "resume_generation": None, "collective_rpc": None,
    "init_weight_transfer_engine": None, "start_weight_update": None, "update_weights": None,
    "finish_weight_update": None, "update_weight_version": None,
    # covrl's own helpers that wait: the deadline is an argument, or the object's own (then ALLOWED says which)
    "wait_for": 1, "wait_until": 1, "take_batch": None, "handshake": 4, "join_weights": 2, "join_nccl": 3,
    "offer_address": 3, "read_address": 1, "receive_header": None, "receive_buckets": None,
    "receive_weights": None, "receive_nccl": None, "send_bucket": None, "score_batch": None,
    "WeightChannel": 4, "NcclSender": 4, "VllmEngine": None, "_send_latest": None, "_send_bucket": None,
    "_connect_direct": None, "_direct_peer": None,
    # the ipc transport (common/ipc_weights.py, learner/ipc.py, VllmEngine's ipc layer)
    "settle": 1, "receive_version": 1, "read_announcement": 1, "read_slots": 1, "wait_mapped": 1, "IpcSender": 4,
    "map_ipc": 1, "receive_ipc": None,
}
# Named like a wait but never block the host: stream ordering on the GPU.
NOT_WAITING = {"wait_stream", "wait_event"}
# Coroutine methods: calling one only makes a coroutine. The wait is where it is awaited (flagged here, an `await`
# cannot take a timeout) or where it is run (`_loop.run(coro, timeout_s)`, checked as a call of its own).
AWAITED_ONLY = {"pause_generation", "resume_generation", "collective_rpc", "init_weight_transfer_engine",
                "start_weight_update", "update_weights", "finish_weight_update", "update_weight_version", "gather"}
# Names too common to flag everywhere: only when the receiver's text matches. (name, receiver regex, timeout index)
RECEIVER_SCOPED: list[tuple[str, str, int | None]] = [
    ("get", r"store|queue|fut|\bray\b", None),  # a store's get waits up to the store's timeout; dicts are not flagged
    ("put", r"queue", 2),
    ("join", r"thread|proc|worker|pool", 0),
    ("run", r"loop", 1),  # actors/vllm_engine.py _Loop.run(coro, timeout_s)
    ("run", r"^subprocess$", None),
    ("send", r"sock", None), ("send_multipart", r"sock", None),
    ("select", r"selector", 0),
    ("gather", r"^asyncio$|^dist$", None),
    ("create", r"StatelessProcessGroup", None),
    ("generate", r"engine|llm", None), ("load_flat", r"engine", None), ("fingerprint", r"engine", None),
    ("publish", r"publisher|channel", None),
    ("backward", r"engine", None), ("step", r"engine", None),
    ("save_checkpoint", r"engine", None), ("load_checkpoint", r"engine", None),
    ("initialize", r"^deepspeed$", None), ("destroy", r"comm", None), ("shutdown", r"llm", None),
    ("from_config", r"VllmEngine", None),
    ("stop", r"publisher|^ch$|channel", None),  # a weight channel's stop header, WeightPublisher.stop
    ("close", r"sender|peer|sink", None),  # an NcclSender; a weight peer (its stop header); the metrics sink (W&B)
    ("release", r"peer|^self$", None),  # a weight peer's NCCL communicator
]
# A `with X:` on something whose name says it is a lock: it cannot take a timeout, so it must be ALLOWED.
LOCKISH = re.compile(r"(^|[._])(lock|cv|cond|mutex)\w*$", re.IGNORECASE)
# A positional timeout must read like a duration: `timeout_s`, `self.period_s`, `min(left, 1.0)`, `600`, ...
DURATIONISH = re.compile(r"timeout|deadline|_s\b|\bleft\b|remain|period|^\s*\d+(\.\d*)?\s*$|\btimedelta\b", re.I)
# Timeouts carried by an options object set in the same function: (call name, attribute assigned).
OPTION_TIMEOUTS = {("ProcessGroupGloo", "_timeout"), ("broadcast", "timeout")}

# (file, enclosing function, call text) -> why this call cannot wait forever. Every reason starts with one of
# REASON_KINDS: "timeout:" (the deadline is set elsewhere, named here), "non-blocking:" (the call cannot wait
# here), "local:" (it waits only on this process's own threads, which never wait on another process while they
# hold what it waits for). Function "*": anywhere in the file; a text ending in "...": a prefix.
REASON_KINDS = ("timeout:", "non-blocking:", "local:")
# A group made without a timeout of its own gets its backend's default, not the world group's (30 min gloo): so the
# learner gives every group its deadline (test_every_learner_process_group_is_bounded below).
PG = ("timeout: the learner ranks' process groups: init_distributed(timeout_s=transport.learner_timeout_s), and "
      "DeepSpeed's own bounded by bound_every_group once the engine is built")
GLOO_PAIR = "timeout: the pair channel's ProcessGroupGloo _timeout (WeightChannel.__init__: the timeout_s it is built with)"
SENDS = ("timeout: Sends: each gloo operation at most transport.weight_send_timeout_s (the channel's own _timeout, "
         "polled by Sends.wait, which also gives up at the hub's verdict)")
ENGINE = ("timeout: inside the engine: TorchEngine computes locally (its receive is the pair channel's gloo _timeout); "
          "VllmEngine bounds every call with generator.engine_timeout_s (_Loop.run, generate's deadline)")
IN_LOOP_RUN = "timeout: awaited inside a coroutine run by _Loop.run(coro, settings.timeout_s), which cancels it past that"
PUBLISH = ("timeout: WeightPublisher: every wait on a generator is a Sends (weight_send_timeout_s) or an NcclSender "
           "deadline (weight_sync_timeout_s), each cut short by the hub's verdict")
PUB_LOCK = ("local: WeightPublisher.lock is held only by this process's threads, across sends that each have a "
            "deadline (Sends, NcclSender)")
ALLOWED: dict[tuple[str, str, str], str] = {
    # ---- learner ranks: torch.distributed / DeepSpeed on the default process group ----
    ("learner/__main__.py", "main", "dist.barrier()"): PG,
    ("learner/__main__.py", "main", "dist.destroy_process_group()"):
        "non-blocking: after the final barrier no collective is pending",
    ("learner/loop.py", "Follower.publish", "self.publisher.publish(step)"):
        "timeout: ranks 1.. have no WeightPublisher (channel None): only the ZeRO-3 gathers wait (process group)",
    ("learner/__main__.py", "main", "publisher.publish(start)"):
        "non-blocking: before hub.start() no weight channel exists; only the ZeRO-3 gathers wait (process group)",
    ("learner/checkpoint.py", "save_checkpoint", "dist.barrier()"): PG,
    ("learner/checkpoint.py", "save_checkpoint", "engine.save_checkpoint(tmp, tag=DS_TAG, save_latest=False)"): PG,
    ("learner/checkpoint.py", "_load", "engine.load_checkpoint(..."): PG,
    ("learner/checkpoint.py", "resume_point", "dist.broadcast(sent, src=0)"): PG,
    ("learner/loop.py", "Ranks.share", "dist.broadcast_object_list(box, src=0)"): PG + ", gloo",
    ("learner/loop.py", "Ranks.agree", "dist.all_reduce(t, op=dist.ReduceOp.MAX)"): PG + ", gloo",
    ("learner/params.py", "_gathered", "deepspeed.zero.GatheredParameters(params, modifier_rank=None)"): PG,
    ("learner/trainer.py", "DataParallel.sum_", "dist.all_reduce(x)"): PG + ", gloo",
    ("learner/trainer.py", "DataParallel.top_values", "dist.all_gather(gathered, buf)"): PG + ", gloo",
    ("learner/trainer.py", "Trainer.__init__", "deepspeed.initialize(..."): PG,
    ("learner/trainer.py", "Trainer._optimizer_step", "self.engine.step()"): PG,
    ("learner/trainer.py", "Trainer._backward", "self.engine.backward(loss, scale_wrt_gas=False)"): PG,
    ("learner/trainer.py", "Trainer.train_step", "dist.all_reduce(sums)"): PG + ", gloo",
    # ---- learner rank 0's weight channels ----
    ("learner/loop.py", "Lead.publish", "self.publisher.publish(step)"): PUBLISH,
    ("learner/loop.py", "Lead.close", "self.publisher.stop()"): PUBLISH,
    ("learner/loop.py", "Lead.close", "self.sink.close()"):
        "timeout: MetricsWriter.close: W&B's finish waits at most common/wandb_log.FINISH_TIMEOUT_S",
    ("hardware/check_learner.py", "main", "publisher.publish(args.version)"): PUBLISH,
    ("hardware/check_learner.py", "main", "publisher.stop()"): PUBLISH,
    ("learner/publisher.py", "ModelPublisher.publish", "self.channel.publish(version, self.layout, buckets)"): PUBLISH,
    ("learner/publisher.py", "ModelPublisher.stop", "self.channel.stop()"): PUBLISH,
    ("learner/publisher.py", "*", "with self.lock"): PUB_LOCK,
    ("learner/publisher.py", "*", "with self.gone_lock"): "local: gone_lock guards one dict and is never held across a wait",
    ("learner/publisher.py", "*", "sends.wait()"): SENDS,
    ("learner/publisher.py", "Sends._settled", "work.wait()"): "non-blocking: only after work.is_completed()",
    ("learner/publisher.py", "_abandon.hold", "work.wait()"): GLOO_PAIR + " (weight_send_timeout_s on the learner's side)",
    ("learner/publisher.py", "NcclPeer.send_bucket", "self.sender.send_bucket(..."):
        "timeout: NcclSender.send_bucket polls its CUDA event for at most timeout_s (weight_sync_timeout_s), or until "
        "the hub's verdict",
    ("learner/publisher.py", "WeightPublisher._send", "peer.send_bucket(..."):
        "timeout: a gloo peer only starts the send (waited for in sends.wait()); an NCCL peer's is NcclPeer.send_bucket's",
    ("learner/publisher.py", "WeightPublisher.publish", "self._connect_direct(lay)"):
        "timeout: offer_address, NcclSender's and IpcSender's set-up each wait at most weight_send_timeout_s",
    ("learner/publisher.py", "WeightPublisher._connect_direct", "self._direct_peer(joined, lay)"):
        "timeout: offer_address, NcclSender's and IpcSender's set-up each wait at most weight_send_timeout_s",
    ("learner/publisher.py", "IpcPeer.send_bucket", "self.sender.send_bucket(..."):
        "timeout: IpcSender.send_bucket: every wait (slot free, copy, signal, acknowledgements) within its timeout_s "
        "(weight_sync_timeout_s), polled, and given up at once at the hub's verdict (cancelled)",
    ("learner/publisher.py", "IpcPeer.release", "self.sender.close()"):
        "non-blocking: IpcSender.close frees the slots now if it may, else leaves that to a daemon thread; it never "
        "waits",
    ("learner/publisher.py", "WeightPublisher._retire", "peer.close()"):
        "timeout: GlooPeer.close: the stop header within the pair channel's gloo _timeout, then release (below)",
    ("learner/publisher.py", "GlooPeer.close", "self.release()"):
        "timeout: NcclPeer.release: NcclSender.close destroys within its timeout (_within); a GlooPeer holds nothing",
    ("learner/publisher.py", "*", "peer.release()"):
        "timeout: NcclPeer.release: NcclSender.close destroys within its timeout (_within); a GlooPeer holds nothing",
    ("learner/publisher.py", "NcclPeer.release", "self.sender.close (called back)"):
        "timeout: NcclSender.close destroys within its timeout (_within), or not at all after an abort",
    **{("learner/publisher.py", func, call): GLOO_PAIR + " (weight_send_timeout_s on the learner's side)"
       for func, call in (("GlooPeer.close", "self.channel.stop (called back)"),
                          ("WeightPublisher._join", "joined.channel.stop (called back)"))},
    ("learner/nccl.py", "NcclSender.send_bucket", "self.comm.broadcast(t, src=0, stream=self.stream)"):
        "timeout: only enqueued on self.stream; the host waits for it in wait_until(done.query, self.timeout_s) below",
    ("learner/nccl.py", "NcclSender.__init__.<lambda>", "trainer_init(..."):
        "timeout: run by _within(timeout_s, ...), which gives up on it past its deadline",
    ("learner/nccl.py", "NcclSender.close", "self.comm.destroy (called back)"):
        "timeout: run by _within(self.timeout_s, ...), which gives up on it past its deadline",
    ("learner/beat.py", "*", "with self.lock"):
        "local: Beat.lock is taken only by this rank's own two threads, each for one small file write",
    # ---- the hub (a thread of learner rank 0) ----
    ("broker/hub.py", "*", "with self.cv"):
        "local: the hub's cv is never held across a wait on another process (NOBLOCK sends; the hooks join, leave and "
        "lost only mark, start threads or append one line to a file)",
    ("broker/hub.py", "*", "self.sock.send(..."):
        "non-blocking: HubSocket.send passes zmq.NOBLOCK (common/transport.py)",
    # ---- generators ----
    ("actors/weight_receiver.py", "*", "with self.cv"):
        "local: WeightReceiver.cv is never held across a wait (receive_weights and load_flat run outside it)",
    ("actors/actor.py", "*", "sock.send(..."):
        "timeout: GeneratorSocket sets SNDTIMEO 30 s (common/transport.py): a send that cannot queue raises zmq.Again",
    ("actors/actor.py", "*", "lp.sock.send(..."):
        "timeout: GeneratorSocket sets SNDTIMEO 30 s (common/transport.py): a send that cannot queue raises zmq.Again",
    ("actors/actor.py", "*", "self.sock.send(..."):
        "timeout: GeneratorSocket sets SNDTIMEO 30 s (common/transport.py): a send that cannot queue raises zmq.Again",
    ("actors/weight_receiver.py", "WeightReceiver.run", "ch.receive_header(self.lay)"): GLOO_PAIR,
    ("actors/weight_receiver.py", "WeightReceiver._receive", "self.engine.receive_weights(..."): ENGINE,
    ("actors/weight_receiver.py", "WeightReceiver.apply", "self.engine.load_flat(staged[1], staged[0])"): ENGINE,
    ("actors/actor.py", "*", "engine.generate(..."): ENGINE,
    ("actors/actor.py", "*", "pool.score_batch(..."):
        "timeout: RewardPool kills an answer after reward.timeout_s, so a batch takes at most ceil(n / workers) x that",
    ("actors/factory.py", "load_engine", "VllmEngine.from_config(cfg, model_path, stop_ids=stops)"):
        "timeout: VllmEngine.__init__ runs its start-up under _Loop.run(..., settings.timeout_s)",
    ("actors/engine.py", "Engine.receive_weights", "ch.receive_buckets(lay, out)"): GLOO_PAIR + ", per bucket",
    ("actors/vllm_engine.py", "VllmEngine.receive_weights", "super().receive_weights(ch, lay, version, flags, out)"):
        GLOO_PAIR + ", per bucket (Engine.receive_weights)",
    ("actors/vllm_engine.py", "VllmEngine.receive_weights", "self.receive_nccl(version)"):
        "timeout: receive_nccl runs under _update: _Loop.run(..., settings.timeout_s)",
    ("actors/vllm_engine.py", "VllmEngine.receive_weights", "self.receive_ipc(ch, version)"):
        "timeout: receive_ipc runs under _update: _Loop.run(..., settings.timeout_s); inside it each signal waits at "
        "most the pair channel's timeout_s and each load settings.timeout_s",
    ("actors/vllm_engine.py", "VllmEngine._build", "self.api.AsyncLLM.from_engine_args(..."): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine._label", "self.llm.update_weight_version(str(version))"): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine._generate_all", "asyncio.gather(..."):
        "timeout: its future is waited for by generate with a deadline (settings.timeout_s), then cancelled",
    ("actors/vllm_engine.py", "VllmEngine._one", "self._open.wait()"):
        "timeout: inside _generate_all, bounded by generate's deadline (settings.timeout_s)",
    ("actors/vllm_engine.py", "VllmEngine._one", "self.llm.generate(..."):
        "timeout: inside _generate_all, bounded by generate's deadline (settings.timeout_s)",
    ("actors/vllm_engine.py", "VllmEngine._paused", "self._idle.wait()"): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine._paused", "self.llm.pause_generation(mode=mode, clear_cache=True)"): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine._paused", "self.llm.resume_generation()"): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine.load_flat.load", "self.llm.collective_rpc(..."): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine.receive_nccl.native", "self.llm.start_weight_update()"): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine.receive_nccl.native", "self.llm.update_weights(..."): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine.receive_nccl.native", "self.llm.finish_weight_update(..."): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "VllmEngine.receive_nccl.extension", "self.llm.collective_rpc(..."): IN_LOOP_RUN,
    ("actors/vllm_engine.py", "CovrlWorkerExtension.covrl_init_nccl", "StatelessProcessGroup.create(..."):
        "timeout: StatelessProcessGroup.create's store_timeout default (300 s in the vLLM sources read)",
    ("actors/vllm_engine.py", "CovrlWorkerExtension.covrl_init_nccl", "PyNcclCommunicator(pg, device=self.device)"):
        "timeout: in a vLLM worker, reached by collective_rpc from join_nccl's _Loop.run(coro, timeout_s); past it "
        "the generator raises and exits, and its process group (the workers) goes with it (common/lifeline.py)",
    ("actors/vllm_engine.py", "CovrlWorkerExtension.covrl_receive_nccl", "self._covrl_nccl.broadcast(..."):
        "timeout: in a vLLM worker, reached by collective_rpc under _update's _Loop.run(..., settings.timeout_s); past "
        "it the generator exits with its workers",
    **{("actors/vllm_engine.py", "_self_check", call): "timeout: a GPU check tool (hardware/check.py) over the "
       "same VllmEngine calls, each bounded as above" for call in (
           "VllmEngine(...", "engine.receive_weights(ch, engine.lay, version, flags)",
           "engine.load_flat(received[0], version)", "engine.fingerprint()", "engine.generate(...")},
    ("actors/vllm_engine.py", "_self_check", "ch.receive_header(engine.lay)"):
        "timeout: the pair channel's gloo _timeout, 600 s (join_weights(..., 600) above)",
    # ---- common/ helpers ----
    ("common/weights.py", "WeightChannel._start", "self.pg.broadcast([t], opts)"):
        "timeout: ProcessGroupGloo _timeout (set in __init__), which an unset BroadcastOptions.timeout falls back to",
    **{("common/weights.py", func, call): "timeout: a gloo broadcast of this channel: its ProcessGroupGloo _timeout "
       "(set in __init__)" for func, call in (
           ("WeightChannel._bcast", "self._start(t).wait()"),
           ("WeightChannel.stop", "self.start_stop().wait()"))},
    ("common/transport.py", "*", "self.sock.recv_multipart(..."):
        "non-blocking: only after poll() reported a message (ZeroMQ delivers a multipart message whole)",
    ("common/transport.py", "GeneratorSocket.send", "self.sock.send_multipart(self._frames(msg))"):
        "timeout: SNDTIMEO 30 s, set in GeneratorSocket.__init__",
    ("common/rewards.py", "*", "with self._lock"):
        "local: serialises score_batch/close; a holder waits only for workers it kills after reward.timeout_s",
    ("common/vllm_weights.py", "offer_address", "store.get(ANNOUNCE_KEY)"):
        "non-blocking: follows store.wait([ANNOUNCE_KEY], timeout) for the same key",
    ("common/vllm_weights.py", "read_address", "store.get(ADDR_KEY)"):
        "non-blocking: follows store.wait([ADDR_KEY], timeout) for the same key",
    ("common/ipc_weights.py", "read_announcement", "store.get(ANNOUNCE_KEY)"):
        "non-blocking: follows store.wait([ANNOUNCE_KEY], timeout) for the same key",
    ("common/ipc_weights.py", "read_slots", "store.get(SLOTS_KEY)"):
        "non-blocking: follows store.wait([SLOTS_KEY], timeout) for the same key",
    ("common/ipc_weights.py", "wait_mapped", "store.get(MAPPED_KEY)"):
        "non-blocking: follows store.wait([MAPPED_KEY], timeout) for the same key",
    ("common/ipc_weights.py", "load_slot", "torch.cuda.synchronize(mapped.device)"):
        "local: this worker's own copy out of the slot (GPU work it enqueued itself; no other process is waited for)",
}


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    func: str
    text: str
    why: str  # what is missing

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.path, self.func, self.text)


def _name(node: ast.expr) -> tuple[str, str]:
    """(called name, receiver text) of a call's func: `a.b.c(...)` -> ("c", "a.b"); `f(...)` -> ("f", "")."""
    if isinstance(node, ast.Attribute):
        return node.attr, ast.unparse(node.value)
    if isinstance(node, ast.Name):
        return node.id, ""
    return "", ""


def _rule(name: str, receiver: str, called: bool = True) -> tuple[bool, int | None]:
    """(is this a waiting call, index of its positional timeout). `called` False: a bound method passed on as a
    callback (`self._try(ch.stop)`), where only explicit names count (`self.wait_s` is a value, not a wait)."""
    if name in BLOCKING:
        return True, BLOCKING[name]
    for scoped, pattern, pos in RECEIVER_SCOPED:
        if name == scoped and re.search(pattern, receiver, re.IGNORECASE):
            return True, pos
    if (name == "wait" or (called and name.startswith("wait_"))) and name not in NOT_WAITING:
        return True, 0
    return False, None


# Calls that only look at a function they are given, never call it.
INTROSPECTION = {"signature", "getsource", "hasattr", "getattr", "callable", "isinstance"}


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path, self.stack, self.funcs, self.sites = path, [], [], []
        self.loops: list[bool] = []  # enclosing while loops: `while True`?
        self.retrying: list[bool] = []  # enclosing try bodies whose timeout handler only continues
        self.awaited: set[int] = set()  # calls that are awaited or iterated with `async for`

    # -- scopes --
    def _scope(self, node, kind):
        self.stack.append(node.name if kind != "lambda" else "<lambda>")
        if kind in ("def", "lambda"):
            self.funcs.append(node)
        self.generic_visit(node)
        if kind in ("def", "lambda"):
            self.funcs.pop()
        self.stack.pop()

    def visit_ClassDef(self, node):
        self._scope(node, "class")

    def visit_FunctionDef(self, node):
        self._scope(node, "def")

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._scope(node, "lambda")

    @property
    def qualname(self) -> str:
        return ".".join(self.stack) or "<module>"

    # -- helpers --
    def _none_params(self) -> set[str]:
        """Parameters of the enclosing function whose default is None (a timeout taken from one may be None)."""
        if not self.funcs:
            return set()
        a = self.funcs[-1].args
        pos = [*a.posonlyargs, *a.args]
        pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
        return {p.arg for p, d in pairs if isinstance(d, ast.Constant) and d.value is None}

    def _assigns_attr(self, attr: str) -> bool:
        if not self.funcs:
            return False
        return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.ctx, ast.Store)
                   for n in ast.walk(self.funcs[-1]))

    def _timeout_ok(self, value: ast.expr) -> bool:
        if isinstance(value, ast.Constant) and value.value is None:
            return False
        return not (isinstance(value, ast.Name) and value.id in self._none_params())

    def _missing(self, call: ast.Call, name: str, pos: int | None) -> str | None:
        """Why this call has no deadline, or None if it passes one."""
        for kw in call.keywords:
            if kw.arg and "timeout" in kw.arg.lower():
                return None if self._timeout_ok(kw.value) else f"{kw.arg}= may be None"
            if kw.arg == "flags" and "NOBLOCK" in ast.unparse(kw.value):
                return None  # ZeroMQ: returns at once
        for call_name, attr in OPTION_TIMEOUTS:
            if name == call_name and self._assigns_attr(attr):
                return None
        if name == "wait" and call.args and isinstance(call.args[0], (ast.List, ast.Tuple, ast.ListComp)):
            pos = 1  # Store.wait(keys, timeout)
        if pos is not None and len(call.args) > pos:
            arg = call.args[pos]
            if not DURATIONISH.search(ast.unparse(arg)):
                return f"argument {pos} ({ast.unparse(arg)}) does not read as a timeout"
            return None if self._timeout_ok(arg) else f"timeout {ast.unparse(arg)} may be None"
        return "no timeout"

    def _site(self, node, text: str, why: str) -> None:
        self.sites.append(Site(self.path, node.lineno, self.qualname, text[:120], why))

    # -- loops that turn a timed wait back into an endless one --
    def visit_While(self, node: ast.While):
        forever = isinstance(node.test, ast.Constant) and node.test.value is True
        self.loops.append(forever)
        self.generic_visit(node)
        self.loops.pop()

    def visit_Try(self, node: ast.Try):
        retries = any(re.search(r"Timeout", ast.unparse(h.type or ast.Constant(None)))
                      and all(isinstance(b, (ast.Continue, ast.Pass)) for b in h.body) for h in node.handlers)
        self.retrying.append(retries and bool(self.loops) and self.loops[-1])
        for child in node.body:
            self.visit(child)
        self.retrying.pop()
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    # -- what waits --
    def visit_Await(self, node: ast.Await):
        self.awaited.add(id(node.value))
        self.generic_visit(node)

    def visit_AsyncFor(self, node: ast.AsyncFor):
        self.awaited.add(id(node.iter))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        name, receiver = _name(node.func)
        waits, pos = _rule(name, receiver)
        if name in AWAITED_ONLY and id(node) not in self.awaited:
            waits = False
        if waits:
            why = self._missing(node, name, pos)
            if why is None and self.retrying and self.retrying[-1]:
                why = "its timeout is caught and retried in a `while True` loop: no deadline overall"
            if why is not None:
                self._site(node, ast.unparse(node), why)
        for arg in [*node.args, *(kw.value for kw in node.keywords)]:  # a waiting method passed as a callback
            if name not in INTROSPECTION and isinstance(arg, ast.Attribute) and _rule(*_name(arg), called=False)[0]:
                self._site(arg, f"{ast.unparse(arg)} (called back)", "a callback cannot be given a timeout here")
        self.generic_visit(node)

    def _with_locks(self, node):
        for item in getattr(node, "items", ()):
            expr = item.context_expr
            if not isinstance(expr, ast.Call) and LOCKISH.search(ast.unparse(expr)):
                self._site(node, f"with {ast.unparse(expr)}", "a lock cannot take a timeout")
        self.generic_visit(node)

    visit_With = visit_AsyncWith = _with_locks


def scan_source(path: str, source: str) -> list[Site]:
    """Every waiting call of one file that passes no timeout (allowed or not)."""
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.sites


def sources() -> list[tuple[str, str]]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")) + [ROOT / h for h in HELPERS]
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in files]


def _matches(key: tuple[str, str, str], site: Site) -> bool:
    """An ALLOWED key covers a site: same file; same function, or "*"; same text, or a prefix ending in "..."."""
    path, func, text = key
    return (path == site.path and func in ("*", site.func)
            and (site.text == text or (text.endswith("...") and site.text.startswith(text[:-3]))))


def _allowed(site: Site) -> bool:
    return any(_matches(key, site) for key in ALLOWED)


def violations(files) -> list[Site]:
    return [s for path, src in files for s in scan_source(path, src) if not _allowed(s)]


# ---- the rule ----------------------------------------------------------------------------------------------


def test_every_wait_on_another_process_has_a_deadline():
    bad = violations(sources())
    assert not bad, "waits without a deadline (pass a timeout, or ALLOW it with where its deadline comes from):\n" + \
        "\n".join(f"  {s.path}:{s.line} in {s.func}: {s.text}  [{s.why}]" for s in bad)


def test_a_new_process_group_is_never_excused():
    """Every group our code makes passes its deadline: `new_group` and its kin cannot be ALLOWED (a group made without
    one waits its backend's default, 30 min on gloo, whatever transport.learner_timeout_s says)."""
    makers = ("new_group", "new_subgroups", "split_group")
    assert not [key for key in ALLOWED if any(m in key[2] for m in makers)]
    src = "import torch.distributed as dist\ndef f(ranks, timeout_s):\n    dist.new_group(ranks)\n" \
          "    dist.new_group(ranks, timeout=timeout_s)\n    dist.new_subgroups(2)\n"
    flagged = [s.text for s in scan_source("learner/synthetic.py", src)]
    assert flagged == ["dist.new_group(ranks)", "dist.new_subgroups(2)"]


def _calls(func: ast.AST) -> list[tuple[int, str]]:
    """(line, call text) of every call in a function, in source order."""
    return sorted((n.lineno, ast.unparse(n)) for n in ast.walk(func) if isinstance(n, ast.Call))


def _function(path: str, qualname: str) -> ast.AST:
    """The definition of `qualname` ("f" or "Class.f") in one file."""
    node = ast.parse((ROOT / path).read_text())
    for part in qualname.split("."):
        node = next((c for c in node.body if isinstance(c, (ast.FunctionDef, ast.ClassDef)) and c.name == part), None)
        assert node is not None, f"{path} has no {qualname}: update this test with where it went"
    return node


def test_every_learner_process_group_is_bounded():
    """PG above holds for DeepSpeed's groups only because the learner bounds them: init_distributed makes groups made
    later default to the deadline, and Trainer.__init__ sets it on every group once the engine has made its own."""
    init_fn = _function("learner/trainer.py", "init_distributed")
    init = [text for _, text in _calls(init_fn)]
    sets = {ast.unparse(t) for n in ast.walk(init_fn) if isinstance(n, ast.Assign) for t in n.targets}
    assert {"c10d.default_pg_timeout", "c10d.default_pg_nccl_timeout"} <= sets, "init_distributed sets torch's defaults"
    assert any(t.startswith("deepspeed.init_distributed(") and "timeout=" in t for t in init)
    calls = _calls(_function("learner/trainer.py", "Trainer.__init__"))
    built = [line for line, text in calls if text.startswith("deepspeed.initialize(")]
    bounded = [line for line, text in calls if text == "bound_every_group(cfg.transport.learner_timeout_s)"]
    assert built and bounded and min(bounded) > max(built), \
        "Trainer.__init__ calls bound_every_group(cfg.transport.learner_timeout_s) after deepspeed.initialize"


def test_allowlist_is_honest_and_current():
    for key, reason in ALLOWED.items():
        assert reason.startswith(REASON_KINDS), f"{key}: a reason names where the deadline comes from ({REASON_KINDS})"
        assert "no deadline" not in reason.lower(), f"{key}: a call with no deadline is a finding, not an exception"
    sites = [s for path, src in sources() for s in scan_source(path, src)]
    stale = sorted(key for key in ALLOWED if not any(_matches(key, s) for s in sites))
    assert not stale, f"ALLOWED entries that match no call any more (remove them): {stale}"


# ---- the scanner itself ------------------------------------------------------------------------------------

SYNTHETIC = '''
import torch.distributed as dist

class Channel:
    def resend(self, t):
        opts = dist.BroadcastOptions()
        self.pg.broadcast([t], opts).wait()

    def fine(self, t, ev, fut, store, sock, timeout_s):
        ev.wait(5)
        fut.result(timeout=3)
        store.wait(["k"], timeout_s)
        sock.recv(timeout_s)
        opts = dist.BroadcastOptions()
        opts.timeout = timeout_s
        self.pg.broadcast([t], opts)

    def not_fine(self, fut, store, loop, coro, sock, nbytes, ch, timeout_s=None):
        store.wait(["k"])
        store.get("k")
        fut.result()
        fut.result(timeout_s)
        loop.run(coro)
        sock.recv(nbytes)
        with self.lock:
            pass
        while True:
            try:
                fut.result(timeout=0.02)
                break
            except TimeoutError:
                continue
        self._try(ch.stop)

    def runs(self, timeout_s):
        coro = self.llm.collective_rpc("x")
        self._loop.run(coro, timeout_s)
        self._loop.run(self.llm.collective_rpc("y"))

    async def engine(self):
        await self.llm.pause_generation(mode="wait")
        async for out in self.llm.generate({}, None, "r"):
            pass
        await self._open.wait()
'''


def _flagged(func: str) -> list[str]:
    return [s.text for s in scan_source("actors/synthetic.py", SYNTHETIC) if s.func == f"Channel.{func}"]


def test_scanner_flags_an_untimed_gloo_broadcast_in_a_new_function():
    flagged = _flagged("resend")
    assert "self.pg.broadcast([t], opts).wait()" in flagged  # the Work.wait()
    assert "self.pg.broadcast([t], opts)" in flagged  # the collective, whose options carry no timeout
    assert violations([("actors/synthetic.py", SYNTHETIC)])  # and nothing in ALLOWED excuses it


def test_scanner_accepts_calls_that_pass_a_timeout():
    assert _flagged("fine") == []


def test_scanner_flags_every_untimed_form():
    assert _flagged("not_fine") == ['store.wait([\'k\'])', "store.get('k')", "fut.result()", "fut.result(timeout_s)",
                                    "loop.run(coro)", "sock.recv(nbytes)", "with self.lock",
                                    "fut.result(timeout=0.02)", "ch.stop (called back)"]
    assert _flagged("runs") == ["self._loop.run(self.llm.collective_rpc('y'))"]
    assert _flagged("engine") == ["self.llm.pause_generation(mode='wait')", "self.llm.generate({}, None, 'r')",
                                  "self._open.wait()"]


@pytest.mark.parametrize("path", [*PACKAGES, *HELPERS])
def test_every_scanned_path_exists(path):
    assert (ROOT / path).exists(), f"{path} moved: update PACKAGES / HELPERS so the rule keeps covering it"
