"""The generation stage's worker (hardware/proof.py `generation`): covrl's generator loop beside bare vLLM, on one
engine, and one weight publish per transport.

    python -m hardware.gen_bench SPEC_JSON   (from the repository root; hardware/proof.py writes SPEC)

What it measures, on one random-init model (hardware/proof_workers.py `build-model`), tokens generated per second of:
- `bare`: vLLM's AsyncLLM alone, every group submitted at once (one request per group, n samples): the bound. Its
  parameters are the fewest that impose the workload: n, temperature 1, top-p 1, the length, detokenize off,
  FINAL_ONLY; no logprobs, seeds or stop ids.
- `bare-covrl-params`: the same with covrl's exact parameters (`actors.vllm_engine.sampling_kwargs`: logprobs=0 of
  the processed distribution, per-request seeds, stop ids, flat logprobs, detokenize off, FINAL_ONLY), so what
  returning logprobs costs vLLM is not charged to covrl's loop (../shared/notes/gpu-speed.md section 5). The goal's
  reference.
- `engine`: covrl's engine driven as `ActorLoop` drives it (`submit` every group, `collect` until none is in
  flight), without the hub, the room or scoring: what covrl's engine layer costs by itself.
- `loop`: covrl's whole generator, `actors.actor.run_actor` (handshake, weight thread, heartbeat, the streaming
  `ActorLoop` that keeps the engine full within its room, the scorer thread with a real reward pool), against a
  real `broker.hub.Hub` and `learner.publisher.WeightPublisher` in this process on loopback (no version is published:
  work of version 0 needs none). Timed from the hub's first Work to the last group at the hub (its start-up, the
  handshake and the reward pool's processes, is recorded apart). Not included: the learner's side (the hub hands
  the batch to no trainer) and weight updates during generation.
Each on two workloads of the same prompts (the arithmetic task's, in the order the hub issues them, with the hub's
seeds): `heavy` (lognormal response lengths, the longest several times the mean) and `fixed` (every response the same
length). vLLM cannot draw a length per sample, so on vLLM each group's length is drawn from the lognormal with its
seed (`actors.engine.forced_lengths`) and imposed as max_tokens = min_tokens (min_tokens holds back the stop ids);
covrl's engine gets the same through the `api` it is built with (`ImposedLengths`), so it builds its requests as
always. The torch engine imposes one length per sample itself (`rollout.forced_length_median`).

Every variant shares one engine, `eager` (vLLM with enforce_eager, or the torch engine), then the same on a second
engine built last, `graphs` (vLLM with CUDA graphs; their capture costs 10-60 s): one AsyncLLM for every variant of
an engine (same KV cache, same compile state), its prefix cache reset before each run. After the eager runs, before
the second engine is built (a failed CUDA-graph build must not cost the publish), one or more publishes of the
model's weights per transport: `rpc` (the gloo weight channel into this process, then `load_flat`: collective_rpc
into vLLM's workers), `ipc` where this checkout's config and vLLM engine accept it (else recorded as not built) and
`nccl` (recorded as not run: it needs the learner and the generator on two GPUs), each timed by phase as far as the
public APIs allow: the learner's bucket assembly (a dry pass of `learner.params.param_buckets`), the whole publish as
the learner sees it (`ModelPublisher.publish`: assembly, the pinned host copy, the sends), the generator's receive
(header to the last bucket) and its load, and the end to end time. Both ends run in this one process here (two in a
run), so they share one GIL; the hub of the loop variant too (in a run it is in learner rank 0's process).

Each built engine's event carries `kv_cache`: the KV cache vLLM allocated, in tokens (the engine core's num_gpu_blocks x
block_size, as the AsyncLLM's VllmConfig holds them after start-up), beside common/memplan.py's prediction for the
same config and GPU memory (`kv_plan`: its "vLLM KV cache" term over `kv_bytes_per_token`); on the torch engine the
plan only.

Each result is one line, `RESULT_TAG` + JSON with an "event" (plan, engine, warmup, run, publish, done), printed as it
happens, so hardware/proof.py keeps what finished when a deadline or a crash ends this process. `deadline_unix`:
no run, engine build or publish starts that would not fit before it (estimated from the runs before); they are
recorded as not run. With `engine = "torch"` (the CPU rehearsal), the StreamingTorchEngine stands in for vLLM: the
bare variants and the CUDA-graph engine are recorded as skipped, with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.actor import run_actor
from actors.continuous import StreamingTorchEngine
from actors.engine import forced_lengths, row_seeds
from actors.vllm_engine import TRANSPORTS as VLLM_TRANSPORTS
from actors.vllm_engine import VllmEngine, VllmSettings, request_seed, sampling_kwargs, vllm_api
from broker.hub import Hub
from common import messages, vllm_weights, weights
from common.config import ConfigError, load_config
from common.data import PromptSource
from common.seeds import prompt_seed
from common.transport import free_port
from learner.params import param_buckets
from learner.publisher import ModelPublisher, WeightPublisher

RESULT_TAG = "GPU_PROOF_RESULT "  # the tag hardware/proof.py reads
HOST = "127.0.0.1"
KEY = b"g" * 32
RUN_ID = "gen-bench"
# In the order they run on each engine and workload: the goal's reference and the loop first, so a deadline cuts
# the diagnostics.
VARIANTS = {
    "bare-covrl-params": "vLLM's AsyncLLM alone, every group submitted at once, with covrl's sampling parameters "
                         "(actors.vllm_engine.sampling_kwargs: logprobs=0 of the processed distribution, seeds, stop "
                         "ids, flat logprobs, detokenize off, FINAL_ONLY) and the imposed length",
    "loop": "covrl's generator: run_actor (handshake, weight thread, heartbeat, the streaming ActorLoop within its "
            "room, the scorer thread with a real reward pool) against a real Hub and WeightPublisher in this process; "
            "timed from the hub's first Work to the last group at the hub; no trainer, no weight update",
    "bare": "vLLM's AsyncLLM alone, every group submitted at once, the fewest parameters: n, temperature 1, top-p 1, "
            "the imposed length, detokenize off, FINAL_ONLY (no logprobs, seeds or stop ids): the bound",
    "engine": "covrl's engine as ActorLoop drives it (submit every group, collect until none is in flight), without "
              "the hub, the room or scoring",
}
VLLM_ONLY = ("bare-covrl-params", "bare")
ENGINES = ("eager", "graphs")
TRANSPORTS = ("rpc", "ipc", "nccl")
# The KV plan's GPU memory where there is no GPU (the CPU rehearsal): an H100's, so the plan's arithmetic runs.
NOMINAL_GPU_BYTES = 80 * 2**30


def emit(obj: dict) -> None:
    """One result line in one write: vLLM's engine core writes to the same pipe, and two writes (print's text,
    then its newline) could have its output land between them."""
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Workload:
    """`groups` prompts x `group_size` samples; response lengths lognormal(median, sigma) capped at max_new_tokens
    (sigma 0: every response `median` tokens)."""

    name: str
    groups: int
    group_size: int
    median: int
    sigma: float
    max_new_tokens: int

    def settings(self, torch_lengths: bool) -> list[str]:
        """The run config of the loop variant's hub (and of the prompts every variant uses): exactly `groups` groups
        at version 0 (one step of them, on-policy), no evaluation, no group dropped for its rewards, the streaming
        loop."""
        out = [f"data.train_size={min(4096, max(256, 8 * self.groups))}", f"rollout.groups_per_step={self.groups}",
               f"rollout.group_size={self.group_size}", f"rollout.max_new_tokens={self.max_new_tokens}",
               "rollout.max_staleness_steps=0", "rollout.temperature=1.0", "rollout.top_p=1.0", "run.steps=1",
               "eval.every_steps=0", "learner.filter.dynamic_sampling=false",
               # The streaming loop, named (on a CPU rehearsal "auto" would take the batch loop; no update happens
               # here, so run.deterministic changes nothing else).
               "run.deterministic=false", 'generator.loop="stream"']
        if torch_lengths:  # the torch engine draws each sample's length itself; vLLM gets them from ImposedLengths
            out += [f"rollout.forced_length_median={self.median}", f"rollout.forced_length_sigma={self.sigma}"]
        return out

    def sampling(self, torch_lengths: bool):
        return messages.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=self.max_new_tokens,
                                       forced_length_median=self.median if torch_lengths else 0,
                                       forced_length_sigma=self.sigma if torch_lengths else 0.0)


@dataclass(frozen=True)
class Groups:
    """A workload's prompts and seeds, as the hub issues them (epoch 0, in its order), and the length each gets:
    one per group on vLLM, one per sample on the torch engine."""

    prompts: list[list[int]]
    seeds: list[int]
    lengths: list[int]


def workload_groups(wl: Workload, tok, per_sample: bool) -> Groups:
    cfg = load_config(None, wl.settings(per_sample))
    src = PromptSource(cfg, tok)
    if len(src) < wl.groups:
        raise ValueError(f"workload {wl.name}: {wl.groups} groups but the task has {len(src)} prompts; the hub would "
                         f"go on to a second epoch (other seeds): lower the groups")
    ids = src.order(0)[: wl.groups]
    seeds = [prompt_seed(cfg.run.seed, 0, i) for i in ids]
    rows = row_seeds(seeds, wl.group_size) if per_sample else torch.tensor(seeds, dtype=torch.int64)
    return Groups([list(map(int, src[i].ids)) for i in ids], seeds,
                  forced_lengths(rows, wl.median, wl.sigma, wl.max_new_tokens).tolist())


def length_figures(lengths: list[int]) -> dict:
    mean = sum(lengths) / max(len(lengths), 1)
    return {"tokens": sum(lengths), "samples": len(lengths), "length_mean": round(mean, 2),
            "length_max": max(lengths, default=0), "length_min": min(lengths, default=0),
            "longest_over_mean": round(max(lengths, default=0) / mean, 2) if mean else None}


def measured(lengths: list[int], seconds: float, **extra) -> dict:
    out = {"status": "measured", "seconds": round(seconds, 3), **length_figures(lengths), **extra}
    out["tokens_per_s"] = round(out["tokens"] / seconds, 1) if seconds > 0 else None
    return out


class ImposedLengths:
    """vLLM's SamplingParams with each request's length imposed: max_tokens = min_tokens = the length drawn for its
    group (min_tokens holds back the stop ids until then), looked up by the request's seed (`request_seed` of the
    group's seed). Given to VllmEngine as its `api.SamplingParams`, so covrl's engine builds every request as it
    always does and only the length changes; `make` is vLLM's own class (the bare variants build with it)."""

    def __init__(self, make):
        self.make = make
        self.by_seed: dict[int, int] | None = None  # None: no length imposed (nothing in this stage runs so)

    def set(self, groups: Groups) -> None:
        self.by_seed = {request_seed(s): n for s, n in zip(groups.seeds, groups.lengths)}

    def __call__(self, **kw):
        if self.by_seed is not None:
            length = self.by_seed.get(kw.get("seed"))
            if length is None:
                raise ValueError(f"a request with seed {kw.get('seed')} is none of this workload's groups: the hub "
                                 f"issued other prompts than the workload drew its lengths for (or requests carry "
                                 f"no seed: generator.seed_requests must stay on here)")
            kw.update(max_tokens=length, min_tokens=length)
        return self.make(**kw)


