"""Memory you can see before you spend it: the bytes each role of a run will hold, from the config and the model's
shape alone (no GPU, no weights read), so `covrl plan` can plan a run on a laptop and `covrl run` can refuse one that
will not fit before anything starts.

Every term is a `Term`: a name, its bytes, the config knob that changes it and where its formula comes from. The
formulas (bytes; Psi = parameters, T = tokens of one micro-batch, Nd = learner ranks, b = bytes per element of the
model's dtype, "auto" as the planned machine resolves it: `Machine.learner_capability`):

- **Model states per learner rank** (ZeRO, Rajbhandari et al. 2020, section 3.1 and figure 1): mixed-precision AdamW
  keeps 2 Psi of bf16 parameters, 2 Psi of bf16 gradients and 12 Psi of optimizer states (the fp32 master copy,
  momentum and variance); an fp32 model keeps 4 Psi + 4 Psi + 8 Psi (no master copy). ZeRO-1 divides the optimizer
  states by Nd, ZeRO-2 the gradients too, ZeRO-3 the parameters too; `learner.offload_optimizer` moves the optimizer
  states (and the step) to the host. ZeRO-3 also gathers the modules it is about to run: the larger of two decoder
  layers and the embedding, at most `stage3_max_live_parameters` (an estimate of its prefetch at its defaults). DeepSpeed's own communication
  buckets: ZeRO-1/2 reduce and gather in buckets of `reduce_bucket_size` / `allgather_bucket_size` elements
  (DeepSpeed's defaults: learner/trainer.py `ds_config` sets neither; `DS_BUCKET_NUMEL` here); with bf16 DeepSpeed
  accumulates gradients in fp32 (4 Psi / Nd under ZeRO-1/2, 4 Psi without ZeRO: an estimate).
- **Activations** (counted from the tensors autograd saves in one Qwen2 / Llama decoder layer; Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4, did the same count for GPT), per
  token and layer: the two RMSNorms save their fp32 input and their output (2 x (4 h + b h)); q before and after
  rotary (2 b h), k before and after (2 b kv d), v (b kv d), the attention output (b h), its log-sum-exp (4 a);
  the MLP's gate and up outputs, the SiLU output and the product (4 b i). With `learner.gradient_checkpointing` each
  layer keeps only its input (b h) and one layer's full set lives during its backward. Attention that builds a
  dense mask (`sdpa`, `eager`: `learner.attn_implementation`) adds T^2 bytes of boolean mask per micro-batch and,
  per layer, sdpa's additive copy (2 b T^2, an upper bound of what the CPU measures), and `eager` a x T^2 scores
  per layer in the compute dtype (twice: scores and probabilities); `varlen` / flash-attention 2 attend each
  packed sample alone and add nothing. The per-token count matches what autograd saves in one layer of the
  built-in model to 0.1 % in fp32 and 4 % in bf16 (tests/unit/test_memplan.py measures it).
- **The head**: log pi(target) and the entropy come out of the LM head a chunk of `learner.logprob_chunk_tokens`
  tokens at a time: the chunk's logits in the compute dtype and fp32 log-softmax, probabilities and their gradient
  (chunked: 3 fp32 copies; fused: 2, learner/fused_head.py), C x V each.
- **Weights publisher**: one reused bucket of `BUCKET_NUMEL` elements on learner rank 0's GPU in the wire dtype;
  with `generator.weight_transport = "ipc"` two staging slots of that size; on the host of rank 0, a copy of the
  whole model in the wire dtype only while a generator receives over gloo (`rpc`: learner/publisher.py HostCopy).
- **Reference model** (`learner.kl.coef > 0`): a whole unsharded replica per learner GPU, Psi x b.
- **Runtime**: the CUDA context, NCCL's buffers and the allocator's reserve per GPU process, `CUDA_RUNTIME_BYTES`
  (an estimate: about 1 GiB on an H100 with torch 2.11).
- **Host**: each learner rank loads the whole model on the host before DeepSpeed places it (Psi x b, transient, all
  ranks of a node at once); offloaded optimizer states; rank 0's host copy; each generator's process.
- **vLLM generator**: vLLM takes `generator.gpu_memory_utilization` of each of its GPUs; in it the weights (Psi x b /
  tp), its profiled activation peak (`VLLM_WORKSPACE_BYTES` + the LM head's logits for `max_num_seqs` rows, an
  estimate) and, with CUDA graphs, their pools (`VLLM_GRAPH_BYTES`, estimate); the rest is KV cache, 2 x layers x
  kv_heads x head_dim x b / tp bytes a token: the plan says how many sequences of prompt + `rollout.max_new_tokens`
  tokens that holds against `generator.max_num_seqs`.

Estimates are named as such in `Term.source`; the GPU proof's `learner` and `generation` stages record the measured
peaks beside the plan (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from common.config import BF16_CAPABILITY, resolve_dtype, with_dtype

GiB = 1 << 30
BUCKET_NUMEL = 32 * 1024 * 1024  # common/weights.py BUCKET_NUMEL (checked by a test)
DS_BUCKET_NUMEL = 500_000_000  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size (ds_config sets none)
ZERO3_MAX_LIVE = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters
CUDA_RUNTIME_BYTES = 1 * GiB  # CUDA context + NCCL + allocator reserve per GPU process (estimate)
VLLM_WORKSPACE_BYTES = 1 * GiB  # vLLM's profiled activation peak besides the logits (estimate)
VLLM_GRAPH_BYTES = GiB // 2  # CUDA graph pools when generator.enforce_eager is off (estimate)
VLLM_HOST_BYTES = 4 * GiB  # a vLLM generator process on the host (estimate)
TORCH_GEN_HOST_BYTES = 400 << 20  # a torch generator process besides its model and cache (calibrated as above:
# 495-508 MiB measured, 395-408 MiB of it besides the terms)
LEARNER_HOST_BYTES = {"cuda": 2 * GiB, "cpu": 560 << 20}  # a learner rank's process besides its model's terms: on a
# GPU node an estimate (CUDA, NCCL and DeepSpeed's libraries); on the CPU calibrated from the built-in model's
# measured peak RSS (tests/bench/test_bench_memplan.py, two runs of 2026-12-07: 586-646 MiB, 523-575 MiB of it
# besides the terms)
HEADROOM = 0.90  # a plan fits when every total is at most this share of the device
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape (Qwen2 / Llama family), from its config.json."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        heads = c["num_attention_heads"]
        return cls(layers=c["num_hidden_layers"], hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                   heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads, vocab=c["vocab_size"],
                   tied=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")))

    @classmethod
    def from_model_dir(cls, path: str) -> "Shape":
        cfg = os.path.join(path, "config.json")
        if not os.path.exists(cfg):
            raise FileNotFoundError(f"{cfg} does not exist: model.path must be a model directory with a config.json "
                                    "(the plan reads the model's shape from it)")
        try:
            with open(cfg) as f:
                return cls.from_config(json.load(f))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            from common.config import ConfigError

            raise ConfigError(f"{cfg} does not give a decoder's shape ({type(e).__name__}: {e}): the plan needs "
                              "num_hidden_layers, hidden_size, intermediate_size, num_attention_heads and vocab_size "
                              "(a Qwen2 / Llama-style config.json)") from None

    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden


# Qwen2.5 shapes (their config.json on the Hugging Face hub), for planning without the weights at hand.
KNOWN = {
    "qwen2.5-0.5b": Shape(24, 896, 4864, 14, 2, 64, 151936, True, True),
    "qwen2.5-1.5b": Shape(28, 1536, 8960, 12, 2, 128, 151936, True, True),
    "qwen2.5-7b": Shape(28, 3584, 18944, 28, 4, 128, 152064, False, True),
    "qwen2.5-32b": Shape(64, 5120, 27648, 40, 8, 128, 152064, False, True),
}


def shape_of(model_path: str) -> Shape:
    """The shape in `model_path`'s config.json, or, where the directory is not here, a known shape its name ends in
    (models/Qwen2.5-7B -> qwen2.5-7b)."""
    if not model_path:
        from common.data import BUILTIN_MODEL

        model_path = BUILTIN_MODEL
    if os.path.isdir(model_path):
        return Shape.from_model_dir(model_path)
    name = os.path.basename(os.path.normpath(model_path)).lower()
    if name in KNOWN:
        return KNOWN[name]
    raise FileNotFoundError(f"model.path {model_path!r} is not a directory here and its name is none of the shapes "
                            f"the plan knows ({', '.join(KNOWN)}): plan where the model is, or name one of those")


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    knob: str  # the setting that changes it
    source: str  # where the formula comes from ("estimate" when it is one)


@dataclass
class Device:
    """One device's plan: a GPU (its roles' terms) or a node's host memory."""

    name: str
    capacity: float | None  # bytes; None: not known (nothing is checked)
    terms: list[Term] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Other moments' peaks on this device, each a whole (e.g. ZeRO-3's start-up, when every GPU holds the whole model
    # before DeepSpeed partitions it): the device must hold the largest of them and of the step's `terms`.
    peaks: list[Term] = field(default_factory=list)

    @property
    def step_total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def total(self) -> float:
        return max([self.step_total] + [t.bytes for t in self.peaks])

    @property
    def largest(self) -> Term:
        """The term to change: the step's largest, or a moment's whole peak when that is what does not fit."""
        worst = max(self.peaks, key=lambda t: t.bytes, default=None)
        if worst is not None and worst.bytes > self.step_total:
            return worst
        return max(self.terms, key=lambda t: t.bytes)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= HEADROOM * self.capacity


