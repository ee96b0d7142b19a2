"""The learner's objective, assembled once from the config (docs/DESIGN.md section 4).

    loss_t = w_t * lambda_t * L(r_t, A_t) [* high-entropy mask] - c_H H_t + c_KL KL_t,
    aggregated over the whole step (`learner.agg`).

`make_objective` picks the policy loss, the importance weight and the
aggregation when the config is read; the train step only calls the result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from common.config import ClipCovLoss, CISPOLoss, GSPOLoss, KLCovLoss, LearnerConfig, PPOLoss
from learner import losses as L


@dataclass
class Tokens:
    """One packed micro-batch, target-aligned: every tensor is [1, N]."""

    logp: torch.Tensor  # log pi_theta (with grad)
    entropy: torch.Tensor  # full-vocabulary entropy of pi_theta
    old: torch.Tensor  # log pi_prox
    behav: torch.Tensor  # log pi_behav
    adv: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    num_seqs: int
    ref: torch.Tensor | None = None  # log pi_ref when a KL penalty is on
    selected: torch.Tensor | None = None  # step-wide Clip-Cov / KL-Cov choice
    keep: torch.Tensor | None = None  # step-wide high-entropy mask


def _policy_loss(loss_cfg):
    """(t, generator) -> (loss_per_token, metrics): the chosen loss with its knobs bound."""
    if isinstance(loss_cfg, PPOLoss):
        f = functools.partial(L.ppo_loss, clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high,
                              dual_clip_c=loss_cfg.dual_clip_c or None)
        return lambda t, g: f(t.logp, t.old, t.adv, t.mask)
    if isinstance(loss_cfg, ClipCovLoss):
        f = functools.partial(L.clip_cov_loss, clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high,
                              cov_fraction=loss_cfg.cov_fraction, cov_lb=loss_cfg.cov_lb, cov_ub=loss_cfg.cov_ub)
        return lambda t, g: f(t.logp, t.old, t.adv, t.mask, generator=g, selected=t.selected)
    if isinstance(loss_cfg, KLCovLoss):
        f = functools.partial(L.kl_cov_loss, kl_fraction=loss_cfg.kl_fraction, kl_coef=loss_cfg.kl_coef)
        return lambda t, g: f(t.logp, t.old, t.adv, t.mask, selected=t.selected)
    if isinstance(loss_cfg, GSPOLoss):
        f = functools.partial(L.gspo_loss, clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high)
        return lambda t, g: f(t.logp, t.old, t.adv, t.mask, seq_ids=t.seq_ids, num_seqs=t.num_seqs)
    if isinstance(loss_cfg, CISPOLoss):
        f = functools.partial(L.cispo_loss, clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high)
        return lambda t, g: f(t.logp, t.old, t.adv, t.mask)
    raise TypeError(f"no policy loss for {type(loss_cfg).__name__}")


class Objective:
    def __init__(self, cfg: LearnerConfig, max_new_tokens: int):
        self.cfg = cfg
        self.policy_loss = _policy_loss(cfg.loss)
        imp = cfg.importance
        kind = "none" if imp.prox == "behaviour" else imp.type  # pi_prox = pi_behav: w = 1 by definition
        lo, hi = (imp.geo_lo, imp.geo_hi) if imp.type == "geo_mask" else (imp.lo, imp.hi)
        self.weights = functools.partial(L.importance_weights, kind=kind, cap=imp.cap, lo=lo, hi=hi)
        self.agg = functools.partial(L.aggregate, mode=cfg.agg, norm_tokens=float(cfg.norm_tokens or max_new_tokens))

    def __call__(self, t: Tokens, *, global_tokens: float, global_seqs: float, par_lambda: float,
                 generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar loss (this micro-batch's share of the step) and per-token metric tensors."""
        w, metrics = self.weights(t.old, t.behav, t.mask, seq_ids=t.seq_ids, num_seqs=t.num_seqs)
        tok, pm = self.policy_loss(t, generator)
        metrics.update(pm)
        tok = tok * w
        if par_lambda != 1.0:
            tok = tok * L.par_weights(t.adv, par_lambda)
        if t.keep is not None:
            tok = tok * t.keep  # dropped low-entropy tokens stay in the denominator
        metrics["pg_loss"] = tok.detach()  # the policy-gradient part, before bonus and KL terms
        if self.cfg.entropy_coef:
            tok = tok - self.cfg.entropy_coef * t.entropy * t.mask
        if self.cfg.kl.coef:
            kl = L.kl_penalty(t.logp, t.ref, self.cfg.kl.estimator) * t.mask
            tok = tok + self.cfg.kl.coef * kl
            metrics["kl_ref"] = kl.detach()
        loss = self.agg(tok, t.mask, global_tokens=global_tokens, global_seqs=global_seqs, seq_ids=t.seq_ids,
                        num_seqs=t.num_seqs)
        return loss, metrics
