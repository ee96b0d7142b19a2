"""Benchmark: the LM head's log pi(target) + entropy, forward and backward, chunked (autograd) vs fused, and the
fused head's kernels (learner/head_kernels.py: eager "fused", "inductor", "triton") beside each other.

Qwen2.5-0.5B's head (V = 151,936, H = 896) in fp32 on one CPU thread, chunk = 1024 tokens (the config's
default), N = 1024, 2048 and 4096 tokens, the loss using both outputs (logp weighted, plus an entropy bonus) as
in training. Each (variant, N) runs in a fresh process: peak RSS above the inputs (the head's weight, the
hidden states; the weight's gradient, 545 MB, counts in both) and the wall time of one forward+backward after a
warm-up on a small head (so it adds nothing to the peak). Recorded in results.json ("lm_head"); not a README row.

The kernels ("lm_head_kernels", KERNEL_RUNS): "fused" and "inductor", "fused" and "triton", in fp32 and bf16, the
peak taken after a full-size warm-up; "triton" under Triton's interpreter (TRITON_INTERPRET=1): on a CPU its time
is the interpreter's, not a kernel's, and its peak RSS holds the interpreter's numpy copies of the arguments besides
the one buffer the kernels use (on a GPU: one [chunk x V] buffer in the model dtype; the eager head's peak is two
fp32 ones). Which kernel is faster is the GPU proof's learner stage to say (docs/gpu.md).
"""

from __future__ import annotations

from tests.bench.common import record, run_measured

V, H, CHUNK = 151_936, 896, 1024
TOKENS = (1024, 2048, 4096)

CODE = """
import json, os, resource, time
if "{VARIANT}" == "triton":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
import torch
torch.set_num_threads(1)
from learner.fused_head import fused_logprobs_and_entropy
from learner.logprobs import logprobs_and_entropy
N, H, V, CHUNK = {N}, {H}, {V}, {CHUNK}
DTYPE = getattr(torch, "{DTYPE}")
torch.manual_seed(0)
head = torch.nn.Linear(H, V, bias=False, dtype=DTYPE)
hidden = torch.randn(N, H, dtype=DTYPE, requires_grad=True)
targets = torch.randint(0, V, (N,))
adv = torch.randn(N)
def run(head, h, t):
    if "{VARIANT}" != "chunked":
        return fused_logprobs_and_entropy(h, head.weight, None, t, temperature=0.7, chunk=CHUNK, kernels="{VARIANT}")
    return logprobs_and_entropy(head, h, t, temperature=0.7, chunk=CHUNK)
def step(head, h, t):
    lp, ent = run(head, h, t)
    (-(lp * adv[: len(lp)]).sum() - 1e-3 * ent.sum()).backward()
def status_mib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024
if {FULL_WARMUP}:  # the same step first (compiles, the interpreter's set-up), then the peak RSS is reset
    step(head, hidden, targets)
    head.weight.grad = None
else:  # a small head: the warm-up adds nothing to the peak
    step(torch.nn.Linear(H, 1000, bias=False, dtype=DTYPE), hidden[:64], targets[:64] % 1000)
hidden.grad = None
import gc
gc.collect()
if {FULL_WARMUP}:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to VmRSS: the peak from here on
base = status_mib("VmRSS") if {FULL_WARMUP} else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
step(head, hidden, targets)
seconds = time.perf_counter() - t0
print(json.dumps({{"seconds": seconds, "base_rss_mib": base, "peak_mib": status_mib("VmHWM")}}))
"""


def test_head_time_and_memory():
    out = {"shape_hidden_vocab_chunk": [H, V, CHUNK], "dtype": "float32", "threads": 1, "tokens": {}}
    for n in TOKENS:
        row = {}
        for variant in ("chunked", "fused"):
            r = run_measured(CODE.format(N=n, H=H, V=V, CHUNK=CHUNK, VARIANT=variant, DTYPE="float32",
                                         FULL_WARMUP=False))
            assert "error" not in r, (variant, n, r)
            row[variant] = {"seconds_fwd_bwd": r["seconds"], "peak_extra_mib": r["peak_rss_mib"] - r["base_rss_mib"]}
        row["time_ratio_fused_vs_chunked"] = row["fused"]["seconds_fwd_bwd"] / row["chunked"]["seconds_fwd_bwd"]
        row["memory_ratio_fused_vs_chunked"] = row["fused"]["peak_extra_mib"] / row["chunked"]["peak_extra_mib"]
        out["tokens"][str(n)] = row
        print(f"\nN={n}: chunked {row['chunked']['seconds_fwd_bwd']:.2f} s {row['chunked']['peak_extra_mib']:.0f} MiB, "
              f"fused {row['fused']['seconds_fwd_bwd']:.2f} s {row['fused']['peak_extra_mib']:.0f} MiB "
              f"(time {row['time_ratio_fused_vs_chunked']:.2f}x, memory {row['memory_ratio_fused_vs_chunked']:.2f}x)")
    record("lm_head", out)


# (tokens = chunk, dtype, the two heads compared). Each process runs the whole step once first (inductor compiles,
# the interpreter sets up), resets its peak RSS (/proc/self/clear_refs), then times the step and takes the peak
# over the RSS before it: the step's own memory, compile and import memory left out. bf16 shows what the kernels
# are for: the eager head upcasts a chunk's bf16 logits to fp32 buffers, the others read them as they are (bf16
# GEMMs on a CPU without AVX-512 are slow: the time is not the point there).
KERNEL_RUNS = ((1024, "float32", ("fused", "inductor")), (64, "bfloat16", ("fused", "inductor")),
               (64, "float32", ("fused", "triton")), (64, "bfloat16", ("fused", "triton")))


def test_head_kernels_time_and_memory():
    out = {"shape_hidden_vocab": [H, V], "threads": 1, "tokens": {},
           "note": "triton runs under Triton's interpreter on the CPU: its time is the interpreter's and its peak RSS "
                   "holds the interpreter's copy of each chunk's logits; chunk = N in every run"}
    for n, dtype, variants in KERNEL_RUNS:
        row = {}
        for variant in variants:
            r = run_measured(CODE.format(N=n, H=H, V=V, CHUNK=n, VARIANT=variant, DTYPE=dtype, FULL_WARMUP=True))
            assert "error" not in r, (variant, n, r)
            row[variant] = {"seconds_fwd_bwd": r["seconds"], "peak_extra_mib": r["peak_mib"] - r["base_rss_mib"]}
        other = variants[1]
        row[f"time_ratio_{other}_vs_fused"] = row[other]["seconds_fwd_bwd"] / row["fused"]["seconds_fwd_bwd"]
        row[f"memory_ratio_{other}_vs_fused"] = row[other]["peak_extra_mib"] / row["fused"]["peak_extra_mib"]
        out["tokens"][f"{n} {dtype}"] = row
        print(f"\nN={n} {dtype}: " + ", ".join(f"{v} {row[v]['seconds_fwd_bwd']:.2f} s {row[v]['peak_extra_mib']:.0f} MiB"
                                       for v in variants))
    record("lm_head_kernels", out)
