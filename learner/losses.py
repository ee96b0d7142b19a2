"""Policy losses, importance weights and aggregation: pure tensor functions.

Three policies meet here (docs/DESIGN.md section 4): pi_behav (the generator's
per-token logprobs), pi_prox (the policy at the start of this train step) and
pi_theta (being optimised). The decoupled objective of AReaL is

    loss_t = w_t * L(r_t, A_t),   w_t = f(pi_prox / pi_behav) (detached),
    r_t = pi_theta / pi_prox,

so the PPO trust region is taken around pi_prox while w corrects for the data
having come from older (or differently computed) behaviour policies.

Every function takes tensors of any shape (the learner uses packed [1, N]
rows), returns tensors, and never syncs with the host (no `.item()`), so the
learner can reduce metrics once after the step. Metric tensors are per-token:
the caller reduces them under the mask with the global token count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LossTerms(NamedTuple):
    """What a loss returns: the loss (per token for a policy loss, [...] like its inputs, zero off the mask; the
    micro-batch's scalar share for `learner.objective.Objective`) and its per-token metric tensors by name."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite without changing any sane value


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_pg(log_ratio, advantages, clip_low, clip_high) -> tuple[torch.Tensor, torch.Tensor]:
    """pg1 = -A r and pg2 = -A clip(r, 1 - eps_low, 1 + eps_high): PPO's two surrogate terms."""
    ratio = log_ratio.exp()
    return -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)


def ppo_loss(
    logprobs: torch.Tensor,  # [...] log pi_theta
    old_logprobs: torch.Tensor,  # [...] log pi_prox
    advantages: torch.Tensor,  # [...]
    mask: torch.Tensor,  # [...] 1 for response tokens
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
) -> LossTerms:
    """PPO clip with clip-higher (eps_low, eps_high) and optional dual-clip for A < 0.

    pg1 = -A r, pg2 = -A clip(r, 1-eps_low, 1+eps_high), loss = max(pg1, pg2);
    dual-clip (Ye et al. 2020): for A < 0 the loss is also capped at -A c, so a
    huge ratio on a negative-advantage token cannot blow up the update.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    pg1, pg2 = _clipped_pg(log_ratio, advantages, clip_low, clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip_c is not None:
        pg3 = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > pg3)
        loss = torch.where(advantages < 0, torch.minimum(loss, pg3), loss)
        clipped = clipped | dual
    metrics = {
        "pg_clipfrac": clipped.float() * mask,
        # k1 estimate of KL(pi_prox || pi_theta) per token (verl's ppo_kl).
        "ppo_kl": -log_ratio.detach() * mask,
    }
    return LossTerms(loss * mask, metrics)


def seq_ids_for(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence index of every element of a [B, T] tensor: each row is one sequence."""
    B = x.shape[0] if x.dim() > 1 else 1
    return torch.arange(B, device=x.device).view(-1, *([1] * (x.dim() - 1))).expand_as(x), B


def segment_sum(x: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[...] values, [...] sequence ids -> [num_seqs] per-sequence sums."""
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq_ids.reshape(-1), x.reshape(-1))


def importance_weights(
    prox_logprobs: torch.Tensor,  # [...] log pi_prox
    behav_logprobs: torch.Tensor,  # [...] log pi_behav
    mask: torch.Tensor,
    *,
    kind: str,
    cap: float = 2.0,
    lo: float = 0.5,
    hi: float = 2.0,
    seq_ids: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w = f(pi_prox / pi_behav), detached; log ratios clamped to +-20.

    none:     1
    tis:      min(rho_t, C) per token (truncated IS)
    seq_tis:  min(prod_t rho_t, C) per sequence, on every token of it
    mis:      rho_t inside [lo, hi], 0 outside (masked IS)
    geo_mask: 1 if the sequence's geometric-mean ratio exp(mean_t log rho) is inside [lo, hi], else 0
    Sequences are rows of a [B, T] tensor, or given by `seq_ids` for packed rows.
    """
    log_rho = ((prox_logprobs - behav_logprobs) * mask).detach()
    if seq_ids is None:
        seq_ids, num_seqs = seq_ids_for(log_rho)
    if kind == "none":
        w, dropped = torch.ones_like(log_rho), torch.zeros_like(log_rho)
    elif kind == "tis":
        rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        w, dropped = rho.clamp(max=cap), (rho > cap).float()
    elif kind == "seq_tis":
        seq_log = segment_sum(log_rho, seq_ids, num_seqs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = seq_log.exp()[seq_ids]
        w, dropped = rho.clamp(max=cap), (rho > cap).float()
    elif kind == "mis":
        rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        inside = (rho >= lo) & (rho <= hi)
        w, dropped = rho * inside, (~inside).float()
    elif kind == "geo_mask":
        n = segment_sum(mask.float(), seq_ids, num_seqs).clamp(min=1.0)
        geo = (segment_sum(log_rho, seq_ids, num_seqs) / n).exp()[seq_ids]
        inside = (geo >= lo) & (geo <= hi)
        w, dropped = inside.float(), (~inside).float()
    else:
        raise ValueError(f"unknown importance weight {kind!r}; use one of none, tis, seq_tis, mis, geo_mask")
    return w * mask, {"is_weight": w * mask, "is_weight_clipfrac": dropped * mask}


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    loss_per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: torch.Tensor | float,
    global_seqs: torch.Tensor | float = 1.0,
    seq_ids: torch.Tensor | None = None,
    num_seqs: int | None = None,
    norm_tokens: float = 1.0,
) -> torch.Tensor:
    """This shard's share of the step's loss; summing the shares over shards gives the step's loss.

    token-mean:              sum(m l) / global_tokens        (DAPO; every token counts the same)
    seq-mean-token-mean:     sum_i mean_t(l_i) / global_seqs  (original GRPO; length-biased)
    seq-mean-token-sum:      sum_i sum_t(l_i) / global_seqs
    seq-mean-token-sum-norm: sum(m l) / (norm_tokens * global_seqs)  (Dr. GRPO: a fixed horizon, not |o_i|)
    `global_*` are counts over the whole step (all micro-batches and ranks), never this shard's,
    so the result does not depend on how the batch was split. Zeroed tokens stay in every count.
    """
    ml = loss_per_token * mask
    if mode == "token-mean":
        return ml.sum() / global_tokens
    if mode == "seq-mean-token-sum-norm":
        return ml.sum() / (norm_tokens * global_seqs)
    if seq_ids is None:
        seq_ids, num_seqs = seq_ids_for(ml)
    per_seq = segment_sum(ml, seq_ids, num_seqs)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / global_seqs
    if mode == "seq-mean-token-mean":
        n = segment_sum(mask.to(ml.dtype), seq_ids, num_seqs)
        return (per_seq / n.clamp(min=1.0)).sum() / global_seqs
    raise ValueError(f"unknown aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


def token_mean(loss_per_token: torch.Tensor, mask: torch.Tensor, global_tokens: torch.Tensor | float) -> torch.Tensor:
    """Sum of masked token losses over the token count of the *whole step*."""
    return aggregate(loss_per_token, mask, "token-mean", global_tokens=global_tokens)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] full-vocabulary entropy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ---- covariance-based entropy control (Cui et al. 2025) ------------------------


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def covariance_score(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    means: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Cov_t = (logp_t - mean logp)(A_t - mean A) (Eq. 10).

    The means are over the valid tokens passed in, or `means` = (mean logp, mean A)
    taken over a larger batch (the whole step: `select_step` in learner/objective.py). logp is detached: the
    score selects tokens, it is not optimised.
    """
    lp = logprobs.detach()
    mean_lp, mean_a = means if means is not None else (_masked_mean(lp, mask), _masked_mean(advantages, mask))
    return (lp - mean_lp) * (advantages - mean_a) * mask


def _count(fraction: float, mask: torch.Tensor) -> torch.Tensor:
    """max(1, int(fraction * valid tokens)) as a tensor: no host sync."""
    return torch.floor(mask.sum() * fraction).clamp(min=1.0)


def _top_k_mask(scores: torch.Tensor, k: torch.Tensor, fraction: float) -> torch.Tensor:
    """True on the k largest scores, k a 0-d tensor (no host sync).

    k = max(1, floor(fraction * n_valid)) never exceeds k_max = max(1, floor(fraction * numel)),
    which the shape alone fixes; so a partial top-k_max (O(N log k_max), not a full sort) is
    enough, and the tensor k then cuts it without reading k on the host.
    """
    flat = scores.reshape(-1)
    k_max = max(1, min(flat.numel(), int(fraction * flat.numel())))
    top = flat.topk(k_max, sorted=True).indices
    take = torch.arange(k_max, device=flat.device) < k
    return torch.zeros_like(flat, dtype=torch.bool).scatter_(0, top, take).view_as(scores)


def clip_cov_candidates(cov: torch.Tensor, mask: torch.Tensor, cov_lb: float, cov_ub: float) -> torch.Tensor:
    return (mask > 0) & (cov > cov_lb) & (cov < cov_ub)


def clip_cov_keys(candidate: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform random keys for candidates, -1 elsewhere: the k largest are a uniform k-subset."""
    if generator is None:
        raise ValueError("Clip-Cov needs a seeded torch.Generator: the token choice must be reproducible")
    # Drawn on the host and moved: the same keys on CPU and GPU, from a CPU generator either way.
    keys = torch.rand(candidate.shape, generator=generator).to(candidate.device)
    return torch.where(candidate, keys, torch.full_like(keys, -1.0))


def kl_cov_eligible(cov: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (mask > 0) & (cov > 0)


def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    cov_fraction: float,
    cov_lb: float,
    cov_ub: float,
    generator: torch.Generator | None,
    selected: torch.Tensor | None = None,
) -> LossTerms:
    """Clip-Cov: zero the gradient of a random few high-covariance tokens.

    Candidates are valid tokens not already clipped by PPO whose covariance
    score lies strictly inside (cov_lb, cov_ub); max(1, int(cov_fraction * n_valid))
    of them, drawn uniformly with `generator`, get their loss multiplied by 0.
    They stay in the token-mean denominator. Paper: cov_fraction 2e-4, bounds
    (1, 5), clip ratios 1 (so the covariance selection is the trust region).
    `selected`, if given, is a choice already made over a larger batch (the
    loss's step-wide choice, learner/objective.py); it still never touches a PPO-clipped token.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    pg1, pg2 = _clipped_pg(log_ratio, advantages, clip_low, clip_high)
    ppo_clipped = pg2 > pg1
    cov = covariance_score(logprobs, advantages, mask)
    candidate = clip_cov_candidates(cov, mask, cov_lb, cov_ub) & ~ppo_clipped
    if selected is not None:
        selected = selected.bool() & ~ppo_clipped & (mask > 0)
    else:
        keys = clip_cov_keys(candidate, generator)
        selected = candidate & _top_k_mask(keys, _count(cov_fraction, mask), cov_fraction)
    loss = torch.maximum(pg1, pg2) * (~selected).float()
    metrics = {
        "pg_clipfrac": selected.float() * mask,  # the paper logs the share of tokens zeroed
        "cov_selected": selected.float() * mask,
        "ppo_kl": -log_ratio.detach() * mask,
    }
    return LossTerms(loss * mask, metrics)


def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_fraction: float,
    kl_coef: float,
    selected: torch.Tensor | None = None,
) -> LossTerms:
    """KL-Cov: unclipped -A r everywhere, plus kl_coef |logp - old| on the top-k covariance tokens.

    k = max(1, int(kl_fraction * n_valid)). The penalty is the absolute log
    ratio, as in the paper's code (not a true KL). Paper: kl_fraction 2e-3 (7B),
    2e-4 (32B), kl_coef 1. With kl_coef = 0 this is the plain importance-weighted
    policy gradient.

    Departure: only tokens with Cov > 0 can be selected. In the paper's regime
    the top 0.2 % always have positive covariance, so nothing changes there; but
    with all advantages equal (Cov = 0 everywhere) no token is "high covariance",
    and penalising an arbitrary k of them would move the policy for no reason.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    pg = -advantages * log_ratio.exp()
    cov = covariance_score(logprobs, advantages, mask)
    if selected is not None:  # chosen over the whole step (learner/objective.py KLCov)
        selected = selected.bool() & (mask > 0)
    else:
        eligible = kl_cov_eligible(cov, mask)
        scores = torch.where(eligible, cov, torch.full_like(cov, float("-inf")))
        selected = eligible & _top_k_mask(scores, _count(kl_fraction, mask), kl_fraction)
    loss = pg + selected.float() * kl_coef * log_ratio.abs()
    metrics = {
        "pg_clipfrac": torch.zeros_like(pg),
        "cov_selected": selected.float() * mask,
        "ppo_kl": -log_ratio.detach() * mask,
    }
    return LossTerms(loss * mask, metrics)


# ---- sequence-level and clipped-weight losses ----------------------------------


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    seq_ids: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> LossTerms:
    """GSPO (Zheng et al. 2025): the PPO clip on a sequence-level ratio.

    s_i = exp(mean_t (logp - old)) over sequence i; token ratio sg(s_i) * pi / sg(pi),
    whose value is s_i and whose gradient is s_i * grad log pi. Published eps about
    3e-4 / 4e-4; aggregate with seq-mean-token-mean as in the paper.
    """
    if seq_ids is None:
        seq_ids, num_seqs = seq_ids_for(logprobs)
    log_ratio = (logprobs - old_logprobs) * mask
    n = segment_sum(mask.to(logprobs.dtype), seq_ids, num_seqs).clamp(min=1.0)
    seq_log = (segment_sum(log_ratio, seq_ids, num_seqs) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s_tok = seq_log.detach().exp()[seq_ids]
    ratio = s_tok * (logprobs - logprobs.detach()).exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    metrics = {"pg_clipfrac": (pg2 > pg1).float() * mask, "ppo_kl": -log_ratio.detach() * mask}
    return LossTerms(loss * mask, metrics)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> LossTerms:
    """CISPO (MiniMax-M1): -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp.

    The IS weight is clipped and detached, so every token keeps a gradient
    (PPO drops the gradient of clipped tokens entirely).
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = log_ratio.exp().detach()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -clipped_ratio * advantages * logprobs
    metrics = {"pg_clipfrac": (clipped_ratio != ratio).float() * mask, "ppo_kl": -log_ratio.detach() * mask}
    return LossTerms(loss * mask, metrics)


# ---- modifiers -------------------------------------------------------------------


def par_weights(advantages: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    """Positive-advantage reweighting (Jin et al. 2025): lambda on tokens with A > 0, 1 elsewhere."""
    return torch.where(advantages > 0, torch.as_tensor(lam, dtype=advantages.dtype), torch.ones_like(advantages))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimators: k1 = logp - ref, k2 = k1^2 / 2, k3 = exp(-k1) + k1 - 1."""
    k1 = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return k1
    if kind == "k2":
        return 0.5 * k1.square()
    if kind == "k3":
        return (-k1).exp() + k1 - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def high_entropy_count(n_valid: float, top_fraction: float) -> int:
    """How many tokens the top-`top_fraction` entropy selection keeps out of `n_valid`: ceil(f * n), at least 1."""
    return max(1, int(n_valid * top_fraction + 0.999999))


def high_entropy_keep(entropy: torch.Tensor, mask: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """Train only the valid tokens whose entropy is at least `kth`, the `high_entropy_count`-th largest valid entropy
    of the whole step's batch on all ranks (Wang et al. 2025: the top 20 %). Float mask, same shape as `entropy`."""
    return ((entropy.double() >= kth) & (mask > 0)).float()


# ---- off-policy token masking (M2PO, Zheng et al. 2025) --------------------------


def m2po_cut(top: torch.Tensor, total, count, threshold: float, complete: bool) -> torch.Tensor:
    """M2PO's cut over a step whose squared log ratios m_t sum to `total` over `count` valid tokens, from `top`, the
    largest of them in descending order padded with -inf (all of them when `complete`). A 0-d tensor: the valid
    tokens with m_t >= it are dropped (inf: none); NaN when `top` is too short to decide (ask again with more).

    The largest values are dropped until the mean of the rest is below `threshold`, tokens of equal value together
    (so the choice depends on neither their order nor how the step is split); at least the tokens of the smallest
    value stay. No host sync."""
    top = top.double()
    total, count = torch.as_tensor(total, dtype=torch.float64), torch.as_tensor(count, dtype=torch.float64)
    finite = torch.isfinite(top)
    dropped_n = torch.arange(1, top.numel() + 1, dtype=torch.float64, device=top.device)
    rest_n = count - dropped_n
    rest_mean = (total - torch.where(finite, top, 0.0).cumsum(0)) / rest_n.clamp(min=1.0)
    following = torch.cat([top[1:], top.new_full((1,), float("-inf"))])
    level_end = finite & (top != following)  # the last of its tie level: where a cut may fall
    if not complete:  # the level of the smallest value in `top` may go on beyond it
        level_end = level_end & (top != top[-1])
    cut_here = level_end & (rest_n > 0) & (rest_mean < threshold)
    inf, nan = top.new_tensor(float("inf")), top.new_tensor(float("nan"))
    first = top[torch.argmax(cut_here.int())] if top.numel() else inf
    # Nothing would do (complete): drop every level above the smallest, the last cut point that leaves a token.
    levels = level_end & (rest_n > 0)
    last = torch.where(levels.any(), top[(levels.int() * torch.arange(top.numel(), device=top.device)).argmax()], inf) \
        if top.numel() else inf
    out = torch.where(cut_here.any(), first, last if complete else nan)
    return torch.where((count <= 0) | (total < threshold * count), inf, out)


def m2po_mask(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
              threshold: float) -> torch.Tensor:
    """M2PO's kept-token mask (float, the shape of `mask`) over the valid tokens given: drop those with the largest
    m_t = (log pi_behav - log pi_prox)^2 until the mean of m over the rest is below `threshold` (`m2po_cut`).
    Dropped tokens stay in the aggregation's denominator. The learner applies it over the whole step on all ranks
    (`learner/offpolicy.py`); this is the same rule on one tensor."""
    m = m2po_second_moment_terms(prox_logprobs, behav_logprobs)
    valid = mask > 0
    top = torch.where(valid, m, float("-inf")).reshape(-1).sort(descending=True).values
    cut = m2po_cut(top, (m * valid).sum(), valid.sum(), threshold, complete=True)
    return ((m < cut) & valid).to(mask.dtype)


def m2po_second_moment_terms(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor) -> torch.Tensor:
    """m_t = (log pi_behav - log pi_prox)^2 in float64, log ratios clamped to +-20 (M2PO's per-token term)."""
    return (behav_logprobs.double() - prox_logprobs.double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).square()