class BenchEngine(VllmEngine):
    """covrl's vLLM engine, with what the bare variants need beside it: coroutines on the event loop its AsyncLLM
    was built on (an AsyncLLM serves the loop it started on), and a prefix-cache reset between runs (every variant
    sends the same prompts)."""

    def run_coro(self, coro, timeout_s: float):
        return self._loop.run(coro, max(1.0, timeout_s))

    def reset_prefix_cache(self, timeout_s: float = 60) -> bool:
        return bool(self.run_coro(self.llm.reset_prefix_cache(), timeout_s))


class PublisherHooks:
    """The hub's generator hooks wired to the weight publisher, as learner rank 0 wires them."""

    def __init__(self, pub):
        self.pub = pub

    def join(self, gen_id: int, incarnation: str) -> None:
        self.pub.join(gen_id, incarnation)

    def leave(self, gen_id: int, incarnation: str) -> None:
        self.pub.leave(gen_id, incarnation)

    def lost(self, gen_id: int, incarnation: str, pid: int, why: str, detail: str) -> None:
        self.pub.drop(gen_id, incarnation)


class Generator(threading.Thread):
    """`run_actor` on a thread of this process, as generator 0 of the bench's hub; its exit code or error kept."""

    def __init__(self, cfg, engine, tok, hub_addr: str):
        super().__init__(name="bench-generator", daemon=True)
        self.cfg, self.engine, self.tok, self.hub_addr = cfg, engine, tok, hub_addr
        self.code: int | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.code = run_actor(self.cfg, engine=self.engine, tokenizer=self.tok, hub_addr=self.hub_addr, key=KEY,
                                  run_id=RUN_ID, gen_id=0, run_dir=None)
        except BaseException as e:  # kept for the run's error; the traceback goes to the log
            traceback.print_exc()
            self.error = f"{type(e).__name__}: {e}"[:500]

    def why(self) -> str:
        if self.is_alive():
            return "the generator is still running: the stage's time ran out"
        return f"the generator exited ({self.error or f'exit code {self.code}'})"


