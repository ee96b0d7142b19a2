"""From scored groups to per-rank, token-balanced, packed micro-batches.

Rank 0 builds one `StepBatch` per learner step and broadcasts it; every rank
reads its own part of the plan. The plan is
`plan[mini_batch][rank] = [micro_batch, ...]`, each micro-batch a list of
sample indices packed into one padding-free row. Every rank gets the same
number of micro-batches per mini-batch (short ranks get empty ones) because
ZeRO's gradient reduction is a collective: a rank that skipped a backward
would hang the others.

Advantages are computed here, per group, before any sharding, so they never
depend on how the batch is split, from the rewards the broker hands over with each group (shaped by its
rules: the scores plus the overlong penalty; the learner never shapes them again).
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from common import messages
from common.config import LearnerConfig
from common.seeds import step_seed
from learner import advantages

_LEARNER = LearnerConfig()  # every default lives in common/config.py


class TrainSample(msgspec.Struct, array_like=True, gc=False):
    input_ids: bytes  # int32 LE [P + R]: prompt then response
    prompt_len: int
    behav_logprobs: bytes  # float32 LE [R]
    versions: bytes  # int32 LE [R]
    advantage: float


class StepBatch(msgspec.Struct, array_like=True, gc=False):
    version: int  # learner version the step starts from
    samples: list[TrainSample]
    plan: list[list[list[list[int]]]]  # [mini][rank][micro] -> sample indices
    mini_tokens: list[int]  # response tokens of each mini-batch, over all ranks
    mini_seqs: list[int]  # responses in each mini-batch, over all ranks
    par_lambda: float = 1.0  # positive-advantage weight for this step (1: off)
    seed: int = 0  # seeds this step's random token choices (Clip-Cov)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepBatch)


def encode(batch: StepBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(buf: bytes) -> StepBatch:
    return _DECODER.decode(buf)


def _balance(lengths: list[int], idx: list[int], ranks: int) -> list[list[int]]:
    """Longest-processing-time greedy: each sample to the rank with fewest tokens."""
    heap = [(0, r) for r in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return out


def _micro_batches(lengths: list[int], idx: list[int], budget: int) -> list[list[int]]:
    """First-fit packing into rows of at most `budget` tokens (a longer sample rides alone)."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        for r, load in enumerate(loads):
            if load + lengths[i] <= budget:
                rows[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            rows.append([i])
            loads.append(lengths[i])
    return [sorted(r) for r in rows]


def build_step_batch(
    groups: list[messages.RolloutGroup],
    rewards: np.ndarray,  # [G, n] shaped rewards, as the broker hands them over
    *,
    version: int,
    ranks: int,
    mini_batches: int,
    micro_batch_tokens: int,
    estimator: str = _LEARNER.advantage,
    par_lambda: float = 1.0,
    seed: int = 0,
) -> StepBatch:
    resp_lengths = np.array([[messages.n_tokens(s.token_ids) for s in g.samples] for g in groups])
    adv = advantages.ESTIMATORS[estimator](rewards, resp_lengths)
    samples: list[TrainSample] = []
    group_of: list[int] = []
    for gi, g in enumerate(groups):
        prompt = messages.as_array(g.prompt_ids, messages.TOKEN_DTYPE)
        for si, s in enumerate(g.samples):
            resp = messages.as_array(s.token_ids, messages.TOKEN_DTYPE)
            samples.append(
                TrainSample(
                    input_ids=messages.to_bytes(np.concatenate([prompt, resp]), messages.TOKEN_DTYPE),
                    prompt_len=len(prompt),
                    behav_logprobs=s.logprobs,
                    versions=s.versions,
                    advantage=float(adv[gi, si]),
                )
            )
            group_of.append(gi)
    lengths = [messages.n_tokens(s.input_ids) for s in samples]
    resp_len = [messages.n_tokens(s.versions) for s in samples]
    per_mini = len(groups) // mini_batches
    plan, mini_tokens, mini_seqs = [], [], []
    for m in range(mini_batches):
        idx = [i for i, gi in enumerate(group_of) if m * per_mini <= gi < (m + 1) * per_mini]
        per_rank = [_micro_batches(lengths, part, micro_batch_tokens) for part in _balance(lengths, idx, ranks)]
        depth = max(1, max(len(p) for p in per_rank))
        plan.append([p + [[] for _ in range(depth - len(p))] for p in per_rank])
        mini_tokens.append(sum(resp_len[i] for i in idx))
        mini_seqs.append(len(idx))
    return StepBatch(version=version, samples=samples, plan=plan, mini_tokens=mini_tokens, mini_seqs=mini_seqs,
                     par_lambda=par_lambda, seed=seed)


def batch_from_config(groups: list[messages.RolloutGroup], rewards: np.ndarray, cfg, *, version: int, ranks: int,
                      par_lambda: float = 1.0, micro_batch_tokens: int | None = None) -> StepBatch:
    """`build_step_batch` with every knob read from the run config (the learner and the reference loop share it);
    `rewards` [G, n]: the shaped rewards the broker decided (`broker.rules.GroupRules.rewards`)."""
    lc = cfg.learner
    return build_step_batch(
        groups, rewards, version=version, ranks=ranks, mini_batches=lc.mini_batches,
        micro_batch_tokens=micro_batch_tokens or lc.micro_batch_tokens, estimator=lc.advantage,
        par_lambda=par_lambda, seed=step_seed(cfg.run.seed, version + 1),
    )


@dataclass(frozen=True)
class Packed:
    """One micro-batch as one padding-free row (`pack`): the model's inputs and everything the step reads per token.

    `input_ids` and `position_ids` are [1, N + 1] (N + 1 row tokens; position ids restart at 0 for every sample);
    the other tensors are [1, N], aligned to *targets*: entry t holds what is needed to score token t + 1 of the row
    from the logits at position t. The samples' boundaries are kept twice: `cu_seqlens` ([num_seqs + 1] int32, row
    offsets) for attention kernels on the device, and `seq_lens` / `max_len` as Python ints, so no forward reads a
    tensor back to find them (`attn_kwargs`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor  # 1 where the target is a response token
    behav: torch.Tensor  # log pi_behav of the target
    versions: torch.Tensor  # the policy version that sampled the target
    adv: torch.Tensor
    seq_ids: torch.Tensor  # which of the num_seqs samples each target belongs to
    num_seqs: int  # samples in the row (0: an empty micro-batch, one pad token)
    cu_seqlens: torch.Tensor
    seq_lens: tuple[int, ...]
    max_len: int

    @property
    def row_tokens(self) -> int:
        """Tokens the model runs over (0 for an empty micro-batch, whose one pad token trains nothing)."""
        return sum(self.seq_lens) if self.num_seqs else 0

    def to(self, device: torch.device) -> "Packed":
        """The same record with every tensor on `device`."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def attn_kwargs(self) -> dict:
        """The sample boundaries as the model's forward takes them: FlashAttention's keyword names (the device
        offsets and the longest sample, for flash_attention_2 and torch's varlen kernels) and the host lengths
        (`seq_lens`, for `learner.attention`'s CPU path). sdpa and eager ignore them and mask by position ids."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_len,
                "max_length_k": self.max_len, "seq_lens": self.seq_lens}


def pack(samples: list[TrainSample], idx: list[int], pad_id: int) -> Packed:
    """The samples `idx` as one padding-free row (`Packed`); restarting position ids tell attention where samples
    end for sdpa, `Packed.attn_kwargs` for varlen kernels."""
    if not idx:  # an empty micro-batch: one pad token, zero mask (keeps collectives aligned)
        one = torch.tensor([[pad_id]])
        zero = torch.zeros((1, 0))
        return Packed(input_ids=one, position_ids=torch.zeros_like(one), targets=one[:, :0], mask=zero, behav=zero,
                      versions=zero.long(), adv=zero, seq_ids=zero.long(), num_seqs=0,
                      cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), seq_lens=(1,), max_len=1)
    ids, pos, mask, behav, vers, adv, sid = [], [], [], [], [], [], []
    for k, i in enumerate(idx):
        s = samples[i]
        seq = messages.as_array(s.input_ids, messages.TOKEN_DTYPE).astype(np.int64)
        P, R = s.prompt_len, len(seq) - s.prompt_len
        ids.append(seq)
        pos.append(np.arange(len(seq)))
        # Target t+1 is a response token iff t+1 >= P; position t = P-1 predicts the first one.
        m = np.zeros(len(seq), dtype=np.float32)
        m[P - 1 : P - 1 + R] = 1.0
        mask.append(m)
        b = np.zeros(len(seq), dtype=np.float32)
        b[P - 1 : P - 1 + R] = messages.as_array(s.behav_logprobs, messages.LOGPROB_DTYPE)
        behav.append(b)
        v = np.zeros(len(seq), dtype=np.int64)
        v[P - 1 : P - 1 + R] = messages.as_array(s.versions, messages.VERSION_DTYPE)
        vers.append(v)
        adv.append(np.full(len(seq), s.advantage, dtype=np.float32))
        sid.append(np.full(len(seq), k, dtype=np.int64))
    row = torch.from_numpy(np.concatenate(ids))[None]
    cat = lambda parts: torch.from_numpy(np.concatenate(parts))[None]  # noqa: E731
    lens = tuple(len(x) for x in ids)
    # The last position of the row predicts nothing: drop it from the target-aligned tensors.
    return Packed(
        input_ids=row, position_ids=cat(pos), targets=row[:, 1:], mask=cat(mask)[:, :-1], behav=cat(behav)[:, :-1],
        versions=cat(vers)[:, :-1], adv=cat(adv)[:, :-1], seq_ids=cat(sid)[:, :-1], num_seqs=len(idx),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32), seq_lens=lens,
        max_len=max(lens),
    )
