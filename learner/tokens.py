"""What the step's losses and token choices read, one record per stage of a micro-batch's step: `Surveyed` (as the
step start saw it), `Choices` (the step-wide token choices made from every rank's `Surveyed`), `Tokens` (what the
loss reads while training) and `Seen` (what the loss did, for the step's profiles); and the collectives over the
data-parallel group (`Collectives`). The packed inputs themselves are `learner.batch.Packed`.

Shared by `learner/objective.py` (the losses and their step-wide choices), `learner/offpolicy.py` (M2PO, the ESS,
the off-policy profile) and the trainer that fills them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Choices:
    """The step-wide token choices of one micro-batch (`Objective.select`), None where the objective makes none.

    A new step-wide mask is one field here and one entry in `Objective.select`."""

    selected: torch.Tensor | None = None  # the loss's own choice (Clip-Cov / KL-Cov over the step)
    keep: torch.Tensor | None = None  # the top-rho high-entropy mask
    m2po_keep: torch.Tensor | None = None  # M2PO's mask (learner/offpolicy.py)


@dataclass(frozen=True)
class Surveyed:
    """One micro-batch as the policy at the step start saw it, before any update: every tensor is [1, N].

    What the step-wide choices (`Objective.select`) and the step's profiles read. Built by `of` from the packed
    micro-batch (`learner.batch.Packed`) and that policy's outputs."""

    old: torch.Tensor  # log pi_prox: the policy at the start of the step
    entropy: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    ref: torch.Tensor | None = None  # log pi_ref when a KL penalty is on
    behav: torch.Tensor | None = None  # log pi_behav
    seq_ids: torch.Tensor | None = None  # which response of the micro-batch each token belongs to
    num_seqs: int = 0
    lag: torch.Tensor | None = None  # each token's version lag: the step's version minus the version that sampled it

    @classmethod
    def of(cls, mb, old: torch.Tensor, entropy: torch.Tensor, *, version: int,
           ref: torch.Tensor | None = None) -> "Surveyed":
        """From one `learner.batch.Packed` and the step-start policy's log pi(target) and entropy on it."""
        return cls(old=old, entropy=entropy, adv=mb.adv, mask=mb.mask, ref=ref, behav=mb.behav, seq_ids=mb.seq_ids,
                   num_seqs=max(mb.num_seqs, 1), lag=version - mb.versions.double())


@dataclass(frozen=True)
class Tokens:
    """One packed micro-batch as the loss reads it while training, target-aligned: every tensor is [1, N]."""

    logp: torch.Tensor  # log pi_theta (with grad)
    entropy: torch.Tensor  # full-vocabulary entropy of pi_theta
    old: torch.Tensor  # log pi_prox
    behav: torch.Tensor  # log pi_behav
    adv: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    num_seqs: int
    ref: torch.Tensor | None = None  # log pi_ref when a KL penalty is on
    choices: Choices = Choices()  # the step-wide token choices

    @classmethod
    def of(cls, start: Surveyed, logp: torch.Tensor, entropy: torch.Tensor, old: torch.Tensor,
           choices: Choices) -> "Tokens":
        """The training forward's `logp` and `entropy` on a micro-batch the step start saw as `start`, with log
        pi_prox `old` and the step's `choices` for it."""
        return cls(logp=logp, entropy=entropy, old=old, behav=start.behav, adv=start.adv, mask=start.mask,
                   seq_ids=start.seq_ids, num_seqs=start.num_seqs, ref=start.ref, choices=choices)


@dataclass(frozen=True)
class Seen:
    """One micro-batch after the loss acted on it, for the step's profiles (`covariance_profile`,
    `offpolicy_profile`): as the step start saw it, the step's choices for it, and what the loss cut (float [1, N]):
    the tokens its trust region clipped (the loss's pg_clipfrac) and those the off-policy correction capped or
    masked (the IS weight's cut, M2PO's drop)."""

    start: Surveyed
    choices: Choices
    clipped: torch.Tensor
    masked: torch.Tensor


class Collectives(Protocol):
    """What a step-wide choice needs from the data-parallel group (the trainer's; one rank in tests)."""

    rank: int
    world: int

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a host float64 tensor over ranks, in place; returns it."""

    def kth_largest(self, values: torch.Tensor, k: int) -> torch.Tensor:
        """The k-th largest of the union of every rank's 1-D host `values`; -inf if fewer than k exist."""

    def top_values(self, values: torch.Tensor, k: int) -> torch.Tensor:
        """The k largest of the union of every rank's 1-D host `values`, descending, float64, padded with -inf."""
