"""Every message that crosses a process boundary, and nothing else.

Each message is a tagged msgspec Struct (`array_like=True`: positional, compact;
`gc=False`: no cyclic refs). Each socket has one typed decoder over the union of
what it may receive (`HUB_INBOUND`, `GENERATOR_INBOUND`), so a peer can never
make us build an object of a type we did not expect.

Token ids, logprobs and versions travel as raw little-endian arrays in `bytes`
fields (int32 / float32 / int32), never as Python lists: a 2048-token response
is 3 x 8 KiB of memcpy instead of 6000 boxed numbers. `as_array`/`to_bytes`
convert at the edges. `check_rollout` validates what a struct type cannot
(lengths that agree, versions that exist) so the hub can reject a malformed
group with a reason instead of failing deep inside the batcher.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

# The version of this wire: a generator and a hub must agree on it (`Hello` is refused otherwise). Raise it with
# any change to a message below; the policy version travels as `policy_version` in every message that carries it.
PROTOCOL_VERSION = 8

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")


class _Msg(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    pass


class SamplingParams(_Msg):
    temperature: float
    top_p: float
    max_new_tokens: int
    # Benchmark workload only (rollout.forced_length_median): > 0 imposes each response's length, drawn per row
    # from lognormal(median, sigma); see actors/engine.py `forced_lengths`.
    forced_length_median: int = 0
    forced_length_sigma: float = 0.0


# ---- generator -> hub --------------------------------------------------------


class Hello(_Msg, tag="hello"):
    protocol_version: int
    run_id: str
    gen_id: int
    incarnation: str  # unique per process start; tells a restart from a delayed message
    pid: int


class WorkRequest(_Msg, tag="want"):
    """A generator's room for training work. `max_groups`: groups it can take on top of everything it has received;
    `received_groups`: training groups it has received so far (this incarnation), so the hub subtracts what is still
    on the wire and never gives more than the room (-1: not counted, `max_groups` is the room now: for hand-written
    clients); `capacity`: the groups it keeps in flight when full (0: unknown), which sizes its evaluation chunks."""

    gen_id: int
    incarnation: str
    max_groups: int
    received_groups: int = -1
    capacity: int = 0


class Heartbeat(_Msg, tag="beat"):
    gen_id: int
    incarnation: str
    policy_version: int  # the newest version that has arrived at this generator (the hub's weight-lag gauge)


class Sample(_Msg):
    token_ids: bytes  # int32 LE [T] response tokens (EOS included when finish_reason == "stop")
    logprobs: bytes  # float32 LE [T] log pi_behav of each token, of the distribution sampled from
    versions: bytes  # int32 LE [T] policy version that produced each token
    reward: float
    finish_reason: str  # "stop" | "length"
    score_status: str  # "ok" | "timeout" | "error"


class RolloutGroup(_Msg, tag="group"):
    gen_id: int
    incarnation: str
    ticket: int  # the hub's id of this issue of the prompt
    prompt_id: int
    epoch: int
    prompt_ids: bytes  # int32 LE [P]
    samples: list[Sample]
    gen_time_s: float


class EvalResult(_Msg, tag="evalres"):
    """Scores of one eval prompt's k samples; no tokens travel back, only what the metrics need."""

    gen_id: int
    incarnation: str
    ticket: int
    policy_version: int  # the version every sample was generated with
    rewards: list[float]
    lengths: list[int]  # response tokens per sample
    score_status: list[str]  # "ok" | "timeout" | "error" per sample
    texts: list[str] = []  # the decoded responses, only for prompts the work asked texts of (keep_texts)
    # Per sample: its tokens' summed entropy (nats) under the sampling distribution of the version that generated
    # them (on-policy entropy; with greedy evaluation, the untempered distribution's); empty where the engine does
    # not measure it (vLLM).
    entropies: list[float] = []


# ---- hub -> generator --------------------------------------------------------