def _nothing() -> None:
    """`before_forward` of the runs without weight updates."""


class Bench:
    """One worker's state: the spec, its deadline, the workloads, and how long runs took (the next one's estimate)."""

    def __init__(self, spec: dict):
        self.spec, self.deadline = spec, spec["deadline_unix"]
        self.vllm = spec["engine"] == "vllm"
        self.tok = AutoTokenizer.from_pretrained(spec["model"])
        with open(os.path.join(spec["model"], "config.json")) as f:
            self.vocab = json.load(f)["vocab_size"]
        n = spec["group_size"]
        self.workloads = [Workload(name, group_size=n, **w) for name, w in spec["workloads"].items()]
        self.warmup = Workload("warmup", group_size=n, **spec["warmup"])
        self.groups = {wl.name: workload_groups(wl, self.tok, not self.vllm) for wl in [*self.workloads, self.warmup]}
        self.took: dict[tuple[str, str], float] = {}  # (engine, workload) -> the longest run's seconds
        self.ids = itertools.count()

    def left(self) -> float:
        return self.deadline - time.time()

    def plan(self) -> None:
        workloads = {}
        for wl in self.workloads:
            g = self.groups[wl.name]
            workloads[wl.name] = {"groups": wl.groups, "group_size": wl.group_size, "median": wl.median,
                                  "sigma": wl.sigma, "max_new_tokens": wl.max_new_tokens,
                                  "lengths_per": "sample" if not self.vllm else "group",
                                  "prompt_tokens_mean": round(sum(map(len, g.prompts)) / len(g.prompts), 1),
                                  "drawn": length_figures(g.lengths if not self.vllm else
                                                          [x for x in g.lengths for _ in range(wl.group_size)])}
        emit({"event": "plan", "variants": VARIANTS, "order": list(VARIANTS), "workloads": workloads,
              "engines": list(ENGINES), "transports": list(TRANSPORTS)})

    def run(self) -> int:
        self.plan()
        for name in ENGINES:
            engine = self.build(name)
            if engine is not None:
                self.engine_pass(name, engine)
            elif name == "eager":
                self.no_publish("no engine to publish to: the eager engine was not built")
        emit({"event": "done"})
        return 0

    # ---- engines ----

    def build(self, name: str):
        """The engine `name`, built (its event says how long it took), or None (an event says why)."""
        head = {"event": "engine", "engine": name}
        if name == "graphs" and not self.vllm:
            emit({**head, "status": "skipped", "reason": "CUDA graphs are vLLM's, on a GPU; the torch engine runs "
                                                         "eagerly (CPU rehearsal)"})
            return None
        need = self.spec["build_estimate_s"][name] + self.estimate(name, self.workloads[0].name)
        if self.left() < need:
            emit({**head, "status": "not_run", "reason": f"the stage's time was spent ({self.left():.0f}s left, "
                                                         f"the engine and one run need about {need:.0f}s)"})
            return None
        t0 = time.perf_counter()
        try:
            engine, what = self.make_vllm(name == "eager") if self.vllm else self.make_torch()
        except Exception as e:  # noqa: BLE001 - recorded: the proof's check says the build failed, and why
            traceback.print_exc()
            emit({**head, "status": "error", "error": f"{type(e).__name__}: {e}"[:800]})
            return None
        build_s = round(time.perf_counter() - t0, 1)
        emit({**head, "status": "built", "build_s": build_s, "what": what, "enforce_eager": name == "eager",
              "kv_cache": self.kv_cache(engine, eager=name == "eager")})
        return engine

    def kv_cache(self, engine, eager: bool) -> dict:
        """The engine's KV cache in tokens (vLLM's num_gpu_blocks x block_size) beside common/memplan.py's prediction
        for the same config and GPU memory; never raises (what could not be read says why)."""
        out = {"plan": kv_plan(self.spec, eager, self.max_prompt_tokens(), self.max_new_tokens())}
        if not self.vllm:
            out["measured"] = {"kv_tokens": None, "reason": "CPU rehearsal: the torch engine stands in for vLLM, and "
                                                            "its cache is max_num_seqs rows, not vLLM's KV blocks"}
        else:
            out["measured"] = vllm_kv_blocks(engine.llm)
        return out

    def max_prompt_tokens(self) -> int:
        return max(len(p) for g in self.groups.values() for p in g.prompts)

    def max_new_tokens(self) -> int:
        return max(wl.max_new_tokens for wl in [*self.workloads, self.warmup])

    def make_vllm(self, eager: bool):
        api = vllm_api()
        api.SamplingParams = ImposedLengths(api.SamplingParams)
        cap, prompt = self.max_new_tokens(), self.max_prompt_tokens()
        settings = VllmSettings(dtype=self.spec["dtype"], gpu_memory_utilization=self.spec["gpu_memory_utilization"],
                                max_num_seqs=self.spec["max_num_seqs"], max_model_len=prompt + cap + 16,
                                enforce_eager=eager, seed_requests=True, timeout_s=max(60.0, self.left()))
        engine = BenchEngine(self.spec["model"], stop_ids=[self.vocab - 1], settings=settings, api=api)
        return engine, (f"vLLM {api.version} AsyncLLM (covrl's VllmEngine), {settings.dtype}, max_num_seqs "
                        f"{settings.max_num_seqs}, gpu_memory_utilization {settings.gpu_memory_utilization}, "
                        f"{'eager' if eager else 'CUDA graphs'}")

    def make_torch(self):
        engine = StreamingTorchEngine(self.spec["model"], eos_token_id=[self.vocab - 1], pad_token_id=0,
                                      dtype=getattr(torch, self.spec["dtype"]), device=self.spec["device"],
                                      max_num_seqs=self.spec["max_num_seqs"])
        return engine, (f"StreamingTorchEngine (covrl's torch engine, continuous batch of {engine.max_num_seqs} rows) "
                        f"on {engine.device}, {self.spec['dtype']}: the CPU rehearsal's stand-in for vLLM")

    def engine_pass(self, name: str, engine) -> None:
        """Warm-up, every workload's variants, and (after the eager runs) the publishes; the engine closed after."""
        try:
            self.warm_up(name, engine)
            for wl in self.workloads:
                for variant in VARIANTS:
                    self.one(name, engine, wl, variant)
            if name == "eager":
                self.publish_all(engine)
        finally:
            if self.vllm:
                engine.close()

    def warm_up(self, name: str, engine) -> None:
        """One small run of each variant that drives the engine alone (first requests compile sampling kernels)."""
        t0, error = time.perf_counter(), None
        try:
            for variant in (*(VLLM_ONLY if self.vllm else ()), "engine"):
                self.variant(variant, engine, self.warmup)
        except Exception as e:  # noqa: BLE001 - recorded; the runs after it say what fails
            traceback.print_exc()
            error = f"{type(e).__name__}: {e}"[:800]
        emit({"event": "warmup", "engine": name, "seconds": round(time.perf_counter() - t0, 2), "error": error})

    # ---- runs ----

    def estimate(self, engine: str, workload: str) -> float:
        """Seconds the next run of `workload` on `engine` is expected to take, with a margin: its longest on this
        engine so far, else on the other engine, else the spec's first guess."""
        mine = self.took.get((engine, workload))
        other = max((s for (e, w), s in self.took.items() if w == workload), default=None)
        seen = mine if mine is not None else other
        return self.spec["first_run_s"] if seen is None else 1.3 * seen + 5

    def one(self, name: str, engine, wl: Workload, variant: str) -> None:
        head = {"event": "run", "engine": name, "workload": wl.name, "variant": variant}
        if variant in VLLM_ONLY and not self.vllm:
            emit({**head, "status": "skipped", "reason": "bare AsyncLLM: vLLM needs a GPU (CPU rehearsal: the "
                                                         "torch engine stands in for covrl's engine, and has no "
                                                         "bare counterpart)"})
            return
        need = self.estimate(name, wl.name)
        if self.left() < need:
            emit({**head, "status": "not_run", "reason": f"the stage's time was spent ({self.left():.0f}s left, the "
                                                         f"run needs about {need:.0f}s)"})
            return
        t0 = time.perf_counter()
        try:
            emit({**head, **self.variant(variant, engine, wl)})
        except Exception as e:  # noqa: BLE001 - recorded as this run's error; the proof's check fails on it
            traceback.print_exc()
            emit({**head, "status": "error", "error": f"{type(e).__name__}: {e}"[:800]})
        took = time.perf_counter() - t0
        self.took[(name, wl.name)] = max(took, self.took.get((name, wl.name), 0.0))

    def variant(self, variant: str, engine, wl: Workload) -> dict:
        g = self.groups[wl.name]
        if self.vllm:
            engine.api.SamplingParams.set(g)
            engine.reset_prefix_cache()
        if variant == "loop":
            return self.loop(engine, wl)
        if variant == "engine":
            return self.driver(engine, wl, g)
        return self.bare(engine, wl, g, covrl=variant == "bare-covrl-params")

    def bare_params(self, engine, wl: Workload, seed: int, length: int, covrl: bool):
        api = engine.api
        if covrl:  # exactly what VllmEngine.submit builds (ImposedLengths sets the length)
            return api.SamplingParams(**sampling_kwargs(wl.group_size, wl.sampling(False), seed, engine.stop_ids,
                                                        engine.settings.seed_requests), output_kind=api.FINAL_ONLY)
        return api.SamplingParams.make(n=wl.group_size, temperature=1.0, top_p=1.0, max_tokens=length,
                                       min_tokens=length, detokenize=False, output_kind=api.FINAL_ONLY)

    def bare(self, engine, wl: Workload, g: Groups, covrl: bool) -> dict:
        """Every group at once into the AsyncLLM, on its own loop; done when the last request is final."""
        params = [self.bare_params(engine, wl, s, n, covrl) for s, n in zip(g.seeds, g.lengths)]
        tag = next(self.ids)

        async def one(i: int, prompt: list[int], sp):
            final = None
            async for out in engine.llm.generate({"prompt_token_ids": prompt}, sp, f"bench{tag}-{i}"):
                final = out
            return final

        async def every():
            return await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(zip(g.prompts, params))))

        t0 = time.perf_counter()
        finals = engine.run_coro(every(), self.left())
        seconds = time.perf_counter() - t0
        return measured([len(c.token_ids) for f in finals for c in f.outputs], seconds,
                        logprobs_returned=all(c.logprobs is not None for f in finals for c in f.outputs))

    def driver(self, engine, wl: Workload, g: Groups) -> dict:
        """covrl's engine as ActorLoop drives it: submit every group, collect until none is in flight."""
        sp = wl.sampling(torch_lengths=not self.vllm)
        got: dict = {}
        t0 = time.perf_counter()
        for i, (prompt, seed) in enumerate(zip(g.prompts, g.seeds)):
            engine.submit(i, prompt, wl.group_size, sp, seed)
        while engine.in_flight:
            if self.left() <= 0:
                raise TimeoutError(f"{engine.in_flight} groups still in flight at the stage's deadline")
            got.update(engine.collect(0.05, _nothing))
        seconds = time.perf_counter() - t0
        return measured([len(c.token_ids) for comps in got.values() for c in comps], seconds)

    def loop(self, engine, wl: Workload) -> dict:
        """run_actor against a real hub: timed from the hub's first Work to the last group at the hub."""
        cfg = load_config(None, wl.settings(torch_lengths=not self.vllm))
        pub = WeightPublisher(HOST, free_port(), 60)
        hub = Hub(cfg, run_id=RUN_ID, key=KEY, host=HOST, port=0, source=PromptSource(cfg, self.tok),
                  weight_addr=f"{HOST}:{pub.port}", generators=lambda: 1, hooks=PublisherHooks(pub))
        gen = Generator(cfg, engine, self.tok, hub.sock.address)
        hub.start()
        t_start = time.perf_counter()
        gen.start()
        try:
            t_first = self.first_work(hub, gen)
            batch = self.batch(hub, gen)
            t_done = time.perf_counter()
            counters = hub.stats().counters
        finally:
            hub.stop()
            pub.stop()
            gen.join(60)
        lengths = [messages.n_tokens(s.token_ids) for sg in batch for s in sg.group.samples]
        return measured(lengths, t_done - t_first, startup_s=round(t_first - t_start, 3),
                        wall_s=round(t_done - t_start, 3), groups_back=len(batch),
                        rejected={k: v for k, v in counters.items() if k.startswith("hub/rejected/")},
                        exit_code=gen.code, recv_timeout_s=cfg.transport.recv_timeout_s)

    def first_work(self, hub, gen: "Generator") -> float:
        """When the hub issued its first slot (`Hub.slots`, an int read without the lock: it only grows)."""
        while hub.slots == 0:
            if not gen.is_alive() or self.left() <= 0:
                raise RuntimeError(f"the generator never got work: {gen.why()}")
            time.sleep(0.001)
        return time.perf_counter()

    def batch(self, hub, gen: "Generator") -> list:
        """The hub's batch of every group, waited for in short slices so a generator that died ends the wait."""
        while True:
            try:
                return hub.take_batch(0, timeout_s=max(1.0, min(5.0, self.left())))
            except TimeoutError:
                if not gen.is_alive() or self.left() <= 0:
                    raise RuntimeError(f"not every group came back: {gen.why()}") from None

    # ---- publishes ----

    def no_publish(self, why: str) -> None:
        for transport in TRANSPORTS:
            emit({"event": "publish", "transport": transport, "status": "not_run", "reason": why})

    def unavailable(self, transport: str) -> dict | None:
        """Why `transport` is not measured here ({status, reason}), or None."""
        if transport == "nccl":
            return {"status": "not_run", "reason": "NCCL weight transfer needs the learner and the generator on two "
                                                   "GPUs; this stage has one"}
        if transport == "ipc":
            why = ipc_missing()
            if why:
                return {"status": "not_built", "reason": why}
            if not self.vllm:
                return {"status": "not_run", "reason": "ipc maps the learner's GPU memory into vLLM's workers: no "
                                                       "torch-engine counterpart (CPU rehearsal)"}
        return None

    def publish_all(self, engine) -> None:
        for transport in TRANSPORTS:
            head = {"event": "publish", "transport": transport}
            if (why := self.unavailable(transport)) is not None:
                emit({**head, **why})
                continue
            if self.left() < self.spec["publish_estimate_s"]:
                emit({**head, "status": "not_run", "reason": f"the stage's time was spent ({self.left():.0f}s left)"})
                continue
            try:
                emit({**head, "status": "measured", **self.publish(engine, transport)})
            except Exception as e:  # noqa: BLE001 - recorded as this transport's error; the proof's check fails on it
                traceback.print_exc()
                emit({**head, "status": "error", "error": f"{type(e).__name__}: {e}"[:800]})

    def publish(self, engine, transport: str) -> dict:
        """`spec["publishes"]` versions of the learner's model (the stage's weights plus noise) to `engine` over
        `transport`, each timed by phase; the checksums of both ends and the loaded weights' fingerprint compared."""
        model = learner_model(self.spec, seed=1 + TRANSPORTS.index(transport))  # each transport other weights
        port, inc = free_port(), f"bench-{transport}"
        pub = WeightPublisher(HOST, port, 120, device=self.spec["device"])
        mp = ModelPublisher(model, zero3=False, channel=pub)
        old = self.use_transport(engine, transport)
        rx = PublishReceiver(engine, f"{HOST}:{port}", weights.pair_prefix(0, inc), 120)
        rx.start()
        try:
            pub.join(0, inc)
            wait_admitted(pub, min(120.0, self.left()))
            out = {"assembly_s": assembly_seconds(model, mp), "versions": []}
            for version in range(1, self.spec["publishes"] + 1):
                out["versions"].append(publish_once(mp, rx, model, version, self.left()))
            out.update(fingerprints(engine, model), bytes=out["versions"][-1]["bytes"],
                       what=publish_what(transport, self.vllm))
            return out
        finally:
            if transport == "ipc" and hasattr(engine, "unmap_ipc"):  # first: the learner's end, told the worker let
                engine.unmap_ipc()  # go of its slots, frees them as it closes (not from a thread, later)
            pub.stop()
            rx.join(60)
            self.use_transport(engine, old)
            del model, mp
            if self.spec["device"] == "cuda":
                torch.cuda.empty_cache()

    def use_transport(self, engine, transport: str) -> str:
        """The vLLM engine's weight transport set to `transport` (the one AsyncLLM serves every transport the
        engine can receive over without a build option); the one it had."""
        if not self.vllm:
            return transport
        old = engine.settings.transport
        engine.settings = replace(engine.settings, transport=transport)
        return old


def kv_plan(spec: dict, eager: bool, prompt_tokens: int, new_tokens: int) -> dict:
    """common/memplan.py's vLLM generator on one GPU (tp 1) for the engine this worker builds: its KV cache term and
    the tokens it holds (the term over `kv_bytes_per_token`). The GPU's memory is torch's total_memory of device 0;
    without a GPU (the CPU rehearsal) a nominal one, `NOMINAL_GPU_BYTES`, so the arithmetic is still exercised."""
    from common import memplan

    try:
        if spec["device"] == "cuda" and torch.cuda.is_available():
            gpu_bytes, source = float(torch.cuda.get_device_properties(0).total_memory), \
                "torch.cuda.get_device_properties(0).total_memory"
        else:
            gpu_bytes, source = float(NOMINAL_GPU_BYTES), (f"nominal {NOMINAL_GPU_BYTES / 2**30:.0f} GiB (no GPU here: "
                                                           f"the plan's arithmetic only)")
        util = spec.get("gpu_memory_utilization")
        cfg = load_config(None, [
            'generator.engine="vllm"', f"model.dtype={json.dumps(spec['dtype'])}",
            f"generator.max_num_seqs={int(spec['max_num_seqs'])}", f"generator.enforce_eager={str(eager).lower()}",
            f"data.max_prompt_tokens={int(prompt_tokens)}", f"rollout.max_new_tokens={int(new_tokens)}",
            *([f"generator.gpu_memory_utilization={float(util)}"] if util else [])])
        with open(os.path.join(spec["model"], "config.json")) as f:
            shape = memplan.Shape.from_config(json.load(f))
        terms, notes = memplan.vllm_gpu(cfg, shape, 1, gpu_bytes)
        b = memplan.dtype_bytes("bfloat16" if cfg.model.dtype == "float32" else cfg.model.dtype)  # as vllm_gpu's
        per_token = memplan.kv_bytes_per_token(shape, b, 1)
        kv = next(t.bytes for t in terms if t.name == "vLLM KV cache")
    except Exception as e:  # noqa: BLE001 - recorded: the figure is missing, the stage goes on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    return {"gpu_bytes": int(gpu_bytes), "gpu_bytes_source": source,
            "gpu_memory_utilization": cfg.generator.gpu_memory_utilization, "kv_cache_bytes": int(kv),
            "kv_bytes_per_token": per_token, "kv_tokens": int(kv // per_token), "params": shape.params,
            "terms": {t.name: int(t.bytes) for t in terms}, "notes": notes}


