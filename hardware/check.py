"""GPU self-check: one vLLM generator and one learner, weights across, logprobs compared.

    covrl gpu-check [--model DIR] [--transport auto|rpc|nccl] [--prompts 16] [--n 4]

- This process perturbs every weight of the model (version 1 must differ from the checkpoint the generator
  starts from) and saves version 1 beside the check's logs.
- The learner role (`python -m hardware.check_learner`, a subprocess on GPU 0, the weight store's master) publishes
  version 1 through the learner's own publish path (`learner/publisher.py`): over the generator's gloo weight
  channel then RPC into the vLLM workers (`rpc`: learner and generator share GPU 0; NCCL cannot put two ranks on
  one GPU), or by NCCL broadcast straight into the workers (`nccl`: the generator on GPU 1; `auto` picks it
  when two GPUs are visible).
- The generator (`python -m actors.vllm_engine --check`, a subprocess) loads version 1, fingerprints
  `model.norm.weight` inside every vLLM worker, samples n responses per prompt at temperature 0.7, and
  reports tokens, behaviour logprobs and per-token versions.
- This process asserts: the weights arrived (the same fingerprint on both sides, after rounding to the
  generator's dtype), every token is stamped version 1, and behaviour logprobs agree with the learner's
  recomputation at staleness 0 (mean |dlogp| under --max-dlogp; the recomputation uses version 1 rounded to the
  generator's dtype, so what remains is bf16 arithmetic). It also prints the gap to untempered logprobs,
  which is what vLLM's default logprobs_mode would have reported. Then tokens/s and weight-sync time.

Default model: the built-in `assets/arith-base` (Qwen2 architecture, 1 M parameters): nothing is downloaded.
Exit 0 when every check passes, 1 when one fails, 2 (one line) without CUDA or vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from common import vllm_weights
from common.transport import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_MODEL = os.path.join(REPO, "assets", "arith-base")
CHANNEL = "gpu_check"  # the generator's incarnation: its pair channel is weights.pair_prefix(0, CHANNEL)


def preflight() -> str | None:
    """None when this machine can run the check, else the one line that says why not and what to do."""
    try:
        import torch
    except ImportError:
        return "gpu_check: torch is not installed; install the project with its gpu extra"
    if not torch.cuda.is_available():
        return ("gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a machine with an NVIDIA "
                "GPU and a CUDA build of torch (the gpu extra: vllm==0.33.0 pins torch 2.14.0)")
    if importlib.util.find_spec("vllm") is None:
        return "gpu_check: vllm is not importable: pip install vllm==0.33.0 (the gpu extra) in this environment"
    return None


def physical_ids() -> list[str]:
    """CUDA device ids as the parent sees them, so a child's CUDA_VISIBLE_DEVICES names the same GPUs."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else []
    return ids or [str(i) for i in range(torch.cuda.device_count())]


def arith_prompts(tokenizer, count: int) -> list[list[int]]:
    from common.arith import ArithTask
    from common.templates import render_prompt

    problems = ArithTask(seed=0, train_size=64, eval_size=max(count, 8)).eval_sets()["arith_easy"][:count]
    return [tokenizer(render_prompt(p.question), add_special_tokens=False)["input_ids"] for p in problems]


def perturbed(model, seed: int = 1, scale: float = 0.02) -> None:
    """Version 1: every parameter moved by `scale` of its own std (deterministic noise)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.device)
            p.add_(noise * scale * (p.float().std() if p.numel() > 1 else 1.0))


def learner_logprobs(model, prompts, tokens, n: int, temperature: float):
    """(tempered, untempered) logprobs of each response's tokens under the learner's weights; fp32."""
    import torch

    tempered, raw = [], []
    with torch.no_grad():
        for i, toks in enumerate(tokens):
            prompt = prompts[i // n]
            ids = torch.tensor([prompt + toks], device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(toks)].float()
            target = torch.tensor(toks, device=ids.device)[:, None]
            tempered.append(torch.log_softmax(logits / temperature, -1).gather(-1, target)[:, 0].cpu())
            raw.append(torch.log_softmax(logits, -1).gather(-1, target)[:, 0].cpu())
    return tempered, raw


def wait_roles(procs: dict, timeout_s: float) -> str | None:
    """Wait for every role process to exit: None when all exit 0, else the name of the first that fails (or is
    still running at `timeout_s`); the caller kills the others."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {name: proc.poll() for name, proc in procs.items()}
        failed = [name for name, code in codes.items() if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes.values()):
            return None
        time.sleep(0.5)
    return next((name for name, proc in procs.items() if proc.poll() is None), None)


