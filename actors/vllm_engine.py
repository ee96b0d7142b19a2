"""vLLM behind the actor's Engine interface: the GPU generator (docs/DESIGN.md section 7).

One `AsyncLLM` per generator process, over every GPU the launcher gave it (tensor parallel size = the
visible CUDA devices, i.e. `--tp`). It runs on an asyncio loop in a thread of its own. `generate`
submits every prompt of a Work message at once (one request per prompt, `SamplingParams(n=group size)`),
so continuous batching sees them all, and blocks the actor until they are back, calling `before_forward`
meanwhile so the actor can apply staged weights while requests are in flight (as the CPU sampler does
between decode steps).

Contracts kept from the CPU path, and how:
- pi_behav: `logprobs_mode="processed_logprobs"` with `logprobs=0` gives the logprob of the sampled token
  under the distribution actually sampled from (after temperature and top-p). vLLM's default,
  `raw_logprobs`, is taken before temperature: every importance weight at T != 1 would be biased.
  `generation_config="vllm"`, so no sampling default from the model directory changes that distribution.
- Versions per token, on every supported vLLM (0.26 to 0.33; `vllm_api` finds what the installed one has):
  - vLLM 0.33: the engine core labels each step's output with the weight version set by
    `finish_weight_update(weight_version=...)` / `update_weight_version`, which change only while generation is
    paused; `CompletionOutput.weight_versions` spans become one int per token. Exact even when a response spans
    an update, so both weight_update modes are allowed.
  - vLLM 0.26 has no labels. "finish" stays exact because covrl drains first: the gate closes, covrl's admitted
    requests end, and only then does the engine pause, so every response ran wholly on the version it was
    submitted under (a paused 0.26 would otherwise hold queued or preempted requests across the update and
    finish them on new weights). "keep" cannot be made exact without vLLM internals and is refused at start,
    with the fix (finish, or vLLM 0.33).
- Seeds (`generator.seed_requests`, on by default): every request carries its prompt's seed. vLLM 0.33's default
  model runner (V2) samples with Gumbel noise keyed on (seed, position, token), so a seeded request costs nothing
  and its samples do not depend on what is batched with it; the legacy runner (VLLM_USE_V2_MODEL_RUNNER=0) samples
  each seeded request with its own torch.Generator, one by one (slow): turn seeds off there, and vLLM samples from
  its engine-wide stream (seeded by run.seed). vLLM gives child j of a request seeded s the seed s + j, so prompt
  seeds are spread first (`request_seed`) and neighbouring prompts never share a sample's noise; a re-issued prompt
  reproduces its samples under the same weights (not equal to the torch sampler's: another noise source).
- Processes: the engine core and its workers are started with `spawn` (VLLM_WORKER_MULTIPROC_METHOD), never
  forked: this process already runs threads (the asyncio loop, the weight receiver, gloo) when the engine is
  built, and vLLM documents spawn for that case.

A weight update (chosen once, at setup) pauses generation, loads, stamps the version, resumes:
- `weight_update="finish"`: `pause_generation(mode="wait")`: requests in flight finish on the old
  weights; new ones wait for the new weights. Every response has one version. (0.26: covrl's drain first.)
- `weight_update="keep"`: `pause_generation(mode="keep")`: requests freeze and continue on the new
  weights (PipelineRL-style). `clear_cache=True` in both modes: the KV of frozen requests is recomputed
  under the new weights. That departs from the CPU sampler (which keeps the KV of earlier tokens),
  because vLLM's prefix cache would otherwise hand old-weight KV to new requests.
Transports:
- `rpc`: the flat vector (in the wire dtype) arrives in this process over the gloo weight channel (the `Engine`
  interface's default, as for the torch engine) and `load_flat` hands it to the workers bucket by bucket through
  `collective_rpc` into `CovrlWorkerExtension`. Works wherever the roles are; the fallback when they share a GPU.
- `nccl`: learner rank 0 broadcasts each bucket into the vLLM workers (`learner/nccl.NcclSender`); this
  engine's `receive_weights` loads each version flagged `FLAG_DIRECT` from the actor's weight thread.
  The receiving end is vLLM's weight-transfer API (`WeightTransferConfig(backend="nccl")`,
  init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update) where the
  installed vLLM has it, else the worker extension's own NCCL group (`covrl_init_nccl`). Needs GPUs of its own.
- `ipc`: learner rank 0 and this generator (tp 1) share one GPU. Before the rendezvous the worker's GPU, pid and
  dtype are announced (`covrl_ipc_identity`); after it the worker maps the learner's two staging slots once
  (`covrl_map_ipc`); each version flagged `FLAG_DIRECT | FLAG_IPC` is loaded under the same pause as nccl:
  `ipc_weights.IpcReceiver` takes each bucket's signal on the pair channel, the worker hands views of its slot to
  `load_weights` and waits for that copy (`covrl_load_ipc`), and the bucket is acknowledged. No byte crosses the
  host. This layer is thin on purpose: the protocol is `common/ipc_weights.py` and `learner/ipc.py`, tested on
  the CPU between two processes over shared-memory slots; only the CUDA backend and vLLM's own load need a GPU.

Importing this module imports neither vLLM nor CUDA; `VllmEngine` does, when built.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch

from actors.engine import Completion, Engine, hash32
from common import ipc_weights
from common import vllm_weights
from common import weights
from common.config import GeneratorConfig, RunConfig
from common.messages import SamplingParams

log = logging.getLogger("covrl.engine")

PAUSE_MODE = {"finish": "wait", "keep": "keep"}  # our weight_update -> vLLM's pause mode
TRANSPORTS = ("rpc", "nccl", "ipc")
EXTENSION = "actors.vllm_engine.CovrlWorkerExtension"
MAX_N = 1 << 16  # samples per prompt: request seeds leave this much room for vLLM's seed + j
# ipc: the most an unmap waits for the worker (at close, or before a new channel's mapping). Past it the learner still
# frees its slots, once the worker's process is gone (vLLM's shutdown ends it).
UNMAP_TIMEOUT_S = 30.0


# ---- pure helpers (unit-tested without vLLM) ---------------------------------------------------


def visible_device_count(environ=os.environ) -> int:
    """CUDA devices this process may use, without initialising CUDA (vLLM forks its workers after)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return torch.cuda.device_count()


