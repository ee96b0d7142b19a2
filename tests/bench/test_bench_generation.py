"""Benchmark: TorchEngine tokens/s vs transformers `model.generate(do_sample=True)` on the demo model.

Both sample the demo model (assets/arith-base, fp32, sdpa, one thread) for the same batch: the demo
config's first `rollout.groups_per_request` arith prompts (as the hub renders and tokenises them), each
`rollout.group_size` times, `rollout.max_new_tokens` new tokens at `rollout.temperature` / `top_p`. Stop
tokens are disabled on both sides (the engine is given an EOS id no model emits; generate gets
`eos_token_id=[]`), so every row runs to the limit and the token counts are exact and equal; the test
checks both. The engine does more work per token than generate (behaviour logprobs of the sampled
distribution, counter-based Gumbel noise, per-token versions); generate samples with torch.multinomial.

Best of a few alternating runs each. The engine's logprobs are also checked against a fresh full forward
of one row, so a fast but wrong engine cannot pass.
"""

from __future__ import annotations

import os
import time

import torch

from actors.engine import TorchEngine
from common.config import Config
from common.data import PromptSource
from common.messages import SamplingParams
from tests.bench.common import REPO, record, verdict

DEMO = os.path.join(REPO, "assets", "arith-base")
REPEATS = 7
TARGET = 1.5
NEVER = -1  # a stop id no model can sample: generation runs to max_new_tokens


def _batch(cfg: Config, tokenizer) -> tuple[list[list[int]], list[int]]:
    source = PromptSource(cfg, tokenizer)
    order = source.order(0)[: cfg.rollout.groups_per_request]
    return [list(source[i].ids) for i in order], [1000 + i for i in order]


def _hf_generate(model, prompts: list[list[int]], n: int, sp: SamplingParams, pad: int):
    """One batched `generate` of n samples per prompt, left-padded like the engine; returns the new tokens [B, T]."""
    from transformers import GenerationConfig

    rows = [p for p in prompts for _ in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    gc = GenerationConfig(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=0,
                          max_new_tokens=sp.max_new_tokens, eos_token_id=[], pad_token_id=pad)  # [] not None: None
    # falls back to the model's generation_config EOS, and then generate stops early
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return out[:, width:]


def _engine_logprob_error(engine: TorchEngine, prompt: list[int], sp: SamplingParams) -> float:
    """Max |logprob - fresh forward| over one sampled row (the test suite's check, at benchmark length)."""
    c = engine.generate([prompt], 1, sp, [7])[0][0]
    ids = torch.tensor([prompt + c.token_ids.tolist()])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / sp.temperature
    ref = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(c.token_ids).long()[:, None])[:, 0]
    return float((torch.from_numpy(c.logprobs) - ref).abs().max())


def test_engine_vs_hf_generate():
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    cfg = Config()
    ro = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = TorchEngine(DEMO, eos_token_id=NEVER, pad_token_id=pad)
    prompts, seeds = _batch(cfg, tokenizer)
    sp = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
    rows = len(prompts) * ro.group_size
    expected = rows * ro.max_new_tokens

    def run_engine() -> int:
        return sum(len(c.token_ids) for g in engine.generate(prompts, ro.group_size, sp, seeds) for c in g)

    def run_hf() -> int:
        return _hf_generate(engine.model, prompts, ro.group_size, sp, pad).numel()

    runs = {"engine": run_engine, "hf_generate": run_hf}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for k, f in runs.items():  # warm-up (allocator, first-call paths)
        f()
    for _ in range(REPEATS):
        for k, f in runs.items():
            t0 = time.perf_counter()
            tokens = f()
            times[k].append(time.perf_counter() - t0)
            if tokens != expected:
                raise AssertionError(f"{k} generated {tokens} tokens, expected {rows} rows x {ro.max_new_tokens}: "
                                     f"stop tokens must be off on both sides for an exact count")
    err = _engine_logprob_error(engine, prompts[0], sp)
    tps = {k: expected / min(v) for k, v in times.items()}
    speedup = tps["engine"] / tps["hf_generate"]
    met = speedup >= TARGET and err < 1e-4
    record("generation", {
        "model": "assets/arith-base",
        "batch": f"{len(prompts)} prompts x {ro.group_size} samples x {ro.max_new_tokens} new tokens (demo config), "
                 f"prompt lengths {sorted(map(len, prompts))}",
        "seconds": times, "tokens_per_s": tps, "speedup_vs_hf_generate": speedup,
        "engine_logprob_max_abs_err_vs_forward": err,
        "target": f"TorchEngine >= {TARGET}x transformers generate(do_sample=True) tokens/s, logprobs within 1e-4 "
                  f"of a fresh forward",
        "verdict": verdict(met),
    })
    print(f"\ngeneration {rows} rows x {ro.max_new_tokens} tokens: engine {tps['engine']:.0f} tok/s, "
          f"hf generate {tps['hf_generate']:.0f} tok/s, speedup {speedup:.2f}x (logprob err {err:.1e}; "
          f"target >= {TARGET}x: {verdict(met)})")
    assert all(t > 0 for v in times.values() for t in v)