def vllm_kv_blocks(llm) -> dict:
    """vLLM's KV cache as its front end knows it after start-up: the engine core reports num_gpu_blocks in its READY
    handshake and the client writes it into its VllmConfig's cache_config (vLLM 0.26: `AsyncLLM.vllm_config`);
    `kv_tokens` = num_gpu_blocks x block_size. None, with why, where no such attribute holds it."""
    tried = []
    for where in ("vllm_config", "engine_core.vllm_config"):
        obj = llm
        try:
            for attr in (*where.split("."), "cache_config"):
                obj = getattr(obj, attr)
        except AttributeError:
            tried.append(f"AsyncLLM.{where}.cache_config: missing")
            continue
        blocks, size = getattr(obj, "num_gpu_blocks", None), getattr(obj, "block_size", None)
        if isinstance(blocks, int) and isinstance(size, int) and blocks > 0 and size > 0:
            return {"kv_tokens": blocks * size, "num_gpu_blocks": blocks, "block_size": size,
                    "source": f"AsyncLLM.{where}.cache_config"}
        tried.append(f"AsyncLLM.{where}.cache_config: num_gpu_blocks {blocks!r}, block_size {size!r}")
    return {"kv_tokens": None, "reason": "vLLM's KV block count not reachable from the front end (" + "; ".join(tried)
                                         + "); the stage reads its 'GPU KV cache size' log line instead, if any"}


