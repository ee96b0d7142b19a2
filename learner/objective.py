"""The learner's objective, assembled once from the config (docs/DESIGN.md section 4).

    loss_t = w_t * lambda_t * L(r_t, A_t) [* high-entropy mask] - c_H H_t + c_KL KL_t,
    aggregated over the whole step (`learner.agg`).

`LOSSES` is the one registry of policy losses, keyed by `learner.loss.type`. An entry binds its config
section and owns both halves of its loss: the per-token loss of one micro-batch (`__call__`) and its
step-wide token choice (`select_step`, None when it has none). Clip-Cov and KL-Cov with
`learner.cov_scope = "step"` choose their tokens over the whole step's batch on all ranks (global
covariance means, global top-k) before the first update; with "micro_batch" the loss chooses inside each
micro-batch, as verl does. The top-rho high-entropy mask is the one modifier with a step-wide choice.

`Objective` picks all of these when the config is read. The trainer runs `Objective.select` once per
step on what its no-grad survey pass saw, then calls the objective per micro-batch; it never names a loss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from common.config import LearnerConfig
from learner import losses


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
    selected: torch.Tensor | None = None  # the loss's step-wide token choice (`select_step`)
    keep: torch.Tensor | None = None  # step-wide high-entropy mask


@dataclass
class Surveyed:
    """One micro-batch as the step's survey pass saw it, before any update: every tensor is [1, N].

    `Objective.select` fills `selected` and `keep`; the trainer hands them on in `Tokens`."""

    old: torch.Tensor  # log pi_prox: the policy at the start of the step
    entropy: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    ref: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    keep: torch.Tensor | None = None


class Collectives(Protocol):
    """What a step-wide choice needs from the data-parallel group (the trainer's; one rank in tests)."""

    rank: int
    world: int

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a host float64 tensor over ranks, in place; returns it."""

    def kth_largest(self, values: torch.Tensor, k: int) -> torch.Tensor:
        """The k-th largest of the union of every rank's 1-D host `values`; -inf if fewer than k exist."""


# ---- step-wide token choices ------------------------------------------------------


def _select_top_covariance(entries: list[Surveyed], comm: Collectives, fraction: float,
                           score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           floor: float) -> list[torch.Tensor]:
    """Tokens with the k = max(1, int(fraction * n_valid)) largest `score(cov, mask)` of the step's batch on all
    ranks, Cov taken around the global means of log pi_prox and A (docs/DESIGN.md section 4). A token scoring
    `floor` or less is never chosen. Bool [1, N] per entry."""
    sums = torch.zeros(3, dtype=torch.float64)
    for e in entries:
        sums += torch.stack([(e.old * e.mask).sum(), (e.adv * e.mask).sum(), e.mask.sum()]).double().cpu()
    comm.sum_(sums)
    n = sums[2].clamp(min=1.0)
    means = (sums[0] / n, sums[1] / n)
    k = max(1, int(fraction * float(sums[2])))
    scores = [score(losses.covariance_score(e.old.double(), e.adv.double(), e.mask, means=means), e.mask) for e in entries]
    above = [s[s > floor] for s in scores]
    kth = comm.kth_largest(torch.cat(above).cpu() if above else torch.zeros(0, dtype=torch.float64), k)
    return [(s >= kth) & (s > floor) for s in scores]


def select_high_entropy(entries: list[Surveyed], comm: Collectives, *, fraction: float) -> list[torch.Tensor]:
    """Keep the top-`fraction` entropy tokens of the step's batch on all ranks (Wang et al. 2025: 0.2).
    Float [1, N] mask per entry; dropped tokens stay in the aggregation's denominator."""
    vals = [e.entropy[e.mask > 0] for e in entries]
    local = torch.cat(vals).cpu() if vals else torch.zeros(0)
    count = comm.sum_(torch.tensor([float(local.numel())], dtype=torch.float64))
    kth = comm.kth_largest(local, losses.high_entropy_count(float(count), fraction))
    return [losses.high_entropy_keep(e.entropy, e.mask, kth) for e in entries]


# ---- the registry of policy losses -----------------------------------------------


class PolicyLoss:
    """One registered loss type, bound to the learner config section.

    `__call__(t, generator)` -> (loss per token [1, N], per-token metric tensors) for one micro-batch.
    `select_step(entries, comm, generator)` -> one `Tokens.selected` per surveyed micro-batch, or None:
    the choice this loss makes over the whole step before the first update.
    """

    select_step: Callable[[list[Surveyed], Collectives, torch.Generator], list[torch.Tensor]] | None = None

    def __call__(self, t: Tokens, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


class PPO(PolicyLoss):
    def __init__(self, lc: LearnerConfig):
        c = lc.loss
        self.f = functools.partial(losses.ppo_loss, clip_low=c.clip_low, clip_high=c.clip_high,
                                   dual_clip_c=c.dual_clip_c or None)

    def __call__(self, t, generator):
        return self.f(t.logp, t.old, t.adv, t.mask)


class ClipCov(PolicyLoss):
    """Clip-Cov; over the step: uniform random keys on the candidates, -1 elsewhere, so the global top-k of the
    keys is a uniform k-subset of every rank's candidates (each rank draws from its own seeded stream)."""

    def __init__(self, lc: LearnerConfig):
        self.cfg = c = lc.loss
        self.f = functools.partial(losses.clip_cov_loss, clip_low=c.clip_low, clip_high=c.clip_high,
                                   cov_fraction=c.cov_fraction, cov_lb=c.cov_lb, cov_ub=c.cov_ub)
        self.select_step = self._select_step if lc.cov_scope == "step" else None

    def __call__(self, t, generator):
        return self.f(t.logp, t.old, t.adv, t.mask, generator=generator, selected=t.selected)

    def _select_step(self, entries, comm, generator):
        def keys(cov, mask):
            candidate = losses.clip_cov_candidates(cov, mask, self.cfg.cov_lb, self.cfg.cov_ub)
            return losses.clip_cov_keys(candidate, generator).double()

        return _select_top_covariance(entries, comm, self.cfg.cov_fraction, keys, floor=-1.0)


class KLCov(PolicyLoss):
    """KL-Cov; over the step: the top-k positive covariance scores of every rank's tokens."""

    def __init__(self, lc: LearnerConfig):
        self.cfg = c = lc.loss
        self.f = functools.partial(losses.kl_cov_loss, kl_fraction=c.kl_fraction, kl_coef=c.kl_coef)
        self.select_step = self._select_step if lc.cov_scope == "step" else None

    def __call__(self, t, generator):
        return self.f(t.logp, t.old, t.adv, t.mask, selected=t.selected)

    def _select_step(self, entries, comm, generator):
        def score(cov, mask):
            # Identical responses give identical scores; a tie at the k-th value would select every tied
            # token. A tiny deterministic offset by (rank, position) breaks ties without reordering scores
            # that differ by more than ~1e-12.
            pos = torch.arange(cov.numel(), dtype=torch.float64, device=cov.device).view_as(cov) / (cov.numel() + 1)
            tie = 1e-12 * (comm.rank + pos) / comm.world
            return torch.where(losses.kl_cov_eligible(cov, mask), cov - tie, torch.full_like(cov, float("-inf")))

        return _select_top_covariance(entries, comm, self.cfg.kl_fraction, score, floor=float("-inf"))


class GSPO(PolicyLoss):
    def __init__(self, lc: LearnerConfig):
        c = lc.loss
        self.f = functools.partial(losses.gspo_loss, clip_low=c.clip_low, clip_high=c.clip_high)

    def __call__(self, t, generator):
        return self.f(t.logp, t.old, t.adv, t.mask, seq_ids=t.seq_ids, num_seqs=t.num_seqs)


class CISPO(PolicyLoss):
    def __init__(self, lc: LearnerConfig):
        c = lc.loss
        self.f = functools.partial(losses.cispo_loss, clip_low=c.clip_low, clip_high=c.clip_high)

    def __call__(self, t, generator):
        return self.f(t.logp, t.old, t.adv, t.mask)


# `learner.loss.type` (the tag of the config's LossConfig union) -> its loss.
LOSSES: dict[str, type[PolicyLoss]] = {"ppo": PPO, "clip_cov": ClipCov, "kl_cov": KLCov, "gspo": GSPO, "cispo": CISPO}


def loss_name(loss_cfg) -> str:
    """The `learner.loss.type` of a loss config section."""
    return type(loss_cfg).__struct_config__.tag


def make_loss(lc: LearnerConfig) -> PolicyLoss:
    """The registered loss for `lc.loss`, bound to its knobs."""
    name = loss_name(lc.loss)
    if name not in LOSSES:
        raise ValueError(f"no policy loss registered for learner.loss.type = {name!r}; registered: "
                         f"{', '.join(sorted(LOSSES))}. A new loss type needs both a config Struct in "
                         f"common/config.py and an entry in learner/objective.py LOSSES")
    return LOSSES[name](lc)


class Objective:
    def __init__(self, cfg: LearnerConfig, max_new_tokens: int):
        self.cfg = cfg
        self.loss = make_loss(cfg)
        imp = cfg.importance
        kind = "none" if imp.prox == "behaviour" else imp.type  # pi_prox = pi_behav: w = 1 by definition
        lo, hi = (imp.geo_lo, imp.geo_hi) if imp.type == "geo_mask" else (imp.lo, imp.hi)
        self.weights = functools.partial(losses.importance_weights, kind=kind, cap=imp.cap, lo=lo, hi=hi)
        self.agg = functools.partial(losses.aggregate, mode=cfg.agg, norm_tokens=float(cfg.norm_tokens or max_new_tokens))
        self.high_entropy = (functools.partial(select_high_entropy, fraction=cfg.high_entropy_fraction)
                             if cfg.high_entropy_fraction > 0 else None)

    @property
    def selects_over_step(self) -> bool:
        """Whether some token choice needs the whole step's batch (and so the trainer's survey pass)."""
        return self.loss.select_step is not None or self.high_entropy is not None

    def select(self, entries: list[Surveyed], comm: Collectives, generator: torch.Generator) -> None:
        """The step-wide token choices, once per step, in a fixed order (each is a collective): the loss's
        `selected`, then the high-entropy `keep`. `generator`: this rank's seeded stream for the step."""
        if self.loss.select_step is not None:
            for e, s in zip(entries, self.loss.select_step(entries, comm, generator), strict=True):
                e.selected = s
        if self.high_entropy is not None:
            for e, k in zip(entries, self.high_entropy(entries, comm), strict=True):
                e.keep = k

    def __call__(self, t: Tokens, *, global_tokens: float, global_seqs: float, par_lambda: float,
                 generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar loss (this micro-batch's share of the step) and per-token metric tensors."""
        w, metrics = self.weights(t.old, t.behav, t.mask, seq_ids=t.seq_ids, num_seqs=t.num_seqs)
        tok, pm = self.loss(t, generator)
        metrics.update(pm)
        tok = tok * w
        if par_lambda != 1.0:
            tok = tok * losses.par_weights(t.adv, par_lambda)
        if t.keep is not None:
            tok = tok * t.keep  # dropped low-entropy tokens stay in the denominator
        metrics["pg_loss"] = tok.detach()  # the policy-gradient part, before bonus and KL terms
        if self.cfg.entropy_coef:
            tok = tok - self.cfg.entropy_coef * t.entropy * t.mask
        if self.cfg.kl.coef:
            kl = losses.kl_penalty(t.logp, t.ref, self.cfg.kl.estimator) * t.mask
            tok = tok + self.cfg.kl.coef * kl
            metrics["kl_ref"] = kl.detach()
        loss = self.agg(tok, t.mask, global_tokens=global_tokens, global_seqs=global_seqs, seq_ids=t.seq_ids,
                        num_seqs=t.num_seqs)
        return loss, metrics
