"""Benchmarks: loss time per mode vs ppo_loss (B=64, T=4096), chunked entropy memory (8k x 152k)."""

from __future__ import annotations

import pytest
import torch

from learner import losses as L
from tests.bench.common import best_of, record, run_measured, verdict

B, T = 64, 4096


def _inputs():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(B, T, generator=g) * 4).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    return logp, old, adv, mask


def test_loss_time_per_mode():
    torch.set_num_threads(1)
    logp, old, adv, mask = _inputs()
    n = mask.sum()
    modes = {
        "ppo": lambda: L.ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0),
        "clip_cov": lambda: L.clip_cov_loss(logp, old, adv, mask, clip_low=1.0, clip_high=1.0, cov_fraction=2e-4,
                                            cov_lb=1.0, cov_ub=5.0, generator=torch.Generator().manual_seed(0)),
        "kl_cov": lambda: L.kl_cov_loss(logp, old, adv, mask, kl_fraction=2e-3, kl_coef=1.0),
        "gspo": lambda: L.gspo_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4),
        "cispo": lambda: L.cispo_loss(logp, old, adv, mask, clip_low=1.0, clip_high=0.28),
    }

    def fwd_bwd(f):
        def run():
            logp.grad = None
            loss, _ = f()
            L.aggregate(loss, mask, "token-mean", global_tokens=n).backward()
        return run

    times = {k: best_of(fwd_bwd(f), repeats=7) for k, f in modes.items()}
    ratios = {k: times[k] / times["ppo"] for k in modes}
    target = max(ratios["clip_cov"], ratios["kl_cov"]) <= 1.5
    record("losses", {"shape": [B, T], "seconds_fwd_bwd": times, "ratio_vs_ppo": ratios,
                      "target": "clip_cov and kl_cov <= 1.5x ppo_loss", "verdict": verdict(target)})
    print("\nloss fwd+bwd at B=64, T=4096 (1 thread):", {k: f"{v * 1e3:.1f} ms ({ratios[k]:.2f}x)" for k, v in times.items()})
    assert all(v > 0 for v in times.values())


CHUNKED = """
import json, time, torch
torch.set_num_threads(1)
from learner.logprobs import logprobs_and_entropy, naive_logprobs_and_entropy
N, H, V = {N}, {H}, {V}
torch.manual_seed(0)
head = torch.nn.Linear(H, V, bias=False)
hidden = torch.randn(N, H)
targets = torch.randint(0, V, (N,))
import resource
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
with torch.no_grad():
    {CALL}
print(json.dumps({{"seconds": time.perf_counter() - t0, "base_rss_mib": base}}))
"""


@pytest.mark.parametrize("n_tokens", [8192])
def test_chunked_entropy_memory(n_tokens):
    shape = dict(N=n_tokens, H=896, V=152064)  # Qwen2.5-0.5B head; the logits alone are 4.6 GiB in fp32
    chunked = run_measured(CHUNKED.format(**shape, CALL="logprobs_and_entropy(head, hidden, targets, chunk=1024)"))
    naive = run_measured(CHUNKED.format(**shape, CALL="naive_logprobs_and_entropy(head, hidden, targets)"))
    out = {"shape_tokens_hidden_vocab": [shape["N"], shape["H"], shape["V"]], "chunked": chunked, "naive": naive}
    if "error" not in naive and "error" not in chunked:
        extra_c = chunked["peak_rss_mib"] - chunked["base_rss_mib"]
        extra_n = naive["peak_rss_mib"] - naive["base_rss_mib"]
        out["peak_extra_mib"] = {"chunked": extra_c, "naive": extra_n}
        out["ratio"] = extra_c / extra_n
        out["target"] = "chunked peak (above the inputs) <= 1/4 of naive"
        out["verdict"] = verdict(out["ratio"] <= 0.25)
        print(f"\nentropy+logprobs at {shape}: chunked {extra_c:.0f} MiB {chunked['seconds']:.1f}s, "
              f"naive {extra_n:.0f} MiB {naive['seconds']:.1f}s, ratio {out['ratio']:.3f}")
    record("chunked_entropy", out)
    assert "error" not in chunked, chunked