def request_seed(seed: int) -> int:
    """vLLM seed of a prompt: its seed mixed to 32 bits, times MAX_N, so the child seeds
    [s, s + n) of different prompts never overlap (unless two 32-bit hashes collide)."""
    return int(hash32(torch.tensor(seed & 0xFFFFFFFF, dtype=torch.int64))) * MAX_N


def sampling_kwargs(n: int, sampling: SamplingParams, seed: int, stop_ids: Sequence[int], seeded: bool = False) -> dict:
    """vllm.SamplingParams arguments for one prompt of a Work or EvalWork message; `seeded`: give the request
    the prompt's own seed (`generator.seed_requests`)."""
    if not 1 <= n <= MAX_N:
        raise ValueError(f"{n} samples per prompt: vLLM requests here take 1..{MAX_N}")
    greedy = sampling.temperature == 0
    kw = dict(
        n=n,
        temperature=float(sampling.temperature),
        top_p=1.0 if greedy else float(sampling.top_p),
        max_tokens=int(sampling.max_new_tokens),
        logprobs=0,  # the sampled token's logprob only
        stop_token_ids=[int(t) for t in stop_ids],
        detokenize=False,  # the actor decodes for scoring; vLLM never needs the text
        flat_logprobs=True,
    )
    if seeded:
        kw["seed"] = request_seed(seed)
    return kw


SPAWN_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def use_spawn(environ=os.environ) -> None:
    """Start vLLM's engine core and workers with spawn, not fork (this process runs threads); a value the user
    set explicitly is kept. Also: without FlashInfer installed (a slim install, such as the GPU kit), vLLM's
    FlashInfer top-k/top-p sampler is turned off, because vLLM 0.26's V2 runner imports FlashInfer unguarded
    when that sampler is on (seen on an H200, 2026-11-26: "No module named 'flashinfer'" at engine start)."""
    for key, value in SPAWN_ENV.items():
        environ.setdefault(key, value)
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def engine_kwargs(model_path: str, settings: "VllmSettings", tp: int, native_nccl: bool) -> dict:
    """vllm.AsyncEngineArgs arguments. `weight_transfer_config` is given as its fields; the engine
    builds `WeightTransferConfig(**fields)` from them."""
    kw = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=settings.dtype,
        seed=settings.seed,
        tensor_parallel_size=tp,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        enforce_eager=settings.enforce_eager,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        enable_prefix_caching=True,
        worker_extension_cls=EXTENSION,
        disable_log_stats=True,
    )
    if settings.max_model_len:
        kw["max_model_len"] = settings.max_model_len
    if settings.transport == "nccl" and native_nccl:
        kw["weight_transfer_config"] = {"backend": "nccl"}
    return kw


def versions_from_spans(spans, num_tokens: int) -> np.ndarray | None:
    """int32 [num_tokens] policy versions from vLLM's WeightVersionSpan list (version, start, end);
    None when vLLM reported none (an older vLLM)."""
    if spans is None:
        return None
    out = np.empty(num_tokens, dtype=np.int32)
    pos = 0
    for span in spans:
        if span.start != pos or span.end < span.start:
            raise RuntimeError(f"vLLM weight-version spans are not contiguous at token {pos}: {list(spans)}")
        try:
            out[span.start:span.end] = int(span.version)
        except ValueError:
            raise RuntimeError(f"vLLM labelled tokens with weight version {span.version!r}, not a covrl version: "
                               "was the engine's version set before generating (VllmEngine does it at start)?") from None
        pos = span.end
    if pos != num_tokens:
        raise RuntimeError(f"vLLM weight-version spans cover {pos} of {num_tokens} tokens")
    return out


