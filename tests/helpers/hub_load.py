"""The hub under load (`run_load`): 32 fake generators against one hub and a trainer loop, run and checked."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import psutil

from common import messages
from common.config import load_config
from common.data import PromptSource
from common.transport import GeneratorSocket
from broker.hub import Hub
from tests.helpers.groups import rollout_group, sample

KEY = b"L" * 32
N_GENS, K = 32, 1


class FakeGenerator(threading.Thread):
    """Answers every work item at once with a 2-sample group stamped with the work's policy version."""

    def __init__(self, address: str, gen_id: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.address, self.gen_id, self.stop = address, gen_id, stop
        self.sent = 0
        self.latencies: list[float] = []

    def run(self) -> None:
        sock = GeneratorSocket(self.address, KEY)
        inc = f"fake{self.gen_id}"
        sock.send(messages.Hello(protocol_version=messages.PROTOCOL_VERSION, run_id="load", gen_id=self.gen_id, incarnation=inc, pid=1))
        assert isinstance(sock.recv(10), messages.Welcome)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            sock.send(messages.WorkRequest(gen_id=self.gen_id, incarnation=inc, max_groups=2))
            w = sock.recv(0.5)
            if not isinstance(w, messages.Work):
                continue
            self.latencies.append(time.perf_counter() - t0)
            for it in w.items:
                s = sample([3, 4], it.prompt_id % 2, logprobs=[-0.1, -0.2], versions=w.policy_version)
                sock.send(rollout_group([s, s], item=it, gen_id=self.gen_id, incarnation=inc))
                self.sent += 1
        sock.close()


def run_load(tiny_model_dir, tmp_path, duration_s: float) -> dict:
    """The load run and its checks; returns the report (also in tmp_path/load.json)."""
    from transformers import AutoTokenizer

    cfg = load_config(None, ["data.train_size=512", "rollout.groups_per_step=32", "rollout.group_size=2",
                             f"rollout.max_staleness_steps={K}", "learner.filter.dynamic_sampling=false",
                             "rollout.max_new_tokens=8", "eval.every_steps=0", "run.steps=1000000",
                             "transport.generator_timeout_s=600"])
    hub = Hub(cfg, run_id="load", key=KEY, host="127.0.0.1", port=0, source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)),
              weight_addr="127.0.0.1:1", generators=lambda: N_GENS)
    hub.start()
    stop = threading.Event()
    gens = [FakeGenerator(hub.sock.address, i, stop) for i in range(N_GENS)]
    for g in gens:
        g.start()
    proc = psutil.Process()
    trained, max_staleness, version, rss = 0, 0, 0, []
    t_start = time.monotonic()
    try:
        while time.monotonic() - t_start < duration_s:
            batch = hub.take_batch(version, timeout_s=30)
            oldest = min(int(messages.as_array(s.versions, messages.VERSION_DTYPE).min()) for r in batch for s in r.group.samples)
            max_staleness = max(max_staleness, version - oldest)
            trained += len(batch)
            hub.wait_version_done(version, timeout_s=30)
            version += 1
            hub.set_version(version)
            if version % 50 == 0:
                rss.append(proc.memory_info().rss)
    finally:
        stop.set()
        for g in gens:
            g.join(5)
    time.sleep(1.0)  # let the last groups in flight reach the hub
    elapsed = time.monotonic() - t_start
    c = hub.stats().counters
    rejected = sum(v for k, v in c.items() if k.startswith("hub/rejected/"))
    sent = sum(g.sent for g in gens)
    with hub.cv:
        waiting = len(hub.ready)
    hub.stop()
    assert hub.error is None
    assert sent == trained + waiting + rejected, (sent, trained, waiting, rejected)  # no group lost, none counted twice
    assert rejected == 0  # honest generators: nothing to reject
    assert max_staleness <= K and c["hub/lost_prompts"] == 0 and c["hub/duplicate_trained_prompts"] == 0
    lat = np.array([x for g in gens for x in g.latencies]) * 1000
    growth_mb = (rss[-1] - rss[0]) / 2**20 if len(rss) > 1 else 0.0
    report = {"generators": N_GENS, "seconds": round(elapsed, 1), "steps": version, "groups_trained": trained,
              "groups_per_s": round(trained / elapsed, 1), "latency_ms_p50": round(float(np.percentile(lat, 50)), 2),
              "latency_ms_p99": round(float(np.percentile(lat, 99)), 2), "rss_growth_mb": round(growth_mb, 1),
              "max_staleness": max_staleness}
    print("\nhub load:", json.dumps(report))
    (tmp_path / "load.json").write_text(json.dumps(report))
    assert version > 50, "the pipeline barely moved: something serialised it"
    assert growth_mb < 64, f"hub memory grew by {growth_mb:.0f} MB in {elapsed:.0f} s"
    return report
