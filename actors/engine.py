"""Generation engines: the one interface every generator process drives.

`Engine.generate(prompts, n, sampling, seeds, before_forward)` returns, for
each prompt, n completions with per-token behaviour logprobs *of the
distribution actually sampled from* (after temperature and top-p
renormalisation: that is pi_behav in the importance weights; temperature 0 is
greedy decoding, used by evaluation, with untempered logprobs) and the policy
version of the weights that produced each token. `before_forward` runs before
every model call so an actor can swap in new weights mid-generation; tokens
after the swap carry the new version (PipelineRL-style in-flight updates; the
KV cache of earlier tokens is kept, as there).

`TorchEngine` is a torch sampler with a KV cache over a
transformers causal LM, on the CPU or on one CUDA device (`device=`; `actors/factory.load_engine` picks this process's GPU when
the launcher gave it one). vLLM (actors/vllm_engine.py) is the fast GPU engine; the torch engine is the
reference, the CPU engine, and the GPU fallback where vLLM cannot be installed (`generator.engine = "torch"`).
Every tensor of a generation lives on the model's device; the completions are copied to the host once, at the
end of `generate`.

Sampling is Gumbel-max with counter-based noise keyed on (row seed, step,
token id), so a row's sample depends on its seed and logits only - not on the
other rows of the batch, on a global RNG or on the device. That makes a re-issued prompt
reproduce its sample under the same weights, and makes the staleness-0 run
match the synchronous reference loop exactly. The noise is integer hashing (bit-identical on every
device) followed by two float64 logarithms (each within about an ulp on CPU and CUDA), so CPU and CUDA noise
agree to ~1e-15 and draw the same samples from the same logits; what differs between devices is the logits
themselves (float32 kernels reduce in different orders, ~1e-6; TF32 matmuls, if a process enables them, ~1e-3),
which flips a sample only when two perturbed scores tie that closely.

For Llama-style decoders (Qwen2, Llama: the demo model and the usual RL bases) the
engine runs the model's own modules through `_StaticKV`: each prompt is prefilled
once for its n samples, the KV cache is allocated once for prompt +
max_new_tokens, and a decode step is a 1-query attention over it. A transformers
forward rebuilds its 4-D mask and concatenates every layer's cache at each step,
which on CPU costs more than the small matmuls themselves; the fast path is ~1.7x
`model.generate` on the demo model (tests/bench/test_bench_generation.py). Other
architectures take `model(...)` with a DynamicCache. Both paths give the same
logprobs to float rounding (fp32: within 2e-5, same tokens).
"""

from __future__ import annotations

import datetime
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

from common import weights
from common.messages import SamplingParams

_M32 = 0xFFFFFFFF
log = logging.getLogger("covrl.engine")


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    versions: np.ndarray  # int32 [T]
    finish_reason: str  # "stop" | "length"
    # Sum over the response's tokens of the sampling distribution's entropy (nats), under the version that generated
    # them: held-out evaluations log it as on-policy entropy. None where the engine does not measure it (vLLM).
    entropy: float | None = None