def sampled_logprobs(token_ids: Sequence[int], logprobs) -> np.ndarray:
    """float32 [T] logprob of each sampled token, from vLLM's per-position logprobs (FlatLogprobs or
    a list of {token id: Logprob}); with logprobs=0 each position holds the sampled token only."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {None if logprobs is None else len(logprobs)} logprob positions for "
                           f"{len(token_ids)} tokens; requests must ask for logprobs=0")
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and len(flat_ids) == len(token_ids) and list(flat_ids) == list(token_ids):
        return np.asarray(logprobs.logprobs, dtype=np.float32)  # FlatLogprobs, one entry per position
    return np.asarray([logprobs[t][tok].logprob for t, tok in enumerate(token_ids)], dtype=np.float32)


def rpc_bytes(t: torch.Tensor, dtype: torch.dtype) -> bytes:
    """A tensor as raw bytes of `dtype` for `collective_rpc`: vLLM's frontend -> engine-core channel decodes
    untyped arguments, so a tensor would arrive as [dtype, shape, buffer index] (the contract test
    shows it); bytes arrive as bytes. `t`, in any wire dtype, is cast straight to `dtype`: no rounding when it is
    `dtype` already (a bf16 wire's bits reach bf16 workers as they came), one rounding from fp32, never a detour
    through another dtype."""
    return t.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy().tobytes()


def from_rpc_bytes(data: bytes, dtype_name: str) -> torch.Tensor:
    """The flat tensor `rpc_bytes` encoded (a copy: `frombuffer` needs writable memory)."""
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype_name))


def finish_reason(reason: str | None) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"a vLLM request ended with finish_reason={reason!r}; covrl never aborts requests, so "
                       "the engine failed or was stopped (see the generator log)")


def to_completion(out, fallback_version: int | None, spans: bool = True) -> Completion:
    """One vLLM CompletionOutput as the actor's Completion; `spans` False: the engine's labels are not covrl's
    versions (a vLLM whose label covrl cannot set), so the fallback is used."""
    tokens = np.asarray(out.token_ids, dtype=np.int32)
    versions = versions_from_spans(getattr(out, "weight_versions", None) if spans else None, len(tokens))
    if versions is None:
        if fallback_version is None:
            raise RuntimeError("this vLLM reports no per-token weight versions and the weights changed while the "
                               "request ran; use weight_update=\"finish\" or vLLM >= 0.33")
        versions = np.full(len(tokens), fallback_version, dtype=np.int32)
    return Completion(token_ids=tokens, logprobs=sampled_logprobs(out.token_ids, out.logprobs), versions=versions,
                      finish_reason=finish_reason(out.finish_reason))


# ---- settings and the vLLM surface we use ------------------------------------------------------


_GEN, _RUN = GeneratorConfig(), RunConfig()  # the defaults of every config key below live in common/config.py


@dataclass(frozen=True)
class VllmSettings:
    """What VllmEngine needs from the run config (`from_config`); defaults are the config's own."""

    weight_update: str = _GEN.weight_update  # "finish" | "keep": see the module docstring
    transport: str = _GEN.weight_transport  # "rpc" | "nccl" | "ipc"
    tensor_parallel_size: int = 0  # 0: every visible CUDA device (the launcher's --tp)
    # vLLM's attention kernels are for 16-bit dtypes: an fp32 model (model.dtype = "float32", what "auto" is on the
    # CPU and older GPUs) is served in bf16.
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = _GEN.gpu_memory_utilization
    max_num_seqs: int = _GEN.max_num_seqs
    max_model_len: int = 0  # 0: the model's
    enforce_eager: bool = _GEN.enforce_eager
    seed: int = _RUN.seed
    seed_requests: bool = _GEN.seed_requests  # per-request seeds: free on vLLM's V2 model runner, slow on V1
    poll_s: float = 0.02  # how often `generate` runs the before_forward hook while waiting
    timeout_s: float = _GEN.engine_timeout_s  # every call into the engine (`EngineTimeout` past it)

    def __post_init__(self):
        if self.weight_update not in PAUSE_MODE:
            raise ValueError(f"weight_update={self.weight_update!r}: \"finish\" (in-flight requests finish on the "
                             "old weights) or \"keep\" (they continue on the new ones, tokens stamped per version)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight transport {self.transport!r}: \"rpc\" (gloo to this process, then into the "
                             "workers), \"nccl\" (learner GPU straight into the workers; needs separate GPUs) or "
                             "\"ipc\" (the learner's GPU slots mapped into the worker; one shared GPU, tp 1)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} is a fraction in (0, 1]")
        vllm_weights.torch_dtype(self.dtype)


class NeverRaised(Exception):
    """Stands in for `RetryableRequestError` on a vLLM that has none (0.26): a paused engine there queues new
    requests instead of rejecting them, so there is nothing to retry."""


def nccl_info_fields(engine_cls) -> tuple[frozenset, frozenset]:
    """(init_info fields, update_info fields) of vLLM's NCCL weight-transfer backend, from the dataclasses it
    parses the two request dicts into (`init_info_cls`, `update_info_cls`)."""
    import dataclasses

    return (frozenset(f.name for f in dataclasses.fields(engine_cls.init_info_cls)),
            frozenset(f.name for f in dataclasses.fields(engine_cls.update_info_cls)))


def vllm_api():
    """The vLLM names VllmEngine uses, resolved once, and what this vLLM can do, found by looking (never by its
    version string; tests pass a fake namespace instead). Supported: vLLM 0.26 through 0.33. The differences:
    - `version_spans`: CompletionOutput.weight_versions (0.33) labels each token with the engine's weight version,
      which covrl sets (`engine_versions`); without both (0.26) covrl keeps every response on one version itself
      (see `VllmEngine._paused`) and ignores any spans;
    - `engine_versions`: AsyncLLM.update_weight_version (0.33); `finish_takes_version`: the native NCCL path's
      `finish_weight_update(weight_version=)` (0.33), else the label is set after a bare finish;
    - `Retryable`: vllm.exceptions.RetryableRequestError (0.33: a paused engine rejects new requests), else a
      private exception never raised (0.26 queues them);
    - `nccl_fields`: where NCCL's `packed` flag lives (init info in 0.33, update info in 0.26)."""
    import dataclasses
    import inspect

    import vllm
    import vllm.exceptions
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    api = SimpleNamespace(AsyncLLM=AsyncLLM, AsyncEngineArgs=vllm.AsyncEngineArgs, SamplingParams=vllm.SamplingParams,
                          FINAL_ONLY=RequestOutputKind.FINAL_ONLY,
                          Retryable=getattr(vllm.exceptions, "RetryableRequestError", NeverRaised),
                          engine_versions=hasattr(AsyncLLM, "update_weight_version"), finish_takes_version=False,
                          native_nccl=False, nccl_fields=None, version=vllm.__version__)
    # spans are only covrl's versions if covrl can set the engine's label: else they would read "default"
    api.version_spans = api.engine_versions and "weight_versions" in {f.name for f in dataclasses.fields(CompletionOutput)}
    try:
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    except ImportError:
        return api  # an older vLLM: the worker extension carries NCCL updates
    api.WeightTransferConfig, api.InitRequest, api.UpdateRequest = (WeightTransferConfig, WeightTransferInitRequest,
                                                                    WeightTransferUpdateRequest)
    api.native_nccl = all(hasattr(AsyncLLM, m) for m in ("init_weight_transfer_engine", "start_weight_update",
                                                         "update_weights", "finish_weight_update"))
    if api.native_nccl:
        api.finish_takes_version = "weight_version" in inspect.signature(AsyncLLM.finish_weight_update).parameters
        api.nccl_fields = nccl_info_fields(NCCLWeightTransferEngine)
    return api


def nccl_init_info(info: dict, fields: tuple[frozenset, frozenset] | None) -> dict:
    """init_info for vLLM's native NCCL path. covrl's protocol is one broadcast per parameter (`packed=False`):
    0.33 reads that flag here, 0.26 from each update's info (`nccl_update_info`). `fields` None (a fake API in
    the unit tests): as 0.33."""
    if fields is not None and "packed" not in fields[0] | fields[1]:
        raise RuntimeError("vLLM's NCCL weight-transfer infos have no `packed` flag, so covrl cannot ask for its "
                           "one-broadcast-per-parameter protocol: this vLLM is outside covrl's supported range (0.26 "
                           "to 0.33); use generator.weight_transport = \"rpc\" or install vllm==0.33.0")
    if fields is None or "packed" in fields[0]:
        info = {**info, "packed": False}
    return _checked(info, None if fields is None else fields[0], "init")


def nccl_update_info(meta: dict, fields: tuple[frozenset, frozenset] | None) -> dict:
    """update_info of one bucket for vLLM's native NCCL path (`packed=False` where this vLLM reads it here)."""
    if fields is not None and "packed" not in fields[0] and "packed" in fields[1]:
        meta = {**meta, "packed": False}
    return _checked(meta, None if fields is None else fields[1], "update")


def _checked(info: dict, fields: frozenset | None, which: str) -> dict:
    if fields is not None and (missing := set(info) - fields):
        raise RuntimeError(f"vLLM's NCCL weight-transfer {which} info has no field(s) {sorted(missing)}: this vLLM "
                           "is outside covrl's supported range (0.26 to 0.33); use generator.weight_transport = "
                           "\"rpc\" or install vllm==0.33.0")
    return info


class EngineTimeout(RuntimeError):
    """A call into the vLLM engine missed its deadline (`generator.engine_timeout_s`): the generator exits with an
    error and the launcher restarts it."""


class _Loop:
    """An asyncio loop in a daemon thread; the actor's threads submit coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout_s: float):
        """Run `coro` on the loop and wait at most `timeout_s` for it; past that it is cancelled (vLLM aborts its
        requests) and `EngineTimeout` is raised. Every await inside it is bounded by this deadline."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise EngineTimeout(f"a call into the vLLM engine did not return within {timeout_s:.0f}s "
                                f"(generator.engine_timeout_s): the engine is taken to be wedged") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def meta_model(model_path: str) -> torch.nn.Module:
    """The model's architecture on the meta device: names and shapes for `weights.layout`, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


# ---- the engine ----------------------------------------------------------------------------


class VllmEngine(Engine):
    """The Engine interface (actors/engine.py) over vLLM's AsyncLLM.

    Weights: with the rpc transport, the interface's default (gloo into this process, then `load_flat` into the
    workers); with nccl, the rendezvous hooks announce the receiver and join the learner's NCCL group, and
    `receive_weights` loads each FLAG_DIRECT version straight into the workers (`receive_nccl`); with ipc, the hooks
    announce the worker's GPU and map the learner's staging slots, and `receive_weights` loads each FLAG_IPC
    version out of them (`receive_ipc`)."""

    def __init__(self, model_path: str, *, stop_ids: Sequence[int], settings: VllmSettings = VllmSettings(),
                 llm=None, api=None):
        self.settings, self.stop_ids = settings, [int(t) for t in stop_ids]
        self.model = meta_model(model_path)  # the actor takes weights.layout(engine.model) from it
        self.lay = weights.layout(self.model)
        self.dtype = vllm_weights.torch_dtype(settings.dtype)
        self.api = api if api is not None else vllm_api()
        if settings.weight_update == "keep" and not self.api.version_spans:
            raise ValueError(f"generator.weight_update = \"keep\" needs vLLM to label each token with its weight "
                             f"version (CompletionOutput.weight_versions, vLLM >= 0.33); vLLM {self.api.version} "
                             "does not: set generator.weight_update = \"finish\" or install vllm==0.33.0")
        # Without per-token labels, "finish" is exact only if no request outlives a pause: covrl drains its own
        # requests first (a paused 0.26 engine would hold queued or preempted ones across the update).
        self.drain = not self.api.version_spans
        self.version = 0
        self.tp = settings.tensor_parallel_size or (1 if llm is not None else visible_device_count())
        self._check_ipc()  # before vLLM takes the GPU
        self.nccl = None  # "native" | "extension" once joined
        # ipc: the learner's slot offer and the pair channel's store once the worker mapped them, the channel's
        # deadline, and the signals' end (built at the first version, on the channel it arrives on).
        self._ipc_handles: bytes | None = None
        self._ipc_store = None
        self._ipc_timeout_s = 0.0
        self._ipc_receiver: ipc_weights.IpcReceiver | None = None
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_update_s = 0.0
        self._ids = itertools.count()
        self._inflight = 0  # covrl's requests admitted to vLLM and not yet final (owned by the loop's thread)
        self._streams: dict[concurrent.futures.Future, tuple] = {}  # submitted groups: future -> (key, n, when)
        self._finished: queue.Queue = queue.Queue()  # their futures, as each request ends
        self._loop = _Loop()
        try:
            self.llm = llm if llm is not None else self._loop.run(self._build(model_path), settings.timeout_s)
            self._open, self._idle = self._loop.run(self._make_gates(), settings.timeout_s)
            self._loop.run(self._label(0), settings.timeout_s)  # the engine core's label is "default" until set
        except BaseException:
            self._loop.close()
            raise

    @classmethod
    def from_config(cls, cfg, model_path: str, *, stop_ids: Sequence[int]) -> "VllmEngine":
        """Settings from the run config: `cfg.generator` and `cfg.model.dtype`."""
        gen = cfg.generator
        # An fp32 checkpoint is served in bf16 (vLLM's attention kernels are for 16-bit dtypes), and so is "auto"
        # (float32 or bfloat16 once resolved; a run's config.toml has it resolved); the learner keeps fp32 master
        # weights and the NCCL/RPC paths cast each bucket to the generator's dtype.
        settings = VllmSettings(weight_update=gen.weight_update, transport=gen.weight_transport,
                                dtype="bfloat16" if cfg.model.dtype in ("auto", "float32") else cfg.model.dtype,
                                gpu_memory_utilization=gen.gpu_memory_utilization, max_num_seqs=gen.max_num_seqs,
                                enforce_eager=gen.enforce_eager, seed=cfg.run.seed, seed_requests=gen.seed_requests,
                                timeout_s=gen.engine_timeout_s)
        return cls(model_path, stop_ids=stop_ids, settings=settings)

    async def _build(self, model_path: str):
        use_spawn()  # before vLLM creates any process
        # vLLM's worker processes import CovrlWorkerExtension by name: make sure they can find this repo.
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if repo not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        tp = self.tp
        if tp < 1:
            raise ValueError("the vLLM engine needs a CUDA device and this process sees none "
                             "(CUDA_VISIBLE_DEVICES is empty); give the generator GPUs (--gpus, --tp) or use the torch engine")
        kw = engine_kwargs(model_path, self.settings, tp, self.api.native_nccl)
        if "weight_transfer_config" in kw:
            kw["weight_transfer_config"] = self.api.WeightTransferConfig(**kw["weight_transfer_config"])
        return self.api.AsyncLLM.from_engine_args(self.api.AsyncEngineArgs(**kw))

    @staticmethod
    async def _make_gates() -> tuple[asyncio.Event, asyncio.Event]:
        """(open, idle), made on the loop. `open` is closed while a "finish" update runs (a paused 0.33 rejects new
        requests, a paused 0.26 would hold them across the update); `idle` is set while no request is in flight."""
        gate, idle = asyncio.Event(), asyncio.Event()
        gate.set()
        idle.set()
        return gate, idle

    async def _label(self, version: int) -> None:
        """The engine's own weight-version label, where it keeps one (0.33); 0.26 has none and covrl's
        `self.version` is the label."""
        if self.api.engine_versions:
            await self.llm.update_weight_version(str(version))

    # ---- generation ----

    def generate(self, prompts, n, sampling, seeds, before_forward: Callable[[], None] | None = None):
        if len(prompts) != len(seeds):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        params = [self.api.SamplingParams(**sampling_kwargs(n, sampling, s, self.stop_ids, self.settings.seed_requests),
                                          output_kind=self.api.FINAL_ONLY) for s in seeds]
        fut = self._loop.submit(self._generate_all([list(map(int, p)) for p in prompts], params))
        try:
            finals = self._finals(fut, len(prompts), before_forward or (lambda: None))
        finally:
            fut.cancel()  # no-op when done; otherwise vLLM aborts the requests
        return [self._completions(out, v_submit, n) for out, v_submit in finals]

    def _completions(self, out, v_submit: int, n: int) -> list[Completion]:
        """One request's final output as its n completions, each token labelled with its version."""
        comps = sorted(out.outputs, key=lambda c: c.index)
        if len(comps) != n:
            raise RuntimeError(f"vLLM returned {len(comps)} completions for a request of n={n}")
        fallback = v_submit if v_submit == self.version or self.settings.weight_update == "finish" else None
        return [to_completion(c, fallback, self.api.version_spans) for c in comps]

    # ---- streaming (actors/actor.py keeps the engine full): one request per group, each collected when final ----

    @property
    def max_num_seqs(self) -> int:
        return self.settings.max_num_seqs

    def submit(self, key, prompt, n, sampling, seed) -> None:
        params = self.api.SamplingParams(**sampling_kwargs(n, sampling, seed, self.stop_ids, self.settings.seed_requests),
                                         output_kind=self.api.FINAL_ONLY)
        fut = self._loop.submit(self._one([int(t) for t in prompt], params))
        self._streams[fut] = (key, n, time.monotonic())
        fut.add_done_callback(self._finished.put)

    def collect(self, wait_s, before_forward):
        """The groups whose requests are final, waiting at most `wait_s` for the first, `before_forward` between
        polls (it may apply staged weights: a pause with its drain); a request older than
        `generator.engine_timeout_s` means the engine is wedged (`EngineTimeout`)."""
        deadline = time.monotonic() + wait_s
        done = []
        while True:
            before_forward()
            try:
                done.append(self._finished.get(timeout=max(0.0, min(self.settings.poll_s, deadline - time.monotonic()))))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
        while not self._finished.empty():
            done.append(self._finished.get_nowait())
        self._check_wedged()
        out = []
        for fut in done:
            key, n, _ = self._streams.pop(fut)
            final, v_submit = fut.result(timeout=0)  # done (it came from the queue); a failed request raises here
            out.append((key, self._completions(final, v_submit, n)))
        return out

    def _check_wedged(self) -> None:
        oldest = min((t for *_, t in self._streams.values()), default=None)
        if oldest is not None and time.monotonic() - oldest > self.settings.timeout_s:
            raise EngineTimeout(f"a vLLM request has not finished within {self.settings.timeout_s:.0f}s "
                                "(generator.engine_timeout_s): the engine is taken to be wedged")

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def _finals(self, fut: concurrent.futures.Future, prompts: int, hook: Callable[[], None]):
        """Wait for every request's final output, running `hook` between polls (it may apply staged weights while
        requests run), at most `generator.engine_timeout_s`."""
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            hook()
            try:
                return fut.result(timeout=min(self.settings.poll_s, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise EngineTimeout(f"vLLM did not finish {prompts} prompts within "
                                        f"{self.settings.timeout_s:.0f}s (generator.engine_timeout_s): the "
                                        "engine is taken to be wedged") from None

    async def _generate_all(self, prompts, params):
        return await asyncio.gather(*(self._one(p, sp) for p, sp in zip(prompts, params)))

    async def _one(self, prompt_ids, params):
        while True:
            while not self._open.is_set():  # re-checked after waking: another update may have closed it again
                await self._open.wait()
            version, rid = self.version, f"covrl-{next(self._ids)}"
            self._inflight += 1  # no await since the gate: an update that closes it next counts this request
            self._idle.clear()
            try:
                final = None
                async for out in self.llm.generate({"prompt_token_ids": prompt_ids}, params, rid):
                    final = out
                if final is None or not final.finished:
                    raise RuntimeError(f"vLLM request {rid} ended without a final output")
                return final, version
            except self.api.Retryable:  # a pause began between the gate and admission: nothing was generated
                self.counters["vllm/requests_retried"] += 1
            finally:
                self._inflight -= 1
                if not self._inflight:
                    self._idle.set()

    # ---- weight updates ----

    def _update(self, version: int, load) -> None:
        """Pause, run `load()` (a coroutine function that loads and labels the version), resume."""
        t0 = time.perf_counter()
        self._loop.run(self._paused(version, load), self.settings.timeout_s)
        self.last_update_s = time.perf_counter() - t0
        self.counters["vllm/weight_updates"] += 1

    async def _paused(self, version: int, load) -> None:
        mode = PAUSE_MODE[self.settings.weight_update]
        if mode == "wait":
            self._open.clear()
        try:
            if mode == "wait" and self.drain:
                t0 = time.perf_counter()
                await self._idle.wait()  # every admitted request ends on the weights it started on
                self.counters["vllm/drain_s"] += time.perf_counter() - t0
            await self.llm.pause_generation(mode=mode, clear_cache=True)
            try:
                await load()
                self.version = version  # before resume: requests admitted from here on start at this version
            finally:
                await self.llm.resume_generation()
        finally:
            self._open.set()

    def load_flat(self, flat: torch.Tensor, version: int) -> None:
        """The rpc transport: a flat vector in `layout` order (from the gloo weight channel, in its wire dtype) into
        the workers, one `weights.wire_plan` bucket per call, so no call carries more than BUCKET_NUMEL elements: the
        pieces of a split parameter go under its one name and shape with their offset, and the workers load it with
        its last piece (`covrl_load_weights`)."""
        if flat.numel() != self.lay.numel:
            raise ValueError(f"load_flat: {flat.numel()} elements for a model of {self.lay.numel}")

        async def load():
            for b in weights.wire_plan(self.lay):
                meta = vllm_weights.bucket_meta(self.lay, b.first, b.end, self.dtype)
                piece = () if b.whole else (b.offset,)
                await self.llm.collective_rpc("covrl_load_weights", args=(
                    meta["names"], meta["shapes"], meta["dtype_names"][0], rpc_bytes(flat[b.start:b.stop], self.dtype),
                    *piece))
            await self._label(version)

        self._update(version, load)

    def join_nccl(self, host: str, port: int, world_size: int, timeout_s: float = 600) -> None:
        """The nccl transport, once per generator: join learner rank 0's NCCL group (it calls `NcclSender` at the
        same time). Workers take ranks 1..tp."""
        info = dict(master_address=host, master_port=int(port), rank_offset=1, world_size=int(world_size))
        if self.api.native_nccl:
            init = nccl_init_info(info, self.api.nccl_fields)
            coro = self.llm.init_weight_transfer_engine(self.api.InitRequest(init_info=init))
            self.nccl = "native"
        else:
            coro = self.llm.collective_rpc("covrl_init_nccl", kwargs=info)
            self.nccl = "extension"
        self._loop.run(coro, timeout_s)

    @property
    def receives_weights_directly(self) -> bool:
        """True with the nccl and ipc transports: buckets go from the learner's GPU into the workers, not through
        this process (`receive_weights` then calls `receive_nccl` or `receive_ipc` on each header)."""
        return self.settings.transport in ("nccl", "ipc")

    # ---- the Engine's weight interface ----

    def _before_weight_rendezvous(self, store) -> None:
        # before the rendezvous, so the learner's join thread sees it
        if self.settings.transport == "nccl":
            self.announce_receiver(store)
        elif self.settings.transport == "ipc":
            self.announce_ipc(store)

    def _after_weight_rendezvous(self, store, timeout_s: float) -> None:
        if self.settings.transport == "nccl":
            self.join_via_store(store, timeout_s)
        elif self.settings.transport == "ipc":
            self.map_ipc(store, timeout_s)

    def receive_weights(self, ch, lay, version: int, flags: int, out=None):
        if flags & weights.FLAG_DIRECT and self.receives_weights_directly:
            sent = "ipc" if flags & weights.FLAG_IPC else "nccl"
            if sent != self.settings.transport:
                raise RuntimeError(f"weight channel: the learner sent version {version} over {sent}, but this "
                                   f"generator announced an {self.settings.transport} receiver (a learner bug: it "
                                   "must decide per channel from the generator's announcement)")
            if sent == "ipc":
                self.receive_ipc(ch, version)  # pauses generation, loads, stamps the version, resumes
            else:
                self.receive_nccl(version)  # the same
            return None
        return super().receive_weights(ch, lay, version, flags, out)

    def announce_receiver(self, store) -> None:
        """Before the pair channel's rendezvous: tell the learner this generator's NCCL group size and dtype."""
        vllm_weights.announce(store, self.tp, self.dtype)

    def join_via_store(self, store, timeout_s: float) -> None:
        """After the rendezvous: read the learner's NCCL address from the pair channel's store and join."""
        addr = vllm_weights.read_address(store, timeout_s)
        self.join_nccl(addr["host"], addr["port"], addr["world_size"], timeout_s)

    def receive_nccl(self, version: int) -> None:
        """The nccl transport, per version: receive every bucket the learner's `NcclSender.send_bucket` broadcasts."""
        if self.nccl is None:
            raise RuntimeError("receive_nccl before join_nccl: the NCCL group to the learner is not built")
        metas = [vllm_weights.bucket_meta(self.lay, first, end, self.dtype) for first, end, _, _ in weights.bucket_plan(self.lay)]

        async def native():
            await self.llm.start_weight_update()
            for meta in metas:
                update = nccl_update_info(meta, self.api.nccl_fields)
                await self.llm.update_weights(self.api.UpdateRequest(update_info=update))
            if self.api.finish_takes_version:
                await self.llm.finish_weight_update(weight_version=str(version))
            else:
                await self.llm.finish_weight_update()
                await self._label(version)

        async def extension():
            for meta in metas:
                await self.llm.collective_rpc("covrl_receive_nccl", args=(meta["names"], meta["dtype_names"], meta["shapes"]))
            await self._label(version)

        self._update(version, native if self.nccl == "native" else extension)

    # ---- the ipc transport: a thin layer over common/ipc_weights.py (tested on the CPU there) ----

    def _check_ipc(self) -> None:
        if self.settings.transport == "ipc" and self.tp != 1:
            raise ValueError(f"generator.weight_transport = \"ipc\" maps learner rank 0's GPU slots into one vLLM "
                             f"worker on that GPU, but this generator runs {self.tp} tensor-parallel workers: use "
                             "--tp 1 (one GPU shared with learner rank 0), or weight_transport = \"rpc\" (or "
                             "\"nccl\" on GPUs of its own)")

    def announce_ipc(self, store) -> None:
        """Before the pair channel's rendezvous: the worker's GPU, pid and start time, and this engine's dtype (the
        slots'), so the learner refuses another GPU before it allocates anything."""
        self._check_ipc()
        (ident,) = self._loop.run(self.llm.collective_rpc("covrl_ipc_identity"), self.settings.timeout_s)
        ipc_weights.announce_ipc(store, ident["uuid"], self.dtype, pid=ident["pid"], started=ident["started"],
                                 backend=ident["backend"])

    def map_ipc(self, store, timeout_s: float) -> None:
        """After the rendezvous: wait for the learner's slots (it offers them at its next publish), have the worker
        map them once for this channel's life, and say so (or why not: then the learner frees them at once)."""
        self.unmap_ipc()  # a mapping of an earlier channel (a bench reuses the engine): let go of it first
        handles = ipc_weights.read_slots(store, timeout_s)
        try:
            self._loop.run(self.llm.collective_rpc("covrl_map_ipc", args=(handles,)), timeout_s)
        except BaseException as e:
            _best_effort(lambda: ipc_weights.say_mapped(store, error=f"{type(e).__name__}: {str(e)[:300]}"))
            raise
        ipc_weights.say_mapped(store)
        self._ipc_handles, self._ipc_store, self._ipc_timeout_s = handles, store, timeout_s
        self._ipc_receiver = None  # the signals of this channel start at its bucket 0

    def receive_ipc(self, ch: weights.WeightChannel, version: int) -> None:
        """The ipc transport, per version: under the update's pause, take every bucket's signal, load it out of its
        slot in the worker, acknowledge (`IpcReceiver.receive_version`, on a thread of the loop's executor, so the
        loop keeps serving the per-bucket loads); each signal within the channel's deadline, each load within
        generator.engine_timeout_s."""
        if self._ipc_handles is None:
            raise RuntimeError("receive_ipc before map_ipc: this generator's worker holds no mapping of the learner's "
                               "ipc slots")
        if self._ipc_receiver is None:
            self._ipc_receiver = ipc_weights.IpcReceiver(ch, self.lay, self._ipc_handles)
        receiver, timeout_s = self._ipc_receiver, self._ipc_timeout_s

        def load(b: ipc_weights.StagedBucket) -> None:
            self._loop.run(self.llm.collective_rpc("covrl_load_ipc", args=(b.slot, b.names, b.shapes)),
                           self.settings.timeout_s)

        async def receive():
            await asyncio.get_running_loop().run_in_executor(None, lambda: receiver.receive_version(load, timeout_s))
            await self._label(version)

        self._update(version, receive)

    def unmap_ipc(self) -> None:
        """Best effort: the worker drops its mapping, then the learner is told it may free its slots. If the worker
        could not be asked, nothing is said: the learner frees them once the worker's process is gone."""
        store, self._ipc_store, self._ipc_handles, self._ipc_receiver = self._ipc_store, None, None, None
        if store is None:
            return
        timeout_s = min(self.settings.timeout_s, UNMAP_TIMEOUT_S)
        if _best_effort(lambda: self._loop.run(self.llm.collective_rpc("covrl_unmap_ipc"), timeout_s)):
            _best_effort(lambda: ipc_weights.say_unmapped(store))

    def fingerprint(self, name: str = vllm_weights.FINGERPRINT_PARAM) -> list[float]:
        """`vllm_weights.fingerprint` of one (unfused, unsplit) parameter in every worker."""
        return list(self._loop.run(self.llm.collective_rpc("covrl_fingerprint", args=(name,)), self.settings.timeout_s))

    def close(self) -> None:
        self.unmap_ipc()
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._loop.close()


def _best_effort(op) -> bool:
    """Run `op`; False if it raised (a store whose learner is gone, an engine past its deadline): said in the log."""
    try:
        op()
        return True
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError and EngineTimeout are RuntimeErrors
        log.warning("ipc weights: %s", str(e)[:300])
        return False


class CovrlWorkerExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`); reached through `collective_rpc`.

    Names start with `covrl_` because vLLM refuses an extension attribute that the worker already has.
    `load_weights` is vLLM's loader for checkpoint tensors: it splits for tensor parallelism and fuses
    q/k/v and gate/up. It is the plain path for unquantized models (vLLM's native NCCL path also runs
    the layerwise reload that quantized models need).
    """

    def _covrl_model(self):
        return self.model_runner.get_model()

    def covrl_load_weights(self, names: list[str], shapes: list[list[int]], dtype_name: str, data: bytes,
                           offset: int | None = None) -> None:
        """Load whole parameters; or, with `offset`, one piece of the split parameter `names[0]` starting `offset`
        elements into it: the pieces are put together on this worker's device and the parameter is loaded with its
        last one (`load_weights` takes whole tensors)."""
        flat = from_rpc_bytes(data, dtype_name).to(self.device)
        if offset is not None:
            held = getattr(self, "_covrl_assembling", None)
            if offset == 0:
                held = (names[0], torch.empty(int(np.prod(shapes[0])), dtype=flat.dtype, device=self.device))
            elif held is None or held[0] != names[0]:
                raise RuntimeError(f"covrl_load_weights: a piece of {names[0]} at element {offset} without its "
                                   f"earlier pieces (holding {held and held[0]}): the pieces must come in order")
            held[1][offset:offset + flat.numel()].copy_(flat)
            done = offset + flat.numel() == held[1].numel()
            self._covrl_assembling = None if done else held
            if not done:
                return
            flat = held[1]
        parts = weights.shaped(flat, [tuple(s) for s in shapes])
        self._covrl_model().load_weights(list(zip(names, parts, strict=True)))

    def covrl_init_nccl(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank_offset + self.rank,
                                          world_size=world_size)
        self._covrl_nccl = PyNcclCommunicator(pg, device=self.device)

    def covrl_receive_nccl(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        model, stream = self._covrl_model(), torch.cuda.current_stream()
        for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            self._covrl_nccl.broadcast(t, src=0, stream=stream)
            model.load_weights([(name, t)])

    # The ipc transport (common/ipc_weights.py): this worker's end of the learner's staging slots.

    def covrl_ipc_identity(self) -> dict:
        """This worker's GPU, pid and start time, for the learner's placement check and its slots' lifetime."""
        return ipc_weights.worker_identity(self.device)

    def covrl_map_ipc(self, handles: bytes) -> None:
        """Map the learner's slots once per channel (plain JSON fields, never a pickle)."""
        self._covrl_ipc = ipc_weights.map_slots(handles, self.device)

    def covrl_load_ipc(self, slot: int, names: list[str], shapes: list[list[int]]) -> int:
        """One bucket out of `slot` into vLLM's parameters; returns once the copies are done on the GPU, so the slot
        may be acknowledged and overwritten."""
        mapped = getattr(self, "_covrl_ipc", None)
        if mapped is None:
            raise RuntimeError("covrl_load_ipc before covrl_map_ipc: this worker maps no ipc slots")
        return ipc_weights.load_slot(mapped, slot, names, shapes, self._covrl_model().load_weights)

    def covrl_unmap_ipc(self) -> None:
        """Drop the mapping (torch drops its importer count with the last reference)."""
        ipc_weights.unmap_slots(getattr(self, "_covrl_ipc", None))
        self._covrl_ipc = None

    def covrl_fingerprint(self, name: str) -> float:
        params = dict(self._covrl_model().named_parameters())
        if name not in params:
            raise KeyError(f"vLLM's model has no parameter {name!r} (it fuses q/k/v and gate/up); fingerprint an "
                           f"unfused one such as {vllm_weights.FINGERPRINT_PARAM!r}")
        return vllm_weights.fingerprint(params[name])


# ---- the generator role of hardware/check.py -------------------------------------------------


def _self_check(argv: list[str] | None = None) -> int:
    """`python -m actors.vllm_engine --check ...`: one generator for hardware/check.py. Joins the learner role's
    weight channel as generator 0 of incarnation `--incarnation` (as an actor does), loads the version it is sent,
    generates the prompts it is given, writes what it saw as JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m actors.vllm_engine")
    ap.add_argument("--check", action="store_true", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True, help="host:port of the learner's weight-channel store")
    ap.add_argument("--incarnation", default="gpu_check", help="this generator's pair channel: weights.pair_prefix(0, this)")
    ap.add_argument("--transport", choices=TRANSPORTS, required=True)
    ap.add_argument("--job", required=True, help="JSON: prompts, n, temperature, top_p, max_new_tokens, dtype, max_model_len")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--nccl-extension", action="store_true", help="receive NCCL updates through CovrlWorkerExtension")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from actors.engine import stop_token_ids

    with open(args.job) as f:
        job = json.load(f)
    stops = stop_token_ids(AutoTokenizer.from_pretrained(args.model), args.model)
    api = vllm_api()
    if args.nccl_extension:
        api.native_nccl = False  # what an older vLLM without the weight-transfer API gets
    engine = VllmEngine(args.model, stop_ids=stops, api=api,
                        settings=VllmSettings(transport=args.transport, dtype=job["dtype"], enforce_eager=True,
                                              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=job["max_model_len"]))
    try:
        ch = engine.join_weights(args.weights, weights.pair_prefix(0, args.incarnation), 600)
        got = ch.receive_header(engine.lay)
        if got is None:
            raise RuntimeError("the learner stopped the weight channel before sending version 1")
        version, flags = got
        t0 = time.perf_counter()
        received = engine.receive_weights(ch, engine.lay, version, flags)
        if received is not None:  # the rpc transport: the vector is here; time its load into the workers
            t0 = time.perf_counter()
            engine.load_flat(received[0], version)
        load_s = time.perf_counter() - t0
        fp = engine.fingerprint()
        sp = SamplingParams(temperature=job["temperature"], top_p=job["top_p"], max_new_tokens=job["max_new_tokens"])
        t0 = time.perf_counter()
        groups = engine.generate(job["prompts"], job["n"], sp, list(range(len(job["prompts"]))))
        gen_s = time.perf_counter() - t0
        comps = [c for g in groups for c in g]
        out = {"version": engine.version, "fingerprint": fp, "load_s": load_s, "gen_s": gen_s,
               "tokens": [c.token_ids.tolist() for c in comps], "logprobs": [c.logprobs.tolist() for c in comps],
               "versions": [c.versions.tolist() for c in comps]}
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, args.out)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(_self_check())
