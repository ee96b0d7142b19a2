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

`CpuEngine` is a torch sampler with a KV cache over a transformers causal LM.
Sampling is Gumbel-max with counter-based noise keyed on (row seed, step,
token id), so a row's sample depends on its seed and logits only - not on the
other rows of the batch or on a global RNG. That makes a re-issued prompt
reproduce its sample under the same weights, and makes the staleness-0 run
match the synchronous reference loop exactly. (The GPU path uses vLLM.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from common.messages import SamplingParams

_M32 = 0xFFFFFFFF


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    versions: np.ndarray  # int32 [T]
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    version: int

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        before_forward: Callable[[], None] | None = None,
    ) -> list[list[Completion]]: ...

    def load_flat(self, flat: torch.Tensor, version: int) -> None: ...


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (products stay below 2**63)."""
    x = x & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def gumbel_noise(row_seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[B, V] standard Gumbel noise, a pure function of (row seed, step, token id)."""
    base = _hash32(_hash32(row_seeds) ^ _hash32(torch.tensor(step + 0x632BE5AB)))  # [B]
    cols = torch.arange(vocab, dtype=torch.int64) * 0x9E3779B1
    u = (_hash32(base[:, None] + cols[None, :]).double() + 0.5) / 4294967296.0  # (0, 1)
    return -torch.log(-torch.log(u))


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


def row_seeds(seeds: Sequence[int], n: int) -> torch.Tensor:
    """Seed of sample j of prompt i: mixes the prompt seed with j."""
    base = torch.tensor(list(seeds), dtype=torch.int64).repeat_interleave(n)
    j = torch.arange(n, dtype=torch.int64).repeat(len(seeds))
    return _hash32(_hash32(base) + j * 0x27D4EB2F)


class CpuEngine:
    def __init__(self, model_path: str, eos_token_id: int | Sequence[int], pad_token_id: int, dtype=torch.float32):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.model.eval().requires_grad_(False)
        # Every token that ends a response (a chat model's end-of-turn and its end-of-text).
        self.stop_ids = torch.tensor(sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)))
        self.pad = pad_token_id
        self.version = 0

    def load_flat(self, flat: torch.Tensor, version: int) -> None:
        from common.weights import load_flat

        load_flat(self.model, flat)
        self.version = version

    @torch.inference_mode()
    def generate(self, prompts, n, sampling, seeds, before_forward=None):
        if len(prompts) != len(seeds):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        hook = before_forward or (lambda: None)
        rows = [list(p) for p in prompts for _ in range(n)]
        B, P = len(rows), max(len(r) for r in rows)
        # Left-pad so every row's next token sits in the last column.
        ids = torch.full((B, P), self.pad, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, P - len(r) :] = torch.tensor(r)
            mask[i, P - len(r) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        rseeds = row_seeds(seeds, n)
        cache = DynamicCache()
        out_tok = torch.full((B, sampling.max_new_tokens), self.pad, dtype=torch.long)
        out_lp = torch.zeros((B, sampling.max_new_tokens), dtype=torch.float32)
        out_ver = torch.zeros((B, sampling.max_new_tokens), dtype=torch.int32)
        lengths = torch.full((B,), sampling.max_new_tokens, dtype=torch.long)
        done = torch.zeros(B, dtype=torch.bool)
        step_ids, step_pos = ids, pos
        for t in range(sampling.max_new_tokens):
            hook()
            logits = self.model(
                input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache, use_cache=True
            ).logits[:, -1]
            if sampling.temperature > 0:
                logp = sampling_logprobs(logits, sampling.temperature, sampling.top_p)
                tok = (logp.double() + gumbel_noise(rseeds, t, logp.shape[-1])).argmax(-1)
            else:  # greedy (evaluation): the logprobs reported are of the untempered distribution
                logp = torch.log_softmax(logits.float(), dim=-1)
                tok = logp.argmax(-1)
            out_tok[:, t] = torch.where(done, self.pad, tok)
            out_lp[:, t] = logp.gather(-1, tok[:, None])[:, 0]
            out_ver[:, t] = self.version
            finished_now = torch.isin(tok, self.stop_ids) & ~done
            lengths[finished_now] = t + 1
            done |= finished_now
            if bool(done.all()):
                break
            step_ids = out_tok[:, t : t + 1]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
        result: list[list[Completion]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                r, L = i * n + j, int(lengths[i * n + j])
                group.append(
                    Completion(
                        token_ids=out_tok[r, :L].numpy().astype(np.int32),
                        logprobs=out_lp[r, :L].numpy().copy(),
                        versions=out_ver[r, :L].numpy().copy(),
                        finish_reason="stop" if bool(done[r]) else "length",
                    )
                )
            result.append(group)
        return result


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


def load_engine(cfg, model_path: str):
    """(engine, tokenizer) for a local Hugging Face model directory, as the config asks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stops = stop_token_ids(tokenizer, model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    return CpuEngine(model_path, eos_token_id=stops, pad_token_id=pad, dtype=dtype), tokenizer
