"""Outcome-reward advantages (host side, numpy); the rewards come shaped by `broker.rules`.

All estimators take rewards [G, n] (groups x responses) and return one
advantage per response; the trainer broadcasts it over the response's tokens.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-6


def grpo(rewards: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """(r - mean_g) / (std_g + eps), unbiased std (Shao et al. 2024)."""
    return (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + EPS)


def drgrpo(rewards: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """r - mean_g: Dr. GRPO drops the std normalisation (its difficulty bias)."""
    return rewards - rewards.mean(1, keepdims=True)


def rloo(rewards: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """r - mean of the other responses = n / (n - 1) (r - mean_g)."""
    n = rewards.shape[1]
    return n / (n - 1) * (rewards - rewards.mean(1, keepdims=True))


def reinforce_pp_baseline(rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """r - mean_g, then whitened over the batch's valid *tokens* (each response weighs its length)."""
    a = rewards - rewards.mean(1, keepdims=True)
    w = lengths.astype(np.float64)
    mean = (a * w).sum() / w.sum()
    var = (w * (a - mean) ** 2).sum() / max(w.sum() - 1.0, 1.0)
    return (a - mean) / (np.sqrt(var) + EPS)


ESTIMATORS = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo, "reinforce_pp_baseline": reinforce_pp_baseline}
