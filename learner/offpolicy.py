"""How far the step's data are from the policy that trains on them, and the corrections that act on it.

Three policies meet in a step (docs/DESIGN.md section 4): pi_behav sampled the tokens, pi_prox is the policy at the
step start, pi_theta is being optimised. The importance ratio here is rho_t = pi_prox / pi_behav of each token.

- `select_m2po`: M2PO's step-wide token mask (Zheng et al. 2025): the tokens with the largest (log rho_t)^2 are
  dropped until the mean of the rest is below `learner.importance.m2po_threshold`, over the whole step on all ranks
  (`learner.losses.m2po_cut`), so the choice does not depend on how the batch is split. AReaL decides per
  micro-batch instead.
- `offpolicy_profile`: the step's off-policy diagnostics (`offpolicy/...`), from tensors the step already has, no
  extra forward pass: the normalised effective sample size of rho at token and sequence level, M2PO's second moment
  of log rho, KL(pi_behav || pi_prox) per token, and which entropy quintile the trust region's and the off-policy
  correction's cuts fall in.
- `EssStepScale`: VCPO's step size, the learning rate scaled by the ESS of the mini-batch's response weights.
  VCPO's off-policy optimal baseline is not built: it weighs each response by its own squared gradient norm, which
  takes one backward pass per response (their code runs micro-batches of one response); covrl packs many
  responses into a micro-batch and would pay that pass for every response.
"""

from __future__ import annotations

import contextlib
import math

import torch

from learner import losses
from learner.tokens import Collectives, Seen, Surveyed, Tokens

QUINTILES = 5
SEARCH_POINTS, SEARCH_ROUNDS = 255, 7  # the quintile edges' search: 256^7 = 2^56 narrower than the range
SEQ_LOG_CLAMP = 300.0  # a response's summed log ratio, clamped: exp(2 * 300) stays finite in float64


def _valid(entries: list, values, mask=lambda e: e.mask) -> torch.Tensor:
    """`values(entry)` at the valid tokens (`mask(entry)` > 0) of every entry, concatenated on the host (float64,
    1-D)."""
    parts = [values(e)[mask(e) > 0].double().cpu() for e in entries]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def select_m2po(entries: list[Surveyed], comm: Collectives, threshold: float, first: int = 64) -> list[torch.Tensor]:
    """M2PO's kept-token mask of each entry (float [1, N]; dropped tokens stay in the aggregation's denominator).

    The cut needs the step's largest m_t = (log rho_t)^2 in order: each round gathers every rank's `first`, then
    twice as many, ... of them until `m2po_cut` can decide (one all_gather a round; M2PO drops few tokens, so
    usually one round)."""
    terms = {id(e): losses.m2po_second_moment_terms(e.old, e.behav) for e in entries}
    local = _valid(entries, lambda e: terms[id(e)])
    total, count = comm.sum_(torch.tensor([float(local.sum()), float(local.numel())], dtype=torch.float64)).tolist()
    k = first
    while True:
        cut = losses.m2po_cut(comm.top_values(local, k), total, count, threshold, complete=k >= count)
        if not torch.isnan(cut):
            return [((terms[id(e)] < cut.to(e.mask.device)) & (e.mask > 0)).to(e.mask.dtype) for e in entries]
        k *= 2


def _ess(sums: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) from [n, sum w, sum w^2]: 1 for equal weights, about 1/n for one dominant weight."""
    n, s1, s2 = sums.tolist()
    return s1 * s1 / (n * s2) if n > 0 and s2 > 0 else float("nan")


def response_weights(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor,
                     num_seqs: int, select: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log rho_t = log num - log den on every token, 0 off the mask and clamped to +-20; rho_i = prod_t rho_t of
    every response with a valid token, its log clamped to +-SEQ_LOG_CLAMP), in float64. `select=False`: log rho_t
    only (None for rho_i)."""
    log_rho = ((num.double() - den.double()) * mask).clamp(-losses.LOG_RATIO_CLAMP, losses.LOG_RATIO_CLAMP)
    if not select:
        return log_rho, None
    seq_log = losses.segment_sum(log_rho, seq_ids, num_seqs).clamp(-SEQ_LOG_CLAMP, SEQ_LOG_CLAMP)
    return log_rho, seq_log.exp()[losses.segment_sum(mask.double(), seq_ids, num_seqs) > 0]