@dataclass
class Plan:
    devices: list[Device]

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def first_misfit(self) -> Device | None:
        return next((d for d in self.devices if not d.fits), None)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a resolved dtype: "auto" has none until `plan` resolves it for its machine."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} has no size here: the plan resolves model.dtype = \"auto\" for its machine "
                         "first (`plan`, `Machine.learner_capability`)")
    return DTYPE_BYTES[dtype]


def model_states(cfg, shape: Shape, ranks: int) -> list[Term]:
    """Parameters, gradients and optimizer states on one learner GPU (ZeRO paper, section 3.1)."""
    L, psi, b = cfg.learner, shape.params, dtype_bytes(cfg.model.dtype)
    stage = L.zero_stage
    opt = (12 if b == 2 else 8) * psi  # fp32 master (mixed precision only), momentum, variance
    src = "ZeRO paper (Rajbhandari et al. 2020) section 3.1"
    params = b * psi / (ranks if stage >= 3 else 1)
    grads = b * psi / (ranks if stage >= 2 else 1)
    terms = [Term("parameters", params, "learner.zero_stage" if ranks > 1 else "model.dtype", src),
             Term("gradients", grads, "learner.zero_stage" if ranks > 1 else "model.dtype", src)]
    if not L.offload_optimizer:
        terms.append(Term("optimizer states", opt / (ranks if stage >= 1 else 1),
                          "learner.offload_optimizer" if stage else "learner.zero_stage", src))
    if stage in (0, 1, 2) and b == 2:
        terms.append(Term("fp32 gradient accumulation", 4 * psi / (ranks if stage else 1), "learner.zero_stage",
                          "DeepSpeed's bf16 optimizers accumulate gradients in fp32 (estimate)"))
    if stage in (1, 2):
        terms.append(Term("ZeRO communication buckets", 2 * min(DS_BUCKET_NUMEL, psi) * b, "learner.zero_stage",
                          "DeepSpeed's default reduce and allgather buckets, 5e8 elements each at most"))
    if stage == 3:
        live = min(ZERO3_MAX_LIVE, max(2 * shape.layer_params(), shape.vocab * shape.hidden))
        terms.append(Term("ZeRO-3 gathered parameters", live * b, "learner.zero_stage",
                          "two decoder layers or the embedding gathered at once (estimate)"))
    return terms


