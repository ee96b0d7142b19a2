"""Scale on paper: a discrete-event simulator of asynchronous RL with G generators, L learners and a staleness bound k.

It predicts the throughput (trained samples per second) of the covrl pipeline at sizes this 2-core machine cannot
run, and the speedup of async (k >= 1) over synchronous (k = 0) training, as G, L and k vary. `make bench` runs a
grid of it (tests/bench/test_bench_simulate.py) and records it in tests/bench/results.json with these assumptions.

Assumptions (the model; every number is a parameter of `Workload` / `Hardware`):
1. Response lengths are i.i.d. per sample: lognormal (median, sigma) or Pareto (scale, alpha), rounded to whole
   tokens and capped at `max_tokens` (the max_new_tokens truncation of RL recipes). Sample i of the prompt stream has
   the same length in every configuration (common random numbers), so configurations differ only by scheduling.
2. Generation is continuous batching (vLLM / SGLang style, `generation="continuous"`): a generator runs up to `slots`
   sequences at once; one decode iteration advances each active sequence by one token and costs
   `iter_base_s + iter_per_seq_s * active` (decoding is memory-bound: a fixed cost to read the weights plus a small
   per-sequence cost for KV reads and compute). A freed slot is refilled at once when admission control allows.
   Prefill, sampling and scoring are folded into those two constants. Time is fluid: a sequence admitted in the
   middle of an iteration starts at once. `generation="static"` is the alternative (covrl's CPU engine, HF generate):
   a generator takes a batch only when it is empty and returns it when its longest response is done, every
   iteration costing the padded batch. `generation="static_compact"` is covrl's torch engine: a
   batch is taken whole and returned whole, but a finished row leaves it, so an iteration costs the rows still
   running.
3. Learning: one data-parallel group of L ranks; a step costs `step_fixed_s + train_s_per_token * tokens / L`, tokens
   = prompt + response tokens of the batch (perfectly balanced shards; gradient all-reduce, optimizer and barrier are
   in `step_fixed_s`, independent of L).
4. Weight sync: after each step the learner is busy for `weight_sync_s` and every generator pauses for the same time;
   in-flight sequences keep their KV cache and continue with the new weights (PipelineRL's in-flight update,
   AReaL's interruptible generation; covrl with run.deterministic = false).
5. Staleness is covrl's admission control (broker/hub.py, broker/rules.py): sample `slot` of the stream is issued only while
   slot < (v + 1 + k) * B (v = learner version, B = samples per step); the batch of step v + 1 is the B lowest-slot
   finished samples, taken once no sample issued before version v - k is in flight. No trained sample is more than k
   versions old, and k = 0 is the synchronous loop: generate the whole batch, train, sync, repeat.
6. Baselines. "sync" = the same G generators and L learners at k = 0 (checked against `sync_reference`, an
   independent phase-by-phase implementation). "colocated sync" = all G + L devices generate, then all G + L train
   (verl-style time sharing, the baseline of the published speedups), with the same sync cost and slots per device.
7. Not modelled: network contention, stragglers and failures, memory limits on slots (KV cache grows with context),
   attention cost growing with context, prompt prefill, reward latency, dynamic-sampling refills.

The stage bound: async samples/s <= min(learner rate, generator rate) with the learner busy at least
train + sync per step, and the generators at best at full occupancy (`slots` active everywhere) plus their sync
pause. So the async/sync speedup is at most `T_sync / max(T_learn, T_gen_ideal)`; with heavy tails T_gen_ideal is
well below the synchronous generation phase (which waits for the longest response at low occupancy), so this bound
can exceed the (g + t) / max(g, t) <= 2 of two equal stages. `stage_bound` computes it.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Workload:
    samples_per_step: int = 512  # B: prompts per step x group size
    prompt_tokens: int = 256
    length_dist: str = "lognormal"  # "lognormal" | "pareto"
    median_tokens: float = 2000.0  # lognormal median
    sigma: float = 0.9  # lognormal shape: P(length > 8 x median) = 1 %
    pareto_scale_tokens: float = 800.0  # Pareto x_m
    pareto_alpha: float = 1.5  # Pareto tail index (infinite variance below 2)
    max_tokens: int = 16384  # max_new_tokens: longer responses are truncated


@dataclass(frozen=True)
class Hardware:
    """Per-device costs, illustrative for a 7B model on an H100-class GPU (see the numbers' derivations)."""

    slots: int = 128  # concurrent sequences per generator (KV-cache bound)
    # 7B bf16 weights (15 GB) at ~3 TB/s: 5 ms per iteration, doubled for scheduling and sampling overhead.
    iter_base_s: float = 0.010
    # ~14 GFLOP per token at ~500 TFLOP/s plus KV reads of a ~2k-token context: 0.07 ms per active sequence.
    iter_per_seq_s: float = 7e-5
    # 6 x 7e9 FLOP/token for forward + backward, plus a logprob-recompute forward, at 400 TFLOP/s (40 % MFU).
    train_s_per_token: float = 1.4e-4
    step_fixed_s: float = 2.0  # optimizer step, all-reduce, barrier
    weight_sync_s: float = 3.0  # broadcast 15 GB of bf16 weights at ~5 GB/s
    generation: str = "continuous"  # "continuous" | "static" | "static_compact"

    def iter_s(self, active: int) -> float:
        return self.iter_base_s + self.iter_per_seq_s * active


def draw_lengths(w: Workload, n: int, seed: int) -> np.ndarray:
    """Response lengths (whole tokens, 1 .. max_tokens) of the first n samples of the stream."""
    rng = np.random.default_rng(seed)
    if w.length_dist == "lognormal":
        x = w.median_tokens * np.exp(w.sigma * rng.standard_normal(n))
    elif w.length_dist == "pareto":
        x = w.pareto_scale_tokens * (1.0 + rng.pareto(w.pareto_alpha, n))
    else:
        raise ValueError(f"length_dist={w.length_dist!r}: use \"lognormal\" or \"pareto\"")
    return np.clip(np.rint(x), 1, w.max_tokens).astype(np.int64)


@dataclass
class Result:
    samples_per_s: float  # over the measured steps
    step_end_s: list[float]  # wall time at the end of each step (after its weight sync)
    train_s: list[float]  # learner busy time per step (training only)
    staleness_mean: float
    staleness_max: int
    gen_utilization: float  # mean active slots / slots over the measured window
    extra: dict = field(default_factory=dict)


def window_rate(step_end_s: list[float], samples_per_step: int, warmup_steps: int) -> float:
    """Samples/s over steps warmup+1 .. last: start-up (the first batch's generation) excluded."""
    n = len(step_end_s) - warmup_steps
    t0 = step_end_s[warmup_steps - 1] if warmup_steps else 0.0
    return n * samples_per_step / (step_end_s[-1] - t0)


class _Generator:
    """Continuous batching in fluid time: `iters` counts decode iterations done; a sequence admitted at
    iteration i with n tokens finishes at iteration i + n. Between events the active set is constant, so
    `iters` grows at 1 / iter_s(active) per second, except while paused."""

    def __init__(self, hw: Hardware):
        self.hw = hw
        self.iters = 0.0
        self.t_last = 0.0
        self.paused_until = 0.0
        self.heap: list[tuple[float, int]] = []  # (finish iteration, slot)
        self.epoch = 0  # invalidates scheduled events after a change
        self.busy_s = 0.0  # integral of active/slots over time
        self.held: list[int] = []  # static_compact: finished rows of the batch still running

    def advance(self, t: float) -> None:
        start = max(self.t_last, self.paused_until)
        if self.heap and t > start:
            self.iters += (t - start) / self.hw.iter_s(len(self.heap))
            self.busy_s += (t - start) * len(self.heap) / self.hw.slots
        self.t_last = max(self.t_last, t)

    def free(self) -> int:
        if self.hw.generation != "continuous" and self.heap:
            return 0  # a static batch takes no new work until it is done
        return self.hw.slots - len(self.heap)

    def next_done(self) -> float | None:
        if not self.heap:
            return None
        start = max(self.t_last, self.paused_until)
        return start + max(self.heap[0][0] - self.iters, 0.0) * self.hw.iter_s(len(self.heap))

    def pop_done(self) -> list[int]:
        done = []
        while self.heap and self.heap[0][0] <= self.iters + 1e-6:
            done.append(heapq.heappop(self.heap)[1])
        if self.hw.generation == "static_compact":  # finished rows stop costing, but leave with their batch
            self.held += done
            if self.heap:
                return []
            done, self.held = self.held, []
        return done


def simulate(G: int, L: int, k: int, w: Workload, hw: Hardware, *, steps: int, warmup_steps: int, seed: int = 0) -> Result:
    """The async pipeline under admission control with staleness bound k; k = 0 is synchronous."""
    B = w.samples_per_step
    lengths = draw_lengths(w, steps * B, seed)
    gens = [_Generator(hw) for _ in range(G)]
    events: list[tuple[float, int, int, int]] = []  # (time, kind, generator or -1, epoch); kind 0 gen, 1 learner
    GEN, LEARN = 0, 1
    t, version, next_slot = 0.0, 0, 0
    in_flight: dict[int, int] = {}  # slot -> issue version
    flying: dict[int, int] = {}  # issue version -> samples of it in flight
    ready: dict[int, int] = {}  # slot -> issue version
    learner = "idle"  # idle | train | sync
    step_end, train_times, stale = [], [], []

    def schedule(g: int) -> None:
        gens[g].epoch += 1
        done = gens[g].next_done()
        if done is not None:
            heapq.heappush(events, (done, GEN, g, gens[g].epoch))

    def fill() -> None:
        nonlocal next_slot
        cap = min(version + 1 + k, steps) * B
        if next_slot >= cap:
            return
        # Each sample goes to the generator with the most free slots, then the lowest index.
        order = [(-gens[i].free(), i) for i in range(G) if gens[i].free() > 0]
        heapq.heapify(order)
        touched = set()
        while next_slot < cap and order:
            _, g = heapq.heappop(order)
            if g not in touched:
                gens[g].advance(t)
                touched.add(g)
            take = [next_slot] if hw.generation == "continuous" else list(range(next_slot, min(next_slot + gens[g].free(), cap)))
            finish = gens[g].iters + max(int(lengths[s]) for s in take)
            for s in take:
                own = finish if hw.generation == "static" else gens[g].iters + int(lengths[s])
                heapq.heappush(gens[g].heap, (own, s))
                in_flight[s] = version
            flying[version] = flying.get(version, 0) + len(take)
            next_slot += len(take)
            if gens[g].free() > 0:
                heapq.heappush(order, (-gens[g].free(), g))
        for g in touched:
            schedule(g)

    def try_train() -> None:
        nonlocal learner
        if learner != "idle" or len(ready) < B:
            return
        floor = version - k
        if any(v < floor for v in flying):
            return  # a straggler issued before the bound could still land: wait for it (hub._try_batch)
        slots = sorted(ready)[:B]
        for s in slots:
            stale.append(version - ready.pop(s))
        tokens = sum(int(lengths[s]) + w.prompt_tokens for s in slots)
        dur = hw.step_fixed_s + hw.train_s_per_token * tokens / L
        train_times.append(dur)
        learner = "train"
        heapq.heappush(events, (t + dur, LEARN, -1, 0))

    fill()
    while len(step_end) < steps:
        if not events:
            raise RuntimeError(f"simulation stalled at t={t:.1f}s, version {version}: no event pending (a simulator bug)")
        t, kind, g, epoch = heapq.heappop(events)
        if kind == GEN:
            if epoch != gens[g].epoch:
                continue  # superseded by a later change to this generator
            gens[g].advance(t)
            for s in gens[g].pop_done():
                v = ready[s] = in_flight.pop(s)
                flying[v] -= 1
                if not flying[v]:
                    del flying[v]
            schedule(g)
            fill()
            try_train()
        elif learner == "train":
            learner = "sync"
            for i, gen in enumerate(gens):  # every generator stops decoding while the weights arrive
                gen.advance(t)
                gen.paused_until = t + hw.weight_sync_s
                schedule(i)
            heapq.heappush(events, (t + hw.weight_sync_s, LEARN, -1, 0))
        else:
            learner = "idle"
            version += 1
            step_end.append(t)
            fill()
            try_train()
    t0 = step_end[warmup_steps - 1] if warmup_steps else 0.0
    for gen in gens:
        gen.advance(t)
    # Utilization over the whole run (the window alone would need per-window bookkeeping; start-up is short).
    util = sum(gen.busy_s for gen in gens) / (G * t)
    return Result(window_rate(step_end, B, warmup_steps), step_end, train_times,
                  float(np.mean(stale)), int(max(stale)), util, {"window_s": step_end[-1] - t0})


def generation_makespan(lengths: np.ndarray, G: int, hw: Hardware) -> float:
    """Synchronous generation phase: `lengths` (in stream order) over G empty generators that start together.

    Written independently of `simulate`: whole decode iterations, one generator event at a time (ties to the lowest
    generator index), slots refilled from the shared queue by the generator that freed them.
    """
    queue = [int(x) for x in lengths][::-1]  # pop() takes the next in stream order
    active = [np.zeros(0, dtype=np.int64) for _ in range(G)]  # remaining tokens per sequence, per generator

    def take(g: int, n: int) -> None:
        got = [queue.pop() for _ in range(min(n, len(queue)))]
        if hw.generation == "static" and got:
            got = [max(got)] * len(got)  # padded: every row runs until the longest is done
        active[g] = np.concatenate([active[g], np.array(got, dtype=np.int64)])

    while queue:  # initial fill: each sample to the generator with the most free slots (lowest index on ties)
        g = max(range(G), key=lambda i: (hw.slots - len(active[i]), -i))
        if len(active[g]) >= hw.slots or (hw.generation != "continuous" and len(active[g])):
            break
        take(g, 1 if hw.generation == "continuous" else hw.slots)
    heap = [(hw.iter_s(len(a)) * int(a.min()), g) for g, a in enumerate(active) if len(a)]
    heapq.heapify(heap)
    end = 0.0
    while heap:
        t, g = heapq.heappop(heap)
        n = int(active[g].min())
        active[g] = active[g][active[g] > n] - n
        end = max(end, t)
        if hw.generation == "continuous" or not len(active[g]):
            take(g, hw.slots - len(active[g]))
        if len(active[g]):
            heapq.heappush(heap, (t + hw.iter_s(len(active[g])) * int(active[g].min()), g))
    return end


def sync_reference(G: int, L: int, w: Workload, hw: Hardware, *, steps: int, warmup_steps: int, seed: int = 0) -> Result:
    """The synchronous loop phase by phase: generate the batch, train on it, sync the weights; repeat.
    extra["gen_phase_s"]: the generation phase of each step."""
    B = w.samples_per_step
    lengths = draw_lengths(w, steps * B, seed)
    t, ends, train, phases = 0.0, [], [], []
    for s in range(steps):
        batch = lengths[s * B:(s + 1) * B]
        gen = generation_makespan(batch, G, hw)
        tr = hw.step_fixed_s + hw.train_s_per_token * float(np.sum(batch + w.prompt_tokens)) / L
        t += gen + tr + hw.weight_sync_s
        ends.append(t)
        train.append(tr)
        phases.append(gen)
    return Result(window_rate(ends, B, warmup_steps), ends, train, 0.0, 0, float("nan"), {"gen_phase_s": phases})


def stage_bound(sync: Result, G: int, w: Workload, hw: Hardware, *, warmup_steps: int, seed: int = 0) -> dict:
    """Upper bounds on the async/sync speedup from the stage times of the measured steps (`sync`: sync_reference).

    T_sync = generation phase + train + sync (the k = 0 step). The async step is at least
    T_learn = train + sync (the learner does both) and T_gen_ideal = response tokens x iter_s(slots) / (slots x G)
    + sync (all generators at full occupancy, pausing for each sync). `bound` = sum T_sync / sum max(T_learn,
    T_gen_ideal); `two_stage_bound` = (g + t) / max(g, t) with g the synchronous generation phase: the bound
    if both stages kept their synchronous times.
    """
    B, steps = w.samples_per_step, len(sync.step_end_s)
    lengths = draw_lengths(w, steps * B, seed)
    gen = sync.extra["gen_phase_s"][warmup_steps:]
    learn = [x + hw.weight_sync_s for x in sync.train_s[warmup_steps:]]
    ideal = [float(np.sum(lengths[s * B:(s + 1) * B])) * hw.iter_s(hw.slots) / (hw.slots * G) + hw.weight_sync_s
             for s in range(warmup_steps, steps)]
    g, t = sum(gen), sum(learn)
    return {"bound": (g + t) / sum(max(a, b) for a, b in zip(learn, ideal)), "two_stage_bound": (g + t) / max(g, t),
            "gen_phase_s": g / len(gen), "learn_s": t / len(learn)}


def colocated_sync(N: int, w: Workload, hw: Hardware, *, steps: int, warmup_steps: int, seed: int = 0) -> Result:
    """verl-style synchronous baseline: all N devices generate, then all N train, then reshard (weight_sync_s)."""
    return sync_reference(N, N, w, hw, steps=steps, warmup_steps=warmup_steps, seed=seed)


def grid(devices=(16, 32, 64, 128), gen_fractions=(0.5, 0.75), ks=(0, 1, 2, 4, 8), *, samples_per_device: int = 32,
         steps: int = 16, warmup_steps: int = 4, seed: int = 0, hw: Hardware = Hardware(), w: Workload = Workload()) -> list[dict]:
    """Speedups over (N devices, generator share, k); the batch grows with N (32 samples per device: weak scaling)."""
    rows = []
    for N in devices:
        wl = Workload(**{**asdict(w), "samples_per_step": samples_per_device * N})
        coloc = colocated_sync(N, wl, hw, steps=steps, warmup_steps=warmup_steps, seed=seed).samples_per_s
        for frac in gen_fractions:
            G = max(1, round(N * frac))
            L = N - G
            base = simulate(G, L, 0, wl, hw, steps=steps, warmup_steps=warmup_steps, seed=seed).samples_per_s
            bound = stage_bound(sync_reference(G, L, wl, hw, steps=steps, warmup_steps=warmup_steps, seed=seed), G, wl, hw,
                                warmup_steps=warmup_steps, seed=seed)
            for k in ks:
                r = simulate(G, L, k, wl, hw, steps=steps, warmup_steps=warmup_steps, seed=seed)
                rows.append({
                    "devices": N, "G": G, "L": L, "k": k, "samples_per_step": wl.samples_per_step,
                    "samples_per_s": round(r.samples_per_s, 4),
                    "speedup_vs_sync": round(r.samples_per_s / base, 4),
                    "speedup_vs_colocated_sync": round(r.samples_per_s / coloc, 4),
                    "stage_bound": round(bound["bound"], 4), "two_stage_bound": round(bound["two_stage_bound"], 4),
                    "staleness_mean": round(r.staleness_mean, 3), "gen_utilization": round(r.gen_utilization, 3),
                })
    return rows


def speedup_curve(G: int, L: int, ks, w: Workload, hw: Hardware, *, steps: int, warmup_steps: int, seed: int = 0) -> list[float]:
    base = simulate(G, L, 0, w, hw, steps=steps, warmup_steps=warmup_steps, seed=seed).samples_per_s
    return [simulate(G, L, k, w, hw, steps=steps, warmup_steps=warmup_steps, seed=seed).samples_per_s / base for k in ks]


def assumptions() -> dict:
    """The model's assumptions and default parameters, for results.json."""
    return {
        "generation": "continuous batching: iteration = iter_base_s + iter_per_seq_s x active sequences, one token "
                      "per active sequence; free slots refilled at once (static batching: per-batch max length)",
        "learner": "step = step_fixed_s + train_s_per_token x (prompt + response tokens) / L",
        "weight_sync": "learner busy and every generator paused for weight_sync_s after each step; in-flight "
                       "sequences continue with the new weights",
        "staleness": "covrl admission control: issue slot only while slot < (v + 1 + k) x B; batch = B lowest "
                     "finished slots once nothing issued before v - k is in flight; k = 0 is synchronous",
        "lengths": "i.i.d., common random numbers across configurations, capped at max_tokens",
        "batch": "32 samples per device (weak scaling)",
        "sync_baseline": "same G generators + L learners at k = 0",
        "colocated_baseline": "all G + L devices generate, then all train, then weight_sync_s (verl-style)",
        "not_modelled": "network contention, stragglers, KV-cache limits growing with context, attention cost "
                        "growing with context, prefill, reward latency, dynamic-sampling refills",
        "workload": asdict(Workload()),
        "hardware": asdict(Hardware()),
    }


if __name__ == "__main__":
    import json

    for row in grid():
        print(json.dumps(row))
