"""The worker of hardware/proof.py's `learner` stage: today's learner path and the new one, side by side, on
random-init model shapes, in one child process (`python -m hardware.learner_bench SPEC_JSON`, from the repo root).

SPEC's `plan` is the list of (shape, variant) items in the order to run them (the first lease's interleaves the
shapes: proof.py FIRST_LEASE_PLAN). Each shape's model is built on its first item (offline, saved to the shape's
`model` directory, reused by a restarted worker); each variant (learner config overrides: attention, logprob head,
compile_layers, gradient checkpointing) builds a real `learner.trainer.Trainer` on one rank (ZeRO-1; bf16 on a GPU,
fp32 on the CPU rehearsal) and trains the same synthetic batch at each packing budget: warm-up steps, timed steps,
then one step under torch.profiler (at the last budget). Every variant of a shape starts from the same saved
weights, so its first step can be compared with the shape's baseline (`first_step`, and the body's hidden states of
the first micro-batch, `hidden_rel_diff`).

Time: an item starts only if its estimate (`estimate_s`: the variant, the model build and compiles it pays first,
scaled by how far the items so far overran their estimates) fits before SPEC's `deadline_unix`; one that does not
is recorded as not run and the next, perhaps cheaper, is considered. The stage kills the worker at its own hard
limit, so a wrong estimate costs the item under way, never the command's deadline.

What ran is read from the live objects, not from log lines (`live_settings`): the attention calls that took torch's
varlen kernels or the per-sample sdpa fallback (learner/attention.py CALLS), the head's kernels, the optimizer's
`fused` flag, the parameters' dtype.

One process for the plan, not per variant: a process start (imports, CUDA context) costs ~15 s of a lease, and a
freed trainer leaves nothing behind that changes the next one's speed: what stays allocated is measured after each
variant is freed (`allocated_after_free_gib`) and at the next one's start (`allocated_at_start_gib`); past
LEAK_LIMIT_GIB the worker exits (LEAKED_EXIT) and the stage starts a new one for the rest, so a leak cannot turn the
later 7B-stack variants into a row of OOMs. torch.compile's caches are reset after a compile_layers or inductor
variant. The worker prints a result line when each variant starts and ends (a deadline or a crash keeps what was
measured); a variant that runs out of memory is recorded as `out_of_memory` (the budgets before it keep their
figures) and one that fails otherwise (a switch this checkout rejects) as `error`, and the next one runs; a broken
CUDA context ends the worker (exit 3) and the stage starts another for the rest.

Time split of the profiled step (`time_split`): device kernel time on a GPU (CPU self time on the CPU) under the
learner's `covrl/attention`, `covrl/head` and `covrl/optimizer` record_function ranges (and torch's
scaled_dot_product_attention op as attention wherever it runs), the rest as "body". A backward op counts where its
forward op ran (autograd's sequence number ties the two, as torch's own profiler does
for backward stack traces), so attention's backward kernels are attention's although the backward runs outside the
forward's range. A range this checkout does not have reads 0 and is missing from `labels_seen`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time

from hardware.proof_workers import _setting, _synthetic_groups, _timed_steps, emit, save_random_model

LABELS = ("covrl/attention", "covrl/head", "covrl/optimizer")
# torch's attention op counts as attention where no covrl/attention range is around it (the sdpa path of a checkout
# that labels only its own attention function), so the baseline's attention time is not hidden in the body.
ATTENTION_OPS = ("aten::scaled_dot_product_attention",)
BACKWARD_FUNCTION = 1  # torch's RecordScope of an autograd node's backward (e.g. "TanhBackward0")
EVALUATE = "autograd::engine::evaluate_function: "  # the engine's range around it, with the same numbers
CONTEXT_BROKEN_EXIT = 3  # the CUDA context is unusable after an error: the stage restarts a worker for the rest
LEAKED_EXIT = 5  # a freed variant left more than LEAK_LIMIT_GIB allocated: the stage restarts a worker for the rest
LEAK_LIMIT_GIB = 1.0
GROUP = 8  # samples per prompt group of the synthetic batch
OOM = "out_of_memory"  # a variant's status when it ran out of memory (a finding: the stage goes on)

# Seconds on one H100, estimated (never measured on a GPU yet: the first lease measures them, `seconds` and
# `model_build_s` in its record) from the H200 throughput stage's record (0.5B at 8192 tokens: 0.96 s a step) and
# the H100's cluster stages, with a margin: the worker's start (imports, CUDA context, the process group); each
# shape's random model built and saved once; one variant (trainer build, 1 warm-up + 2 timed steps per budget, one
# profiled step and its parse); what a variant pays the first time its shape runs a kernel it compiles (Triton's
# two head kernels, inductor's head graphs, torch.compile of the decoder layers); gradient checkpointing's recompute.
WORKER_START_S = 20.0
MODEL_BUILD_S = {"0.5b": 15.0, "7b-4l": 35.0}
VARIANT_S = {"0.5b": 20.0, "7b-4l": 50.0}
FIRST_USE_S = {"triton": 10.0, "inductor": 45.0, "compile": 60.0}
GC_FACTOR = 1.3


def run(spec: dict) -> int:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    import torch

    from common.config import load_config
    from learner.trainer import init_distributed, thread_setup

    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner-bench %(levelname)s %(name)s: %(message)s")
    cuda = spec["device"] == "cuda"
    thread_setup(load_config(None, []))
    torch.manual_seed(0)
    init_distributed()
    est = Estimates()
    for v in spec["plan"]:
        shape = v["shape"]
        sspec = {**spec, **spec["shapes"][shape]}
        need = est.need(shape, v["overrides"])
        if (why := over_budget(spec, need)) is not None:
            emit({"event": "not_run", "shape": shape, "variant": v["name"], "reason": why, "estimate_s": round(need)})
            continue
        if shape not in est.built:
            emit({"event": "model", "shape": shape, **ensure_model(sspec)})
        emit({"event": "start", "shape": shape, "variant": v["name"], "estimate_s": round(need)})
        t0 = time.perf_counter()
        try:
            out = run_variant(sspec, v, cuda)
        except torch.OutOfMemoryError as e:  # building the trainer, before any budget: a finding, the next one runs
            out = {"status": OOM, "error": f"OutOfMemoryError: {e}"[:600], "overrides": v["overrides"]}
        except Exception as e:  # recorded, and the next variant runs: this checkout may reject a switch
            import traceback

            traceback.print_exc()
            out = {"status": "error", "error": f"{type(e).__name__}: {e}"[:600]}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        out["estimate_s"] = round(need, 1)
        est.ran(shape, v["overrides"], out["seconds"], need)
        out.update(free(cuda, compiled=bool(v["overrides"].get("learner.compile_layers"))
                        or v["overrides"].get("learner.logprob_head") == "inductor"))
        emit({"event": "variant", "shape": shape, "variant": v["name"], **out})
        if out["status"] == "error" and cuda and not context_alive():
            print("learner-bench: the CUDA context is broken after this error; the stage starts a new worker for the "
                  "remaining variants", flush=True)
            return CONTEXT_BROKEN_EXIT
        if (out.get("allocated_after_free_gib") or 0.0) > LEAK_LIMIT_GIB:
            print(f"learner-bench: {out['allocated_after_free_gib']:.2f} GiB still allocated after freeing "
                  f"{v['name']} (limit {LEAK_LIMIT_GIB} GiB); the stage starts a new worker for the rest", flush=True)
            return LEAKED_EXIT
    return 0


class Estimates:
    """A plan's time as the worker judges it, item by item (and proof.py's first_lease_schedule, the same way): the
    shapes whose model is built, the compiles already paid for in this process, and the worst overrun so far, by
    which each later estimate is scaled."""

    def __init__(self):
        self.built: set[str] = set()
        self.paid: set[tuple[str, str]] = set()  # (shape, what it compiled)
        self.scale = 1.0

    def need(self, shape: str, over: dict) -> float:
        return estimate_s(shape, over, shape not in self.built, self.paid) * self.scale

    def ran(self, shape: str, over: dict, seconds: float | None = None, need: float | None = None) -> None:
        """An item ran (or, with no `seconds`, is planned to): its model is built, its compiles paid for."""
        self.built.add(shape)
        self.paid |= first_uses(shape, over)
        if seconds is not None and need:
            self.scale = max(self.scale, seconds / need)


def first_uses(shape: str, over: dict) -> set[tuple[str, str]]:
    """What a variant compiles that a later variant of its shape in the same process would not pay for again."""
    head = over.get("learner.logprob_head")
    return ({(shape, head)} if head in ("triton", "inductor") else set()) | (
        {(shape, "compile")} if over.get("learner.compile_layers") else set())


def estimate_s(shape: str, over: dict, build_model: bool, paid: set) -> float:
    """An item's seconds by the estimates above (unknown shapes as the larger): the variant, gradient
    checkpointing's recompute, the compiles it pays first, and its shape's model if not built yet."""
    need = VARIANT_S.get(shape, max(VARIANT_S.values()))
    if over.get("learner.gradient_checkpointing"):
        need *= GC_FACTOR
    need += sum(FIRST_USE_S[what] for s, what in first_uses(shape, over) - paid)
    if build_model:
        need += MODEL_BUILD_S.get(shape, max(MODEL_BUILD_S.values()))
    return need


def ensure_model(spec: dict) -> dict:
    """The shape's random-init model in spec["model"]: built and saved unless a complete one of this config is
    there (`built.json`, written last)."""
    marker = os.path.join(spec["model"], "built.json")
    try:
        with open(marker) as f:
            built = json.load(f)
        if built["config"] == spec["config"] and built["dtype"] == spec["dtype"]:
            return {**built, "built_now": False}
    except (OSError, ValueError, KeyError):
        pass
    t0 = time.perf_counter()
    n_params = save_random_model(spec["config"], spec["model"], spec["dtype"], spec["device"])
    built = {"config": spec["config"], "dtype": spec["dtype"], "n_params": n_params,
             "build_s": round(time.perf_counter() - t0, 1)}
    with open(marker + ".tmp", "w") as f:
        json.dump(built, f)
    os.replace(marker + ".tmp", marker)
    return {**built, "built_now": True}


def over_budget(spec: dict, need: float) -> str | None:
    """Why an item needing `need` seconds is not started (it would end past SPEC's deadline_unix), or None."""
    deadline = spec.get("deadline_unix")
    if deadline is None:
        return None
    left = deadline - time.time()
    if left >= need:
        return None
    return (f"the stage's time was spent ({left:.0f}s left, this variant needs about {need:.0f}s by its estimate): "
            f"run it with --learner-variants or a larger --learner-budget-s")


def run_variant(spec: dict, v: dict, cuda: bool) -> dict:
    """One variant: a Trainer with its overrides, every packing budget timed, one step profiled, the first step
    and the first micro-batch's hidden states for the agreement with the baseline."""
    import torch

    from common.config import load_config
    from learner import attention
    from learner.trainer import Trainer

    at_start = torch.cuda.memory_allocated() / 2**30 if cuda else None
    calls_before = dict(attention.CALLS)
    cfg = load_config(None, [
        f"model.path={json.dumps(spec['model'])}", f"model.dtype={json.dumps(spec['dtype'])}", "learner.zero_stage=1",
        "learner.log_entropy_delta=false", f"rollout.max_new_tokens={spec['response_tokens']}",
        f"rollout.group_size={GROUP}", f"rollout.groups_per_step={max(1, spec['samples'] // GROUP)}",
        *(f"{k}={json.dumps(x)}" for k, x in v["overrides"].items())])
    lines, trainer = LearnerLines(), None
    try:
        t0 = time.perf_counter()
        trainer = Trainer(cfg, spec["model"])
        build_s = time.perf_counter() - t0
        module = trainer.module
        mc = module.config
        n_params = sum(p.numel() for p in module.parameters())
        emb, head = module.get_input_embeddings().weight, module.get_output_embeddings().weight
        # Model FLOPs count matmuls: an untied input embedding is a lookup (the tied one counts once, as the head).
        n_flop = n_params - (emb.numel() if emb.data_ptr() != head.data_ptr() else 0)
        d_attn = mc.num_attention_heads * (getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        hidden = HiddenProbe(module)
        budgets, first = run_budgets(trainer, cfg, spec, v, cuda, hidden, n_flop,
                                     6 * mc.num_hidden_layers * d_attn)
        timed = [b for b in budgets if "error" not in b]
        out = {
            "status": "measured" if timed else OOM if budgets and "OutOfMemoryError" in budgets[-1]["error"]
            else "error", "overrides": v["overrides"], "learner_line": lines.last(),
            "live": live_settings(trainer, calls_before),
            "attn_implementation": mc._attn_implementation,
            "gradient_checkpointing": bool(getattr(module, "is_gradient_checkpointing", False)),
            "n_params": n_params, "n_flop_params": n_flop, "build_s": round(build_s, 1),
            "allocated_at_start_gib": at_start, "budgets": budgets, "first_step": first,
            "all_steps_applied": all(b["all_steps_applied"] for b in timed),
            **hidden_agreement(spec, v, hidden.first), **({} if timed else {"error": budgets[-1]["error"]}),
        }
    finally:
        lines.close()
        if trainer is not None:
            trainer.engine.destroy()  # its optimizer and buffers go now; the rest with this frame
    return out


def run_budgets(trainer, cfg, spec: dict, v: dict, cuda: bool, hidden, n_flop: int, attn_coef: int):
    """Every packing budget of one variant: its timed steps' figures (one step profiled at the last budget), or an
    out-of-memory error that ends the variant; (budgets, the first step's numbers for the agreement)."""
    import torch

    from broker.rules import GroupRules
    from learner.batch import batch_from_config

    groups = _synthetic_groups(spec, trainer.module.config.vocab_size, GROUP)
    budgets, first = [], None
    for i, budget in enumerate(spec["micro_batch_tokens"]):
        batch = batch_from_config(groups, GroupRules.of(cfg).rewards(groups), cfg, version=0, ranks=1,
                                  micro_batch_tokens=budget)
        lengths = [len(x.input_ids) // 4 for x in batch.samples]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            if v.get("inject") == "oom" and spec["device"] == "cpu":  # the rehearsal's test of this path
                raise torch.OutOfMemoryError(f"injected by the CPU rehearsal (--learner-inject-oom) at {budget}")
            steps = _timed_steps(trainer, batch, spec, budget, cuda, label=f"{v['name']}, ")
        except torch.OutOfMemoryError as e:  # a finding, not a failure: the smaller budgets stand
            budgets.append({"micro_batch_tokens": budget, "error": f"OutOfMemoryError: {e}"[:300], **memory(cuda)})
            print(f"{v['name']}, micro_batch_tokens {budget}: out of memory; this variant stops here", flush=True)
            break  # the engine's state after a failed backward is not worth timing
        if i == 0:
            first = {k: steps[0][k] for k in ("grad_norm", "logp_mean", "entropy", "pg_loss")}
            hidden.remove()
        attn_flops = sum(attn_coef * n * (n + 1) for n in lengths)
        setting = _setting(budget, batch, steps[spec["warmup"]:], n_flop, attn_flops, lengths)
        setting.update(memory(cuda))
        if spec.get("profile", True) and i == len(spec["micro_batch_tokens"]) - 1:
            setting["profile"] = profile_step(trainer, batch, cuda)
        budgets.append(setting)
    return budgets, first


def live_settings(trainer, calls_before: dict) -> dict:
    """What the variant ran, read from the live objects: the attention calls of this variant by path (torch's varlen
    kernels or the per-sample sdpa fallback; none for transformers' own sdpa), the head's kernels, the optimizer's
    `fused` flag (torch's AdamW under DeepSpeed's wrappers), the parameters' dtype, gradient checkpointing."""
    import torch

    from learner import attention

    module = trainer.module
    opt = trainer.engine.optimizer
    for _ in range(4):  # DeepSpeed's ZeRO optimizer wraps torch's; its bf16 wrapper may wrap that
        if isinstance(opt, torch.optim.Optimizer) or not hasattr(opt, "optimizer"):
            break
        opt = opt.optimizer
    head = module.lm_head.__dict__.get("covrl_head_kernels", "chunked")
    return {"attention_calls": {k: attention.CALLS[k] - calls_before.get(k, 0) for k in attention.CALLS},
            "head": head, "optimizer": type(opt).__name__,
            "fused_adamw": bool(getattr(opt, "defaults", {}).get("fused")),
            "param_dtype": str(next(module.parameters()).dtype).replace("torch.", ""),
            "gradient_checkpointing": bool(getattr(module, "is_gradient_checkpointing", False))}


class LearnerLines(logging.Handler):
    """The trainer's "learner: ZeRO-..." line: what DeepSpeed and transformers set up, not what was asked."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        logging.getLogger("covrl.trainer").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "learner: ZeRO-" in record.getMessage():
            self.lines.append(record.getMessage())

    def last(self) -> str:
        return self.lines[-1] if self.lines else ""

    def close(self) -> None:
        logging.getLogger("covrl.trainer").removeHandler(self)
        super().close()


class HiddenProbe:
    """The body's final hidden states of the first forward it sees (the first step's first micro-batch), fp32 on
    the host: compared with the baseline's, they check the attention path without the head."""

    def __init__(self, module):
        self.first = None
        self.handle = module.model.register_forward_hook(self._hook)

    def _hook(self, _module, _args, output):
        if self.first is None:
            h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            self.first = h.detach().float().cpu()

    def remove(self) -> None:
        self.handle.remove()


def hidden_agreement(spec: dict, v: dict, hidden) -> dict:
    """The first micro-batch's hidden states against the baseline's (saved by the baseline, so a restarted worker
    has them): relative L2 difference over the whole row and the largest one of a single token."""
    import torch

    path = os.path.join(spec["model"], f"hidden-{spec['baseline']}.pt")
    if hidden is None:
        return {"hidden_rel_diff": None, "hidden_note": "the body's forward hook saw nothing"}
    if v["name"] == spec["baseline"]:
        torch.save(hidden, path + ".tmp")
        os.replace(path + ".tmp", path)
        return {"hidden_rel_diff": 0.0, "hidden_max_token_rel_diff": 0.0}
    if not os.path.exists(path):
        return {"hidden_rel_diff": None, "hidden_note": f"no baseline ({spec['baseline']}) hidden states to compare"}
    ref = torch.load(path)
    if ref.shape != hidden.shape:
        return {"hidden_rel_diff": None, "hidden_note": f"shape {tuple(hidden.shape)} vs baseline {tuple(ref.shape)}"}
    diff = (hidden - ref).flatten(0, -2)  # [tokens, H]
    ref2 = ref.flatten(0, -2)
    per_token = diff.norm(dim=-1) / ref2.norm(dim=-1).clamp_min(1e-12)
    return {"hidden_rel_diff": float(diff.norm() / ref2.norm().clamp_min(1e-12)),
            "hidden_max_token_rel_diff": float(per_token.max())}


def memory(cuda: bool) -> dict:
    """Peak memory of the budget (reset at its start) on a GPU; the process's peak RSS on the CPU."""
    if cuda:
        import torch

        return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}
    import resource

    return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


def profile_step(trainer, batch, cuda: bool) -> dict:
    """One more train step under torch.profiler, split by `time_split`; its own train_s (the profiler slows it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        stats = trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    split = time_split(prof.events(), device=cuda)
    split.update(train_s=round(stats.train_s, 4), wall_s=round(step_s, 4), parse_s=round(time.perf_counter() - t1, 1),
                 grad_norm=stats.grad_norm)
    return split


def time_split(events, device: bool) -> dict:
    """Seconds of one profiled step under each `LABELS` range, the rest ("body") and the total: kernel time on the
    device (`device`), else CPU self time (`events`: a torch.profiler's `events()`)."""
    import torch

    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async),
                 key=lambda e: e.time_range.start)
    label = labeller(cpu)
    us = dict.fromkeys((*LABELS, "body"), 0.0)
    for e in cpu:
        # A range's own "kernel" entry on the device is its GPU span (gpu_user_annotation), not work: left out.
        t = sum(k.duration for k in e.kernels if k.name != e.name) if device else e.self_cpu_time_total
        if t:
            us[label(e)] += t
    out = {f"{name.split('/')[1]}_s": round(us[name] / 1e6, 4) for name in LABELS}
    out.update(body_s=round(us["body"] / 1e6, 4), total_s=round(sum(us.values()) / 1e6, 4),
               labels_seen=sorted({e.name for e in cpu if e.name in LABELS}),
               attention_ops_seen=sorted({e.name for e in cpu if e.name in ATTENTION_OPS}),
               clock="device kernel time" if device else "CPU self time")
    return out