def importance_sums(seen: list[Seen]) -> torch.Tensor:
    """This rank's [n, sum rho, sum rho^2] over valid tokens, then the same over responses with rho_i = prod_t
    rho_t, then the sums of (log rho_t)^2, of rho_t - 1 - log rho_t and of the tokens M2PO dropped: float64 [9]."""
    out = torch.zeros(9, dtype=torch.float64)
    for s in seen:
        e, keep = s.start, s.choices.m2po_keep
        log_rho, seq_rho = response_weights(e.old, e.behav, e.mask, e.seq_ids, e.num_seqs)
        valid = e.mask > 0
        lr = log_rho[valid]
        rho = lr.exp()
        dropped = ((1.0 - keep) * e.mask).sum().double() if keep is not None else lr.new_zeros(())
        out += torch.stack([valid.sum().double(), rho.sum(), rho.square().sum(),
                            seq_rho.new_tensor(float(seq_rho.numel())), seq_rho.sum(),
                            seq_rho.square().sum(), lr.square().sum(), (rho - 1.0 - lr).sum(), dropped]).cpu()
    return out


def quintile_edges(entropy: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """The step's entropy quintile edges on all ranks (float64 [4], `entropy` this rank's valid tokens): edge j is
    the smallest value t with at least ceil(j n / 5) of the step's n tokens at or below it. Found by a search that
    narrows each edge's interval 256-fold a round (one all_reduce of 4 x 255 counts; SEARCH_ROUNDS rounds reach
    float64's resolution of the range, so no two distinct entropies share an interval): no gather of the
    entropies. A token's quintile is the number of edges it lies above, so tied tokens share one."""
    n = float(comm.sum_(torch.tensor([float(entropy.numel())], dtype=torch.float64)))
    target = torch.tensor([math.ceil(j * n / QUINTILES) for j in range(1, QUINTILES)], dtype=torch.float64)
    ordered = entropy.double().sort().values
    lo = torch.full((QUINTILES - 1,), -1.0, dtype=torch.float64)  # entropies are >= 0: nothing at or below -1
    hi = torch.full((QUINTILES - 1,), float(comm.kth_largest(entropy, 1)), dtype=torch.float64)
    rows = torch.arange(QUINTILES - 1)
    for _ in range(SEARCH_ROUNDS):
        grid = lo[:, None] + (hi - lo)[:, None] * torch.arange(1, SEARCH_POINTS + 1, dtype=torch.float64) / (SEARCH_POINTS + 1)
        below = comm.sum_(torch.searchsorted(ordered, grid, right=True).double())  # [4, points]: tokens <= each
        enough = below >= target[:, None]
        first = torch.where(enough.any(1), enough.int().argmax(1), torch.full_like(rows, SEARCH_POINTS))
        padded = torch.cat([lo[:, None], grid, hi[:, None]], 1)  # the interval around the first point with enough
        lo, hi = padded[rows, first], padded[rows, first + 1]
    return hi


def quintile_cuts(seen: list[Seen], comm: Collectives) -> dict[str, float]:
    """Share of the tokens of each entropy quintile of the step (q1 the lowest, at the step start) that the trust
    region clipped (`Seen.clipped`) and that the off-policy correction masked or capped (`Seen.masked`), on all
    ranks; NaN for a quintile that holds no token (ties)."""
    start_mask = lambda s: s.start.mask  # noqa: E731
    entropy = _valid(seen, lambda s: s.start.entropy, start_mask)
    quintile = (entropy[:, None] > quintile_edges(entropy, comm)[None, :]).sum(1)
    flags = [_valid(seen, lambda s: s.clipped, start_mask), _valid(seen, lambda s: s.masked, start_mask)]
    local = torch.stack([torch.bincount(quintile, weights=w, minlength=QUINTILES).double()
                         for w in (torch.ones_like(entropy), *flags)])
    tokens, clipped, masked = comm.sum_(local).unbind(0)
    out = {}
    for q in range(QUINTILES):
        n = float(tokens[q])
        out[f"clipped_q{q + 1}"] = float(clipped[q]) / n if n else math.nan
        out[f"masked_q{q + 1}"] = float(masked[q]) / n if n else math.nan
    return out


def offpolicy_profile(seen: list[Seen], comm: Collectives) -> dict[str, float]:
    """The step's off-policy diagnostics on all ranks (every rank returns the same), keys without the
    `offpolicy/` prefix: `ess_token` and `ess_seq` (normalised ESS of rho over tokens and over responses),
    `m2` (M2PO's mean (log rho)^2), `kl_behav_prox` (mean rho - 1 - log rho: the k3 estimate of
    KL(pi_behav || pi_prox) from tokens pi_behav sampled), `m2po_masked` (share of tokens M2PO dropped) and
    `clipped_q<i>` / `masked_q<i>` (`quintile_cuts`). Each `Seen.start` needs `behav`, `seq_ids` and `num_seqs`."""
    sums = comm.sum_(importance_sums(seen))
    n = max(float(sums[0]), 1.0)
    out = {"ess_token": _ess(sums[0:3]), "ess_seq": _ess(sums[3:6]), "m2": float(sums[6]) / n,
           "kl_behav_prox": float(sums[7]) / n, "m2po_masked": float(sums[8]) / n}
    return out | quintile_cuts(seen, comm)


class EssStepScale:
    """VCPO's step size (Huang et al. 2026; their code's rule): each optimizer step's learning rate times
    min(1, rho / base_ratio), or its square root (`"sqrt"`, theirs for Adam), where rho = (sum w)^2 / (n sum w^2) is
    the normalised ESS of the mini-batch's response weights w_i = prod_t pi_theta / pi_behav (pi_theta as the
    training forward saw it, detached) over all ranks. `add` each micro-batch, then `factor` at the optimizer
    step (a collective on every rank; none when off). No smoothing and no floor, as in their code."""

    def __init__(self, rule: str, base_ratio: float):
        self.rule, self.base_ratio = rule, base_ratio
        self.sums: torch.Tensor | None = None  # on the tokens' device, from the mini-batch's first `add`

    def add(self, t: Tokens) -> None:
        """One micro-batch's tokens, after its training forward."""
        if self.rule == "off":
            return
        # On the device, and without selecting the responses by a mask (which would read their count back): the
        # responses without a valid token weigh 0. `factor` copies the mini-batch's sums to the host once.
        log_rho, _ = response_weights(t.logp.detach(), t.behav, t.mask, t.seq_ids, t.num_seqs, select=False)
        valid = (losses.segment_sum(t.mask.double(), t.seq_ids, t.num_seqs) > 0).double()
        w = losses.segment_sum(log_rho, t.seq_ids, t.num_seqs).clamp(-SEQ_LOG_CLAMP, SEQ_LOG_CLAMP).exp() * valid
        mine = torch.stack([valid.sum(), w.sum(), w.square().sum()])
        self.sums = mine if self.sums is None else self.sums + mine

    def factor(self, comm: Collectives) -> float:
        """The learning-rate factor of the mini-batch added since the last call (1 when off)."""
        if self.rule == "off":
            return 1.0
        host = self.sums.cpu().clone() if self.sums is not None else torch.zeros(3, dtype=torch.float64)
        sums, self.sums = comm.sum_(host), None
        return ess_lr_factor(_ess(sums), self.base_ratio, self.rule)


def ess_lr_factor(ess_ratio: float, base_ratio: float, rule: str) -> float:
    """min(1, ess_ratio / base_ratio), its square root for `"sqrt"`; 1 when off or the ESS is undefined."""
    if rule == "off" or ess_ratio != ess_ratio:
        return 1.0
    scale = min(1.0, ess_ratio / base_ratio)
    return scale ** 0.5 if rule == "sqrt" else scale


@contextlib.contextmanager
def scaled_lr(optimizer, factor: float):
    """Every parameter group's learning rate times `factor` inside the block, restored after (a ZeRO optimizer's
    `param_groups` are its inner optimizer's)."""
    if factor == 1.0:
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr
