"""The torch engine's continuous batch: groups join between decode steps and leave the moment their samples end.

`TorchEngine.generate` decodes one static batch to its longest response. A generator that streams (actors/actor.py)
instead submits each group as it arrives and collects each one as soon as its n samples have finished, so the
engine's rows stay full while response lengths vary; this is what vLLM does with its own scheduler, done here for
the Llama-style decoders the torch engine steps itself (`_StaticKV`; other architectures are served in batches by
`Engine`'s default, actors/engine.py).

How a row lives (one row = one sample of one group):
- **Admission**, between two decode steps, while rows are free: the queued groups' prompts are prefilled together
  (`_StaticKV`, left-padded, as `generate` does), each prompt's keys and values are copied into the cache rows of
  its n samples (left-aligned: entry 0 is the prompt's first token), and each row's first token is sampled from the
  prompt's last logits.
- **Decode**: every running row feeds its last token at its own position and writes its keys and values at its own
  cache length. Attention runs in buckets of consecutive rows (`attention_buckets`), each over its own longest
  row's entries, each row masked to its own: one straggler 1,200 tokens long among 127 rows of 150 would otherwise
  make every row read 1,200 entries (51 ms an iteration against 17 ms on the benchmark's model, 2-core CPU).
- **Retirement**: a row that emitted a stop token, reached its forced length or `max_new_tokens` is done; its
  tokens, logprobs, versions and entropy go to the host, and its place is filled from the end of its attention
  bucket, that row's from the end of the next bucket, and so on (`_compact`: a few rows a hole, each cache copied
  up to its own length). So the running rows are always rows 0 .. A-1 of the buffers, in admission order up to the
  buckets' edges (oldest, hence longest, first: the buckets stay tight), and a decode step works on views, never
  on gathered copies. A group is returned when its last row is done.
- **Sampling** is the engine's own (`TorchEngine._choose`): Gumbel noise keyed on (row seed, the row's own step,
  token), so a sample depends on its seed and logits only, not on when it was admitted or what it is batched with
  (to float rounding of the logits, as for `generate`'s batches). Rows of one batch share one `SamplingParams`; a
  group with other sampling parameters waits until the running rows have finished.
- **Weights**: `before_forward` runs once before each iteration's forwards (it may swap weights in); every token
  is stamped with the engine's version at that moment, as in `generate`.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from actors.engine import Completion, TorchEngine, _StaticKV, _rope, forced_lengths, row_seeds
from common.messages import SamplingParams


class StreamingTorchEngine(TorchEngine):
    """The torch engine a streaming generator drives (actors/factory.py builds it): `submit` / `collect` /
    `in_flight` over a `ContinuousBatch` of `max_num_seqs` rows for the decoders `_StaticKV` steps, `Engine`'s
    batches for any other architecture. `generate` (evaluation, the reference loop) is the static batch, unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stream = ContinuousBatch(self, self.max_num_seqs) if _StaticKV.supports(self.model) else None

    def submit(self, key, prompt, n, sampling, seed) -> None:
        if self._stream is None:
            return super().submit(key, prompt, n, sampling, seed)
        self._stream.submit(key, prompt, n, sampling, seed)

    def collect(self, wait_s, before_forward):
        """Decode iterations until a group finishes or `wait_s` has passed (at least one iteration when groups are
        in flight), so the caller gets back to its socket between groups."""
        if self._stream is None:
            return super().collect(wait_s, before_forward)
        deadline = time.monotonic() + wait_s
        done = self._stream.step(before_forward)
        while not done and self._stream.busy and time.monotonic() < deadline:
            done = self._stream.step(before_forward)
        return done

    @property
    def in_flight(self) -> int:
        return super().in_flight if self._stream is None else self._stream.busy


@dataclass
class _Group:
    key: object
    prompt: list[int]
    n: int
    sampling: SamplingParams
    seed: int
    done: dict[int, Completion] = field(default_factory=dict)  # sample index -> its completion


