"""The throughput workers of hardware/proof.py, each a child process (one CUDA context, freed when it exits):

    python -m hardware.proof_workers build-model|learner|gen|vllm-gen|vllm-smoke SPEC_JSON   (from the repo root)

`build-model` writes a random-init model of the shape SPEC names (offline), `learner` times `learner.trainer.Trainer`
train steps on synthetic batches (tokens/s and model FLOP/s per packing budget), `gen` times the torch engine's
generation and `vllm-gen` covrl's vLLM engine's. `vllm-smoke` proves the vLLM install itself, without covrl's engine:
its compiled ops (`_C`) load and compute, FA3 is there, an AsyncLLM builds, seeded sampling repeats, processed
logprobs come back, pause / collective_rpc / resume work. Each prints result lines, `RESULT_TAG` + JSON (the last
one is the result; `vllm-smoke` prints one after each phase, so a crash keeps what was proven), which
hardware/proof.py reads. Each runs as a process of its own so that its CUDA context is freed when it exits.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TAG = "GPU_PROOF_RESULT "  # the same tag as hardware/proof.py reads
BASE_MODEL = os.path.join(REPO, "assets", "arith-base")


def emit(obj: dict) -> None:
    print(RESULT_TAG + json.dumps(obj), flush=True)


def worker_build_model(spec: dict) -> int:
    emit({"n_params": save_random_model(spec["config"], spec["model"], spec["dtype"], spec["device"])})
    return 0


def save_random_model(config: dict, model_dir: str, dtype: str, device: str) -> int:
    """A random-init Qwen2 of `config` (seed 0) saved to `model_dir` in `dtype`, with assets/arith-base's tokenizer;
    its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**config, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    with dev:  # initialise on the GPU: a 0.5B init on the host takes minutes
        model = Qwen2ForCausalLM(cfg)
    model = model.to(getattr(torch, dtype)).to("cpu")  # saved from the host
    os.makedirs(model_dir, exist_ok=True)
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(BASE_MODEL, name), os.path.join(model_dir, name))
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return n_params


