"""What the head tests share (tests/unit/test_fused_head.py, tests/unit/test_head_kernels.py): the fp32-vs-float64
comparison, the loss that uses the head's outputs, and fresh leaves."""

import torch
from torch.testing import assert_close


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 result vs float64 reference: rtol 1e-5, atol 1e-5 of the tensor's scale (tests/unit/test_fused_head.py)."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * scale)


def _loss(lp, ent, terms: str):
    """The three ways a loss can use the outputs; the per-token weights make every token's gradient differ."""
    w = torch.linspace(-1.0, 2.0, lp.shape[0], dtype=lp.dtype)
    return {"logp+entropy": (w * lp).sum() + 0.3 * ent.sum(), "logp": (w * lp).sum(), "entropy": 0.3 * ent.sum()}[terms]


def _leaves(*tensors, dtype=torch.float32):
    return [None if t is None else t.detach().to(dtype, copy=True).requires_grad_() for t in tensors]