class ContinuousBatch:
    """Up to `rows` samples decoded together over `engine`'s model (a `TorchEngine` whose model `_StaticKV`
    supports). `submit` queues a group; `step` runs one iteration (admit, decode, retire) and returns the groups
    that finished in it."""

    def __init__(self, engine, rows: int):
        self.engine, self.rows = engine, rows
        cfg = engine.model.config
        body = engine.model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.queue: collections.deque[_Group] = collections.deque()
        self.sampling: SamplingParams | None = None  # of the running rows
        self.owner: list[tuple[_Group, int]] = []  # running row r -> (its group, its sample index)
        self.steps = np.zeros(0, dtype=np.int64)  # host mirror: tokens each running row has sampled
        self.length = np.zeros(0, dtype=np.int64)  # host mirror: cache entries each running row has filled
        self.L = 0  # cache entries per row allocated
        self.keys_t: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    # ---- the interface the engine forwards ----

    def submit(self, key, prompt, n: int, sampling: SamplingParams, seed: int) -> None:
        if n > self.rows:
            raise ValueError(f"a group of {n} samples does not fit a continuous batch of {self.rows} rows; "
                             f"raise generator.max_num_seqs to at least {n}")
        self.queue.append(_Group(key, [int(t) for t in prompt], n, sampling, int(seed)))

    @property
    def busy(self) -> int:
        """Groups queued or running."""
        return len(self.queue) + len({id(g) for g, _ in self.owner})

    @torch.inference_mode()
    def step(self, before_forward: Callable[[], None]) -> list[tuple[object, list[Completion]]]:
        """One iteration: swap weights in (`before_forward`), admit queued groups into free rows, decode one token
        of every row that was already running, retire finished rows; the groups completed, in completion order."""
        if not self.queue and not self.owner:
            return []
        before_forward()
        running = len(self.owner)
        new = self._admit()
        finished = []
        if running:
            finished.append(self._sample_rows(0, running, self._decode(running)))
        if new is not None:
            finished.append(self._sample_rows(running, len(self.owner), new))
        return self._retire(torch.cat(finished))

    # ---- admission ----

    def _admit(self) -> torch.Tensor | None:
        """Prefill the queued groups that fit (and share the running rows' sampling); their prompts' last logits,
        one row per sample ([new rows, V]), or None when none was admitted."""
        take = []
        free = self.rows - len(self.owner)
        while self.queue and self.queue[0].n <= free:
            g = self.queue[0]
            if (self.owner or take) and g.sampling != (self.sampling if self.owner else take[0].sampling):
                break
            take.append(self.queue.popleft())
            free -= g.n
        if not take:
            return None
        if not self.owner:
            self.sampling = take[0].sampling
            self._outputs(self.sampling.max_new_tokens)
        eng, dev = self.engine, self.engine.device
        ids, mask = eng._left_padded([g.prompt for g in take])
        pre = _StaticKV(eng.model, ids, mask, 1, 0)
        logits = pre(None)  # [N, V]
        P = ids.shape[1]
        plens = [len(g.prompt) for g in take]
        self._reserve(max(plens) + self.sampling.max_new_tokens)
        first = len(self.owner)
        for i, g in enumerate(take):
            rows = slice(first, first + g.n)
            for kt, v, pk, pv in zip(self.keys_t, self.values, pre.keys_t, pre.values):
                kv = self.kv_heads
                kt.view(self.rows, kv, self.head_dim, self.L)[rows, :, :, : plens[i]] = \
                    pk.view(-1, kv, self.head_dim, P)[i, :, :, P - plens[i]:][None]
                v.view(self.rows, kv, self.L, self.head_dim)[rows, :, : plens[i]] = \
                    pv.view(-1, kv, P, self.head_dim)[i, :, P - plens[i]:][None]
            self.owner.extend((g, j) for j in range(g.n))
            first += g.n
        self._init_rows(take, plens, dev)
        return logits.repeat_interleave(torch.tensor([g.n for g in take], device=dev), 0)

    def _init_rows(self, take: list[_Group], plens: list[int], dev) -> None:
        """Per-row state of the rows just admitted (the last len(sum n) rows of `owner`)."""
        A = len(self.owner)
        start = A - sum(g.n for g in take)
        seeds = torch.cat([row_seeds([g.seed], g.n, dev) for g in take])
        sp = self.sampling
        self.seeds[start:A] = seeds
        if sp.forced_length_median:
            self.forced[start:A] = forced_lengths(seeds, sp.forced_length_median, sp.forced_length_sigma,
                                                  sp.max_new_tokens)
        lens = torch.tensor([p for g, p in zip(take, plens) for _ in range(g.n)], dtype=torch.long, device=dev)
        self.cache_len[start:A] = lens
        self.pos[start:A] = lens - 1  # position of each row's latest token (the prompt's last)
        host = np.array([p for g, p in zip(take, plens) for _ in range(g.n)], dtype=np.int64)
        self.length = np.concatenate([self.length, host])
        self.steps = np.concatenate([self.steps, np.zeros(A - start, dtype=np.int64)])

    def _reserve(self, entries: int) -> None:
        """Buffers of `self.rows` rows with room for `entries` cache entries each (grown, contents kept)."""
        if self.keys_t and entries <= self.L:
            return
        eng, dev = self.engine, self.engine.device
        dtype = eng.model.model.embed_tokens.weight.dtype
        L, R, kv, d = max(entries, self.L), self.rows, self.kv_heads, self.head_dim
        old_k, old_v, old_L = self.keys_t, self.values, self.L
        self.keys_t = [torch.zeros((R * kv, d, L), dtype=dtype, device=dev) for _ in eng.model.model.layers]
        self.values = [torch.zeros((R * kv, L, d), dtype=dtype, device=dev) for _ in eng.model.model.layers]
        for k_new, v_new, k_old, v_old in zip(self.keys_t, self.values, old_k, old_v):
            k_new[..., :old_L] = k_old
            v_new[:, :old_L] = v_old
        self.L = L

    def _outputs(self, T: int) -> None:
        """Per-row state and output buffers of `T` tokens (made when the first group arrives, or when a batch of
        longer responses starts: the sampling changes only while no row runs)."""
        if getattr(self, "T", 0) >= T:
            return
        R, dev = self.rows, self.engine.device
        self.T = T
        self.tok = torch.zeros((R, T), dtype=torch.long, device=dev)
        self.lp = torch.zeros((R, T), dtype=torch.float32, device=dev)
        self.ver = torch.zeros((R, T), dtype=torch.int32, device=dev)
        self.ent = torch.zeros((R, T), dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(R, dtype=torch.int64, device=dev)
        self.forced = torch.zeros(R, dtype=torch.int64, device=dev)
        self.cache_len = torch.zeros(R, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(R, dtype=torch.int64, device=dev)
        self.last = torch.zeros(R, dtype=torch.int64, device=dev)

    # ---- decode ----

    def _decode(self, A: int) -> torch.Tensor:
        """One token of running rows 0 .. A-1, each at its own position and cache length: [A, V] logits."""
        model, body = self.engine.model, self.engine.model.model
        kv, d, R, L = self.kv_heads, self.head_dim, self.rows, self.L
        self.pos[:A] += 1
        pos, at = self.pos[:A, None], self.cache_len[:A]
        buckets = attention_buckets(self.length[:A] + 1)  # host mirror: no sync
        end = max(e for _, _, e in buckets)
        cols = torch.arange(end, device=at.device)
        bias = torch.zeros((A, 1, end), dtype=self.keys_t[0].dtype, device=at.device).masked_fill_(
            (cols[None, :] > at[:, None])[:, None], float("-inf"))
        rows = torch.arange(A, device=at.device)
        h = body.embed_tokens(self.last[:A, None])  # [A, 1, D]
        cos, sin = body.rotary_emb(h, pos)
        half = d // 2
        cos, sin = cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]
        for layer, k_cache, v_cache in zip(body.layers, self.keys_t, self.values):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = _rope(a.q_proj(x).view(A, 1, self.heads, d), cos, sin)
            k = _rope(a.k_proj(x).view(A, 1, kv, d), cos, sin)[:, 0]  # [A, kv, d]
            v = a.v_proj(x).view(A, kv, d)
            k_cache.view(R, kv, d, L)[rows, :, :, at] = k
            v_cache.view(R, kv, L, d)[rows, :, at] = v
            if len(buckets) == 1:
                out = self._attend(q, k_cache[: A * kv, :, :end], v_cache[: A * kv, :end], a.scaling, bias)
            else:
                out = torch.cat([self._attend(q[i:j], k_cache[i * kv: j * kv, :, :e], v_cache[i * kv: j * kv, :e],
                                              a.scaling, bias[i:j, :, :e]) for i, j, e in buckets])
            h = h + a.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.cache_len[:A] += 1
        self.length[:A] += 1
        return model.lm_head(body.norm(h[:, -1]))

    def _attend(self, q, keys_t, values, scale: float, bias) -> torch.Tensor:
        """q [A, 1, h, d] against keys^T [A * kv, d, end] and values [A * kv, end, d], each row masked by `bias`
        [A, 1, end] -> [A, 1, h * d] (`_StaticKV._decode_attention`'s arithmetic)."""
        A, groups, end = q.shape[0], self.heads // self.kv_heads, bias.shape[-1]
        qg = q.view(A * self.kv_heads, groups, self.head_dim)
        scores = torch.bmm(qg, keys_t).mul_(scale).view(A, self.heads, end).add_(bias)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(A * self.kv_heads, groups, end)
        return torch.bmm(probs, values).view(A, 1, self.heads * self.head_dim)

    # ---- sampling and retirement ----

    def _sample_rows(self, start: int, stop: int, logits: torch.Tensor) -> torch.Tensor:
        """Sample rows start .. stop-1 from their logits, record token, logprob, version and entropy; the rows
        that finished (a bool mask over those rows)."""
        sp, dev = self.sampling, logits.device
        t_host = self.steps[start:stop]
        t = torch.from_numpy(t_host.copy()).to(dev)  # a copy: the host mirror moves on below
        forced = self.forced[start:stop] if sp.forced_length_median else None
        tok, logp = self.engine._choose(logits, t, sp, self.seeds[start:stop], forced)
        lp = logp.gather(-1, tok[:, None])[:, 0]
        ent = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
        rows = torch.arange(start, stop, device=dev)
        self.tok[rows, t], self.lp[rows, t], self.ent[rows, t] = tok, lp, ent
        self.ver[rows, t] = self.engine.version
        self.last[start:stop] = tok
        self.steps[start:stop] += 1
        return torch.isin(tok, self.engine.stop_ids) | (t + 1 >= sp.max_new_tokens)

    def _retire(self, finished: torch.Tensor) -> list[tuple[object, list[Completion]]]:
        """Hand finished rows to their groups and fill their places with the last running rows; the groups now
        complete."""
        done_rows = finished.nonzero()[:, 0].tolist()  # the one host sync of an iteration
        if not done_rows:
            return []
        idx = torch.tensor(done_rows, device=self.tok.device)
        width = int(self.steps[done_rows].max())
        keep = torch.arange(width, device=idx.device)[None, :] < torch.from_numpy(self.steps[done_rows]).to(idx.device)[:, None]
        tok, lp = self.tok[idx, :width].cpu().numpy(), self.lp[idx, :width].cpu().numpy()
        ver = self.ver[idx, :width].cpu().numpy()
        ent = (self.ent[idx, :width].double() * keep).sum(-1).cpu().tolist()
        stops = set(self.engine.stop_ids.tolist())
        out = []
        for i, r in enumerate(done_rows):
            g, j = self.owner[r]
            n_tok = int(self.steps[r])
            g.done[j] = Completion(token_ids=tok[i, :n_tok].astype(np.int32), logprobs=lp[i, :n_tok].copy(),
                                   versions=ver[i, :n_tok].copy(),
                                   finish_reason="stop" if int(tok[i, n_tok - 1]) in stops else "length",
                                   entropy=ent[i])
            if len(g.done) == g.n:
                out.append((g.key, [g.done[k] for k in range(g.n)]))
        self._compact(done_rows)
        return out

    def _compact(self, done: list[int]) -> None:
        """Drop the finished rows, the highest first. A hole is filled from the end of its attention bucket, that
        row's place from the end of the next bucket, and so on to the last row: a few rows move per hole (each
        cache up to its own length), and each moves only within its bucket or to the bucket before it, next to
        its own, so the rows stay in admission order up to the buckets' edges."""
        dev = self.tok.device
        kv, d, R, L = self.kv_heads, self.head_dim, self.rows, self.L
        for p in sorted(done, reverse=True):
            A = len(self.owner)
            chain = [p] + [stop - 1 for _, stop, _ in attention_buckets(self.length[:A] + 1) if stop - 1 > p]
            for dst, src in zip(chain, chain[1:]):
                upto = int(self.length[src])
                for k, v in zip(self.keys_t, self.values):
                    k.view(R, kv, d, L)[dst, :, :, :upto] = k.view(R, kv, d, L)[src, :, :, :upto]
                    v.view(R, kv, L, d)[dst, :, :upto] = v.view(R, kv, L, d)[src, :, :upto]
            if len(chain) > 1:
                dst, src = chain[:-1], chain[1:]
                d_idx, s_idx = torch.tensor(dst, device=dev), torch.tensor(src, device=dev)
                for buf in (self.tok, self.lp, self.ver, self.ent, self.seeds, self.forced, self.cache_len,
                            self.pos, self.last):
                    buf[d_idx] = buf[s_idx]
                self.steps[dst], self.length[dst] = self.steps[src], self.length[src]
                for a, b in zip(dst, src):
                    self.owner[a] = self.owner[b]
            del self.owner[A - 1]
            self.steps, self.length = self.steps[: A - 1].copy(), self.length[: A - 1].copy()


_BUCKET_FIXED = 1024  # an attention bucket's fixed cost, in row-entries (a few small kernels per layer)


def attention_buckets(ends: np.ndarray) -> list[tuple[int, int, int]]:
    """Consecutive row ranges (start, stop, entries) covering rows 0 .. len(ends)-1, each attended over its own
    longest row's `ends`: a bucket closes where the rows fall below half of its longest (no row reads more than
    twice its own entries), and neighbours join again where that saves less than a bucket's fixed cost. Rows are kept in
    the order they were admitted, so `ends` is almost non-increasing and a few buckets cover the batch."""
    out: list[list[int]] = []
    start, top = 0, int(ends[0])
    for r in range(1, len(ends)):
        e = int(ends[r])
        if 2 * e < top:
            out.append([start, r, top])
            start, top = r, e
        else:
            top = max(top, e)
    out.append([start, len(ends), top])
    merged = [out[0]]
    for b in out[1:]:  # neighbours join where the entries padding would add cost less than a bucket's fixed cost
        a = merged[-1]
        top = max(a[2], b[2])
        if (b[1] - a[0]) * top - (a[1] - a[0]) * a[2] - (b[1] - b[0]) * b[2] < _BUCKET_FIXED:
            merged[-1] = [a[0], b[1], top]
        else:
            merged.append(b)
    return [tuple(b) for b in merged]