def layer_activation_bytes(shape: Shape, b: int) -> float:
    """Bytes one token leaves saved for the backward in one decoder layer (the count in the module doc)."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim
    norms = 2 * (4 * h + b * h)
    attn = 2 * b * h + 3 * b * kv + b * h + 4 * shape.heads
    mlp = 4 * b * i
    return norms + attn + mlp


def resolved_attention(cfg, cuda: bool) -> str:
    a = cfg.learner.attn_implementation
    if a != "auto":
        return a
    return "varlen" if cuda and cfg.model.dtype in ("bfloat16", "float16") else "sdpa"


def activations(cfg, shape: Shape, cuda: bool) -> list[Term]:
    """One micro-batch's activations and the head's chunk on a learner GPU (or host, on the CPU)."""
    L, b = cfg.learner, dtype_bytes(cfg.model.dtype)
    T, per_layer = L.micro_batch_tokens, layer_activation_bytes(shape, b)
    src = "saved tensors of a decoder layer (module doc; Korthikanti et al. 2022 section 4)"
    if L.gradient_checkpointing:
        body = T * (shape.layers * b * shape.hidden + per_layer)
        terms = [Term("activations (checkpointed)", body, "learner.micro_batch_tokens", src)]
    else:
        terms = [Term("activations", T * shape.layers * per_layer, "learner.gradient_checkpointing", src)]
    attn = resolved_attention(cfg, cuda)
    if attn in ("sdpa", "eager"):
        layers = 1 if L.gradient_checkpointing else shape.layers
        terms.append(Term("dense attention masks", T * T * (1 + 2 * b * layers), "learner.attn_implementation",
                          "transformers' [T x T] boolean block-causal mask of a packed row, and per layer sdpa's "
                          "additive copy (measured on the CPU: 5-8 bytes per entry for one fp32 layer; 2 b + 1 here)"))
    if attn == "eager":
        scores = 2 * shape.heads * T * T * b * (1 if L.gradient_checkpointing else shape.layers)
        terms.append(Term("attention scores", scores, "learner.attn_implementation",
                          "eager attention keeps scores and probabilities, [heads x T x T] per layer"))
    fused = L.logprob_head == "fused" or (L.logprob_head == "auto" and cuda)
    C = min(L.logprob_chunk_tokens, T)
    terms.append(Term("LM head chunk", C * shape.vocab * (b + 4 * (2 if fused else 3)), "learner.logprob_chunk_tokens",
                      "a chunk's logits and their fp32 log-softmax, probabilities and gradient"))
    return terms


def learner_gpu(cfg, shape: Shape, ranks: int, rank: int, cuda: bool = True) -> list[Term]:
    """Every term on learner rank `rank`'s GPU."""
    b = dtype_bytes(cfg.model.dtype)
    terms = model_states(cfg, shape, ranks) + activations(cfg, shape, cuda)
    if rank == 0:
        slots = 3 if cfg.generator.weight_transport == "ipc" else 1
        terms.append(Term("weight publisher buckets", slots * min(BUCKET_NUMEL, shape.params) * b,
                          "generator.weight_transport", "one reused bucket (+ two IPC staging slots), "
                          "learner/publisher.py"))
    if cfg.learner.kl.coef > 0:
        terms.append(Term("reference model", shape.params * b, "learner.kl.coef",
                          "an unsharded replica per learner GPU"))
    terms.append(Term("CUDA runtime", CUDA_RUNTIME_BYTES, "-", "CUDA context, NCCL, allocator reserve (estimate)"))
    return terms