def ipc_missing() -> str | None:
    """Why this checkout cannot publish over `ipc`, or None when its config and vLLM engine both accept it."""
    try:
        load_config(None, ['generator.engine="vllm"', 'generator.weight_transport="ipc"'])
    except ConfigError as e:
        return f"this checkout's config refuses it: {str(e).splitlines()[0][:300]}"
    if "ipc" not in VLLM_TRANSPORTS:
        return f"not built in this checkout: the vLLM engine's transports are {', '.join(VLLM_TRANSPORTS)}"
    return None


def publish_what(transport: str, vllm: bool) -> str:
    if transport == "rpc":
        sink = ("collective_rpc into vLLM's workers (pause, load_weights per bucket, resume)" if vllm else
                "load_flat into the torch engine's parameters")
        return f"gloo weight channel from the learner's pinned host copy into this process, then {sink}"
    return f"{transport}: the engine's own receive (receive_weights); load included in receive_s when it loads itself"


def learner_model(spec: dict, seed: int):
    """The learner's copy of the model on the learner's device, its weights moved away from the engine's (noise of
    1e-2, seeded), so a load that did not happen shows in the fingerprint."""
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model = model.to(spec["device"]).requires_grad_(False)
    gen = torch.Generator(device=spec["device"]).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype), alpha=1e-2)
    return model