def devices_for(transport: str, tp: int) -> tuple[str, list[str], str]:
    """(the transport `auto` resolves to, the visible GPU ids, the generator's CUDA_VISIBLE_DEVICES): NCCL puts
    the generator after the learner's GPU, rpc on the same first GPUs."""
    ids = physical_ids()
    if transport == "auto":
        transport = "nccl" if len(ids) >= 1 + tp else "rpc"
    if transport == "nccl" and len(ids) < 1 + tp:
        raise SystemExit(f"gpu_check: --transport nccl with --tp {tp} needs {1 + tp} visible GPUs (NCCL puts each rank "
                         f"on its own GPU) and {len(ids)} are visible; lower --tp or use --transport rpc")
    if transport == "rpc" and len(ids) < tp:
        raise SystemExit(f"gpu_check: --tp {tp} needs {tp} visible GPUs and {len(ids)} are visible")
    return transport, ids, ",".join(ids[1:1 + tp] if transport == "nccl" else ids[:tp])


def run_roles(roles: dict, env: dict, timeout_s: float, outputs: dict[str, str]) -> None:
    """Start each role (name -> (argv, its GPUs, its log)) in order and wait for all; the ones still running at
    the end are killed. SystemExit with the failed role's log tail when one fails or leaves no output file."""
    procs = {}
    try:
        for name, (cmd, devices, path) in roles.items():
            with open(path, "wb") as logf:
                procs[name] = subprocess.Popen(cmd, cwd=REPO, env={**env, "CUDA_VISIBLE_DEVICES": devices},
                                               stdout=logf, stderr=subprocess.STDOUT)
        failed = wait_roles(procs, timeout_s)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed is None and all(os.path.isfile(path) for path in outputs.values()):
        return
    name = failed or next(name for name, path in outputs.items() if not os.path.isfile(path))
    path = roles[name][2]
    with open(path, errors="replace") as f:
        tail = "".join(f.readlines()[-30:])
    raise SystemExit(f"gpu_check: the {name} exited with {procs[name].returncode}; its log ({path}) ends:\n{tail}")