def worker_learner(spec: dict) -> int:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    import logging

    import torch
    import torch.distributed as dist

    from broker.rules import GroupRules
    from common.config import load_config
    from learner.batch import batch_from_config
    from learner.trainer import Trainer, init_distributed, thread_setup

    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner-tput %(levelname)s %(name)s: %(message)s")
    group = 8
    cfg = load_config(None, [f"model.path={json.dumps(spec['model'])}", f"model.dtype={json.dumps(spec['dtype'])}",
                             "learner.zero_stage=1",
                             "learner.log_entropy_delta=false", f"rollout.max_new_tokens={spec['response_tokens']}",
                             f"rollout.group_size={group}", f"rollout.groups_per_step={max(1, spec['samples'] // group)}"])
    thread_setup(cfg)
    torch.manual_seed(0)
    init_distributed()
    cuda = spec["device"] == "cuda"
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record)

    logging.getLogger("covrl.trainer").addHandler(Grab())
    trainer = Trainer(cfg, spec["model"])
    line = next((r.getMessage() for r in records if "learner: ZeRO-" in r.getMessage()), "")
    mc = trainer.module.config
    n_params = sum(p.numel() for p in trainer.module.parameters())
    groups = _synthetic_groups(spec, mc.vocab_size, group)
    d_attn = mc.num_attention_heads * mc.head_dim if getattr(mc, "head_dim", None) else mc.hidden_size
    settings = []
    for budget in spec["micro_batch_tokens"]:  # the same trainer and samples, packed into rows of <= budget tokens
        rewards = GroupRules.of(cfg).rewards(groups)  # shaped as the hub hands them to learner rank 0
        batch = batch_from_config(groups, rewards, cfg, version=0, ranks=1, micro_batch_tokens=budget)
        lengths = [len(x.input_ids) // 4 for x in batch.samples]
        attn_flops = sum(6 * mc.num_hidden_layers * d_attn * n * (n + 1) for n in lengths)
        timed = _timed_steps(trainer, batch, spec, budget, cuda)[spec["warmup"]:]
        settings.append(_setting(budget, batch, timed, n_params, attn_flops, lengths))
    best = max(settings, key=lambda x: x["tokens_per_s"])
    out = {
        **best, "device": str(trainer.device), "learner_line": line, "n_params": n_params, "samples": len(groups) * group,
        "prompt_tokens": spec["prompt_tokens"], "response_tokens": spec["response_tokens"],
        "warmup_steps": spec["warmup"], "timed_steps": spec["timed"],
        "attn_implementation": mc._attn_implementation, "settings": settings,
        "all_steps_applied": all(x["all_steps_applied"] for x in settings),
    }
    out.update(_peak_memory(cuda))
    emit(out)
    dist.destroy_process_group()
    return 0


def _synthetic_groups(spec: dict, vocab: int, group: int) -> list:
    """spec["samples"] random responses in groups of `group`, rewards alternating 0 and 1, with logprobs about a
    random model's own, so the importance weights stay near 1."""
    import numpy as np

    from common import messages

    rng = np.random.default_rng(0)
    prompt_len, resp_len = spec["prompt_tokens"], spec["response_tokens"]
    groups = []
    for g in range(max(1, spec["samples"] // group)):
        prompt = rng.integers(1, vocab, prompt_len)
        samples = [messages.Sample(
            token_ids=messages.to_bytes(rng.integers(1, vocab, resp_len), messages.TOKEN_DTYPE),
            logprobs=messages.to_bytes(-math.log(vocab) + 0.01 * rng.standard_normal(resp_len), messages.LOGPROB_DTYPE),
            versions=messages.to_bytes(np.zeros(resp_len), messages.VERSION_DTYPE), reward=float(j % 2),
            finish_reason="length", score_status="ok") for j in range(group)]
        groups.append(messages.RolloutGroup(gen_id=0, incarnation="tput", ticket=g, prompt_id=g, epoch=0,
                                            prompt_ids=messages.to_bytes(prompt, messages.TOKEN_DTYPE),
                                            samples=samples, gen_time_s=0.0))
    return groups


def _timed_steps(trainer, batch, spec: dict, budget: int, cuda: bool, label: str = "") -> list[dict]:
    """Warm-up then timed train steps on one batch: each step's train and wall seconds, grad norm, tokens, and the
    step's mean log pi(target), entropy and policy loss over its response tokens."""
    import torch

    from learner.trainer import SUM_KEYS, step_metrics

    steps = []
    for i in range(spec["warmup"] + spec["timed"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        m, sums = step_metrics(stats), stats.totals()
        steps.append({"train_s": stats.train_s, "wall_s": wall, "grad_norm": m["actor/grad_norm"],
                      "tokens": float(stats.sums[SUM_KEYS.index("seq_tokens")]), "skipped": any(stats.skipped),
                      "logp_mean": sums["logp"] / max(sums["tokens"], 1.0), "entropy": m["actor/entropy"],
                      "pg_loss": m["actor/pg_loss"]})
        print(f"{label}micro_batch_tokens {budget}, step {i + 1}{' (warm-up)' if i < spec['warmup'] else ''}: "
              f"{stats.train_s:.3f}s train, {m['perf/learner_tokens_per_s']:.0f} tokens/s, grad norm "
              f"{m['actor/grad_norm']:.4g}", flush=True)
    return steps


def _setting(budget: int, batch, timed: list[dict], n_params: int, attn_flops: int, lengths: list[int]) -> dict:
    """One packing budget's figures over its timed steps: tokens/s and model FLOP/s."""
    tokens = sum(x["tokens"] for x in timed)
    train_s = sum(x["train_s"] for x in timed)
    flops = 6 * n_params * tokens + attn_flops * len(timed)
    resp_tokens = sum(len(x.versions) // 4 for x in batch.samples) * len(timed)
    return {
        "micro_batch_tokens": budget, "micro_batches": len(batch.plan[0][0]), "tokens_per_step": sum(lengths),
        "train_s_per_step": [round(x["train_s"], 4) for x in timed],
        "wall_s_per_step": [round(x["wall_s"], 4) for x in timed],
        "tokens_per_s": tokens / train_s, "response_tokens_per_s": resp_tokens / train_s,
        "model_flops_per_step": flops / len(timed), "attention_flops_per_step": attn_flops,
        "model_flops_per_s": flops / train_s, "grad_norms": [x["grad_norm"] for x in timed],
        "all_steps_applied": all(not x["skipped"] and math.isfinite(x["grad_norm"]) for x in timed),
    }


def _peak_memory(cuda: bool) -> dict:
    if cuda:
        import torch

        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def model_vocab(spec: dict) -> int:
    with open(os.path.join(spec["model"], "config.json")) as f:
        return json.load(f)["vocab_size"]


def gen_prompts(spec: dict, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab - 1, spec["prompt_tokens"]).tolist() for _ in range(spec["prompts"])]


def timed_generation(engine, spec: dict, vocab: int, cuda: bool) -> dict:
    """Warm up, then time one generate of SPEC's prompts x samples x new tokens: the figures `gen` and `vllm-gen`
    both report, on the same prompts. `cuda`: this process runs the kernels (the torch engine), so the clock waits
    for the device and the peak memory is this process's; vLLM's workers are other processes, and its generate
    returns only when they are done."""
    import torch

    from common.messages import SamplingParams

    prompts, seeds = gen_prompts(spec, vocab), list(range(spec["prompts"]))
    engine.generate(prompts[:2], 2, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8), seeds[:2])  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    groups = engine.generate(prompts, spec["samples"], SamplingParams(temperature=1.0, top_p=1.0,
                                                                      max_new_tokens=spec["new_tokens"]), seeds)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    comps = [c for g in groups for c in g]
    tokens = sum(len(c.token_ids) for c in comps)
    out = {"prompts": spec["prompts"], "samples": spec["samples"], "new_tokens": spec["new_tokens"],
           "prompt_tokens": spec["prompt_tokens"], "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "stopped": sum(c.finish_reason == "stop" for c in comps), "stop_id": vocab - 1}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def worker_gen(spec: dict) -> int:
    import torch

    from actors.engine import TorchEngine

    vocab = model_vocab(spec)
    stop = vocab - 1  # a random model samples any one id with probability ~1/vocab per step
    engine = TorchEngine(spec["model"], eos_token_id=[stop], pad_token_id=0, dtype=getattr(torch, spec["dtype"]),
                         device=spec["device"])
    emit({"engine": type(engine).__name__, "param_device": str(next(engine.model.parameters()).device),
          **timed_generation(engine, spec, vocab, spec["device"] == "cuda")})
    return 0


def worker_vllm_gen(spec: dict) -> int:
    """covrl's VllmEngine on the throughput model: the same prompts and counts as `gen`, so the two compare. Its
    weights live in vLLM's worker processes, so no parameter device is reported here (vllm-kit shows vLLM on CUDA)."""
    import torch

    from actors.vllm_engine import VllmEngine, VllmSettings

    vocab = model_vocab(spec)
    t0 = time.perf_counter()
    engine = VllmEngine(spec["model"], stop_ids=[vocab - 1], settings=VllmSettings(
        dtype=spec["dtype"], gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5),
        enforce_eager=spec.get("enforce_eager", True), max_model_len=spec["prompt_tokens"] + spec["new_tokens"] + 8))
    build_s = time.perf_counter() - t0
    try:
        emit({"engine": f"vLLM {engine.api.version}", "build_s": build_s, "enforce_eager": engine.settings.enforce_eager,
              "torch": torch.__version__, **timed_generation(engine, spec, vocab, cuda=False)})
    finally:
        engine.close()
    return 0


def smoke_ops(out: dict) -> None:
    """vLLM's compiled ops load (the kit's pruned `_C`) and one computes what it should; FA3 is importable."""
    import importlib

    import torch

    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(256, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    got = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    try:  # what a pruned fatbin could break: the library's load, or (CUDA loads modules lazily) its first launch
        import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C*)

        torch.ops._C.rms_norm(got, x, w, 1e-6)
        torch.cuda.synchronize()
    except BaseException as e:  # say it and stop: the proof then asks for the fallback kit
        out["c_loaded"], out["c_error"] = False, f"{type(e).__name__}: {e}"[:500]
        emit(out)
        raise SystemExit(3)
    out["c_loaded"] = True
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    out["rms_norm_rel_err"] = float((got.double() - ref).norm() / ref.norm())
    out["rms_norm_all_written"] = bool(torch.isfinite(got).all())
    fa = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")
    out["fa3"], out["fa2"] = bool(getattr(fa, "FA3_AVAILABLE", False)), bool(getattr(fa, "FA2_AVAILABLE", False))
    out["fa3_error"] = getattr(fa, "FA3_UNAVAILABLE_REASON", None)
    out["ops_s"] = round(time.perf_counter() - t0, 1)
    emit(out)


async def smoke_engine(out: dict, spec: dict) -> None:
    import vllm
    from transformers import AutoTokenizer
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    model = spec.get("model", BASE_MODEL)
    ids = AutoTokenizer.from_pretrained(model)("12+34=")["input_ids"]
    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(
        model=model, tokenizer=model, dtype="bfloat16", seed=0, gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        max_model_len=256, enforce_eager=spec.get("enforce_eager", True), logprobs_mode="processed_logprobs",
        generation_config="vllm", enable_prefix_caching=True, disable_log_stats=True))
    out["build_s"] = round(time.perf_counter() - t0, 1)
    emit(out)

    async def sample(rid: str, seed: int):
        sp = vllm.SamplingParams(n=4, temperature=0.7, top_p=0.95, max_tokens=32, logprobs=0, detokenize=False,
                                 flat_logprobs=True, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for o in llm.generate({"prompt_token_ids": ids}, sp, rid):
            final = o
        return [(list(c.token_ids), list(c.logprobs.logprobs)) for c in sorted(final.outputs, key=lambda c: c.index)]

    try:
        a, b, c = await asyncio.gather(sample("a", 7 << 16), sample("b", 7 << 16), sample("c", 9 << 16))
        out["seeded_repeat_equal"] = [t for t, _ in a] == [t for t, _ in b]
        out["other_seed_differs"] = [t for t, _ in a] != [t for t, _ in c]
        lps = [x for _, lp in a for x in lp]
        out["logprobs_per_token"] = all(len(t) == len(lp) for t, lp in a)
        out["logprobs_valid"] = bool(lps) and all(math.isfinite(x) and x <= 0 for x in lps)
        out["tokens_sampled"] = sum(len(t) for t, _ in a)
        await llm.pause_generation(mode="keep", clear_cache=True)
        out["collective_rpc"] = repr(await llm.collective_rpc("check_health"))[:80]
        await llm.resume_generation()
        out["after_resume_tokens"] = len((await sample("d", 1 << 16))[0][0])
    finally:
        llm.shutdown()


def worker_vllm_smoke(spec: dict) -> int:
    from actors.vllm_engine import use_spawn

    use_spawn()  # spawn, and FlashInfer's sampler off where FlashInfer is not installed (as covrl's engine does)
    import torch
    import vllm

    out = {"vllm": vllm.__version__, "vllm_file": vllm.__file__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0)}
    smoke_ops(out)
    asyncio.run(smoke_engine(out, spec))
    emit(out)
    return 0


WORKERS = {"build-model": worker_build_model, "learner": worker_learner, "gen": worker_gen,
           "vllm-gen": worker_vllm_gen, "vllm-smoke": worker_vllm_smoke}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in WORKERS:
        print(f"usage: python -m hardware.proof_workers {{{','.join(sorted(WORKERS))}}} SPEC_JSON", file=sys.stderr)
        return 2
    return WORKERS[argv[0]](json.loads(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