def learner_peaks(cfg, shape: Shape) -> list[Term]:
    """Moments besides the step: without `deepspeed.zero.Init` (learner/trainer.py), `deepspeed.initialize` moves the
    whole model to each GPU before ZeRO-3 partitions it."""
    if cfg.learner.zero_stage < 3:
        return []
    b = dtype_bytes(cfg.model.dtype)
    whole = shape.params * b * (2 if cfg.learner.kl.coef > 0 else 1) + CUDA_RUNTIME_BYTES
    return [Term("start-up: the whole model on the GPU before ZeRO-3 partitions it", whole, "learner.zero_stage",
                 "deepspeed.initialize moves the module to the GPU first; covrl does not use zero.Init")]


def learner_host(cfg, shape: Shape, ranks: int, rank: int, gloo_peer: bool, cuda: bool = True) -> list[Term]:
    """A learner rank's host bytes: the model it loads, offloaded optimizer states, rank 0's host copy."""
    b = dtype_bytes(cfg.model.dtype)
    terms = [Term(f"learner {rank}: model loaded on the host", shape.params * b, "model.dtype",
                  "every rank loads the whole model before DeepSpeed places it"),
             Term(f"learner {rank}: process", LEARNER_HOST_BYTES["cuda" if cuda else "cpu"], "-",
                  "torch, DeepSpeed, data: estimated on GPUs, calibrated on the CPU")]
    if cfg.learner.offload_optimizer:
        terms.append(Term(f"learner {rank}: offloaded optimizer states", (12 if b == 2 else 8) * shape.params / ranks,
                          "learner.offload_optimizer", "ZeRO-Offload keeps the fp32 master and AdamW states here"))
    if rank == 0 and gloo_peer:
        terms.append(Term("learner 0: host copy of the weights", shape.params * b,
                          "generator.weight_transport", "learner/publisher.py HostCopy, while a gloo peer receives"))
    return terms


