"""Benchmark: weight sync bytes/s over our gloo pair channel vs a local memcpy of the same bytes.

The learner's side is the real one: `param_buckets` (the fp32 bucket copies of `W.bucket_plan`) fed to
`WeightPublisher.publish` (header, buckets, the late-joiner copy, the checksum) on a pair channel that a
generator process joined exactly as an actor does (`W.pair_prefix(gen_id, incarnation)`, rank 1 of 2,
`WeightChannel.receive`, which fills a new flat vector and checksums it). A sync is timed from the start
of `publish` until the generator has written the version's checksum into the store, so the time covers
every byte arriving, and the checksums of both sides must agree to the bit.

Two models: a synthetic 256 MiB one (8 x 32 MiB parameters, two 128 MiB buckets) for bytes/s, and the
demo model assets/arith-base for the time per sync users see. The ceiling is `dst.copy_(src)` of the
same bytes in one process on one thread: the weights cannot move faster than memory can copy them.
Gloo over loopback TCP copies each byte into and out of the kernel (and the learner gathers each bucket
once more), so even the bare broadcast reaches only a fraction of that ceiling. Issue 8 sets no target here;
ours is about our own overhead: the full sync at least half as fast as the bare pair-channel broadcast of
the same buckets (no header, checksum, copies or fresh receive buffer). `param_buckets` is also timed
alone. The first sync of each kind is a warm-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from common import weights as W
from common.transport import free_port
from learner.params import param_buckets, scratch_for
from learner.publisher import WeightPublisher
from tests.bench.common import REPO, best_of, record, verdict

DEMO = os.path.join(REPO, "assets", "arith-base")
BIG_PARAMS, BIG_SHAPE = 8, (4096, 2048)  # 8 x 8M fp32 = 256 MiB
VERSIONS = {"big": 6, "demo": 20}
TIMEOUT_S = 60.0
TARGET = 0.5  # of the bare gloo broadcast
GEN_ID, INCARNATION = 1, "bench"

# argv: host port spec mode versions; spec is "demo" or a JSON [names, shapes]; mode "publish" or "raw".
RECEIVER = r"""
import gc, json, sys
import torch
from common import weights as W
from tests.helpers.weight_channel import receive
torch.set_num_threads(1)
host, port, spec, mode, versions = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
if spec == "demo":
    from transformers import AutoModelForCausalLM
    lay = W.layout(AutoModelForCausalLM.from_pretrained(sys.argv[6], dtype=torch.float32))  # as the actor does
else:
    names, shapes = json.loads(spec)
    lay = W.Layout(tuple(names), tuple(tuple(s) for s in shapes))
ch = W.WeightChannel(host, port, 1, 2, 60.0, prefix=W.pair_prefix(int(sys.argv[7]), sys.argv[8]))
if mode == "raw":  # the bare collective: the same buckets into one reused buffer, no header, no checksum
    flat = torch.zeros(lay.numel)
    for v in range(1, versions + 1):
        for _, _, start, end in W.bucket_plan(lay):
            ch._bcast(flat[start:end])
        ch.store.set(f"bench/got/{v}", "0")
else:
    flat = None  # each version into the last one's vector, as the actor does once a version is applied
    while (got := receive(ch, lay, out=flat)) is not None:
        version, flat, total = got
        ch.store.set(f"bench/got/{version}", repr(total))