class Engine(ABC):
    """What a generator process drives: generation, and taking in the learner's new weights.

    `version` is the policy version of the weights the engine holds. It stamps every token, and it is the one
    owner of the policy version in a generator process (actors/actor.py reads it, never copies it); only the
    engine sets it, as it loads a version (`load_flat`, or a direct receive).

    Weights come over this generator's pair channel to learner rank 0 (`common/weights.py`): the actor's weight
    thread calls `join_weights` once, then `receive_weights` after each header. By default the buckets come over
    gloo into a host vector that `receive_weights` returns and the main thread hands to `load_flat` between
    forwards (the torch engine; vLLM with the rpc transport). An engine whose weights bypass this process (vLLM
    with the nccl transport) overrides the rendezvous hooks, to announce its receiver before the rendezvous and
    join its own group after it, and loads each version flagged `weights.FLAG_DIRECT` itself, from the weight thread.
    """

    model: torch.nn.Module  # the architecture; `weights.layout(engine.model)` is the weight channel's layout
    version: int

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        before_forward: Callable[[], None] | None = None,
    ) -> list[list[Completion]]: ...

    @abstractmethod
    def load_flat(self, flat: torch.Tensor, version: int) -> None:
        """Load a flat parameter vector (layout order) as `version`, in the wire dtype it arrived in (fp32, bf16 or
        fp16: the learner's model's, `weights.wire_dtype`). Must not keep `flat` after returning: the weight receiver
        reuses its memory for the next version."""

    # ---- streaming: what a generator that keeps its engine full drives (actors/actor.py) ----

    max_num_seqs: int = 256  # sequences the engine generates at once (its capacity; generator.max_num_seqs)

    def submit(self, key, prompt: Sequence[int], n: int, sampling: SamplingParams, seed: int) -> None:
        """Queue one group, a prompt's n samples; `collect` returns it under `key` once all n have finished."""
        self.__dict__.setdefault("_batch", []).append((key, prompt, n, sampling, seed))

    def collect(self, wait_s: float, before_forward: Callable[[], None]) -> list[tuple[object, list[Completion]]]:
        """Groups that finished since the last call, as (key, completions), each once. Waits at most about
        `wait_s` when none has (an engine that generates on the caller's thread returns after a step of work
        instead), calling `before_forward` before every forward or between polls, as `generate` does.

        This default serves an engine without a scheduler of its own in batches: every queued group with the first
        one's sampling parameters is generated as one batch, and the whole batch is returned at its end."""
        queued = self.__dict__.get("_batch") or []
        if not queued:
            return []
        sampling = queued[0][3]
        now = [q for q in queued if q[3] == sampling]
        self._batch = [q for q in queued if q[3] != sampling]
        groups = self.generate([q[1] for q in now], now[0][2], sampling, [q[4] for q in now], before_forward) \
            if len({q[2] for q in now}) == 1 else \
            [self.generate([q[1]], q[2], sampling, [q[4]], before_forward)[0] for q in now]
        return [(q[0], g) for q, g in zip(now, groups)]

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet collected."""
        return len(self.__dict__.get("_batch") or [])

    def join_weights(self, weight_addr: str, prefix: str, timeout_s: float) -> weights.WeightChannel:
        """This generator's channel to learner rank 0: the generator's end of the pair channel under `prefix`
        (`weights.pair_prefix`) in the learner's store at `weight_addr`. Blocks until the learner has joined it too."""
        host, port = weight_addr.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        pair = dist.PrefixStore(prefix, store)
        self._before_weight_rendezvous(pair)
        ch = weights.WeightChannel(host, int(port), weights.GENERATOR_RANK, weights.PAIR_WORLD, timeout_s, prefix=prefix,
                                   store=store)
        self._after_weight_rendezvous(pair, timeout_s)
        return ch

    def _before_weight_rendezvous(self, store: dist.Store) -> None:
        """Tell the learner, in the pair channel's store, what it must know before it admits this channel."""

    def _after_weight_rendezvous(self, store: dist.Store, timeout_s: float) -> None:
        """Join whatever else the learner builds for this channel once it has admitted it."""

    def receive_weights(self, ch: weights.WeightChannel, lay: weights.Layout, version: int, flags: int,
                        out: torch.Tensor | None = None) -> tuple[torch.Tensor, float] | None:
        """The buckets that follow a header of `version`: (flat host vector in the wire dtype the header named,
        checksum), for `load_flat` between forwards; or None when the engine has loaded `version` itself (then
        `self.version == version`). `out`: a free vector of the model's size to receive into (used when it has
        the wire dtype)."""
        weights.refuse_direct(flags, f"this generator's {type(self).__name__}")
        return ch.receive_buckets(lay, out)


