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
from typing import Callable

import torch

from common.config import LearnerConfig
from learner import losses, offpolicy
from learner.losses import LossTerms
from learner.tokens import Choices, Collectives, Seen, Surveyed, Tokens


# ---- step-wide token choices ------------------------------------------------------


def step_means(entries: list[Surveyed], comm: Collectives,
               lag_ref_steps: float = 0.0) -> tuple[tuple[torch.Tensor, torch.Tensor], float, float]:
    """((mean log pi_prox, mean A) over the valid tokens of the step's batch on all ranks, the token count, the
    budget count): the centre of every covariance score of the step and what its token budget is a fraction of
    (one all_reduce). The budget count is the token count, or with `lag_ref_steps` > 0 (the staleness-aware
    budget, a covrl extension) the sum over valid tokens of 1 + lag / lag_ref_steps (`Surveyed.lag`)."""
    sums = torch.zeros(4, dtype=torch.float64)
    for e in entries:
        if lag_ref_steps > 0 and e.lag is None:
            raise ValueError("the staleness-aware budget (lag_ref_steps > 0) needs each surveyed token's lag (Surveyed.lag)")
        budget = ((e.mask.double() * (1.0 + e.lag.double() / lag_ref_steps)).sum() if lag_ref_steps > 0
                  else e.mask.sum())
        sums += torch.stack([(e.old * e.mask).sum(), (e.adv * e.mask).sum(), e.mask.sum(), budget]).double().cpu()
    comm.sum_(sums)
    n = sums[2].clamp(min=1.0)
    return (sums[0] / n, sums[1] / n), float(sums[2]), float(sums[3])


def _select_top_covariance(entries: list[Surveyed], comm: Collectives, fraction: float,
                           score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           floor: float, random: torch.Generator | None = None,
                           lag_ref_steps: float = 0.0) -> list[torch.Tensor]:
    """Tokens with the k = max(1, int(fraction * n_valid)) largest `score(cov, mask)` of the step's batch on all
    ranks, Cov taken around the global means of log pi_prox and A (docs/DESIGN.md section 4). A token scoring
    `floor` or less is never chosen. Bool [1, N] per entry. With `lag_ref_steps` > 0, n_valid counts each token as
    1 + lag / lag_ref_steps (`step_means`): a budget that grows with the batch's staleness.

    `random` (`learner.loss.selection = "random"`, the control for the covariance choice): as many tokens as the
    covariance rule would choose, min(k, tokens scoring above `floor`), drawn uniformly among all valid tokens
    with this seeded stream instead."""
    means, _, budget = step_means(entries, comm, lag_ref_steps)
    k = max(1, int(fraction * budget))
    scores = [score(losses.covariance_score(e.old.double(), e.adv.double(), e.mask, means=means), e.mask) for e in entries]
    if random is not None:
        eligible = comm.sum_(torch.tensor([float(sum(int((s > floor).sum()) for s in scores))], dtype=torch.float64))
        k = int(min(k, float(eligible)))
        scores = [losses.clip_cov_keys(e.mask > 0, random).double() for e in entries]
        floor = -1.0
        if k == 0:
            return [torch.zeros_like(s, dtype=torch.bool) for s in scores]
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


# The top-K token counts whose share of the step's summed covariance is logged (actor/cov_top<K>_share).
COV_TOP = (1, 10, 50, 200)


def covariance_profile(seen: list[Seen], comm: Collectives, bounds: tuple[float, float]) -> dict[str, float]:
    """How the step's summed covariance sum_t Cov_t (log pi at the step start, around the global means) is spread
    over its tokens, on all ranks (every rank returns the same values): the sum (`cov_sum`), the share the tokens
    the loss selected carry (`cov_selected_share`; `Choices.selected`, 0 without a selection), the share the K
    largest carry (`cov_top<K>_share`, exact under ties), and how many tokens lie in Clip-Cov's candidate band
    (`cov_candidates`, `bounds` = (cov_lb, cov_ub)) and the share they carry together (`cov_candidates_share`).
    The shares are absent when the sum is not positive."""
    entries = [s.start for s in seen]
    means, _, _ = step_means(entries, comm)
    covs = [losses.covariance_score(e.old.double(), e.adv.double(), e.mask, means=means).cpu() for e in entries]
    flat = torch.cat([c[e.mask.cpu() > 0] for c, e in zip(covs, entries)]) if entries else torch.zeros(0, dtype=torch.float64)
    selected = sum(float(c[(s.choices.selected.cpu() & (s.start.mask.cpu() > 0))].sum()) for c, s in zip(covs, seen)
                   if s.choices.selected is not None)
    kths = [comm.kth_largest(flat, k) for k in COV_TOP]
    band = (flat > bounds[0]) & (flat < bounds[1])
    local = [float(flat.sum()), selected, float(band.sum()), float(flat[band].sum())]
    for kth in kths:
        above = flat > kth
        local += [float(flat[above].sum()), float(above.sum())]
    total, selected, candidates, band_sum, *tops = comm.sum_(torch.tensor(local, dtype=torch.float64)).tolist()
    out = {"cov_sum": total, "cov_candidates": candidates}
    if total > 0:
        out["cov_selected_share"] = selected / total
        out["cov_candidates_share"] = band_sum / total
        for k, kth, above_sum, above_n in zip(COV_TOP, kths, tops[0::2], tops[1::2]):
            # Tokens tied at the k-th value: count only as many as make k (the sum over more than k would inflate it).
            top = above_sum + (k - above_n) * float(kth) if torch.isfinite(kth) else above_sum
            out[f"cov_top{k}_share"] = top / total
    return out