def labeller(cpu: list):
    """label(event) -> the `LABELS` range it ran under, or "body", for the host events `cpu` (in start order). An
    op inside an autograd node's backward is labelled as that node's forward op was: the backward node carries the
    forward's (sequence_nr, thread), matched to the first op of that number outside any backward."""

    def backward_node(e) -> bool:
        return e.scope == BACKWARD_FUNCTION or e.name.startswith(EVALUATE)

    def in_backward(e) -> bool:
        while e is not None:
            if backward_node(e):
                return True
            e = e.cpu_parent
        return False

    forward: dict[tuple[int, int], object] = {}
    for e in cpu:
        if e.sequence_nr >= 0 and not in_backward(e):
            forward.setdefault((e.sequence_nr, e.thread), e)
    memo: dict[int, str] = {}

    def label(e) -> str:
        path, found = [], "body"
        while e is not None:
            if id(e) in memo:
                found = memo[id(e)]
                break
            path.append(e)
            if e.name in LABELS or e.name in ATTENTION_OPS:
                found = e.name if e.name in LABELS else LABELS[0]
                break
            if backward_node(e) and (f := forward.get((e.sequence_nr, e.fwd_thread))) is not None:
                found = label(f)
                break
            e = e.cpu_parent
        for p in path:  # every event on the way up runs under the same range
            memo[id(p)] = found
        return found

    return label


def free(cuda: bool, compiled: bool) -> dict:
    """Drop what the variant left (its trainer went with its frame), reset torch.compile's caches after a variant
    that compiled; on a GPU, what is still allocated then (`allocated_after_free_gib`)."""
    import torch

    gc.collect()
    if compiled:
        torch._dynamo.reset()  # the compiled layers' or head's caches: nothing of them reaches the next variant
    if not cuda:
        return {}
    torch.cuda.empty_cache()
    return {"allocated_after_free_gib": round(torch.cuda.memory_allocated() / 2**30, 3)}


def context_alive() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception as e:  # a sticky CUDA error (illegal address, ...): nothing more can run in this process
        print(f"learner-bench: CUDA context check failed: {type(e).__name__}: {e}", flush=True)
        return False
    return True


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m hardware.learner_bench SPEC_JSON (hardware/proof.py's learner stage writes it)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(run(json.loads(sys.argv[1])))
