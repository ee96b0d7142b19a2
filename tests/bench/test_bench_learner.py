"""Benchmark: learner forward+backward tokens/s, packed micro-batches vs right-padded batches.

The batch is what a learner step sees: GRPO groups (one ~30-token prompt, 8 responses each) whose response
lengths are heavy-tailed (lognormal, median 120 tokens, clipped so prompt + response <= 512), seeded.
The model is the demo architecture (assets/arith-base's config, max_position_embeddings raised to 1024,
randomly initialised offline) in fp32 with sdpa on one thread.

- packed: what learner/trainer.py does. `build_step_batch` plans micro-batches of at most
  `learner.micro_batch_tokens` (the config default) tokens, `pack` lays each out as one padding-free row
  with restarting position_ids, and the forward is `model.model(input_ids, position_ids)` followed by the
  chunked `logprobs_and_entropy` head.
- padded: the usual alternative. The same sequences in arrival order, PADDED_BATCH at a time, right-padded to
  the longest in that batch, with an attention mask; the head runs over the whole rectangle (pads included,
  as a padded trainer does) and the loss is masked.

Both use the same loss (masked advantage-weighted logprob minus an entropy bonus) and backward. Tokens/s
counts real tokens only (prompt + response, no pads) on both sides, so the two rates are for identical work.
Best of a few alternating passes over the whole batch.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from broker.rules import scores
from common import messages as M
from common.config import Config
from learner.batch import build_step_batch, pack
from learner.logprobs import logprobs_and_entropy
from tests.bench.common import REPO, record, verdict
from tests.helpers.groups import rollout_group, sample

DEMO = os.path.join(REPO, "assets", "arith-base")
GROUPS, GROUP_SIZE = 4, 8
MAX_TOKENS = 512
PADDED_BATCH = 4  # sequences per padded micro-batch: about as many real tokens as one packed 512-token row
REPEATS = 5


def _groups(vocab: int) -> list[M.RolloutGroup]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(GROUPS):
        prompt = rng.integers(1, vocab, int(rng.integers(24, 37)))
        samples = []
        for _ in range(GROUP_SIZE):
            n = int(np.clip(rng.lognormal(np.log(120), 0.9), 4, MAX_TOKENS - len(prompt)))
            # keyword order is draw order: tokens, logprobs, reward
            samples.append(sample(tokens=rng.integers(1, vocab, n), logprobs=-rng.random(n), versions=0,
                                  reward=rng.integers(0, 2)))
        out.append(rollout_group(samples, prompt=prompt, incarnation="bench", ticket=g, prompt_id=g))
    return out


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(DEMO)
    cfg.max_position_embeddings = 2 * MAX_TOKENS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def _loss(model, hidden, targets, mask, adv, chunk: int) -> torch.Tensor:
    """[N, H] hidden, [N] targets / mask / adv -> scalar; the head in chunks, as the trainer runs it."""
    logp, ent = logprobs_and_entropy(model.lm_head, hidden, targets, chunk=chunk)
    return -((logp * adv + 1e-3 * ent) * mask).sum() / mask.sum().clamp(min=1.0)


def _padded(samples, idx: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """A right-padded [B, T_max] batch of `idx` with attention mask; targets aligned like `pack`'s."""
    seqs = [M.as_array(samples[i].input_ids, M.TOKEN_DTYPE).astype(np.int64) for i in idx]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width), dtype=torch.float32)
    adv = torch.zeros((len(seqs), width), dtype=torch.float32)
    for r, (i, s) in enumerate(zip(idx, seqs)):
        ids[r, : len(s)] = torch.from_numpy(s)
        attn[r, : len(s)] = 1
        p = samples[i].prompt_len
        resp[r, p - 1 : len(s) - 1] = 1.0  # position t predicts token t+1, a response token iff t+1 >= P
        adv[r] = samples[i].advantage
    return {"input_ids": ids, "attention_mask": attn, "targets": ids[:, 1:], "mask": resp[:, :-1], "adv": adv[:, :-1]}


def _packing_isolation_error(model, samples, rows: list[list[int]], pad_id: int) -> float:
    """Max |hidden| difference of a row's last sequence, packed behind others vs run alone: restarting
    position_ids must isolate packed sequences (transformers does so only without a cache: use_cache=False)."""
    idx = next(r for r in rows if len(r) > 1)
    row = pack(samples, idx, pad_id)
    last = M.as_array(samples[idx[-1]].input_ids, M.TOKEN_DTYPE).astype(np.int64)
    with torch.no_grad():
        packed = model.model(input_ids=row.input_ids, position_ids=row.position_ids,
                             use_cache=False).last_hidden_state[0, -len(last):]
        alone = model.model(input_ids=torch.from_numpy(last)[None], use_cache=False).last_hidden_state[0]
    err = float((packed - alone).abs().max())
    if err > 1e-3:
        raise AssertionError(f"packed sequences see each other (max diff {err:.2e}): the packed numbers would be "
                             f"for a different computation")
    return err


def _setup():
    """(config, model, the step batch of `_groups` planned into packed micro-batches), on one thread."""
    torch.set_num_threads(1)
    cfg = Config()
    model = _model()
    groups = _groups(model.config.vocab_size)
    batch = build_step_batch(groups, scores(groups), version=0, ranks=1, mini_batches=1,
                             micro_batch_tokens=cfg.learner.micro_batch_tokens)
    return cfg, model, batch