# ---- the registry of policy losses -----------------------------------------------


class PolicyLoss:
    """One registered loss type, bound to the learner config section.

    `__call__(t, generator)` -> `LossTerms` (loss per token [1, N], per-token metric tensors) for one micro-batch.
    `select_step(entries, comm, generator)` -> one `Choices.selected` per surveyed micro-batch, or None:
    the choice this loss makes over the whole step before the first update.
    """

    select_step: Callable[[list[Surveyed], Collectives, torch.Generator], list[torch.Tensor]] | None = None

    def __call__(self, t: Tokens, generator: torch.Generator) -> LossTerms:
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
        return self.f(t.logp, t.old, t.adv, t.mask, generator=generator, selected=t.choices.selected)

    def _select_step(self, entries, comm, generator):
        def keys(cov, mask):
            candidate = losses.clip_cov_candidates(cov, mask, self.cfg.cov_lb, self.cfg.cov_ub)
            return losses.clip_cov_keys(candidate, generator).double()

        return _select_top_covariance(entries, comm, self.cfg.cov_fraction, keys, floor=-1.0,
                                      lag_ref_steps=self.cfg.lag_ref_steps,
                                      random=generator if self.cfg.selection == "random" else None)


class KLCov(PolicyLoss):
    """KL-Cov; over the step: the top-k positive covariance scores of every rank's tokens."""

    def __init__(self, lc: LearnerConfig):
        self.cfg = c = lc.loss
        self.f = functools.partial(losses.kl_cov_loss, kl_fraction=c.kl_fraction, kl_coef=c.kl_coef)
        self.select_step = self._select_step if lc.cov_scope == "step" else None

    def __call__(self, t, generator):
        return self.f(t.logp, t.old, t.adv, t.mask, selected=t.choices.selected)

    def _select_step(self, entries, comm, generator):
        def score(cov, mask):
            # Identical responses give identical scores; a tie at the k-th value would select every tied
            # token. A tiny deterministic offset by (rank, position) breaks ties without reordering scores
            # that differ by more than ~1e-12.
            pos = torch.arange(cov.numel(), dtype=torch.float64, device=cov.device).view_as(cov) / (cov.numel() + 1)
            tie = 1e-12 * (comm.rank + pos) / comm.world
            return torch.where(losses.kl_cov_eligible(cov, mask), cov - tie, torch.full_like(cov, float("-inf")))

        return _select_top_covariance(entries, comm, self.cfg.kl_fraction, score, floor=float("-inf"),
                                      lag_ref_steps=self.cfg.lag_ref_steps,
                                      random=generator if self.cfg.selection == "random" else None)


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
        self.m2po = (functools.partial(offpolicy.select_m2po, threshold=imp.m2po_threshold)
                     if imp.m2po_threshold > 0 else None)

    @property
    def selects_over_step(self) -> bool:
        """Whether some token choice needs the whole step's batch (and so the trainer's survey pass)."""
        return self.loss.select_step is not None or self.high_entropy is not None or self.m2po is not None

    def select(self, entries: list[Surveyed], comm: Collectives, generator: torch.Generator) -> list[Choices]:
        """The step-wide token choices of each entry, once per step, in a fixed order (each is a collective): the
        loss's `selected`, the high-entropy `keep`, then M2PO's `m2po_keep`. `generator`: this rank's seeded stream
        for the step."""
        none = [None] * len(entries)
        selected = self.loss.select_step(entries, comm, generator) if self.loss.select_step is not None else none
        keep = self.high_entropy(entries, comm) if self.high_entropy is not None else none
        m2po_keep = self.m2po(entries, comm) if self.m2po is not None else none
        return [Choices(selected=s, keep=k, m2po_keep=m)
                for s, k, m in zip(selected, keep, m2po_keep, strict=True)]

    def __call__(self, t: Tokens, *, global_tokens: float, global_seqs: float, par_lambda: float,
                 generator: torch.Generator) -> LossTerms:
        """The scalar loss (this micro-batch's share of the step) and per-token metric tensors."""
        w, metrics = self.weights(t.old, t.behav, t.mask, seq_ids=t.seq_ids, num_seqs=t.num_seqs)
        tok, pm = self.loss(t, generator)
        metrics.update(pm)
        tok = tok * w
        if par_lambda != 1.0:
            tok = tok * losses.par_weights(t.adv, par_lambda)
        if t.choices.keep is not None:
            tok = tok * t.choices.keep  # dropped low-entropy tokens stay in the denominator
        if t.choices.m2po_keep is not None:
            tok = tok * t.choices.m2po_keep  # so do the tokens M2PO dropped
        metrics["pg_loss"] = tok.detach()  # the policy-gradient part, before bonus and KL terms
        if self.cfg.entropy_coef:
            tok = tok - self.cfg.entropy_coef * t.entropy * t.mask
        if self.cfg.kl.coef:
            kl = losses.kl_penalty(t.logp, t.ref, self.cfg.kl.estimator) * t.mask
            tok = tok + self.cfg.kl.coef * kl
            metrics["kl_ref"] = kl.detach()
        loss = self.agg(tok, t.mask, global_tokens=global_tokens, global_seqs=global_seqs, seq_ids=t.seq_ids,
                        num_seqs=t.num_seqs)
        return LossTerms(loss, metrics)