def wait_admitted(pub, timeout_s: float) -> None:
    """Until the publisher has admitted the generator's channel (or holds it for its next publish)."""
    deadline = time.monotonic() + timeout_s
    while not (pub.counter_values().get("weights/joins") or pub.pending_direct):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the generator's weight channel was not admitted within {timeout_s:.0f}s")
        time.sleep(0.01)


def assembly_seconds(model, mp) -> float:
    """The learner's bucket assembly alone: one pass of `param_buckets` (each bucket gathered and cast into the
    scratch buffer on the learner's device), without staging or sending."""
    cuda = mp.scratch.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in param_buckets(model, mp.layout, False, mp.scratch):
        pass
    if cuda:
        torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 4)


def publish_once(mp, rx: "PublishReceiver", model, version: int, left_s: float) -> dict:
    """One version: the learner's publish on this thread, the generator's receive and load on `rx`'s."""
    with torch.no_grad():  # each version its own fingerprint
        model.get_parameter(vllm_weights.FINGERPRINT_PARAM).mul_(1.0 + 0.01 * version)
    t0 = time.perf_counter()
    seconds, nbytes, checksum = mp.publish(version)
    got = rx.seen.get(timeout=max(1.0, left_s))
    if got is None:
        raise RuntimeError(f"the generator's weight receiver failed at version {version}: {rx.error!r}")
    return {"version": version, "bytes": nbytes, "publish_s": round(seconds, 4),
            "header_after_s": round(got["t_header"] - t0, 4),  # the learner's start: the host copy, the headers
            "receive_s": round(got["t_received"] - got["t_header"], 4),
            "load_s": None if got["t_loaded"] is None else round(got["t_loaded"] - got["t_received"], 4),
            "end_to_end_s": round((got["t_loaded"] or got["t_received"]) - t0, 4),
            "engine_update_s": got["engine_update_s"], "checksum_learner": checksum,
            "checksum_generator": got["checksum"],
            "checksums_equal": None if got["checksum"] is None else checksum == got["checksum"]}