def hash32(x):
    """A 32-bit integer mixer on int64 tensors, or on Python ints (the same values; products stay below 2**63)."""
    x = x & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """`hash32` in place, for a large tensor the caller owns (the same values, no temporaries per round)."""
    x.bitwise_and_(_M32)
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def gumbel_noise(row_seeds: torch.Tensor, step, vocab: int) -> torch.Tensor:
    """[B, V] standard Gumbel noise, a pure function of (row seed, step, token id), on `row_seeds`' device; `step`
    an int, or each row's own step ([B] int64: the continuous batch, whose rows are at different steps).

    Integer hashing in int64 (exact on every device), then float64 `log` twice: CPU and CUDA agree to an ulp or
    two, so logits + noise have the same argmax. The step's hash is a Python int: no host tensor
    per decode step."""
    base = hash32(hash32(row_seeds) ^ hash32(step + 0x632BE5AB))  # [B]
    cols = torch.arange(vocab, dtype=torch.int64, device=row_seeds.device) * 0x9E3779B1
    u = _hash32_(base[:, None] + cols[None, :]).double().add_(0.5).mul_(2.0**-32)  # (0, 1); 2**-32 is exact
    return u.log_().neg_().log_().neg_()


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[B, V] log-probabilities of the distribution we sample from (-inf outside top-p)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    cum = sorted_logp.exp().cumsum(dim=-1)
    drop_sorted = (cum - sorted_logp.exp()) >= top_p  # keep the smallest prefix reaching top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def forced_lengths(rseeds: torch.Tensor, median: int, sigma: float, cap: int) -> torch.Tensor:
    """[B] response lengths of the generation-heavy benchmark workload: round(median x exp(sigma x z)) with z
    standard normal (Box-Muller on two hashes of each row's seed, so a row's length is a pure function of its seed),
    clipped to 1 .. cap. The mean is median x exp(sigma^2 / 2); the longest of B rows is about
    median x exp(sigma x sqrt(2 ln B))."""
    u1 = (hash32(rseeds ^ 0x5BD1E995).double() + 0.5) * 2.0**-32
    u2 = (hash32(rseeds ^ 0x1B873593).double() + 0.5) * 2.0**-32
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return (median * torch.exp(sigma * z)).round().clamp(1, cap).long()