def kv_bytes_per_token(shape: Shape, b: int, tp: int) -> float:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * b / tp


def sequence_tokens(cfg) -> int:
    return cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


def vllm_gpu(cfg, shape: Shape, tp: int, gpu_bytes: float | None) -> tuple[list[Term], list[str]]:
    """A vLLM generator's share of one of its GPUs, and what its KV cache holds."""
    b = dtype_bytes("bfloat16" if cfg.model.dtype == "float32" else cfg.model.dtype)
    weights = shape.params * b / tp
    logits = cfg.generator.max_num_seqs * shape.vocab * 4 / tp
    work = VLLM_WORKSPACE_BYTES + logits + (0 if cfg.generator.enforce_eager else VLLM_GRAPH_BYTES)
    notes: list[str] = []
    if gpu_bytes is None:
        terms = [Term("vLLM weights", weights, "--tp", "parameters / tp"),
                 Term("vLLM activations and graphs", work, "generator.max_num_seqs", "estimate")]
        return terms, ["KV cache: give --gpu-memory to see how many sequences it holds"]
    budget = cfg.generator.gpu_memory_utilization * gpu_bytes
    kv = budget - weights - work - CUDA_RUNTIME_BYTES
    per_seq = kv_bytes_per_token(shape, b, tp) * sequence_tokens(cfg)
    seqs = max(0.0, kv) / per_seq
    terms = [Term("vLLM weights", weights, "--tp", "parameters / tp"),
             Term("vLLM activations and graphs", work, "generator.max_num_seqs", "estimate"),
             Term("vLLM KV cache", max(0.0, kv), "generator.gpu_memory_utilization",
                  "the rest of gpu_memory_utilization x the GPU"),
             Term("CUDA runtime", CUDA_RUNTIME_BYTES, "-", "CUDA context, allocator reserve (estimate)")]
    if kv <= 0:
        notes.append(f"the weights and workspace leave no KV cache in {cfg.generator.gpu_memory_utilization:.2f} of the "
                     "GPU: raise generator.gpu_memory_utilization or --tp")
    notes.append(f"KV cache holds {seqs:.0f} sequences of {sequence_tokens(cfg)} tokens (max_prompt_tokens + "
                 f"max_new_tokens) against generator.max_num_seqs = {cfg.generator.max_num_seqs}"
                 + ("" if seqs >= cfg.generator.max_num_seqs else
                    ": vLLM will run fewer at full length (preempting longer ones); lower max_num_seqs or raise --tp"))
    return terms, notes


def torch_generator(cfg, shape: Shape) -> list[Term]:
    """The torch engine: its model and a KV cache of max_num_seqs rows of prompt + max_new_tokens."""
    b = dtype_bytes(cfg.model.dtype)
    return [Term("torch generator model", shape.params * b, "model.dtype", "parameters"),
            Term("torch generator KV cache", kv_bytes_per_token(shape, b, 1) * sequence_tokens(cfg)
                 * cfg.generator.max_num_seqs, "generator.max_num_seqs",
                 "max_num_seqs rows of prompt + max_new_tokens (actors/continuous.py)")]


@dataclass(frozen=True)
class Machine:
    """Where the run is planned: GPUs per node and their memory, host memory per node (None: unknown)."""

    gpus: int
    gpu_bytes: float | None
    host_bytes: float | None
    # The oldest compute capability (major, minor) of its GPUs; None: not known (a machine described, Ray's nodes).
    capability: tuple[int, int] | None = None

    def learner_capability(self) -> tuple[int, int] | None:
        """What `model.dtype = "auto"` is resolved against (common/config.py `resolve_dtype`): None where the learner
        ranks run on the CPU (no GPUs), the GPUs' capability where known, else sm80: a machine described is taken to
        have the GPUs covrl is run on (A100, H100, H200)."""
        if not self.gpus:
            return None
        return self.capability or BF16_CAPABILITY


def plan(cfg, shape: Shape, learners: int, gens: int, tp: int, machine: Machine) -> Plan:
    """The plan of a run placed as the launcher places it on one node (`common/runfiles.py:place_gpus`): learner ranks
    on GPUs 0 .. L-1, then generators --tp GPUs each, or, where the GPUs are too few, generators sharing the learners'
    GPUs (colocated: vLLM's gpu_memory_utilization of the GPU beside the learner's terms); no GPUs: everything on
    the host. `model.dtype = "auto"` is planned as the machine resolves it (`Machine.learner_capability`)."""
    cfg = with_dtype(cfg, resolve_dtype(cfg.model.dtype, machine.learner_capability()))
    host = Device("host", machine.host_bytes)
    gloo_peer = cfg.generator.weight_transport == "rpc"
    for r in range(learners):
        host.terms += learner_host(cfg, shape, learners, r, gloo_peer, cuda=machine.gpus > 0)
    if machine.gpus == 0:
        for r in range(learners):
            host.terms += [Term(f"learner {r}: {t.name}", t.bytes, t.knob, t.source)
                           for t in learner_gpu(cfg, shape, learners, r, cuda=False) if t.name != "CUDA runtime"]
        for g in range(gens):
            host.terms += [Term(f"generator {g}: {t.name}", t.bytes, t.knob, t.source) for t in torch_generator(cfg, shape)]
            host.terms.append(Term(f"generator {g}: process", TORCH_GEN_HOST_BYTES, "-", "calibrated on the CPU"))
        return Plan([host])
    from common.runfiles import colocated_memory_fractions, place_gpus

    placed = place_gpus(machine.gpus, learners, gens, tp)  # the launcher's own placement (PlacementError if none)
    gpu = [Device(f"GPU {i}", machine.gpu_bytes) for i in range(machine.gpus)]
    for r, (i,) in enumerate(placed.learners):
        gpu[i].name += f" learner {r}"
        gpu[i].terms += learner_gpu(cfg, shape, learners, r)
        gpu[i].peaks += learner_peaks(cfg, shape)
    use_vllm = cfg.generator.engine != "torch"
    for g, where in enumerate(placed.generators):
        for i in where:
            gpu[i].name += f" generator {g}" + (" (colocated)" if placed.colocated else "")
            if use_vllm:
                terms, notes = vllm_gpu(cfg, shape, tp, machine.gpu_bytes)
                gpu[i].terms += terms
                gpu[i].notes += [f"generator {g}: {n}" for n in notes]
            else:
                gpu[i].terms += torch_generator(cfg, shape)
        host.terms.append(Term(f"generator {g}: process", VLLM_HOST_BYTES if use_vllm else TORCH_GEN_HOST_BYTES,
                               "-", "estimate"))
    if placed.colocated:
        learner_share, _ = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
        for d in gpu:
            if "learner" in d.name and "generator" in d.name:
                d.notes.append(f"colocated: the learner rank's allocator is capped at {learner_share:.2f} of the GPU "
                               "(common/runfiles.py colocated_memory_fractions)")
    return Plan([d for d in gpu if d.terms] + [host])