# Destroy the process group before interpreter teardown: left to the exit, ProcessGroupGloo aborts the
# process ("terminate called without an active exception", exit -6) in about 1 run in 5 on this machine.
del ch
gc.collect()
"""


class _Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(BIG_SHAPE, generator=g))
                                             for _ in range(BIG_PARAMS))


def _wait_joined(pub: WeightPublisher, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while GEN_ID not in pub.channels:
        if proc.poll() is not None:
            raise RuntimeError(f"weights: the generator exited {proc.returncode} before joining its pair channel: "
                               f"{proc.stderr.read()[-500:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"weights: the generator did not join within {TIMEOUT_S}s ({pub.counter_values()})")
        time.sleep(0.01)


def _sync_seconds(module: torch.nn.Module, spec: str, versions: int, raw: bool = False) -> list[float]:
    """Seconds of each sync after the first (publish start -> the generator has it); the learner runs here,
    the generator in a subprocess. `raw`: broadcast ready buckets on the same channel instead (gloo alone)."""
    lay = W.layout(module)
    scratch = scratch_for(module, lay)  # the learner's one reused bucket buffer
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, TIMEOUT_S)
    args = [sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), spec, "raw" if raw else "publish", str(versions),
            DEMO, str(GEN_ID), INCARNATION]
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
                            stderr=subprocess.PIPE, text=True)
    try:
        pub.join(GEN_ID, INCARNATION)
        _wait_joined(pub, proc)
        channel = pub.channels[GEN_ID].channel
        times = []
        for v in range(1, versions + 1):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1e-3)  # a new version: different bytes each time
            ready = [b.contiguous() for b in param_buckets(module, lay, False)] if raw else None
            t0 = time.perf_counter()
            if raw:
                for b in ready:
                    channel._bcast(b)
            else:
                _, nbytes, sent_sum = pub.publish(v, lay, param_buckets(module, lay, False, scratch))
            pub.store.wait([f"bench/got/{v}"])
            times.append(time.perf_counter() - t0)
            got_sum = float(pub.store.get(f"bench/got/{v}").decode())
            if not raw and (got_sum != sent_sum or nbytes != lay.numel * 4):
                raise RuntimeError(f"weights: version {v} arrived with checksum {got_sum!r}, sent {sent_sum!r}")
        if pub.counter_values().get("weights/dropped_channels"):
            raise RuntimeError(f"weights: the channel was dropped during the benchmark: {pub.counter_values()}")
        if not raw:
            pub.stop()  # the raw receiver leaves after its last version
        _, err = proc.communicate(timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"weights: the generator exited {proc.returncode}: {err.strip()[-500:]}")
        return times[1:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_weight_sync_vs_memcpy():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    big = _Big()
    lay = W.layout(big)
    nbytes = lay.numel * 4
    spec = json.dumps([list(lay.names), [list(s) for s in lay.shapes]])
    sync_times = _sync_seconds(big, spec, VERSIONS["big"])
    raw_times = _sync_seconds(big, spec, VERSIONS["big"], raw=True)
    src = torch.rand(lay.numel)
    dst = torch.empty_like(src)
    memcpy_s = best_of(lambda: dst.copy_(src), repeats=5)
    del src, dst
    scratch = scratch_for(big, lay)
    gather_s = best_of(lambda: [None for _ in param_buckets(big, lay, False, scratch)], repeats=3)  # the bucket copies alone
    del big
    demo = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    demo_bytes = W.layout(demo).numel * 4
    demo_times = _sync_seconds(demo, "demo", VERSIONS["demo"])

    gbps = {"sync": nbytes / min(sync_times) / 1e9, "bare_gloo": nbytes / min(raw_times) / 1e9,
            "memcpy": nbytes / memcpy_s / 1e9}
    ratio = gbps["sync"] / gbps["memcpy"]
    vs_bare = gbps["sync"] / gbps["bare_gloo"]
    record("weight_sync", {
        "payload_bytes": nbytes, "buckets": len(W.bucket_plan(lay)), "gb_per_s": gbps, "ratio_vs_memcpy": ratio,
        "ratio_bare_gloo_vs_memcpy": gbps["bare_gloo"] / gbps["memcpy"], "ratio_vs_bare_gloo": vs_bare,
        "seconds": {"sync": sync_times, "bare_gloo": raw_times, "memcpy_min": memcpy_s, "param_buckets_min": gather_s},
        "demo_model": {"bytes": demo_bytes, "seconds_per_sync_min": min(demo_times),
                       "seconds_per_sync_median": sorted(demo_times)[len(demo_times) // 2]},
        "target": f"full sync (param_buckets -> WeightPublisher.publish -> receive) >= {TARGET} of the bare gloo "
                  f"broadcast of the same buckets (our own target; memcpy is the ceiling, reported)",
        "verdict": verdict(vs_bare >= TARGET),
    })
    print(f"\nweight sync of {nbytes / 2**20:.0f} MiB: {gbps['sync']:.2f} GB/s ({min(sync_times):.3f} s) vs memcpy "
          f"{gbps['memcpy']:.2f} GB/s: ratio {ratio:.3f}; bare gloo "
          f"{gbps['bare_gloo']:.2f} GB/s (sync/bare {vs_bare:.2f}, target >= {TARGET}: {verdict(vs_bare >= TARGET)}), param_buckets alone {gather_s:.3f} s; demo model "
          f"({demo_bytes / 2**20:.1f} MiB) {min(demo_times) * 1e3:.1f} ms per sync")
    assert all(t > 0 for t in sync_times + raw_times + demo_times) and memcpy_s > 0