def row_seeds(seeds: Sequence[int], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Seed of sample j of prompt i: mixes the prompt seed with j. [len(seeds) * n] int64 on `device`."""
    base = torch.tensor(list(seeds), dtype=torch.int64, device=device).repeat_interleave(n)
    j = torch.arange(n, dtype=torch.int64, device=device).repeat(len(seeds))
    return hash32(hash32(base) + j * 0x27D4EB2F)


class TorchEngine(Engine):
    """The torch sampler on `device` ("cpu", "cuda", "cuda:1", ...), the model's weights in `dtype`.

    The model is loaded on the host, then moved to `device`; `self.device` is where its parameters ended up
    (e.g. cuda:0 for "cuda"), and every tensor of a generation is made there."""

    def __init__(self, model_path: str, eos_token_id: int | Sequence[int], pad_token_id: int, dtype=torch.float32,
                 device: torch.device | str = "cpu", max_num_seqs: int = 256):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.max_num_seqs = max_num_seqs
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = next(self.model.parameters()).device
        # Every token that ends a response (a chat model's end-of-turn and its end-of-text).
        stops = sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=self.device)
        self.pad = pad_token_id
        self.version = 0

    def load_flat(self, flat: torch.Tensor, version: int) -> None:
        """`flat`: the weight receiver's host vector, in the wire dtype (fp32, bf16 or fp16). Each parameter's slice
        is copied into the model by `Tensor.copy_`, which moves it to the parameter's device and casts it to the
        parameter's dtype (exact when the dtypes match or widen; one rounding from fp32 to bf16 otherwise). A
        blocking copy (copy_'s default) returns only once the data has arrived, so `flat` is free to reuse on
        return; on CUDA it is also ordered after the kernels already queued on the current stream (a swap between
        forwards never races the step before it). One host-to-device copy per parameter."""
        weights.load_flat(self.model, flat)
        self.version = version

    @torch.inference_mode()
    def generate(self, prompts, n, sampling, seeds, before_forward=None):
        if len(prompts) != len(seeds):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        hook, dev, T = before_forward or (lambda: None), self.device, sampling.max_new_tokens
        ids, mask = self._left_padded(prompts)
        B = len(prompts) * n  # row i * n + j: sample j of prompt i
        rseeds = row_seeds(seeds, n, dev)
        stepper = _StaticKV if _StaticKV.supports(self.model) else _HfCache
        step = stepper(self.model, ids, mask, n, T)
        out_tok = torch.full((B, T), self.pad, dtype=torch.long, device=dev)
        out_lp = torch.zeros((B, T), dtype=torch.float32, device=dev)
        out_ver = torch.zeros((B, T), dtype=torch.int32, device=dev)
        out_ent = torch.zeros((B, T), dtype=torch.float32, device=dev)
        lengths = torch.full((B,), T, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        # The benchmark workload: row r stops at forced[r] tokens exactly (stop token withheld before, emitted there).
        forced = (forced_lengths(rseeds, sampling.forced_length_median, sampling.forced_length_sigma, T)
                  if sampling.forced_length_median else None)
        steps = 0  # columns of the output buffers written
        # The stepper's rows as output rows: all B in order until rows finish; then the finished ones are dropped
        # from the stepper (`keep`), so a heavy-tailed batch does not pay for its finished rows to the end.
        rows, a_seeds, a_forced, a_done, last = None, rseeds, forced, done, None
        compacts = hasattr(step, "keep")
        for t in range(T):
            hook()
            logits = step(last)  # [A, V]: after the prompts, then after the previous token
            tok, logp = self._choose(logits, t, sampling, a_seeds, a_forced)
            written = torch.where(a_done, self.pad, tok)
            lp = logp.gather(-1, tok[:, None])[:, 0]
            ent = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)  # top-p's -inf: 0 * finite
            finished_now = torch.isin(tok, self.stop_ids) & ~a_done
            a_done = a_done | finished_now
            if rows is None:
                out_tok[:, t], out_lp[:, t], out_ver[:, t], out_ent[:, t] = written, lp, self.version, ent
                lengths.masked_fill_(finished_now, t + 1)
                done = a_done
            else:
                out_tok[rows, t], out_lp[rows, t], out_ver[rows, t], out_ent[rows, t] = written, lp, self.version, ent
                lengths[rows] = torch.where(finished_now, t + 1, lengths[rows])
                done[rows] = a_done
            last = written[:, None]
            steps = t + 1
            # The one host sync of a decode step (on CUDA the host waits here for the step's kernels, so the next
            # step's launches do not overlap this one's tail: tens of microseconds a token). Kept because stopping
            # as soon as every row has finished saves whole forwards, and `before_forward` must run exactly once
            # per forward (it may swap weights).
            alive = int(a_done.numel() - a_done.sum())
            if alive == 0:
                break
            if compacts and alive <= COMPACT_AT * a_done.numel():
                keep = (~a_done).nonzero()[:, 0]
                step.keep(keep)
                rows = keep if rows is None else rows[keep]
                a_seeds, a_done, last = a_seeds[keep], a_done[keep], last[keep]
                a_forced = a_forced[keep] if a_forced is not None else None
        return _completions(len(prompts), n, out_tok[:, :steps], out_lp[:, :steps], out_ver[:, :steps],
                            out_ent[:, :steps], lengths, done)

    def _left_padded(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, P] ids and attention mask, one left-padded row per prompt, so every prompt's next token sits in the
        last column. The n samples of a prompt share its prefill: the stepper copies its KV rows n times instead of
        recomputing them. Built on the host, then moved in one copy each (not one small copy per prompt)."""
        N, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((N, P), self.pad, dtype=torch.long, device="cpu")
        mask = torch.zeros((N, P), dtype=torch.long, device="cpu")
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(list(p), dtype=torch.long, device="cpu")
            mask[i, P - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _choose(self, logits: torch.Tensor, t: int, sampling: SamplingParams, seeds: torch.Tensor,
                forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token of each live row at decode step t, the log-probabilities it is reported under)."""
        if sampling.temperature > 0:
            logp = sampling_logprobs(logits, sampling.temperature, sampling.top_p)
            score = gumbel_noise(seeds, t, logp.shape[-1]).add_(logp)  # in float64
        else:  # greedy (evaluation): the logprobs reported are of the untempered distribution
            logp = torch.log_softmax(logits.float(), dim=-1)
            score = logp
        if forced is None:
            return score.argmax(-1), logp
        # The forced-length workload: the stop token withheld before the row's length, emitted at it; the reported
        # logprob stays the policy's own for the token chosen.
        score = score.clone() if score is logp else score
        score[:, self.stop_ids] = torch.where((t + 1 < forced)[:, None], -math.inf, score[:, self.stop_ids])
        return torch.where(t + 1 == forced, self.stop_ids[0], score.argmax(-1)), logp


def _completions(N: int, n: int, tok: torch.Tensor, lp: torch.Tensor, ver: torch.Tensor, ent: torch.Tensor,
                 lengths: torch.Tensor, done: torch.Tensor) -> list[list[Completion]]:
    """The written columns of the output buffers as each prompt's n completions, to the host once per generation
    (a no-op on the CPU)."""
    tok_h, lp_h, ver_h = tok.cpu().numpy(), lp.cpu().numpy(), ver.cpu().numpy()
    keep = torch.arange(ent.shape[1], device=ent.device)[None, :] < lengths[:, None]
    ent_h = (ent.double() * keep).sum(-1).cpu().tolist()  # the response's tokens only
    len_h, done_h = lengths.cpu().tolist(), done.cpu().tolist()
    result: list[list[Completion]] = []
    for i in range(N):
        group = []
        for j in range(n):
            r = i * n + j
            L = len_h[r]
            group.append(Completion(token_ids=tok_h[r, :L].astype(np.int32), logprobs=lp_h[r, :L].copy(),
                                    versions=ver_h[r, :L].copy(), finish_reason="stop" if done_h[r] else "length",
                                    entropy=ent_h[r]))
        result.append(group)
    return result


class _HfCache:
    """Any causal LM: `model(...)` with a DynamicCache and a growing 2-D attention mask (all on ids' device)."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, n: int, max_new_tokens: int):
        self.model = model  # ids, mask: [N, P] one left-padded row per prompt, each sampled n times
        self.ids, self.mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        self.pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache()

    def __call__(self, last: torch.Tensor | None) -> torch.Tensor:  # None: the prompts; else [B, 1] -> [B, V]
        ids = self.ids
        if last is not None:
            ids = last
            self.pos = self.pos[:, -1:] + 1
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self.model(input_ids=ids, attention_mask=self.mask, position_ids=self.pos, past_key_values=self.cache,
                          use_cache=True).logits[:, -1]


# A generation drops its finished rows from the decode batch once at most this share of its rows is still running.
COMPACT_AT = 0.75


class _StaticKV:
    """Llama-style decoders (Qwen2, Llama) stepped through their own modules over a preallocated KV cache.

    The same computation as the transformers forward (pre-norm blocks, rotary q/k, grouped-query attention,
    gated MLP), minus what only a general forward needs: each prompt is prefilled once and its keys and
    values copied into the cache rows of its n samples; the cache is written in place instead of
    concatenated; and a decode step's attention is one query against the cache under a fixed key mask
    (the prompts' left padding is all it masks). Modules are read at every step, so weights swapped in
    place between steps (`load_flat`) take effect at once.
    """

    TYPES = ("qwen2", "llama")

    @classmethod
    def supports(cls, model) -> bool:
        cfg = model.config
        return (cfg.model_type in cls.TYPES and not getattr(cfg, "use_sliding_window", False)
                and all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]))

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, n: int, max_new_tokens: int):
        self.model, self.body = model, model.model  # ids, mask: [N, P] one left-padded row per prompt
        cfg = model.config
        P, B = ids.shape[1], ids.shape[0] * n
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = self.body.layers[0].self_attn.head_dim
        dtype = self.body.embed_tokens.weight.dtype
        L, dev = P + max_new_tokens, ids.device  # everything on the model's device, as ids and mask are
        # Keys are stored transposed, [B * kv, d, L]: q @ K^T is then a plain batched GEMM on a slice of the
        # cache (2x faster on CPU than multiplying by a transposed [B, kv, L, d] slice).
        self.keys_t = [torch.empty((B * self.kv_heads, self.head_dim, L), dtype=dtype, device=dev)
                       for _ in self.body.layers]
        self.values = [torch.empty((B * self.kv_heads, L, self.head_dim), dtype=dtype, device=dev)
                       for _ in self.body.layers]
        valid = torch.cat([mask.bool().repeat_interleave(n, 0),
                           torch.ones((B, max_new_tokens), dtype=torch.bool, device=dev)], 1)
        # Additive key mask of a decode step, [B, 1, L]: prompt padding gets -inf, generated tokens are valid.
        self.key_bias = torch.zeros(valid.shape, dtype=dtype, device=dev).masked_fill_(~valid, float("-inf"))[:, None]
        # Prefill mask [N, 1, P, P]: causal over valid keys; a padding query sees itself, so no row is empty
        # (an all-masked softmax row is NaN, and NaN values would leak through 0-weights into real rows).
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril_()
        self.prefill_mask = ((causal & mask.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev))[:, None]
        self.prompt_ids, self.n = ids, n
        self.prompt_pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, P]
        self.pos = self.prompt_pos[:, -1:].repeat_interleave(n, 0)  # [B, 1] position of each row's latest token
        self.length = 0  # cache entries filled

    def keep(self, rows: torch.Tensor) -> None:
        """Go on with these rows only (indices into the current rows, ascending): their cache entries move to the
        front of the same buffers, in place; nothing is reallocated."""
        A, end, kv = len(rows), self.length, self.kv_heads
        B = self.pos.shape[0]
        for i, (k, v) in enumerate(zip(self.keys_t, self.values)):
            kb, vb = k.view(B, kv, self.head_dim, -1), v.view(B, kv, -1, self.head_dim)
            kb[:A, :, :, :end] = kb[rows, :, :, :end]  # the right side is gathered into a new tensor first
            vb[:A, :, :end] = vb[rows, :, :end]
            self.keys_t[i], self.values[i] = k[: A * kv], v[: A * kv]
        self.key_bias, self.pos = self.key_bias[rows], self.pos[rows]

    def __call__(self, last: torch.Tensor | None) -> torch.Tensor:  # None: the prompts; else [B, 1] -> [B, V]
        prefill = last is None
        if prefill:  # R = N prompt rows, each filling the cache rows of its `copies` = n samples
            ids, pos, copies = self.prompt_ids, self.prompt_pos, self.n
        else:
            self.pos = self.pos + 1
            ids, pos, copies = last, self.pos, 1
        (R, S), kv, d = ids.shape, self.kv_heads, self.head_dim
        start, end = self.length, self.length + S
        h = self.body.embed_tokens(ids)  # [R, S, D]
        cos, sin = self.body.rotary_emb(h, pos)  # [R, S, d]
        half = d // 2
        cos, sin = cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]  # [R, S, 1, d]
        for layer, k_cache, v_cache in zip(self.body.layers, self.keys_t, self.values):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = _rope(a.q_proj(x).view(R, S, self.heads, d), cos, sin)  # [R, S, h, d]
            k = _rope(a.k_proj(x).view(R, S, kv, d), cos, sin).permute(0, 2, 3, 1)  # [R, kv, d, S]
            v = a.v_proj(x).view(R, S, kv, d).transpose(1, 2)  # [R, kv, S, d]
            k_cache.view(R, copies, kv, d, -1)[..., start:end] = k[:, None]
            v_cache.view(R, copies, kv, -1, d)[:, :, :, start:end] = v[:, None]
            if prefill:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(2, 3), v, attn_mask=self.prefill_mask, scale=a.scaling,
                    enable_gqa=True,
                ).transpose(1, 2).reshape(R, S, self.heads * d)
            else:
                out = self._decode_attention(q, k_cache[..., :end], v_cache[:, :end], a.scaling, end)
            h = h + a.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.length = end
        logits = self.model.lm_head(self.body.norm(h[:, -1]))  # [R, V]: only the last position is ever sampled
        return logits.repeat_interleave(copies, 0) if copies > 1 else logits

    def _decode_attention(self, q, keys_t, values, scale: float, end: int) -> torch.Tensor:
        """One query per row, [B, 1, h, d] against keys^T [B * kv, d, L] and values [B * kv, L, d] -> [B, 1, h * d].
        Query head i reads kv head i // groups (as transformers' repeat_kv), so a group's heads are the rows
        of one small GEMM with their keys."""
        B, groups = q.shape[0], self.heads // self.kv_heads
        qg = q.view(B * self.kv_heads, groups, self.head_dim)
        scores = torch.bmm(qg, keys_t).mul_(scale).view(B, self.heads, end).add_(self.key_bias[:, :, :end])  # [B, h, L]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(B * self.kv_heads, groups, end)
        return torch.bmm(probs, values).view(B, 1, self.heads * self.head_dim)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, S, heads, d] with cos, sin [B, S, 1, d], sin's first half negated beforehand:
    transformers' x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1], written as
    [x2, x1] * [-sin1, sin2] so one flip replaces two slices, a negation and a concatenation (same bits)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1], a new tensor
    return swapped.mul_(sin).add_(x * cos)


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """Ids that end a response: the tokenizer's EOS plus the model's generation_config eos_token_id(s)
    (an instruct model ends its turn with e.g. <|im_end|> and also stops at <|endoftext|>)."""
    import json
    import os

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_cfg = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_cfg):
        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        ids |= {eos} if isinstance(eos, int) else set(eos or ())
    if not ids:
        raise ValueError(f"{model_path}: neither the tokenizer nor generation_config.json names an EOS token, so "
                         f"generation could never stop before max_new_tokens; set eos_token in tokenizer_config.json")
    return sorted(ids)
