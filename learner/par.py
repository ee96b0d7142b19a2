"""Positive-advantage reweighting schedules (Jin et al. 2025, arXiv 2511.05993).

Tokens with A > 0 are weighted by lambda in [0, 1]; lambda < 1 slows the
sharpening that positive samples cause and so slows entropy collapse.
Schedules: constant; linear (lambda = 0 for the first half of the run, then
linear to 1: the paper's stage schedule); entropy_guided:
lambda_{k+1} = clip(lambda_k - delta, 0, 1) if H_k < target else clip(lambda_k + delta, 0, 1),
defaults delta = 0.05, target 0.2, lambda_0 = 0. With `target_entropy_relative` r > 0 (a covrl extension, not in
the paper) the target is r * H_1, the batch entropy of the run's first step: a threshold that means something for a
model whose entropy never reaches the published 0.2.
This follows the paper's summaries; its full text was not available to us, so
the update direction is as ALGORITHMS.md states it, not checked against code.
"""

from __future__ import annotations

from common.config import ParConfig


class ParSchedule:
    def __init__(self, cfg: ParConfig, total_steps: int):
        self.cfg = cfg
        self.total = total_steps
        self.lam = cfg.lam
        self.first_entropy: float | None = None  # H_1, the relative target's reference

    @property
    def enabled(self) -> bool:
        return self.cfg.schedule != "off"

    def value(self, step: int) -> float:
        """lambda for `step` (1-based); 1.0 when PAR is off (no reweighting)."""
        s = self.cfg.schedule
        if s == "off":
            return 1.0
        if s == "constant":
            return self.cfg.lam
        if s == "linear":
            half = self.total / 2
            return min(1.0, max(0.0, (step - half) / max(half, 1.0)))
        return self.lam

    @property
    def target(self) -> float | None:
        """The entropy threshold of entropy_guided (None until H_1 is seen, for a relative target)."""
        if self.cfg.target_entropy_relative > 0:
            return None if self.first_entropy is None else self.cfg.target_entropy_relative * self.first_entropy
        return self.cfg.target_entropy

    def observe(self, entropy: float) -> None:
        """entropy_guided: move lambda after each step by the batch entropy H_k."""
        if self.first_entropy is None:
            self.first_entropy = entropy
        if self.cfg.schedule == "entropy_guided":
            step = -self.cfg.delta if entropy < self.target else self.cfg.delta
            self.lam = min(1.0, max(0.0, self.lam + step))

    def state(self) -> dict:
        return {"lam": self.lam, "first_entropy": self.first_entropy}

    def load_state(self, state: dict) -> None:
        self.lam = float(state["lam"])
        self.first_entropy = state.get("first_entropy")  # absent in checkpoints from before the relative target
