"""Policy losses, importance weights and aggregation: pure tensor functions.

Three policies meet here (DESIGN.md section 4): pi_behav (the generator's
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

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite without changing any sane value


def ppo_loss(
    logprobs: torch.Tensor,  # [...] log pi_theta
    old_logprobs: torch.Tensor,  # [...] log pi_prox
    advantages: torch.Tensor,  # [...]
    mask: torch.Tensor,  # [...] 1 for response tokens
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip with clip-higher (eps_low, eps_high) and optional dual-clip for A < 0.

    pg1 = -A r, pg2 = -A clip(r, 1-eps_low, 1+eps_high), loss = max(pg1, pg2);
    dual-clip (Ye et al. 2020): for A < 0 the loss is also capped at -A c, so a
    huge ratio on a negative-advantage token cannot blow up the update.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
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
    return loss * mask, metrics


def importance_weights(
    prox_logprobs: torch.Tensor,  # [...] log pi_prox
    behav_logprobs: torch.Tensor,  # [...] log pi_behav
    mask: torch.Tensor,
    *,
    kind: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w = f(pi_prox / pi_behav), detached. `none`: 1; `tis`: min(rho, C) per token."""
    log_rho = (prox_logprobs - behav_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "none":
        w = torch.ones_like(log_rho)
        clipped = torch.zeros_like(log_rho, dtype=torch.bool)
    elif kind == "tis":
        rho = log_rho.exp()
        w = rho.clamp(max=cap)
        clipped = rho > cap
    else:
        raise ValueError(f"unknown importance weight {kind!r}; use one of none, tis")
    return w * mask, {"is_weight": w * mask, "is_weight_clipfrac": clipped.float() * mask}


def token_mean(loss_per_token: torch.Tensor, mask: torch.Tensor, global_tokens: torch.Tensor | float) -> torch.Tensor:
    """Sum of masked token losses over the token count of the *whole step*.

    Dividing by the global count (not this micro-batch's) makes the gradient the
    same however the batch is split over ranks and micro-batches.
    """
    return (loss_per_token * mask).sum() / global_tokens


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] full-vocabulary entropy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
