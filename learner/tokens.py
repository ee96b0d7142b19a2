"""What the step's losses and token choices read: one micro-batch's token tensors (`Tokens` while training,
`Surveyed` as the step start saw it) and the collectives over the data-parallel group (`Collectives`).

Shared by `learner/objective.py` (the losses and their step-wide choices), `learner/offpolicy.py` (M2PO, the ESS,
the off-policy profile) and the trainer that fills them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
    m2po_keep: torch.Tensor | None = None  # step-wide M2PO mask (learner/offpolicy.py)


@dataclass
class Surveyed:
    """One micro-batch as the step's survey pass saw it, before any update: every tensor is [1, N].

    `Objective.select` fills `selected`, `keep` and `m2po_keep`; the trainer hands them on in `Tokens`, and after
    the update records what the loss cut (`clipped`, `masked`) for the step's profiles."""

    old: torch.Tensor  # log pi_prox: the policy at the start of the step
    entropy: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    ref: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    behav: torch.Tensor | None = None  # log pi_behav
    seq_ids: torch.Tensor | None = None  # which response of the micro-batch each token belongs to
    num_seqs: int = 0
    m2po_keep: torch.Tensor | None = None
    clipped: torch.Tensor | None = None  # tokens the trust region clipped (the loss's pg_clipfrac)
    masked: torch.Tensor | None = None  # tokens the off-policy correction capped or masked (IS weight, M2PO)
    lag: torch.Tensor | None = None  # each token's version lag: the step's version minus the version that sampled it


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