def fingerprints(engine, model) -> dict:
    """The fingerprint parameter as loaded in the engine and as the learner holds it (in the engine's dtype)."""
    name = vllm_weights.FINGERPRINT_PARAM
    if isinstance(engine, VllmEngine):
        got, dtype = engine.fingerprint(name), engine.dtype
    else:
        param = engine.model.get_parameter(name)
        got, dtype = [vllm_weights.fingerprint(param)], param.dtype
    want = vllm_weights.fingerprint(model.get_parameter(name), dtype)
    return {"fingerprint_generator": got, "fingerprint_learner": want, "fingerprint_equal": all(x == want for x in got)}


class PublishReceiver(threading.Thread):
    """The generator's end of a publish, as the actor's weight thread and main thread do it (join the pair channel,
    then per header: `receive_weights`, and `load_flat` when it returns the vector), each version's times on
    `seen` (None once it failed: `error`)."""

    def __init__(self, engine, addr: str, prefix: str, timeout_s: float):
        super().__init__(name="bench-weights", daemon=True)
        self.engine, self.addr, self.prefix, self.timeout_s = engine, addr, prefix, timeout_s
        self.seen: queue.Queue = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            lay = weights.layout(self.engine.model)
            ch = self.engine.join_weights(self.addr, self.prefix, self.timeout_s)
            spare = None
            while (got := ch.receive_header(lay)) is not None:
                spare = self.version(ch, lay, *got, spare)
        except BaseException as e:
            traceback.print_exc()
            self.error = e
            self.seen.put(None)

    def version(self, ch, lay, version: int, flags: int, spare):
        t_header = time.perf_counter()
        received = self.engine.receive_weights(ch, lay, version, flags, out=spare)
        t_received, t_loaded = time.perf_counter(), None
        if received is not None:
            self.engine.load_flat(received[0], version)
            t_loaded = time.perf_counter()
        self.seen.put({"t_header": t_header, "t_received": t_received, "t_loaded": t_loaded,
                       "checksum": None if received is None else received[1],
                       "engine_update_s": getattr(self.engine, "last_update_s", None)})
        return None if received is None else received[0]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hardware.gen_bench SPEC_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gen-bench %(levelname)s %(name)s: %(message)s")
    spec = json.loads(argv[0])
    if spec["device"] == "cpu":  # the rehearsal: two intra-op threads spin against any other process on 2 cores
        torch.set_num_threads(1)
    return Bench(spec).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