def compare_logprobs(model, wdtype, prompt_ids, got: dict, n: int, temperature: float):
    """(the learner's fingerprint, mean |dlogp| tempered and untempered, tokens): the learner's weights rounded as
    the generator holds them, so what is left of |dlogp| is arithmetic."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(wdtype).float())
    expect_fp = vllm_weights.fingerprint(dict(model.named_parameters())[vllm_weights.FINGERPRINT_PARAM], wdtype)
    tempered, raw = learner_logprobs(model, prompt_ids, got["tokens"], n, temperature)
    behav = [torch.tensor(lp) for lp in got["logprobs"]]
    tokens = sum(len(t) for t in got["tokens"])
    dlogp = float(sum((b - t).abs().sum() for b, t in zip(behav, tempered)) / max(tokens, 1))
    draw = float(sum((b - r).abs().sum() for b, r in zip(behav, raw)) / max(tokens, 1))
    return expect_fp, dlogp, draw, tokens


def run(model_dir: str, transport: str, *, prompts: int = 16, n: int = 4, temperature: float = 0.7,
        max_new_tokens: int = 64, dtype: str = "bfloat16", timeout_s: float = 900,
        nccl_impl: str = "native", gpu_memory_utilization: float = 0.4, tp: int = 1) -> dict:
    """Run the check; returns the measurements (`checks` holds name -> (passed, detail))."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transport, ids, gen_device = devices_for(transport, tp)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = arith_prompts(tokenizer, prompts)
    wdtype = vllm_weights.torch_dtype(dtype)

    work = tempfile.mkdtemp(prefix="gpu_check_")
    job, out, log, sync, learner_log = (os.path.join(work, f) for f in (
        "job.json", "out.json", "generator.log", "learner.json", "learner.log"))
    # Version 1, on the host: the learner role publishes this directory, and its logprobs are recomputed from it.
    version1 = os.path.join(work, "version1")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    perturbed(model)
    model.save_pretrained(version1)
    del model
    max_len = max(len(p) for p in prompt_ids) + max_new_tokens + 8
    with open(job, "w") as f:
        json.dump({"prompts": prompt_ids, "n": n, "temperature": temperature, "top_p": 1.0,
                   "max_new_tokens": max_new_tokens, "dtype": dtype, "max_model_len": max_len}, f)
    port = free_port()
    learner_argv = [sys.executable, "-m", "hardware.check_learner", "--model", version1, "--weights", f"127.0.0.1:{port}",
                    "--out", sync, "--until", out, "--incarnation", CHANNEL, "--timeout-s", str(timeout_s)]
    argv = [sys.executable, "-m", "actors.vllm_engine", "--check", "--model", model_dir, "--weights", f"127.0.0.1:{port}",
            "--incarnation", CHANNEL, "--transport", transport, "--job", job, "--out", out,
            "--gpu-memory-utilization", str(gpu_memory_utilization)]
    if nccl_impl == "extension":
        argv.append("--nccl-extension")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # The learner on the first GPU (the store master: started first), the generator beside it or after it.
    run_roles({"learner": (learner_argv, ids[0], learner_log), "generator": (argv, gen_device, log)}, env, timeout_s,
              {"generator": out, "learner": sync})
    with open(out) as f:
        got = json.load(f)
    with open(sync) as f:
        published = json.load(f)
    sync_s, sent = published["weight_sync_s"], published["bytes_sent"]
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(version1, dtype=torch.float32).cuda().eval()
    expect_fp, dlogp, draw, tokens = compare_logprobs(model, wdtype, prompt_ids, got, n, temperature)
    versions = {v for vs in got["versions"] for v in vs}
    return {
        "transport": transport + ("" if transport == "rpc" else f" ({nccl_impl})") + f", tp {tp}",
        "tokens": tokens, "tokens_per_s": tokens / max(got["gen_s"], 1e-9),
        "weight_sync_s": sync_s, "generator_load_s": got["load_s"], "bytes_sent": sent,
        "fingerprint": {"learner": expect_fp, "generator": got["fingerprint"]},
        "mean_abs_dlogp": dlogp, "mean_abs_dlogp_untempered": draw, "versions": sorted(versions),
        "log": log,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="covrl gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="local Hugging Face model directory (default: built-in arith-base)")
    ap.add_argument("--transport", choices=("auto", "rpc", "nccl"), default="auto")
    ap.add_argument("--nccl-impl", choices=("native", "extension"), default="native",
                    help="NCCL receiver: vLLM's weight-transfer API, or covrl's worker extension (older vLLM)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs of the generator (after the learner's with nccl)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--max-dlogp", type=float, default=0.05, help="largest mean |behaviour - learner logprob| accepted")
    ap.add_argument("--timeout-s", type=float, default=900)
    args = ap.parse_args(argv)
    problem = preflight()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    r = run(args.model, args.transport, prompts=args.prompts, n=args.n, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, dtype=args.dtype, timeout_s=args.timeout_s, nccl_impl=args.nccl_impl,
            tp=args.tp)
    fp = r["fingerprint"]
    checks = {
        "weights arrive": (all(g == fp["learner"] for g in fp["generator"]),
                           f"fingerprint of {vllm_weights.FINGERPRINT_PARAM}: learner {fp['learner']!r}, vLLM workers {fp['generator']!r}"),
        "versions stamped": (r["versions"] == [1], f"token versions {r['versions']} (expected [1])"),
        "logprobs agree": (r["mean_abs_dlogp"] <= args.max_dlogp,
                           f"mean |dlogp| at staleness 0: {r['mean_abs_dlogp']:.5f} over {r['tokens']} tokens "
                           f"(limit {args.max_dlogp}; vs untempered logprobs: {r['mean_abs_dlogp_untempered']:.4f})"),
    }
    for name, (ok, detail) in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    # The first publish of a run: with nccl it includes building the generator's NCCL group.
    print(f"transport {r['transport']}: weight sync {r['weight_sync_s'] * 1e3:.1f} ms learner side "
          f"({r['bytes_sent'] / 2**20:.1f} MiB of fp32 parameters), {r['generator_load_s'] * 1e3:.1f} ms generator side")
    print(f"generation: {r['tokens']} tokens at {r['tokens_per_s']:.0f} tokens/s; total {time.perf_counter() - t0:.0f}s; "
          f"generator log {r['log']}")
    return 0 if all(ok for ok, _ in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