class Welcome(_Msg, tag="welcome"):
    """The hub admits a generator incarnation. Its weight channel is its own two-member group under
    `pair_prefix(gen_id, incarnation)` (common/weights.py) in the store at `weight_addr`; the version it generates
    with is the first one it receives there, never a number from here."""

    protocol_version: int
    run_id: str
    weight_addr: str  # host:port of the learner's weight-channel TCPStore


class Refused(_Msg, tag="refused"):
    reason: str


class WorkItem(_Msg):
    ticket: int
    prompt_id: int
    epoch: int
    prompt_ids: bytes  # int32 LE [P]
    answer: str
    data_source: str
    seed: int  # sampling seed of this prompt; re-issues reuse it


class Work(_Msg, tag="work"):
    items: list[WorkItem]
    group_size: int
    sampling: SamplingParams
    policy_version: int  # generate with weights of at least this version


class EvalWork(_Msg, tag="eval"):
    """Held-out prompts to sample with weights of exactly `policy_version` (the hub holds the next
    version back until every eval item of this one is in), and score; answered with EvalResult."""

    items: list[WorkItem]  # epoch is 0; prompt_id indexes the eval set named by data_source
    k: int
    sampling: SamplingParams  # temperature 0: greedy
    policy_version: int
    keep_texts: int = 0  # send back the response texts of the items whose prompt_id is below this (rollout log)


class Stop(_Msg, tag="stop"):
    reason: str


HUB_INBOUND = Union[Hello, WorkRequest, Heartbeat, RolloutGroup, EvalResult]
GENERATOR_INBOUND = Union[Welcome, Refused, Work, EvalWork, Stop]


def to_bytes(values, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def as_array(buf: bytes, dtype: np.dtype) -> np.ndarray:
    """Zero-copy read-only view of a raw array field."""
    return np.frombuffer(buf, dtype=dtype)


def n_tokens(buf: bytes) -> int:
    """Entries of a per-token raw array field (token ids, logprobs, versions: 4 bytes each)."""
    return len(buf) // TOKEN_DTYPE.itemsize


assert TOKEN_DTYPE.itemsize == LOGPROB_DTYPE.itemsize == VERSION_DTYPE.itemsize, "n_tokens counts any per-token field"


def check_eval(res: EvalResult, *, k: int, version: int, max_tokens: int) -> str | None:
    """Why this eval result cannot be counted, or None (a stable metric-key reason, like check_rollout)."""
    if not (len(res.rewards) == len(res.lengths) == len(res.score_status) == k) or len(res.texts) not in (0, k):
        return "eval_shape"
    if res.policy_version != version:
        return "eval_version"
    if any(not (0 < n <= max_tokens) for n in res.lengths) or any(not (r == r) for r in res.rewards):
        return "eval_fields"
    return None


def check_rollout(group: RolloutGroup, *, group_size: int, max_version: int, max_tokens: int) -> str | None:
    """Why this group cannot be trained on, or None if it can.

    Decoding already guaranteed the types; this checks the shapes and values a
    type cannot express. Every reason is a short stable string: it is a metric key.
    """
    if len(group.samples) != group_size:
        return "group_size"
    if len(group.prompt_ids) % TOKEN_DTYPE.itemsize or not group.prompt_ids:
        return "prompt_ids"
    for s in group.samples:
        n, rem = divmod(len(s.token_ids), TOKEN_DTYPE.itemsize)
        if rem or n == 0 or n > max_tokens:
            return "token_ids"
        if len(s.logprobs) != n * LOGPROB_DTYPE.itemsize or len(s.versions) != n * VERSION_DTYPE.itemsize:
            return "length_mismatch"
        versions = as_array(s.versions, VERSION_DTYPE)
        if versions.min() < 0 or versions.max() > max_version:
            return "version"
        logprobs = as_array(s.logprobs, LOGPROB_DTYPE)
        if not np.isfinite(logprobs).all() or (logprobs > 1e-4).any():
            return "logprobs"
        if not (s.reward == s.reward) or s.finish_reason not in ("stop", "length"):
            return "sample_fields"
    return None