def test_packed_vs_padded_train_throughput():
    cfg, model, batch = _setup()
    chunk, pad_id = cfg.learner.logprob_chunk_tokens, model.config.pad_token_id or 0
    samples = batch.samples
    lengths = [len(s.input_ids) // 4 for s in samples]
    real_tokens = sum(lengths)
    packed = [pack(samples, idx, pad_id) for idx in batch.plan[0][0]]
    order = list(range(len(samples)))
    padded = [_padded(samples, order[i : i + PADDED_BATCH], pad_id) for i in range(0, len(order), PADDED_BATCH)]
    if sum(int(mb.input_ids.numel()) for mb in packed) != real_tokens:
        raise AssertionError("packed rows must hold exactly the batch's tokens, no padding")
    isolation_err = _packing_isolation_error(model, samples, batch.plan[0][0], pad_id)

    def run_packed():
        model.zero_grad(set_to_none=True)
        for mb in packed:
            hidden = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                 use_cache=False).last_hidden_state
            _loss(model, hidden[0, :-1], mb.targets[0], mb.mask[0], mb.adv[0], chunk).backward()

    def run_padded():
        model.zero_grad(set_to_none=True)
        for mb in padded:
            hidden = model.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                 use_cache=False).last_hidden_state
            H = hidden.shape[-1]
            _loss(model, hidden[:, :-1].reshape(-1, H), mb["targets"].reshape(-1), mb["mask"].reshape(-1),
                  mb["adv"].reshape(-1), chunk).backward()

    runs = {"packed": run_packed, "padded": run_padded}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f()  # warm-up
    for _ in range(REPEATS):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    tps = {k: real_tokens / min(v) for k, v in times.items()}
    ratio = tps["packed"] / tps["padded"]
    padded_slots = sum(int(mb["input_ids"].numel()) for mb in padded)
    record("learner_packing", {
        "model": "assets/arith-base architecture, random init, max_position_embeddings 1024, fp32, sdpa, 1 thread",
        "batch": f"{GROUPS} groups x {GROUP_SIZE}, prompts 24-36 tokens, responses lognormal(median 120, sigma 0.9) "
                 f"clipped to {MAX_TOKENS} total",
        "sequence_lengths": {"min": min(lengths), "median": int(np.median(lengths)), "max": max(lengths)},
        "packed_vs_alone_max_abs_diff": isolation_err,
        "real_tokens": real_tokens, "padded_slots": padded_slots, "pad_fraction": 1 - real_tokens / padded_slots,
        "micro_batches": {"packed": len(packed), "padded": len(padded)},
        "packed_budget_tokens": cfg.learner.micro_batch_tokens, "padded_batch_seqs": PADDED_BATCH,
        "seconds_fwd_bwd": times, "real_tokens_per_s": tps, "ratio_packed_vs_padded": ratio,
        "target": "packed >= padded (real tokens/s of forward+backward)", "verdict": verdict(ratio >= 1.0),
    })
    print(f"\nlearner fwd+bwd, {real_tokens} real tokens in {len(samples)} sequences (pads would add "
          f"{padded_slots - real_tokens}): packed {tps['packed']:.0f} tok/s in {len(packed)} rows, padded "
          f"{tps['padded']:.0f} tok/s in {len(padded)} batches, ratio {ratio:.2f} "
          f"(target >= 1: {verdict(ratio >= 1.0)})")
    assert all(t > 0 for v in times.values() for t in v)


def test_entropy_delta_pass_cost_by_stride():
    """What `actor/entropy_delta` costs: its pass is a no-grad forward (with the entropy head) over every S-th packed
    micro-batch after the update. Measured against the step's forward+backward over the whole batch, at S = 8 (the
    default) and S = 1 (exact: the whole batch)."""
    cfg, model, batch = _setup()
    chunk, pad_id = cfg.learner.logprob_chunk_tokens, model.config.pad_token_id or 0
    packed = [pack(batch.samples, idx, pad_id) for idx in batch.plan[0][0]]

    def forward(mb):
        return model.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).last_hidden_state

    def train():
        model.zero_grad(set_to_none=True)
        for mb in packed:
            _loss(model, forward(mb)[0, :-1], mb.targets[0], mb.mask[0], mb.adv[0], chunk).backward()

    def after(stride):
        def run():
            with torch.no_grad():
                for mb in packed[::stride]:
                    logprobs_and_entropy(model.lm_head, forward(mb)[0, :-1], mb.targets[0], chunk=chunk)
        return run

    runs = {"train": train, "stride_8": after(8), "stride_1": after(1)}
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(REPEATS):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    share = {k: best[k] / best["train"] for k in ("stride_8", "stride_1")}
    record("entropy_delta_pass", {
        "model": "assets/arith-base architecture, random init, fp32, sdpa, 1 thread",
        "micro_batches": len(packed), "seconds_best": best,
        "extra_over_train_fwd_bwd": share,
        "note": "the after-update entropy pass of actor/entropy_delta, as a share of the step's forward+backward",
    })
    print(f"\nentropy_delta pass over {len(packed)} micro-batches: stride 8 adds {share['stride_8']:.1%}, stride 1 adds "
          f"{share['stride_1']:.1%} of the step's forward+backward ({best['train']:.3f} s)")
    assert share["stride_1"] > share["stride_8"] > 0
