"""Benchmark: the LM head's log pi(target) + entropy, forward and backward, chunked (autograd) vs fused.

Qwen2.5-0.5B's head (V = 151,936, H = 896) in fp32 on one CPU thread, chunk = 1024 tokens (the config's
default), N = 1024, 2048 and 4096 tokens, the loss using both outputs (logp weighted, plus an entropy bonus) as
in training. Each (variant, N) runs in a fresh process: peak RSS above the inputs (the head's weight, the
hidden states; the weight's gradient, 545 MB, counts in both) and the wall time of one forward+backward after a
warm-up on a small head (so it adds nothing to the peak). Recorded in results.json ("lm_head"); not a README row.
"""

from __future__ import annotations

from tests.bench.common import record, run_measured

V, H, CHUNK = 151_936, 896, 1024
TOKENS = (1024, 2048, 4096)

CODE = """
import json, resource, time, torch
torch.set_num_threads(1)
from learner.fused_head import fused_logprobs_and_entropy
from learner.logprobs import logprobs_and_entropy
N, H, V, CHUNK = {N}, {H}, {V}, {CHUNK}
torch.manual_seed(0)
head = torch.nn.Linear(H, V, bias=False)
hidden = torch.randn(N, H, requires_grad=True)
targets = torch.randint(0, V, (N,))
adv = torch.randn(N)
def run(head, h, t):
    if "{VARIANT}" == "fused":
        return fused_logprobs_and_entropy(h, head.weight, None, t, temperature=0.7, chunk=CHUNK)
    return logprobs_and_entropy(head, h, t, temperature=0.7, chunk=CHUNK)
def step(head, h, t):
    lp, ent = run(head, h, t)
    (-(lp * adv[: len(lp)]).sum() - 1e-3 * ent.sum()).backward()
step(torch.nn.Linear(H, 1000, bias=False), hidden[:64], targets[:64] % 1000)  # warm-up, small: keeps the peak
hidden.grad = None
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
step(head, hidden, targets)
print(json.dumps({{"seconds": time.perf_counter() - t0, "base_rss_mib": base}}))
"""


def test_head_time_and_memory():
    out = {"shape_hidden_vocab_chunk": [H, V, CHUNK], "dtype": "float32", "threads": 1, "tokens": {}}
    for n in TOKENS:
        row = {}
        for variant in ("chunked", "fused"):
            r = run_measured(CODE.format(N=n, H=H, V=V, CHUNK=CHUNK, VARIANT=variant))
            assert "error" not in r, (variant, n, r)
            row[variant] = {"seconds_fwd_bwd": r["seconds"], "peak_extra_mib": r["peak_rss_mib"] - r["base_rss_mib"]}
        row["time_ratio_fused_vs_chunked"] = row["fused"]["seconds_fwd_bwd"] / row["chunked"]["seconds_fwd_bwd"]
        row["memory_ratio_fused_vs_chunked"] = row["fused"]["peak_extra_mib"] / row["chunked"]["peak_extra_mib"]
        out["tokens"][str(n)] = row
        print(f"\nN={n}: chunked {row['chunked']['seconds_fwd_bwd']:.2f} s {row['chunked']['peak_extra_mib']:.0f} MiB, "
              f"fused {row['fused']['seconds_fwd_bwd']:.2f} s {row['fused']['peak_extra_mib']:.0f} MiB "
              f"(time {row['time_ratio_fused_vs_chunked']:.2f}x, memory {row['memory_ratio_fused_vs_chunked']:.2f}x)")
    record("lm_head", out)