def refusal(p: Plan) -> str | None:
    """One line naming the device that does not fit, its largest term and the knob that changes it; None if it fits."""
    d = p.first_misfit()
    if d is None:
        return None
    t = d.largest
    label = " ".join(d.name.split()[:2]) if d.name.startswith("GPU") else d.name
    knob = "" if t.knob == "-" else f"; change {t.knob}"
    return (f"the run does not fit {label}: {gib(d.total)} planned of {gib(d.capacity)} ({HEADROOM:.0%} usable); its "
            f"largest term is {t.name}, {gib(t.bytes)}{knob} (covrl plan shows every term)")


def gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def _groups(p: Plan) -> list[tuple[list[Device], Device]]:
    """Devices with the same terms and capacity, together (the learner GPUs of ranks 1 .. L-1, say)."""
    def key(d: Device):
        return d.capacity, [(t.name, round(t.bytes)) for t in d.terms + d.peaks]

    out: list[tuple[list[Device], Device]] = []
    for d in p.devices:
        same = next((members for members, first in out if d.name != "host" and key(first) == key(d)), None)
        if same is None:
            out.append(([d], d))
        else:
            same.append(d)
    return out


def render(p: Plan) -> str:
    """The whole plan: each device (identical ones together), its terms largest first, its total against its
    capacity, and the formulas' sources once at the end."""
    lines, sources = [], {}
    for members, d in _groups(p):
        names = d.name if len(members) == 1 else f"{len(members)} GPUs alike: " + "; ".join(m.name for m in members)
        cap = "" if d.capacity is None else f" of {gib(d.capacity)}"
        verdict = "" if d.capacity is None else ("  fits" if d.fits else "  DOES NOT FIT")
        lines.append(f"{names}: {gib(d.total)}{cap}{verdict}")
        if d.peaks:
            lines.append(f"  the step: {gib(d.step_total)}")
        for t in sorted(d.terms, key=lambda t: -t.bytes):
            ref = sources.setdefault(t.source, len(sources) + 1)
            knob = "" if t.knob == "-" else f"  [{t.knob}]"
            lines.append(f"  {gib(t.bytes):>11}  {t.name}{knob}  ({ref})")
        for t in d.peaks:
            ref = sources.setdefault(t.source, len(sources) + 1)
            lines.append(f"  another moment: {gib(t.bytes)}  {t.name}  ({ref})")
        lines += [f"  note: {n}" for n in d.notes]  # alike devices' notes differ only in the generator's number
    lines.append("sources: " + "; ".join(f"({i}) {s}" for s, i in sources.items()))
    return "\n".join(lines)


def totals_line(p: Plan) -> str:
    """The banner's line: each group of alike devices' total against its capacity."""
    parts = []
    for members, d in _groups(p):
        label = ("host" if d.name == "host" else
                 " ".join(d.name.split()[:2]) if len(members) == 1 else f"{len(members)} GPUs like {d.name.split(' ', 2)[1]}")
        parts.append(f"{label} {gib(d.total)}" + ("" if d.capacity is None else f" of {gib(d.capacity)}"))
    return "memory plan: " + ", ".join(parts) + " (covrl plan: every term)"
