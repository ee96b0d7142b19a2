"""GPU proof: one command that shows, on a machine with one NVIDIA GPU, that covrl's GPU path works end to end,
and measures it.

    python3 -m hardware.proof [--out DIR] [--work DIR] [--stages learner,vllm-kit,...,vllm-z3] [--rehearse-cpu]
                              [--deadline-s S] [--learner-variants V,...] [--learner-shapes S[:B+B],...]
    python3 -m hardware.proof --record DIR/gpu_proof.json [MORE.json ...]   # into tests/bench/results.json

Run it from the repository root: a GPU machine without covrl installed finds the packages there (`-m` puts the
current directory on sys.path); with covrl installed, `covrl gpu-proof` is the same command. Every child process
(the GPU tests, the cluster runs, the throughput workers) gets the repository root on PYTHONPATH.

Everything a stage needs is checked first (CUDA, the packages, the colocated placement, the engine's device
argument); a missing piece is one line on stderr and exit 2, before anything runs. Then the stages, in the
order given (default: the order of value, learner, vllm-kit, generation, vllm-tests, vllm-run, tests, z1,
throughput, z3, vllm-z3, so a time limit cuts the ZeRO-3 repeats first), each timed, each with its log in `--out`
(`<stage>.log`):

  learner     Today's learner path and the new one side by side, in one command (workers: hardware/learner_bench.py,
              one process per shape). Variants (`--learner-variants`, ATTN-HEAD[-compile][-gc]; default
              sdpa-chunked (the baseline: today's path), varlen-fused (the new path: torch's FlashAttention-2 varlen
              kernels over packed rows + the fused logprob head), varlen-chunked, sdpa-fused, varlen-fused-gc,
              sdpa-chunked-gc, varlen-fused-compile), each a real `Trainer` on one rank (ZeRO-1, bf16; fp32 in the
              rehearsal) built with those learner overrides from the same random-init weights. Shapes
              (`--learner-shapes`): 0.5b (Qwen2.5-0.5B, 64 x (64 + 512) tokens at micro_batch_tokens 8192) and
              7b-4l (Qwen2.5-7B's layers, heads and untied 152k head, 4 layers; 48 x (64 + 960) tokens at 8192 and
              20480). Per variant and budget: 1 warm-up + 2 timed steps (`--learner-steps`): tokens/s, MFU (the
              throughput convention, N = the parameters in matmuls), the speed-up over the baseline of this command,
              peak memory (reset per budget) beside common/memplan.py's prediction for the same config (learner_gpu,
              one rank: peak_over_plan, within 15 % or a finding, recorded, not a check), every grad norm finite;
              one more step under torch.profiler, split into
              device time under covrl/attention (and torch's sdpa op, where no range is around it), covrl/head,
              covrl/optimizer and the rest (a backward op counted where its forward ran; a range the code lacks
              reads 0); and the first step's agreement with the baseline (grad norm, mean logp, entropy, and the
              first micro-batch's hidden states; over 3 % (hidden 5 %) in bf16 it is flagged and fails a check).
              Each variant's figures go into gpu_proof.json as it ends (an OOM at a budget keeps the smaller
              budgets' figures); a variant the
              code rejects records its error and the next runs; `--learner-budget-s` (300) bounds the stage: each
              shape gets an equal share of what is left and starts no variant that would not fit (recorded as not
              run). Rehearsal: tiny shapes; varlen and compile variants are recorded as skipped, with the reason.
  vllm-kit    vLLM itself, without covrl's engine (a child process, hardware/proof_workers.py vllm-smoke): its
              compiled ops load (`vllm._C_stable_libtorch`, in the kit pruned to sm_90) and `_C.rms_norm` matches a
              float64 reference; FlashAttention 3 is importable; an AsyncLLM builds on assets/arith-base; two
              requests with one seed give the same samples, another seed others; processed logprobs, one per token;
              pause(keep) / collective_rpc / resume, then generation again. If `_C` does not load, the proof stops
              within a minute with exit 3 and says to carry the fallback kit (PTX kept) instead; if vLLM does not
              import at all, the vLLM stages are not run and the torch stages go on.
  generation  covrl's generator loop beside bare vLLM, in one command (worker: hardware/gen_bench.py, one process) on
              a random-init model of Qwen2.5-0.5B's shape (built as for throughput). ONE AsyncLLM (covrl's
              VllmEngine, eager) serves every variant, its prefix cache reset before each run: tokens/s of `bare`
              (AsyncLLM alone, every group submitted at once, the fewest parameters: the bound), `bare-covrl-params`
              (the same with covrl's exact sampling parameters: logprobs=0 processed, seeds, stop ids, FINAL_ONLY,
              detokenize off; the goal's reference), `engine` (covrl's engine submit / collect as ActorLoop drives it,
              no hub, no scoring) and `loop` (the real run_actor against a real Hub and WeightPublisher in the
              worker, scoring included; timed from the hub's first Work to the last group back), each on a
              heavy-tailed workload (lognormal lengths, longest >= 5x the mean: a check) and a fixed-length one, the
              same prompts and seeds (the hub's) in every variant; vLLM gets each group's drawn length as max_tokens =
              min_tokens (it cannot draw one per sample; the torch engine does). Then one publish of the model's
              weights per transport, timed by phase (learner assembly, the learner's publish, the generator's
              receive and load, end to end; checksums and the loaded fingerprint compared): rpc; ipc where this
              checkout accepts it (else recorded as not built); nccl recorded as not run (two GPUs). Then the same
              variants on a second engine with CUDA graphs, built last. Every run, build and publish is recorded as
              it ends; `--gen-budget-s` (480) bounds the stage (what would not fit is recorded as not run). Goals
              recorded beside the figures, not checks: loop >= 0.9 x bare-covrl-params on the heavy workload; a
              publish <= 0.2 s, per transport. Checks: the engines built, no run failed, every variant of a workload
              did the same work, the loop's groups all back, the publish's checksums and fingerprint equal. Each
              engine's KV cache in tokens (vLLM's num_gpu_blocks x block_size, else its "GPU KV cache size" log line)
              beside common/memplan.py's prediction for the same config and GPU memory (kv_tokens_over_plan, within
              15 % or a finding, recorded, not a check). Rehearsal:
              the torch engine (StreamingTorchEngine) stands in for vLLM; the bare variants and the CUDA-graph engine
              are recorded as skipped, with the reason, and the torch engine driven alone is the loop's reference; the
              KV plan is recorded for a nominal 80 GiB GPU, with nothing measured beside it.
  vllm-tests  `pytest -m gpu tests/gpu/test_vllm_engine.py`: covrl's VllmEngine on the GPU (stops, logprobs of the
              tempered distribution, seeds, an rpc update, a finish-mode update with 64 sequences in flight whose
              every token scores under the version it is labelled with, keep mode or its refusal on 0.26, and
              hardware/check.py's learner + generator roles over the rpc weight channel).
  vllm-run    A colocated 1-GPU cluster run with the vLLM generator (rpc weights, gpu_memory_utilization 0.3, eager)
              and the bf16 DeepSpeed learner (ZeRO-1) on assets/arith-base: 12 steps on-policy
              (rollout.max_staleness_steps = 0) at temperature 0.7. The z1 checks (checksums equal on both sides
              after every publish, every version received, the checkpoint, the device lines), staleness 0, and at
              most 1 % of tokens with pi_prox / pi_behav over the importance cap; the mean ratio within 1 +- 0.05
              is an implementation check only (its expectation is 1 for any two policies: the agreement itself is
              vllm-tests'). (CPU rehearsal: the torch engine, as vLLM needs a GPU.)
  tests       `pytest -q -m gpu tests/gpu --ignore tests/gpu/test_vllm_engine.py -p no:cacheprovider -rs` with a
              JUnit report: passed / failed / skipped counts and every skip's reason (the NCCL ones skip without 2
              GPUs). Passes when nothing failed or errored; all-skipped counts as passed.
  z1          A colocated 1-GPU cluster run (one learner rank and one torch-engine generator share GPU 0) on the
              built-in model `assets/arith-base`, bf16, DeepSpeed ZeRO-1: 24 steps, a checkpoint every 12, no
              evaluation. Checks: exit code 0; metrics.jsonl holds steps 1..24 once each; for every version the
              generator received, the checksum it logged (RUN_DIR/generators/gen0.jsonl) equals the learner's
              `weights/checksum` of that step, exactly, and every version 1..24 was received; a complete
              checkpoint of step 24 exists (common/checkpoint_dirs.py); logs/learner0.log's "learner: ZeRO-" line
              names ZeRO-1, bf16 True and a cuda device. Then interrupt and resume: a fresh run to 12 steps
              (checkpoint every 6), then `cluster.py --resume RUN --steps 24 --gpus 1`: it must resume from
              step 12 and end at 24 with steps 1..24 once each, and the resumed generator's checksums (version 12
              again, then 13..24) must equal the learner's. Whether the resumed run's final weights equal the
              uninterrupted run's, to the bit, is recorded (not required: bf16 kernels need not be deterministic).
  z3          The same with ZeRO-3 (`--no-z3-resume`: only the 24-step run with its checkpoints, when time is short).
  vllm-z3     vllm-run with the learner in ZeRO-3 (one rank: the publisher gathers its partitioned parameters for
              every update), the same checks.
  throughput  On a random-init model of Qwen2.5-0.5B's shape, built offline (the tokenizer of assets/arith-base,
              whose vocabulary is smaller than the model's: fine for throughput). (1) Learner: `learner.trainer.
              Trainer` built as the learner builds it (torch.distributed over one rank), bf16, ZeRO-1, fed the same
              synthetic StepBatch (64 samples of 64 prompt + 512 response tokens) for 2 warm-up and 5 timed steps,
              once per packing budget learner.micro_batch_tokens = 1024 (one sample per row), 4096 and 8192 (sdpa
              attends over a whole packed row under a block mask, so longer rows cost attention work that is masked
              out); the best is the headline, every budget is recorded.
              tokens/s = tokens trained (prompt + response, as perf/learner_tokens_per_s counts them) / train_s;
              MFU = model FLOPs / train_s / the device's peak dense bf16 FLOP/s, with model FLOPs = 6 N tokens
              (N: every parameter, the tied embedding once, as the LM head's matmul) + causal attention
              6 L d S (S + 1) per sequence of S tokens (forward and backward over the unmasked query-key pairs);
              the entropy-after pass is off (learner.log_entropy_delta = false) so a step is one forward and one
              backward. Peak GPU memory too. (2) Generation: the torch engine (actors/engine.py `TorchEngine(...,
              device=)`) on the GPU, bf16, 32 prompts x 8 samples x 256 new tokens at temperature 1; the stop id
              is the model's last vocabulary id, which a random model rarely samples; tokens/s = tokens generated
              / seconds. (3) The same generation with covrl's vLLM engine (`--throughput-parts vllm-gen`; eager,
              so CUDA graphs' capture time stays out of a short lease: a lower bound on vLLM's speed).

At the end: `--out`/gpu_proof.json (device, versions, UTC date, git commit, a digest of the sources, and per stage
passed / seconds / figures / key log lines), gpu_proof_logs.tar.gz (stage logs, the runs' logs, metrics and
generator logs, the JUnit report; no checkpoints), and a short table. gpu_proof.json is also written after every
stage, so a run stopped by a time limit keeps what it finished; running again into the same --out (same device,
same sources) adds or replaces stages. Exit 0 only if every stage passed; 4 if every stage that ran passed but
--deadline-s left some not run; 3 if vLLM's _C did not load (carry the fallback kit); else 1. The runs
(checkpoints, the 0.5B model) go to `--work` (default: --out), which the device tool need not bring back.

`--rehearse-cpu`: the same stages on a CPU-only machine at toy scale (`--gpus 0`, float32, 4 steps with resume
from 2, a tiny random model for throughput, MFU null), so this script's logic is proven before GPU time is spent.
vllm-kit then only imports vLLM's Python (`--python .venv-vllm-0.26.0/bin/python` has it) and vllm-tests is skipped:
a skipped stage is recorded as such, never as passed.

`--record FILE.json [...]`: merges finished gpu_proof.json files of one device into tests/bench/results.json under
"gpu_proofs", keyed by the device, in the order of their dates: a stage run later replaces the same stage run
earlier, and the record's machine, versions and commit are its newest file's (keys only older files have, such as
notes written into an earlier record, are kept). Every stage carries its own date, commit and source digest. That
device's earlier record is replaced (pass it, or every file of its leases, to keep their stages), another device's
stays; the rest of results.json stays as it is.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAGES = ("learner", "vllm-kit", "generation", "vllm-tests", "vllm-run", "tests", "z1", "throughput", "z3", "vllm-z3")
VLLM_STAGES = ("vllm-kit", "generation", "vllm-tests", "vllm-run", "vllm-z3")
STAMP_KEYS = ("date", "git_commit", "git_dirty", "source_digest")  # each stage's provenance in gpu_proof.json
VLLM_TESTS = "tests/gpu/test_vllm_engine.py"
KIT_FAILED_EXIT = 3  # the kit's compiled ops did not load: rerun with the fallback kit (README "GPU proof")
DEADLINE_EXIT = 4  # every stage that ran passed, and --deadline-s left some not run: run those in another command
RESULT_TAG = "GPU_PROOF_RESULT "  # hardware/proof_workers.py prints its result after this tag
# The throughput workers run as child processes (one CUDA context each, freed when they exit).
WORKER_MODULE = "hardware.proof_workers"
LEARNER_WORKER = "hardware.learner_bench"  # the learner stage's worker, one per shape
BASE_MODEL = os.path.join(REPO, "assets", "arith-base")
RESULTS = os.path.join(REPO, "tests", "bench", "results.json")
# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name(); first match wins.
# H100 SXM reports itself as "NVIDIA H100 80GB HBM3".
PEAK_BF16_DENSE = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=397, max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)
# Qwen2.5-7B's layer, head and vocabulary shapes with 4 of its 28 layers (2.0 B parameters: 1.09 B of them the
# untied embedding and head), so one GPU holds it with ZeRO-1 and a step is seconds.
QWEN25_7B_4L = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)
TINY_UNTIED = dict(TINY, num_hidden_layers=4, tie_word_embeddings=False)
# The learner stage's shapes: the model and one step's synthetic batch (samples of prompt + response tokens, in
# groups of 8), packed at each micro_batch_tokens budget. Time on an H200, estimated from the throughput stage's
# record (0.5B at 8192: 0.96 s per step of 36864 tokens, 116 TFLOP/s) with 1 warm-up + 2 timed + 1 profiled step
# per budget: 0.5b ~15 s a variant (trainer build ~6 s, steps ~4 s, the profile and its parsing ~5 s); 7b-4l
# (1.5 B parameters in matmuls, 49152 tokens a step, ~2 s at ~250 TFLOP/s) ~40 s a variant (build ~12 s, two
# budgets). All 7 default variants: ~2 + ~5 min, and a compile_layers variant pays its compilation (about a minute
# a shape) on top, so the stage's --learner-budget-s (300 s) keeps it to about 5 minutes: each shape gets an equal
# share of what is left, and a worker starts no variant it cannot finish in its share (recorded as not run). In the
# default order that cuts the compile and gradient-checkpointing ablations of 7b-4l first.
LEARNER_SHAPES = {
    "0.5b": dict(what="Qwen2.5-0.5B's shape (the throughput stage's), random init", model=QWEN25_05B, samples=64,
                 prompt_tokens=64, response_tokens=512, micro_batch_tokens=(8192,)),  # 5 micro-batches
    "7b-4l": dict(what="Qwen2.5-7B's shape truncated to 4 layers, untied head, random init", model=QWEN25_7B_4L,
                  samples=48, prompt_tokens=64, response_tokens=960, micro_batch_tokens=(8192, 20480)),  # 6 and 3
}
LEARNER_SHAPES_CPU = {  # the rehearsal's stand-ins: tiny, a few hundred tokens, the same packing structure
    "0.5b": dict(what="tiny random Qwen2, tied (rehearsal)", model=TINY, samples=8, prompt_tokens=16,
                 response_tokens=32, micro_batch_tokens=(192,)),  # 2 micro-batches
    "7b-4l": dict(what="tiny random Qwen2, 4 layers, untied (rehearsal)", model=TINY_UNTIED, samples=8,
                  prompt_tokens=16, response_tokens=48, micro_batch_tokens=(128, 320)),  # 4 and 2
}
# The learner stage's variants, ATTN-HEAD[-compile][-gc], in the order of value: the baseline (today's path) first,
# then the whole new path, then the ablations that explain its gain, gradient checkpointing (memory for compute),
# and compile_layers last: its first steps compile, and its caches are the one state a variant could leave behind.
LEARNER_VARIANTS = ("sdpa-chunked", "varlen-triton", "varlen-inductor", "varlen-fused", "varlen-chunked",
                    "sdpa-fused", "varlen-triton-gc", "sdpa-chunked-gc", "varlen-triton-compile")
LEARNER_ATTN = ("sdpa", "varlen", "flash_attention_2", "eager")
LEARNER_HEADS = ("chunked", "fused", "triton", "inductor")
# The first lease's plan (`--first-lease`, `make gpu-first-lease`): (shape, variant) in the order of what it must
# answer, the shapes interleaved so the 7B-shaped stack is measured before the ablations of the 0.5B: today's path
# and the new one (varlen attention + the Triton head) on both shapes (the MFU goals); the head compiled by inductor
# instead (whichever of the two measures better becomes the default); today's fused head on varlen (what the new
# head gains over it); gradient checkpointing; torch.compile of the layers; then the rest of the ablations. The
# worker starts each item only if its estimate fits (hardware/learner_bench.py estimate_s), so a short lease cuts
# from the end.
FIRST_LEASE_PLAN = (("0.5b", "sdpa-chunked"), ("0.5b", "varlen-triton"), ("7b-4l", "sdpa-chunked"),
                    ("7b-4l", "varlen-triton"), ("0.5b", "varlen-inductor"), ("7b-4l", "varlen-inductor"),
                    ("0.5b", "varlen-fused"), ("7b-4l", "varlen-fused"), ("0.5b", "varlen-triton-gc"),
                    ("7b-4l", "varlen-triton-gc"), ("0.5b", "varlen-triton-compile"), ("0.5b", "varlen-chunked"),
                    ("0.5b", "sdpa-fused"), ("7b-4l", "varlen-chunked"), ("7b-4l", "sdpa-fused"),
                    ("7b-4l", "varlen-triton-compile"))
# The first lease's command (make gpu-first-lease): everything within FIRST_LEASE_S of the command's start, the kit's
# unpack included; the learner stage stops starting items FIRST_LEASE_TESTS_S before that, which the GPU tests get
# (they took 25-32 s on the lent machines, before the head kernels' tests), and its worker is killed
# FIRST_LEASE_TESTS_MIN_S before it at the latest, so the tests stage always starts (run_proof starts no stage with
# less than a minute left). Estimates of what comes before the stage (not measured yet: the command records both):
# the kit's site tree unpacked (no vLLM) and the preflight.
FIRST_LEASE_S = 480.0
FIRST_LEASE_TESTS_S = 100.0
FIRST_LEASE_TESTS_MIN_S = 75.0
FIRST_LEASE_UNPACK_S = 15.0
FIRST_LEASE_PREFLIGHT_S = 15.0
LEARNER_EXTRAS = {"compile": "learner.compile_layers", "gc": "learner.gradient_checkpointing"}
# A variant's first step (from the same weights, on the same batch) against the baseline's: the relative difference
# of its grad norm, mean log pi(target) and entropy, and of the first micro-batch's final hidden states, above which
# it is flagged. bf16: a few % (other kernels round differently); fp32 (the CPU rehearsal) agrees to ~1e-6.
LEARNER_AGREE_REL = {"bfloat16": 0.03, "float32": 1e-3}
LEARNER_HIDDEN_REL = {"bfloat16": 0.05, "float32": 1e-3}
LEARNER_GRACE_S = 150  # past a shape's share, the variant under way may finish (a compile one takes longest)
# The generation stage (worker: hardware/gen_bench.py): the workloads, the same prompts in every variant (the
# arithmetic task's, in the hub's order). heavy: lognormal lengths, median 32, sigma 0.7, capped at 1024 (drawn per
# group on vLLM: mean 42.1, longest 302 = 7.2x the mean, 172,576 tokens); fixed: 64 tokens each (131,072). Time on an
# H200, estimated from the throughput stage's eager vLLM (18,074 tokens/s at 256 sequences, ~14 ms a decode step):
# ~10 s (heavy) and ~7 s (fixed) a run eagerly, about half that with CUDA graphs; the eager engine ~40 s to build,
# the CUDA-graph one ~60-150 s (compile and capture, never run on a lent machine so far); with the model (~20 s),
# the warm-ups and two publishes per transport (~30 s) about 4.5-6 minutes in all, inside `budget_s` (no run, build
# or publish starts that would not fit; they are recorded as not run).
GEN_BENCH = dict(group_size=8, max_num_seqs=256, gpu_memory_utilization=0.5, publishes=2, budget_s=480,
                 workloads={"heavy": dict(groups=512, median=32, sigma=0.7, max_new_tokens=1024),
                            "fixed": dict(groups=256, median=64, sigma=0.0, max_new_tokens=64)},
                 warmup=dict(groups=16, median=16, sigma=0.0, max_new_tokens=16),
                 first_run_s=40, build_estimate_s={"eager": 60, "graphs": 150}, publish_estimate_s=40)
# The rehearsal's: drawn per sample by the torch engine (heavy: mean 6.4, longest 59 = 9.2x the mean).
GEN_BENCH_CPU = dict(group_size=4, max_num_seqs=16, gpu_memory_utilization=None, publishes=2, budget_s=300,
                     workloads={"heavy": dict(groups=16, median=4, sigma=1.0, max_new_tokens=64),
                                "fixed": dict(groups=8, median=8, sigma=0.0, max_new_tokens=8)},
                     warmup=dict(groups=2, median=4, sigma=0.0, max_new_tokens=4),
                     first_run_s=20, build_estimate_s={"eager": 30, "graphs": 60}, publish_estimate_s=20)
GEN_WORKER = "hardware.gen_bench"
GEN_GOAL_RATIO = 0.9  # covrl's loop over bare AsyncLLM, heavy workload, the same sampling parameters
GEN_GOAL_PUBLISH_S = 0.2  # one colocated publish of the 0.5B shape, end to end
GEN_MIN_TAIL = 5.0  # the heavy workload's longest response over its mean, at least
# Measured memory beside common/memplan.py's prediction (the learner's peak allocated bytes per budget, vLLM's KV
# cache in tokens): within this share of the plan, or a finding. A verdict recorded in the figures, never a check.
MEMPLAN_TOLERANCE = 0.15
VLLM_KV_TOKENS_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")  # vLLM's engine core, at start-up
VLLM_KV_MEMORY_LOG = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
# Imported by the roles of a run or by the throughput workers; checked up front (import name, why).
NEEDS = {
    "torch": "everything", "numpy": "everything", "transformers": "models", "tokenizers": "tokenizers",
    "safetensors": "checkpoints", "msgspec": "config and messages", "tomli_w": "config.toml", "zmq": "the hub",
    "psutil": "the launcher", "tensorboard": "metrics", "math_verify": "rewards", "deepspeed": "the learner",
    "pydantic": "deepspeed's config", "hjson": "deepspeed", "msgpack": "deepspeed", "pyarrow": "datasets",
}
STAGE_NEEDS = {"tests": ("pytest",)}


@dataclass(frozen=True)
class Scale:
    gpus: int
    dtype: str
    steps: int
    ckpt_every: int  # the full run's checkpoint period
    resume_first: int  # steps of the first half of the resume proof
    resume_ckpt_every: int
    model: dict
    samples: int
    prompt_tokens: int
    response_tokens: int
    micro_batch_tokens: tuple  # learner throughput: each packing budget measured
    warmup: int
    timed: int
    gen_prompts: int
    gen_samples: int
    gen_tokens: int
    gen_prompt_tokens: int
    run_timeout_s: float  # one cluster launch
    worker_timeout_s: float  # one throughput worker
    vllm_steps: int  # the vllm-run stage's steps
    learner_shapes: dict  # the learner stage's shapes, by name (LEARNER_SHAPES)
    learner_warmup: int  # learner stage: warm-up steps per budget (the first one is the agreement's first step)
    learner_timed: int  # learner stage: timed steps per budget
    learner_budget_s: float  # learner stage: the time its workers may start variants in
    gen_bench: dict  # generation stage: workloads, engine size, budget (GEN_BENCH)


GPU = Scale(gpus=1, dtype="bfloat16", steps=24, ckpt_every=12, resume_first=12, resume_ckpt_every=6, model=QWEN25_05B,
            samples=64, prompt_tokens=64, response_tokens=512, micro_batch_tokens=(1024, 4096, 8192), warmup=2,
            timed=5,
            gen_prompts=32, gen_samples=8, gen_tokens=256, gen_prompt_tokens=64, run_timeout_s=360,
            worker_timeout_s=360, vllm_steps=12, learner_shapes=LEARNER_SHAPES, learner_warmup=1, learner_timed=2,
            learner_budget_s=300, gen_bench=GEN_BENCH)
CPU = Scale(gpus=0, dtype="float32", steps=4, ckpt_every=2, resume_first=2, resume_ckpt_every=1, model=TINY,
            samples=8, prompt_tokens=16, response_tokens=32, micro_batch_tokens=(64, 512), warmup=1, timed=2,
            gen_prompts=4, gen_samples=2, gen_tokens=16, gen_prompt_tokens=16, run_timeout_s=900,
            worker_timeout_s=600, vllm_steps=4, learner_shapes=LEARNER_SHAPES_CPU, learner_warmup=1,
            learner_timed=1, learner_budget_s=600, gen_bench=GEN_BENCH_CPU)


# ---------------------------------------------------------------------------------------------------------------
# small helpers


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def git_commit(repo: str = REPO) -> tuple[str, bool | None]:
    """(commit, dirty) read from .git without the git binary; ("unknown", None) when there is no .git.
    `dirty` comes from `git status` when git is installed, else None."""
    try:
        gitdir, common = _git_dirs(repo)
        with open(os.path.join(gitdir, "HEAD")) as f:
            head = f.read().strip()
        if head.startswith("ref: "):
            commit = _resolve_ref(gitdir, common, head[5:])
        else:
            commit = head if re.fullmatch(r"[0-9a-f]{40}", head) else "unknown"
    except OSError:
        return "unknown", None
    return commit, (_git_dirty(repo) if commit != "unknown" else None)


def _git_dirs(repo: str) -> tuple[str, str]:
    """The checkout's git directory and the common one (they differ in a worktree, whose .git is "gitdir: PATH")."""
    gitdir = os.path.join(repo, ".git")
    if os.path.isfile(gitdir):
        with open(gitdir) as f:
            gitdir = os.path.join(repo, f.read().split(":", 1)[1].strip())
    common = gitdir
    if os.path.isfile(os.path.join(gitdir, "commondir")):
        with open(os.path.join(gitdir, "commondir")) as f:
            common = os.path.normpath(os.path.join(gitdir, f.read().strip()))
    return gitdir, common


def _resolve_ref(gitdir: str, common: str, ref: str) -> str:
    """The commit a ref names: its loose file in either git directory, else its line in packed-refs."""
    for base in (gitdir, common):
        if os.path.isfile(os.path.join(base, ref)):
            with open(os.path.join(base, ref)) as f:
                return f.read().strip()
    packed = os.path.join(common, "packed-refs")
    commit = "unknown"
    if os.path.isfile(packed):
        with open(packed) as f:
            lines = [line.split() for line in f]
        commit = next((parts[0] for parts in lines if len(parts) == 2 and parts[1] == ref), commit)
    return commit


def _git_dirty(repo: str) -> bool | None:
    """Whether tracked files differ from the commit (`git status`); None without git or when it fails."""
    if not shutil.which("git"):
        return None
    try:
        p = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(p.stdout.strip()) if p.returncode == 0 else None


def source_digest(repo: str = REPO) -> str:
    """sha256 over the project's Python sources and pyproject.toml (path and bytes): which code ran, also where
    the copy has no .git."""
    h = hashlib.sha256()
    files = [os.path.join(repo, "pyproject.toml")]
    for d in ("actors", "broker", "common", "hardware", "launch", "learner", "study"):
        files += glob.glob(os.path.join(repo, d, "**", "*.py"), recursive=True)
    for path in sorted(files):
        h.update(os.path.relpath(path, repo).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def invocation() -> str:
    """How this process was started, as one would type it again: `python3 -m hardware.proof`, the console script
    or the file, relative to the repository root."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name == "hardware.proof":
        return "python3 -m hardware.proof"
    return os.path.relpath(sys.argv[0], REPO) if os.path.isabs(sys.argv[0]) else sys.argv[0]


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16_DENSE:
        if key in device_name:
            return flops
    return None


class StageLog:
    """One stage's log file, echoed to the console in short."""

    def __init__(self, path: str, name: str):
        self.f = open(path, "a", buffering=1)
        self.name = name
        self.lines: list[str] = []  # key lines for gpu_proof.json

    def write(self, text: str) -> None:
        self.f.write(text if text.endswith("\n") else text + "\n")

    def say(self, text: str, key: bool = False) -> None:
        line = f"[{self.name}] {text}"
        print(line, flush=True)
        self.write(f"{utc_now()} {line}")
        if key:
            self.lines.append(text)

    def close(self) -> None:
        self.f.close()


class Checks:
    """Named pass/fail checks of one stage; a failed one is also a key line."""

    def __init__(self, log: StageLog, prefix: str = ""):
        self.log, self.prefix, self.results, self.failed = log, prefix, {}, []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        name = self.prefix + name
        self.results[name] = bool(ok)
        text = f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else "")
        self.log.say(text, key=not ok)
        if not ok:
            self.failed.append(text)
        return bool(ok)


def _handle_line(on_line, line: str, log: StageLog) -> None:
    """`on_line(line)`; a bug in the handler is logged, never raised: it must not stop the reading (the child would
    block on a full pipe)."""
    try:
        on_line(line)
    except Exception:
        import traceback

        log.write(traceback.format_exc())


def run_logged(argv: list[str], log: StageLog, timeout_s: float, env: dict | None = None, graceful: bool = False,
               cwd: str = REPO, on_line=None) -> tuple[int, float, list[str]]:
    """Run argv in its own session, every output line into the stage log; (exit code, seconds, lines).
    On timeout: SIGTERM (twice, for the launcher's graceful then immediate stop when `graceful`), then SIGKILL;
    the exit code is then 124. `on_line(line)`: called for each line as it comes (from the reader thread)."""
    log.write(f"{utc_now()} $ {' '.join(argv)}")
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True, errors="replace")
    lines: list[str] = []

    def pump():
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            log.write(line)
            if on_line is not None:
                _handle_line(on_line, lines[-1], log)

    from launch.process_group import signal_group, stop_group  # covrl's: preflight has checked it imports

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        p.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        log.say(f"timed out after {timeout_s:.0f}s: stopping it", key=True)
        stop_group(p, ([(signal.SIGTERM, 30), (signal.SIGTERM, 30)] if graceful else [(signal.SIGTERM, 10)]) +
                   [(signal.SIGKILL, 10)])
    except KeyboardInterrupt:
        signal_group(p.pid, signal.SIGTERM)
        p.wait()
        raise
    reader.join(timeout=10)
    seconds = time.monotonic() - t0
    code = 124 if timed_out else p.returncode
    log.write(f"{utc_now()} exit {code} after {seconds:.1f}s")
    return code, seconds, lines


def result_of(lines: list[str]) -> dict | None:
    for line in reversed(lines):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return None


# ---------------------------------------------------------------------------------------------------------------
# preflight


def refuse(text: str):
    """A preflight check failed: one line on stderr, exit status 2."""
    print(f"error: {text}", file=sys.stderr)
    raise SystemExit(2)


def preflight(args, scale: Scale) -> tuple[dict, list[str]]:
    """(facts about this machine, warnings), or SystemExit(2) with one line on stderr naming what is missing."""
    if importlib.util.find_spec("common") is None:
        refuse(f"covrl's packages (common/, learner/, actors/) are not importable: run from the repository root as "
               f"`python3 -m hardware.proof ...` (not `python3 hardware/proof.py`), or install covrl (`make venv`); "
               f"this file is {os.path.abspath(__file__)}")
    facts = device_facts(args)
    probe_packages(args)
    # Versions the project declares: mismatches are warnings (torch cannot travel as a wheel).
    warnings = version_warnings(args)
    facts["versions"] = package_versions(args)
    for path in (os.path.join(BASE_MODEL, "config.json"), os.path.join(BASE_MODEL, "tokenizer.json"),
                 os.path.join(REPO, "launch", "cluster.py")):
        if not os.path.isfile(path):
            refuse(f"{path} is missing: run from a complete checkout of the repository")
    if {"z1", "z3", "vllm-run", "vllm-z3"} & set(args.stages) and scale.gpus:
        facts["placement"] = cluster_placement(facts, scale)
    from common.paths import unwritable

    for d in {args.out, args.work}:
        if (why := unwritable(d)) is not None:
            refuse(f"{d} is not writable ({why}); pass a writable --out / --work")
    need_gib = (1 if args.rehearse_cpu else 8 if "learner" in args.stages else
                6 if {"throughput", "generation"} & set(args.stages) else 1)
    free_gib = shutil.disk_usage(args.work).free / 2**30
    if free_gib < need_gib:
        refuse(f"{args.work} has {free_gib:.1f} GiB free; the stages need about {need_gib} GiB (checkpoints, the 0.5B "
               f"model, the learner stage's 4 GB 7b-4l model)")
    return facts, warnings


def device_facts(args) -> dict:
    """Python, torch and CUDA versions, and the GPU (name, count, memory, capability, driver); a rehearsal's CPU."""
    try:
        import torch
    except ImportError:
        refuse("torch is not importable: install a CUDA build of torch (or run where one is)")
    facts: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "rehearse_cpu": bool(args.rehearse_cpu)}
    if args.rehearse_cpu:
        facts.update(device="cpu (rehearsal)", device_count=0)
        return facts
    if not torch.cuda.is_available():
        refuse(f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
               f"torch.cuda.is_available() is False): run this on a GPU machine, or pass --rehearse-cpu")
    facts.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                 gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                 capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    if shutil.which("nvidia-smi"):
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            facts["driver"] = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            facts["driver"] = None
    return facts


def probe_packages(args) -> None:
    """Import every package the stages need in a child (a broken install fails there, not here)."""
    mods = list(NEEDS) + [m for s in args.stages for m in STAGE_NEEDS.get(s, ())]
    probe = (
        "import importlib, json\n"
        f"mods = {mods!r}\n"
        "bad = {}\n"
        "for m in mods:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except BaseException as e:\n"
        "        bad[m] = f'{type(e).__name__}: {e}'.splitlines()[0][:200]\n"
        "out = {'bad': bad}\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run([args.python, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=child_env(args))
    try:
        probed = json.loads(p.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        refuse(f"{args.python} could not probe the packages (exit {p.returncode}): {p.stderr.strip()[-300:]}")
    if probed["bad"]:
        name, why = next(iter(probed["bad"].items()))
        refuse(f"cannot import {name} ({why}); {len(probed['bad'])} package(s) missing or broken in all: "
               f"{', '.join(probed['bad'])}. On the GPU machine unpack the carried kit first (make gpu-proof does: "
               f"make gpu-kit on a machine with a registry, then carry .kit/common, .kit/bin-sm90 and "
               f".kit/manifest.json)")


def cluster_placement(facts: dict, scale: Scale) -> dict:
    """Where `covrl run` puts 1 learner and 1 generator on the cluster stages' GPUs (refused if it cannot)."""
    if facts["device_count"] < scale.gpus:
        refuse(f"the cluster stages need {scale.gpus} GPU(s); torch sees {facts['device_count']}")
    from common.config import load_config
    from common.runfiles import PlacementError, check_colocation, place_gpus

    try:
        placement = place_gpus(scale.gpus, 1, 1, 1)
        check_colocation(placement, load_config(None, ['generator.engine="torch"']).generator)
    except (PlacementError, ValueError) as e:
        refuse(f"covrl run cannot place 1 learner + 1 generator on {scale.gpus} GPU: {e}")
    return {"learners": placement.learners, "generators": placement.generators, "colocated": placement.colocated}


def child_env(args, **extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH", "")])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    if args.rehearse_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def package_versions(args) -> dict:
    import importlib.metadata as metadata

    out = {}
    for name in ("torch", "transformers", "deepspeed", "tokenizers", "safetensors", "huggingface-hub", "msgspec",
                 "pyzmq", "math-verify", "numpy", "pydantic", "pytest", "vllm", "flash-attn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def version_warnings(args) -> list[str]:
    """The project's declared dependencies that the installed versions do not meet (pyproject.toml)."""
    import importlib.metadata as metadata

    try:
        import tomllib

        from packaging.requirements import Requirement
    except ImportError:
        return ["could not check versions (packaging or tomllib missing)"]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    out = []
    for spec in deps:
        req = Requirement(spec)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name}: not installed (pyproject asks {req.specifier})")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} is outside pyproject's {req.specifier}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# stage: tests


def junit_counts(junit: str) -> tuple[dict, list[str]]:
    """Test counts (tests, passed, failed, errors, skipped) and "name: reason" for each skip, from a JUnit report;
    zeros when there is none."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skips: list[str] = []
    if not os.path.exists(junit):
        return counts, skips
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.parse(junit).getroot()
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for key, attr in (("tests", "tests"), ("failed", "failures"), ("errors", "errors"), ("skipped", "skipped")):
            counts[key] += int(suite.get(attr, 0))
        skips += [f"{'.'.join(filter(None, [case.get('classname'), case.get('name')]))}: "
                  f"{skipped.get('message', '').strip()}"
                  for case in suite.iter("testcase") for skipped in case.findall("skipped")]
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts, skips


def stage_tests(ctx, paths: tuple = ("tests/gpu", f"--ignore={VLLM_TESTS}"), name: str = "tests") -> dict:
    """`pytest -m gpu` over `paths`: the torch-side GPU tests (stage tests) or the vLLM engine's (vllm-tests)."""
    log, chk = ctx.log, ctx.checks
    junit = os.path.join(ctx.args.work, f"{name}_junit.xml")
    argv = [ctx.args.python, "-m", "pytest", "-q", "-m", "gpu", *paths, "-p", "no:cacheprovider", "-rs",
            f"--junitxml={junit}"]
    code, seconds, lines = run_logged(argv, log, ctx.timeout(300), env=child_env(ctx.args))
    counts, skips = junit_counts(junit)
    if os.path.exists(junit):
        ctx.bundle.append(junit)
    summary = next((ln for ln in reversed(lines) if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", ln)
                    and ln.strip()), "")
    log.say(f"summary: {summary.strip('= ')}", key=True)
    for ln in lines:
        if ln.startswith("SKIPPED"):
            log.say(ln, key=True)
    chk("pytest ran (exit 0, or 5: no tests collected)", code in (0, 5), f"exit {code}")
    chk("junit report written", os.path.exists(junit))
    chk("no test failed or errored", counts["failed"] == 0 and counts["errors"] == 0,
        f"{counts['failed']} failed, {counts['errors']} errors")
    return {"counts": counts, "skips": skips, "exit_code": code, "summary": summary.strip("= "),
            "pytest_seconds": round(seconds, 1)}


# ---------------------------------------------------------------------------------------------------------------
# stages: vllm-kit, vllm-tests, vllm-run


def skip(ctx, reason: str) -> None:
    """This stage cannot run here (a GPU stage in the CPU rehearsal): recorded as skipped, not passed."""
    ctx.checks("skipped here, and why", True, reason)
    ctx.skip_reason = reason


class StopProof(Exception):
    """The rest of the proof cannot run (the kit's compiled ops did not load); the message says what to do."""


def vllm_probe(ctx) -> dict:
    """vLLM's version and location as the children see it (PYTHONPATH included), or why it does not import."""
    code = "import json, vllm; print(json.dumps({'version': vllm.__version__, 'file': vllm.__file__}))"
    p = subprocess.run([ctx.args.python, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=child_env(ctx.args))
    if p.returncode == 0:
        return json.loads(p.stdout.strip().splitlines()[-1])
    return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}


def stage_vllm_kit(ctx) -> dict:
    """vLLM itself, without covrl's engine (hardware/proof_workers.py vllm-smoke). If its compiled ops do not load,
    the proof stops here: the next command carries the fallback kit instead (PTX kept)."""
    log, chk, args = ctx.log, ctx.checks, ctx.args
    probe = vllm_probe(ctx)
    log.say(f"vllm: {probe}", key=True)
    if args.rehearse_cpu and "version" not in probe:
        skip(ctx, "CPU rehearsal: vLLM does not import here (run with --python .venv-vllm-0.26.0/bin/python)")
        return {"probe": probe}
    if not chk("vllm imports", "version" in probe, probe.get("error", "")):
        ctx.vllm_broken = f"vllm does not import ({probe.get('error')}): carry the kit (make gpu-kit; README \"GPU proof\")"
        return {"probe": probe}
    if args.rehearse_cpu:
        skip(ctx, "CPU rehearsal: vLLM's kernels and engine need a GPU (its Python imported)")
        return {"probe": probe}
    code, secs, lines = run_worker(ctx, "vllm-smoke", {"model": BASE_MODEL, "gpu_memory_utilization": 0.3},
                                   timeout_s=240)
    r = result_of(lines) or {}
    if not chk("vLLM's compiled ops (_C) load and launch", r.get("c_loaded") is True, r.get("c_error") or f"exit {code}"):
        raise StopProof(f"vLLM's _C did not load ({r.get('c_error') or f'exit {code}'}): run the proof again with "
                        f"the fallback kit (carry .kit/common and .kit/bin-ptx instead of .kit/bin-sm90)")
    chk("rms_norm from _C matches a float64 reference (rel. err < 1e-2, every element written)",
        r.get("rms_norm_all_written") is True and r.get("rms_norm_rel_err", 1) < 1e-2, f"{r.get('rms_norm_rel_err')}")
    chk("FlashAttention 3 is available", r.get("fa3") is True, str(r.get("fa3_error") or ""))
    if not chk("an AsyncLLM builds on assets/arith-base", "build_s" in r, f"exit {code} after {secs:.0f}s"):
        err = next((ln for ln in reversed(lines) if re.search(r"\b\w+Error: ", ln)), "")
        log.say(f"the engine did not build: {err.strip()[-300:]}", key=True)
        ctx.vllm_broken = f"vLLM's engine did not build in vllm-kit ({err.strip()[-200:]})"
    chk("the same seed gives the same samples", r.get("seeded_repeat_equal") is True)
    chk("another seed gives other samples", r.get("other_seed_differs") is True)
    chk("processed logprobs: one per token, finite, <= 0",
        r.get("logprobs_per_token") is True and r.get("logprobs_valid") is True)
    chk("pause(keep) / collective_rpc / resume, then generation", (r.get("after_resume_tokens") or 0) > 0,
        str(r.get("collective_rpc")))
    chk("the smoke worker exits 0", code == 0, f"exit {code}")
    log.say(f"vLLM {r.get('vllm')} on {r.get('device')}: _C rms_norm rel err {r.get('rms_norm_rel_err')}, FA3 "
            f"{r.get('fa3')}, FA2 {r.get('fa2')}, engine built in {r.get('build_s')}s", key=True)
    return {"probe": probe, **r}


def stage_vllm_tests(ctx) -> dict:
    if ctx.args.rehearse_cpu:
        skip(ctx, "CPU rehearsal: the vLLM engine tests need a GPU")
        return {}
    figures = stage_tests(ctx, (VLLM_TESTS,), "vllm_tests")
    c = figures["counts"]  # a pytest that cannot import vLLM skips them all: that proves nothing
    ctx.checks("the vLLM engine tests ran (none skipped)", c["passed"] > 0 and c["skipped"] == 0,
               f"{c['passed']} passed, {c['skipped']} skipped")
    return figures


# The vllm-run stage's staleness-0 checks on pi_prox (recomputed by the learner at the step start) over pi_behav
# (the generator's logprob of the tokens it sampled, same weights). The mean ratio within 1 +- IS_WEIGHT_BAND is an
# implementation check only: E_behav[pi_prox / pi_behav] = 1 for any two policies, so it fails only on a gross
# error. The share of tokens over the importance cap (rho > 2, i.e. |dlogp| > 0.69 on one token) is the sensitive
# one. The agreement itself (mean |dlogp| <= 0.05, tempered, against the untempered control) is vllm-tests'
# test_behaviour_logprobs_are_of_the_tempered_distribution and gpu_check's.
IS_WEIGHT_BAND = 0.05
IS_CLIP_MAX = 0.01


def stage_vllm_run(ctx, name: str = "vllm-run", zero: int = 1) -> dict:
    """A colocated 1-GPU run with the vLLM generator (rpc weights) and the bf16 DeepSpeed learner in ZeRO `zero`,
    on-policy (max_staleness_steps = 0) at temperature 0.7, so behaviour and learner logprobs are of the same
    weights and the same tempered distribution. Rehearsed on CPU with the torch engine (the checks, not vLLM)."""
    chk, s = ctx.checks, ctx.scale
    engine = "torch" if ctx.args.rehearse_cpu else "vllm"
    steps = s.vllm_steps
    extra = ("rollout.max_staleness_steps=0", "rollout.temperature=0.7", "generator.gpu_memory_utilization=0.3",
             "generator.enforce_eager=true")
    figures = {"engine": engine, "zero_stage": zero, "dtype": s.dtype, "gpus": s.gpus,
               "full_run": full_run(ctx, name, zero, steps, steps, engine, extra)}
    rows = [r for r in read_jsonl(os.path.join(ctx.args.work, name, "metrics.jsonl"))
            if r.get("actor/is_weight_mean") is not None]
    stale = [r.get("staleness/max") for r in rows]
    chk("every step trained on-policy (staleness/max 0)", bool(rows) and all(v == 0 for v in stale), f"{stale}")
    w = [round(r["actor/is_weight_mean"], 4) for r in rows]
    clip = [round(r.get("actor/is_weight_clipfrac", 0.0), 4) for r in rows]
    chk(f"implementation check: mean pi_prox/pi_behav within 1 +- {IS_WEIGHT_BAND} at every step",
        bool(w) and all(abs(x - 1) <= IS_WEIGHT_BAND for x in w), f"{w}")
    chk(f"at most {IS_CLIP_MAX:.0%} of tokens truncated by the importance cap", all(c <= IS_CLIP_MAX for c in clip),
        f"{clip}")
    figures["is_weight_mean"], figures["is_weight_clipfrac"] = w, clip
    ctx.log.say(f"{engine} run: {len(rows)} steps, is_weight_mean {min(w, default=None)}..{max(w, default=None)}, "
                f"clipfrac max {max(clip, default=None)}", key=True)
    return figures


# ---------------------------------------------------------------------------------------------------------------
# stages: z1 / z3


LEARNER_LINE = re.compile(r"learner: ZeRO-(\d+), optimizer offload (\S+), bf16 (\S+), attention (\S+), "
                          r"gradient checkpointing (\S+), device (\S+)")


def cluster_argv(ctx, run_dir: str, zero: int, steps: int, ckpt_every: int, engine: str = "torch",
                 extra: tuple = ()) -> list[str]:
    s = ctx.scale
    argv = [ctx.args.python, "-m", "launch.cluster", "--gens", "1", "--learners", "1", "--gpus",
            str(s.gpus), "--steps", str(steps), "--run-dir", run_dir, "--quiet",
            "--set", f'generator.engine="{engine}"', "--set", f'model.dtype="{s.dtype}"',
            "--set", f"learner.zero_stage={zero}", "--set", f"run.checkpoint_every_steps={ckpt_every}",
            "--set", "eval.every_steps=0"]
    for setting in extra:
        argv += ["--set", setting]
    return argv


def gen_logs(run_dir: str) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "generators", "gen*.jsonl"))):
        if not path.endswith("_eval.jsonl"):
            out += [(os.path.basename(path)[:-6], row) for row in read_jsonl(path)]
    return out


def checksum_report(run_dir: str, rows: list[tuple[str, dict]] | None = None) -> dict:
    """Every generator-logged version against the learner's weights/checksum of that step, compared exactly."""
    metrics = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    rows = gen_logs(run_dir) if rows is None else rows
    bad, checked = [], 0
    for gen, row in rows:
        v = row.get("version")
        want = metrics.get(v, {}).get("weights/checksum")
        got = row.get("checksum")
        if got is None:
            bad.append(f"{gen} v{v}: no checksum logged (direct={row.get('direct')})")
        elif want is None:
            bad.append(f"{gen} v{v}: metrics.jsonl has no weights/checksum for step {v}")
        elif got != want:
            bad.append(f"{gen} v{v}: generator {got!r} != learner {want!r}")
        else:
            checked += 1
    return {"checked": checked, "mismatches": bad, "received": sorted({r.get("version") for _, r in rows})}


def learner_line(run_dir: str) -> list[re.Match]:
    path = os.path.join(run_dir, "logs", "learner0.log")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [m for m in map(LEARNER_LINE.search, f) if m]


def launcher_key_lines(lines: list[str]) -> list[str]:
    keys = ("covrl run", "  GPUs:", "covrl:", "  checkpoint:", "  staleness", "error:", "learner0 exited", "gen0 ")
    return [ln for ln in lines if ln.startswith(keys)]


def run_figures(run_dir: str) -> dict:
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r.get("critic/score/mean") is not None]

    def mean(key, skip_first=True):
        vals = [r[key] for r in (rows[1:] if skip_first and len(rows) > 1 else rows) if r.get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {
        "steps_logged": len(rows),
        "s_per_step_mean": mean("timing_s/step"),
        "train_s_mean": mean("timing_s/train"),
        "learner_tokens_per_s_mean": mean("perf/learner_tokens_per_s"),
        "gen_tokens_per_s_mean": mean("perf/gen_tokens_per_s"),
        "weight_sync_s_mean": mean("timing_s/weight_sync"),
        "weights_bytes": rows[-1].get("weights/bytes") if rows else None,
        "reward_first_last": [rows[0].get("critic/score/mean"), rows[-1].get("critic/score/mean")] if rows else None,
        "entropy_first_last": [rows[0].get("actor/entropy"), rows[-1].get("actor/entropy")] if rows else None,
        "staleness_max": max((r.get("staleness/max") or 0 for r in rows), default=None),
        "final_checksum": rows[-1].get("weights/checksum") if rows else None,
    }


def check_learner_line(ctx, chk, run_dir: str, zero: int, prefix: str) -> str | None:
    found = learner_line(run_dir)
    log_path = os.path.join(run_dir, "logs", "learner0.log")
    if not chk(f"{prefix}learner log has the 'learner: ZeRO-' line", bool(found), log_path):
        return None
    m = found[-1]
    want_bf16 = "False" if ctx.args.rehearse_cpu else "True"
    want_dev = "cpu" if ctx.args.rehearse_cpu else "cuda"
    chk(f"{prefix}learner: ZeRO-{zero}, bf16 {want_bf16}, device {want_dev}",
        m.group(1) == str(zero) and m.group(3) == want_bf16 and m.group(6).startswith(want_dev), m.group(0))
    return m.group(0)


def check_generator_line(ctx, chk, run_dir: str, engine: str = "torch") -> str | None:
    """actors/factory.py's load_engine logs which engine runs where: "generator engine: torch on cuda, ..." or
    "generator engine: vllm 0.26.0 on cuda, ..."."""
    path = os.path.join(run_dir, "logs", "gen0.log")
    with open(path, errors="replace") if os.path.exists(path) else open(os.devnull) as f:
        found = [ln.split(": ", 1)[-1].strip() for ln in f if "generator engine:" in ln]
    want = "cpu" if ctx.args.rehearse_cpu else "cuda"
    pattern = re.compile(rf"generator engine: {engine}( \S+)? on {want}\b")
    chk(f"generator: {engine} engine on {want}", bool(found) and bool(pattern.match(found[-1])),
        found[-1] if found else f"no 'generator engine:' line in {path}")
    return found[-1] if found else None


def full_run(ctx, name: str, zero: int, steps: int, ckpt_every: int, engine: str = "torch",
             extra: tuple = ()) -> dict:
    """One cluster run with checkpoints, checked: exit 0, steps 1..steps once each, the generator's checksum of
    every version equal to the learner's and every version received, a complete final checkpoint, the learner's
    and the generator's device lines."""
    log, chk, s, args = ctx.log, ctx.checks, ctx.scale, ctx.args
    run = os.path.join(args.work, name)
    fresh_dir(run)
    ctx.bundle_runs.append(run)
    log.say(f"full run: {steps} steps, ZeRO-{zero}, {s.dtype}, {engine} engine, checkpoint every {ckpt_every} -> {run}")
    code, secs, lines = run_logged(cluster_argv(ctx, run, zero, steps, ckpt_every, engine, extra), log,
                                   ctx.timeout(s.run_timeout_s), env=child_env(args), graceful=True)
    for ln in launcher_key_lines(lines):
        log.say(ln, key=True)
    chk("full run exits 0", code == 0, f"exit {code} after {secs:.0f}s")
    logged = [r["step"] for r in read_jsonl(os.path.join(run, "metrics.jsonl"))]
    chk(f"metrics.jsonl has steps 1..{steps} once each", logged == list(range(1, steps + 1)), f"got {logged}")
    rep = checksum_report(run)
    missing = sorted(set(range(1, steps + 1)) - set(rep["received"]))
    bad = rep["mismatches"]
    chk("generator checksums equal the learner's for every version it received", rep["checked"] > 0 and not bad,
        f"{rep['checked']} equal" + (f"; {len(bad)} differ: {bad[:3]}" if bad else ""))
    chk(f"the generator received every version 1..{steps}", not missing, f"missing {missing}" if missing else "")
    from common.checkpoint_dirs import complete_checkpoints

    ckpts = complete_checkpoints(run)
    chk(f"a complete checkpoint of step {steps} exists", any(st == steps for st, _ in ckpts),
        f"complete: {[st for st, _ in ckpts]}")
    final = dict(ckpts).get(steps)
    if final:
        chk("the checkpoint holds a loadable HF model dir", all(os.path.isfile(os.path.join(final, f)) for f in
                                                                ("config.json", "model.safetensors")), final)
    line = check_learner_line(ctx, chk, run, zero, "")
    gen_line = check_generator_line(ctx, chk, run, engine)
    return {"seconds": round(secs, 1), "exit_code": code, "checksums_equal": rep["checked"],
            "checkpoints": [st for st, _ in ckpts], "learner_line": line, "generator_line": gen_line,
            **run_figures(run)}


def stage_zero(ctx, zero: int, resume: bool) -> dict:
    log, chk, s, args = ctx.log, ctx.checks, ctx.scale, ctx.args
    figures: dict = {"zero_stage": zero, "dtype": s.dtype, "gpus": s.gpus, "engine": "torch"}
    # 1. One full run with checkpoints.
    figures["full_run"] = full_run(ctx, f"z{zero}", zero, s.steps, s.ckpt_every)
    if not resume:
        return figures
    from common.checkpoint_dirs import complete_checkpoints

    # 2. Interrupt and resume: a run to resume_first steps, then --resume to the full length.
    rrun = os.path.join(args.work, f"z{zero}r")
    fresh_dir(rrun)
    ctx.bundle_runs.append(rrun)
    half = s.resume_first
    log.say(f"resume proof: {half} steps (checkpoint every {s.resume_ckpt_every}), then --resume to {s.steps} -> {rrun}")
    code1, secs1, lines1 = run_logged(cluster_argv(ctx, rrun, zero, half, s.resume_ckpt_every), log,
                                      ctx.timeout(s.run_timeout_s), env=child_env(args), graceful=True)
    for ln in launcher_key_lines(lines1):
        log.say(ln, key=True)
    chk(f"first half ({half} steps) exits 0", code1 == 0, f"exit {code1} after {secs1:.0f}s")
    first_rows = gen_logs(rrun)
    ck1 = [st for st, _ in complete_checkpoints(rrun)]
    chk(f"first half left a complete checkpoint of step {half}", half in ck1, f"complete: {ck1}")
    argv = [args.python, "-m", "launch.cluster", "--resume", rrun, "--steps", str(s.steps),
            "--gpus", str(s.gpus), "--quiet"]
    code2, secs2, lines2 = run_logged(argv, log, ctx.timeout(s.run_timeout_s), env=child_env(args), graceful=True)
    for ln in launcher_key_lines(lines2):
        log.say(ln, key=True)
    chk("resume exits 0", code2 == 0, f"exit {code2} after {secs2:.0f}s")
    banner = next((ln for ln in lines2 if "resuming from" in ln), "")
    chk(f"the launcher resumed from step_{half}", banner.rstrip().endswith(f"step_{half}"),
        banner.rsplit(", ", 1)[-1] if banner else "no 'resuming from .../step_N' line")
    with open(os.path.join(rrun, "logs", "learner0.log"), errors="replace") as f:
        resumed_lines = [ln.strip() for ln in f if "resumed from" in ln]
    chk(f"the learner loaded the step-{half} checkpoint", any(f"(step {half})" in ln for ln in resumed_lines),
        resumed_lines[-1] if resumed_lines else "no 'resumed from' line in learner0.log")
    if resumed_lines:
        log.say(resumed_lines[-1].split(": ", 1)[-1], key=True)
    steps = [r["step"] for r in read_jsonl(os.path.join(rrun, "metrics.jsonl"))]
    chk(f"after resuming, metrics.jsonl has steps 1..{s.steps} once each", steps == list(range(1, s.steps + 1)),
        f"got {steps}")
    all_rows = gen_logs(rrun)
    second = all_rows[len(first_rows):]
    rep2 = checksum_report(rrun, second)
    got = rep2["received"]
    chk(f"the resumed generator received versions {half}..{s.steps}", set(range(half, s.steps + 1)) <= set(got),
        f"got {got}")
    chk("resumed versions: generator checksums equal the learner's", rep2["checked"] > 0 and not rep2["mismatches"],
        f"{rep2['checked']} equal" + (f"; differ: {rep2['mismatches'][:3]}" if rep2["mismatches"] else ""))
    v_half = [r for _, r in second if r.get("version") == half]
    metrics = {r["step"]: r for r in read_jsonl(os.path.join(rrun, "metrics.jsonl"))}
    chk(f"the restored weights (version {half} after the restart) have the checksum step {half} logged before it",
        bool(v_half) and v_half[0].get("checksum") == metrics.get(half, {}).get("weights/checksum"),
        f"{v_half[0].get('checksum') if v_half else None!r} vs {metrics.get(half, {}).get('weights/checksum')!r}")
    rep_all = checksum_report(rrun, all_rows)
    ck2 = [st for st, _ in complete_checkpoints(rrun)]
    chk(f"a complete checkpoint of step {s.steps} exists after resuming", s.steps in ck2, f"complete: {ck2}")
    check_learner_line(ctx, chk, rrun, zero, "resumed ")
    rf = run_figures(rrun)
    same = rf["final_checksum"] is not None and rf["final_checksum"] == figures["full_run"]["final_checksum"]
    log.say(f"resumed run's final weights {'equal' if same else 'differ from'} the uninterrupted run's "
            f"(checksum {rf['final_checksum']!r} vs {figures['full_run']['final_checksum']!r}; informational: equality is "
            f"not expected, since the first half ran with run.steps={half} and its hub issued no work past that step "
            f"(the admission cap), so the extended run's prompt stream differs from the uninterrupted run's)", key=True)
    figures["resume"] = {"first_seconds": round(secs1, 1), "resume_seconds": round(secs2, 1), "resumed_from": half,
                         "checksums_equal_after_resume": rep2["checked"], "checksums_equal_both_halves": rep_all["checked"],
                         "checkpoints": ck2, "final_equals_uninterrupted": same, **rf}
    return figures


def fresh_dir(path: str) -> None:
    """A stage's own run directory from an earlier attempt goes (cluster.py refuses a dir that holds a run)."""
    if os.path.isdir(path):
        shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------------------------
# stage: throughput


def stage_throughput(ctx) -> dict:
    log, chk, s, args = ctx.log, ctx.checks, ctx.scale, ctx.args
    device = "cpu" if args.rehearse_cpu else "cuda"
    model_dir = os.path.join(args.work, "tput-model")
    fresh_dir(model_dir)
    shape = "tiny random Qwen2 (rehearsal)" if args.rehearse_cpu else "Qwen2.5-0.5B shape, random init"
    figures: dict = {"model": shape, "model_config": s.model, "dtype": s.dtype}
    common = {"model": model_dir, "dtype": s.dtype, "device": device}
    try:
        code, secs, lines = run_worker(ctx, "build-model", {**common, "config": s.model})
        built = result_of(lines)
        if not chk("model built and saved", code == 0 and built is not None, f"exit {code} after {secs:.0f}s"):
            return figures
        figures["n_params"] = built["n_params"]
        log.say(f"model: {built['n_params'] / 1e6:.1f} M parameters -> {model_dir} ({secs:.0f}s)", key=True)
        if "learner" in args.throughput_parts:
            figures["learner"] = tput_learner(ctx, common)
        if "gen" in args.throughput_parts:
            figures["generation"] = tput_gen(ctx, common)
        if "vllm-gen" in args.throughput_parts and not args.rehearse_cpu and not ctx.vllm_broken:
            figures["vllm_generation"] = tput_gen(ctx, {**common, "enforce_eager": True, "gpu_memory_utilization": 0.5},
                                                  "vllm-gen")
    finally:
        if not args.keep_model:
            shutil.rmtree(model_dir, ignore_errors=True)
    return figures


def run_worker(ctx, kind: str | None, spec: dict, timeout_s: float | None = None, on_line=None,
               module: str = WORKER_MODULE) -> tuple[int, float, list[str]]:
    """A worker child (`module` KIND SPEC_JSON; a module of one worker takes no KIND) with its lines in the log."""
    argv = [ctx.args.python, "-m", module, *([kind] if kind else []), json.dumps(spec)]
    return run_logged(argv, ctx.log, ctx.timeout(timeout_s or ctx.scale.worker_timeout_s), env=child_env(ctx.args),
                      on_line=on_line)


def tput_learner(ctx, common: dict) -> dict:
    log, chk, s = ctx.log, ctx.checks, ctx.scale
    from common.transport import free_port

    spec = {**common, "port": free_port(), "samples": s.samples, "prompt_tokens": s.prompt_tokens,
            "response_tokens": s.response_tokens, "micro_batch_tokens": list(s.micro_batch_tokens), "warmup": s.warmup,
            "timed": s.timed}
    code, secs, lines = run_worker(ctx, "learner", spec)
    r = result_of(lines)
    if not chk("learner throughput measured", code == 0 and r is not None, f"exit {code} after {secs:.0f}s"):
        return {"exit_code": code}
    peak = None if ctx.args.rehearse_cpu else peak_flops(ctx.facts["device"])
    r["peak_flops_bf16_dense"] = peak if peak else ("unknown peak" if not ctx.args.rehearse_cpu else None)
    r["mfu"] = round(r["model_flops_per_s"] / peak, 4) if peak else None
    r["mfu_definition"] = ("(6 N tokens + causal attention 6 L d S(S+1) per sequence) / train_s / peak dense bf16 "
                           "FLOP/s; N = all parameters (tied embedding once); one forward + one backward per step "
                           "(learner.log_entropy_delta = false)")
    chk("every timed step trained (finite grad norm, none skipped)", r["all_steps_applied"],
        "; ".join(f"{x['micro_batch_tokens']}: {[round(g, 4) for g in x['grad_norms']]}" for x in r["settings"]))
    m = LEARNER_LINE.search(r["learner_line"])
    want_bf16, want_dev = ("False", "cpu") if ctx.args.rehearse_cpu else ("True", "cuda")
    chk(f"trainer: ZeRO-1, bf16 {want_bf16}, device {want_dev}", bool(m) and m.group(1) == "1" and
        m.group(3) == want_bf16 and m.group(6).startswith(want_dev), r["learner_line"] or "no 'learner: ZeRO-' line")
    mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else (", MFU n/a (unknown peak)" if not ctx.args.rehearse_cpu
                                                                 else ", MFU null (CPU rehearsal)")
    mem = f", peak GPU memory {r['peak_allocated_gib']:.1f} GiB" if r.get("peak_allocated_gib") is not None else ""
    for x in r["settings"]:
        x["mfu"] = round(x["model_flops_per_s"] / peak, 4) if peak else None
        log.say(f"  micro_batch_tokens {x['micro_batch_tokens']}: {x['micro_batches']} micro-batches, "
                f"{x['tokens_per_s']:.0f} tokens/s, {x['model_flops_per_s'] / 1e12:.2f} TFLOP/s"
                + (f", MFU {x['mfu']:.1%}" if x["mfu"] is not None else ""), key=True)
    log.say(f"learner (best: micro_batch_tokens {r['micro_batch_tokens']}): {r['tokens_per_s']:.0f} tokens/s "
            f"({r['tokens_per_step']} tokens/step, {r['samples']} x ({r['prompt_tokens']} + {r['response_tokens']})), "
            f"{r['model_flops_per_s'] / 1e12:.2f} TFLOP/s{mfu}{mem}; {r['learner_line']}", key=True)
    return r


def tput_gen(ctx, common: dict, worker: str = "gen") -> dict:
    """Generation tokens/s of the torch engine (`gen`) or covrl's vLLM engine (`vllm-gen`), same prompts and counts."""
    log, chk, s = ctx.log, ctx.checks, ctx.scale
    spec = {**common, "prompts": s.gen_prompts, "samples": s.gen_samples, "new_tokens": s.gen_tokens,
            "prompt_tokens": s.gen_prompt_tokens}
    code, secs, lines = run_worker(ctx, worker, spec)
    r = result_of(lines)
    if not chk(f"generation throughput measured ({worker})", code == 0 and r is not None, f"exit {code} after {secs:.0f}s"):
        err = next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
        if err:
            log.say(err, key=True)
        return {"exit_code": code}
    if "param_device" in r:  # the torch engine's, in its own process (vLLM's live in its workers)
        want = "cpu" if ctx.args.rehearse_cpu else "cuda"
        chk(f"the engine's weights are on {want}", r["param_device"].startswith(want), r["param_device"])
    mem = f", peak GPU memory {r['peak_allocated_gib']:.1f} GiB" if r.get("peak_allocated_gib") is not None else ""
    eager = f", enforce_eager {r['enforce_eager']}, engine built in {r['build_s']:.0f}s" if "build_s" in r else ""
    log.say(f"generation ({r['engine']}{eager}): {r['tokens_per_s']:.0f} tokens/s ({r['tokens']} tokens in {r['seconds']:.2f}s: "
            f"{r['prompts']} prompts x {r['samples']} samples x {r['new_tokens']} new tokens, {r['stopped']} rows "
            f"stopped early){mem}", key=True)
    return r


# ---------------------------------------------------------------------------------------------------------------
# stage: generation


def stage_generation(ctx) -> dict:
    """covrl's generator loop beside bare vLLM on one shared engine, then one weight publish per transport
    (hardware/gen_bench.py): tokens/s per engine, workload and variant, recorded as each run ends, with the goals."""
    log, chk, s, args = ctx.log, ctx.checks, ctx.scale, ctx.args
    gb = s.gen_bench
    budget = args.gen_budget_s if args.gen_budget_s is not None else gb["budget_s"]
    device, engine = ("cpu", "torch") if args.rehearse_cpu else ("cuda", "vllm")
    model_dir = os.path.join(args.work, "gen-model")
    fresh_dir(model_dir)
    figures: dict = {
        "engine": engine, "model": "tiny random Qwen2 (rehearsal)" if args.rehearse_cpu else
        "Qwen2.5-0.5B shape, random init", "model_config": s.model, "dtype": s.dtype,
        "group_size": gb["group_size"], "max_num_seqs": gb["max_num_seqs"],
        "gpu_memory_utilization": gb["gpu_memory_utilization"], "budget_s": budget, "goals": gen_goals(),
        "engines": {}, "runs": {}, "ratios": {}, "publish": {},
        "memory_plan": {"tolerance": MEMPLAN_TOLERANCE, "within": {},
                        "what": "per engine: vLLM's KV cache in tokens against common/memplan.py vllm_gpu's KV term "
                                "over kv_bytes_per_token, same config and GPU memory (engines.NAME.kv_cache); a "
                                "verdict, not a check; None: nothing measured (CPU rehearsal)"},
    }
    try:
        code, secs, lines = run_worker(ctx, "build-model", {"model": model_dir, "dtype": s.dtype, "device": device,
                                                            "config": s.model})
        built = result_of(lines)
        if not chk("model built and saved", code == 0 and built is not None, f"exit {code} after {secs:.0f}s"):
            return figures
        figures["n_params"] = built["n_params"]
        log.say(f"model: {built['n_params'] / 1e6:.1f} M parameters -> {model_dir} ({secs:.0f}s); {budget:.0f}s for "
                f"the runs", key=True)
        stage_s = ctx.timeout(budget)  # the worker starts nothing it cannot finish 30 s before this
        spec = {"model": model_dir, "dtype": s.dtype, "device": device, "engine": engine,
                "deadline_unix": time.time() + max(0.0, stage_s - 30),
                **{k: v for k, v in gb.items() if k != "budget_s"}}
        code, _, _ = run_worker(ctx, None, spec, timeout_s=stage_s, on_line=gen_line_handler(ctx, figures),
                                module=GEN_WORKER)
        figures["worker_exit_code"] = code
        gen_checks(ctx, figures, code)
    finally:
        if not args.keep_model:
            shutil.rmtree(model_dir, ignore_errors=True)
    return figures


def gen_goals() -> dict:
    return {
        "loop": {"goal": f"covrl's loop >= {GEN_GOAL_RATIO} x bare AsyncLLM with every group in flight on the "
                         f"heavy-tailed workload, with the same sampling parameters (variant bare-covrl-params)",
                 "threshold": GEN_GOAL_RATIO, "by_engine": {}},
        "publish": {"goal": f"one colocated publish of the 0.5B shape <= {GEN_GOAL_PUBLISH_S} s end to end (the "
                            f"last publish of the stage's: the first also allocates the host copies)",
                    "threshold_s": GEN_GOAL_PUBLISH_S, "by_transport": {}},
    }


def gen_line_handler(ctx, figures: dict):
    """The worker's result lines as they come, each recorded and saved at once (`ctx.save_partial`)."""

    seen: dict = {}  # vLLM's start-up log lines about its KV cache, of the engine being built (until its event)

    def on_line(line: str) -> None:
        if line.startswith(RESULT_TAG):
            r = json.loads(line[len(RESULT_TAG):])
            if r.get("event") == "engine":
                _attach_kv_log(r, seen)
            gen_record(ctx, figures, r)
            if ctx.save_partial is not None:
                ctx.save_partial(figures)
        elif m := VLLM_KV_TOKENS_LOG.search(line):
            seen["kv_tokens"] = int(m.group(1).replace(",", ""))
        elif m := VLLM_KV_MEMORY_LOG.search(line):
            seen["available_kv_cache_gib"] = float(m.group(1))

    return on_line


def _attach_kv_log(r: dict, seen: dict) -> None:
    """An engine event takes the KV cache log lines seen while it was built; the next engine starts afresh."""
    if isinstance(r.get("kv_cache"), dict):
        r["kv_cache"]["log"] = dict(seen) or None
    seen.clear()


def gen_record(ctx, figures: dict, r: dict) -> None:
    """One event of the worker into the figures, with its key line."""
    log, event = ctx.log, r.pop("event")
    if event == "plan":
        figures.update(variants=r["variants"], order=r["order"], workloads=r["workloads"])
        for name, w in r["workloads"].items():
            d = w["drawn"]
            log.say(f"workload {name}: {w['groups']} groups x {w['group_size']}, lengths per {w['lengths_per']} "
                    f"lognormal(median {w['median']}, sigma {w['sigma']}) <= {w['max_new_tokens']}: mean "
                    f"{d['length_mean']}, longest {d['length_max']} ({d['longest_over_mean']}x), {d['tokens']} tokens",
                    key=True)
    elif event == "engine":
        name = r.pop("engine")
        figures["engines"][name] = r
        log.say(f"engine {name}: {r['status']}" + (f" in {r['build_s']}s: {r['what']}" if "build_s" in r else
                                                   f": {r.get('reason') or r.get('error')}"), key=True)
        if isinstance(r.get("kv_cache"), dict):
            gen_kv_verdict(ctx, figures, name, r["kv_cache"])
    elif event == "warmup":
        figures["engines"].setdefault(r["engine"], {}).update(warmup_s=r["seconds"], warmup_error=r["error"])
    elif event == "run":
        gen_run(ctx, figures, r)
    elif event == "publish":
        gen_publish(ctx, figures, r)
    elif event == "done":
        figures["worker_done"] = True


def gen_kv_verdict(ctx, figures: dict, name: str, kv: dict) -> None:
    """An engine's KV cache in tokens (vLLM's num_gpu_blocks x block_size; else its 'GPU KV cache size' log line)
    over common/memplan.py's prediction (hardware/gen_bench.py `kv_plan`), and whether it is within
    MEMPLAN_TOLERANCE: recorded in `kv` and figures["memory_plan"], with a key line; a miss is a finding, not a
    failed check. The CPU rehearsal records the plan only."""
    plan, got, seen = kv.get("plan") or {}, kv.get("measured") or {}, kv.get("log") or {}
    tokens, source = got.get("kv_tokens"), got.get("source")
    if not tokens and seen.get("kv_tokens"):
        tokens, source = seen["kv_tokens"], "vLLM's start-up log line 'GPU KV cache size: N tokens'"
    kv.update(tolerance=MEMPLAN_TOLERANCE, kv_tokens=tokens, kv_tokens_source=source, kv_tokens_over_plan=None,
              within_tolerance=None)
    if tokens and plan.get("kv_tokens"):
        ratio = tokens / plan["kv_tokens"]
        kv.update(kv_tokens_over_plan=round(ratio, 4), within_tolerance=abs(ratio - 1) <= MEMPLAN_TOLERANCE)
    else:
        kv["no_verdict"] = (plan.get("error") and f"no plan: {plan['error']}" or
                            got.get("reason") or "no KV cache size from vLLM (neither its config nor its log)")
    if seen.get("available_kv_cache_gib") and plan.get("kv_cache_bytes"):
        kv["kv_bytes_over_plan"] = round(seen["available_kv_cache_gib"] * 2**30 / plan["kv_cache_bytes"], 4)
    mp = figures.setdefault("memory_plan", {"tolerance": MEMPLAN_TOLERANCE, "within": {}})
    mp["within"][f"{name} KV cache"] = kv["within_tolerance"]
    if "kv_tokens" not in plan:
        ctx.log.say(f"engine {name} KV cache: no plan ({plan.get('error')})", key=True)
        return
    planned = (f"plan {plan['kv_tokens']:,} tokens ({plan['kv_cache_bytes'] / 2**30:.2f} GiB of "
               f"{plan['gpu_memory_utilization']} x {plan['gpu_bytes'] / 2**30:.1f} GiB, {plan['gpu_bytes_source']})")
    if kv["within_tolerance"] is None:
        ctx.log.say(f"engine {name} KV cache: {planned}; measured: none ({kv['no_verdict']})", key=True)
        return
    verdict = (f"within {MEMPLAN_TOLERANCE:.0%}" if kv["within_tolerance"] else
               f"OUTSIDE {MEMPLAN_TOLERANCE:.0%} (a finding for common/memplan.py)")
    ctx.log.say(f"engine {name} KV cache: {tokens:,} tokens ({source}), {planned}: {kv['kv_tokens_over_plan']:.2f}x "
                f"the plan, {verdict}", key=True)


def gen_run(ctx, figures: dict, r: dict) -> None:
    eng, wl, variant = r.pop("engine"), r.pop("workload"), r.pop("variant")
    figures["runs"].setdefault(eng, {}).setdefault(wl, {})[variant] = r
    tag = f"{eng} {wl} {variant}"
    if r["status"] != "measured":
        ctx.log.say(f"{tag}: {r['status']}: {r.get('reason') or r.get('error')}", key=True)
        return
    extra = (f"; start-up {r['startup_s']:.2f}s, {r['groups_back']} groups back" if variant == "loop" else "")
    ctx.log.say(f"{tag}: {r['tokens_per_s']:.0f} tokens/s ({r['tokens']} tokens in {r['seconds']:.2f}s; lengths mean "
                f"{r['length_mean']}, longest {r['length_max']}){extra}", key=True)
    gen_ratios(ctx, figures, eng, wl)


def gen_ratios(ctx, figures: dict, eng: str, wl: str) -> None:
    """Each measured variant's tokens/s over the reference's (bare-covrl-params; in the rehearsal, which has no
    bare vLLM, covrl's engine driven alone stands in), and the loop goal on the heavy workload."""
    runs = {v: x for v, x in figures["runs"][eng][wl].items() if x.get("status") == "measured"}
    ref = "bare-covrl-params" if "bare-covrl-params" in runs else "engine" if ctx.args.rehearse_cpu else None
    if ref not in runs:
        return
    over = {v: round(x["tokens_per_s"] / runs[ref]["tokens_per_s"], 4) for v, x in runs.items()}
    out = {"reference": ref, "over_reference": over}
    if "bare" in runs and "bare-covrl-params" in runs:  # what covrl's sampling parameters cost vLLM itself
        out["covrl_params_over_bare"] = round(runs["bare-covrl-params"]["tokens_per_s"] /
                                              runs["bare"]["tokens_per_s"], 4)
    figures["ratios"].setdefault(eng, {})[wl] = out
    if wl == "heavy" and "loop" in over:
        rehearsal = ref != "bare-covrl-params"
        figures["goals"]["loop"]["by_engine"][eng] = {
            "ratio": over["loop"], "reference": ref,
            "met": None if rehearsal else over["loop"] >= GEN_GOAL_RATIO,
            **({"note": "CPU rehearsal: the torch engine driven alone as the reference, not the goal's"} if rehearsal
               else {})}


def gen_publish(ctx, figures: dict, r: dict) -> None:
    t = r.pop("transport")
    figures["publish"][t] = r
    if r["status"] != "measured":
        ctx.log.say(f"publish {t}: {r['status']}: {r.get('reason') or r.get('error')}", key=True)
        return
    last = r["versions"][-1]
    rehearsal = ctx.args.rehearse_cpu
    figures["goals"]["publish"]["by_transport"][t] = {
        "end_to_end_s": last["end_to_end_s"], "met": None if rehearsal else last["end_to_end_s"] <= GEN_GOAL_PUBLISH_S,
        **({"note": "CPU rehearsal: a tiny model, not the goal's"} if rehearsal else {})}
    phases = "; ".join(f"v{v['version']}: {v['end_to_end_s']:.3f}s end to end (learner publish {v['publish_s']:.3f}, "
                       f"generator receive {v['receive_s']:.3f}, load {v['load_s']})" for v in r["versions"])
    ctx.log.say(f"publish {t}: {r['bytes'] / 1e6:.1f} MB, assembly {r['assembly_s']:.3f}s; {phases}", key=True)


def gen_checks(ctx, figures: dict, code: int) -> None:
    chk = ctx.checks
    chk("the worker finished (exit 0, every result written)", code == 0 and figures.get("worker_done") is True,
        f"exit {code}")
    engines = figures["engines"]
    chk("the eager engine built", engines.get("eager", {}).get("status") == "built",
        str(engines.get("eager", {}).get("error") or ""))
    graphs = engines.get("graphs", {})
    chk("the CUDA-graph engine built (or was skipped / not run, with why)",
        graphs.get("status") in ("built", "skipped", "not_run"), str(graphs.get("error") or graphs.get("status")))
    for eng, wls in figures["runs"].items():
        for wl, runs in wls.items():
            gen_run_checks(ctx, figures, eng, wl, runs)
    heavy = figures["runs"].get("eager", {}).get("heavy", {})
    ref = figures["ratios"].get("eager", {}).get("heavy", {}).get("reference")
    chk("eager heavy: the goal's pair measured (loop and its reference)",
        heavy.get("loop", {}).get("status") == "measured" and ref is not None, f"reference {ref}")
    gen_publish_checks(ctx, figures)
    for goal in figures["goals"].values():
        for key, g in {**goal.get("by_engine", {}), **goal.get("by_transport", {})}.items():
            verdict = "n/a (rehearsal)" if g["met"] is None else "MET" if g["met"] else "NOT MET"
            ctx.log.say(f"goal {goal['goal']}: {key}: {g.get('ratio', g.get('end_to_end_s'))} -> {verdict}", key=True)


def gen_run_checks(ctx, figures: dict, eng: str, wl: str, runs: dict) -> None:
    """A workload's runs on one engine: none failed, all did the same work, the heavy one's tail, the loop's
    groups all back."""
    chk, tag = ctx.checks, f"{eng} {wl}"
    for variant, r in runs.items():
        if r["status"] == "error":
            chk(f"{tag} {variant}: measured", False, r["error"])
    done = {v: r for v, r in runs.items() if r["status"] == "measured"}
    if not done:
        return
    work = {v: (r["tokens"], r["samples"], r["length_max"]) for v, r in done.items()}
    chk(f"{tag}: every variant generated the same work (tokens, samples, longest)", len(set(work.values())) == 1,
        str(work))
    first = next(iter(done.values()))
    if wl == "heavy":
        chk(f"{tag}: the longest response >= {GEN_MIN_TAIL:g}x the mean", first["longest_over_mean"] >= GEN_MIN_TAIL,
            f"longest {first['length_max']}, mean {first['length_mean']}")
    loop = done.get("loop")
    if loop is not None:
        want = figures["workloads"][wl]["groups"]
        chk(f"{tag} loop: every group back at the hub, none rejected, run_actor exited 0",
            loop["groups_back"] == want and not loop["rejected"] and loop["exit_code"] == 0,
            f"{loop['groups_back']} of {want}, rejected {loop['rejected']}, exit {loop['exit_code']}")


def gen_publish_checks(ctx, figures: dict) -> None:
    chk = ctx.checks
    for t, r in figures["publish"].items():
        if r["status"] == "error":
            chk(f"publish {t}: measured", False, r["error"])
        if r["status"] != "measured":
            continue
        sums = [v["checksums_equal"] for v in r["versions"]]
        chk(f"publish {t}: every version's checksum equal on both sides", all(x is not False for x in sums), str(sums))
        chk(f"publish {t}: the loaded weights' fingerprint equals the learner's", r["fingerprint_equal"],
            f"{r['fingerprint_generator']} vs {r['fingerprint_learner']}")
    chk("publish rpc: measured", figures["publish"].get("rpc", {}).get("status") == "measured",
        str(figures["publish"].get("rpc", {}).get("reason") or figures["publish"].get("rpc", {}).get("error") or ""))


# ---------------------------------------------------------------------------------------------------------------
# stage: learner


def learner_variant(name: str) -> dict:
    """A learner stage variant's name, ATTN-HEAD[-compile][-gc], as the learner config overrides it stands for;
    ValueError saying the form otherwise."""
    attn, _, rest = name.partition("-")
    head, *extras = rest.split("-")
    if attn not in LEARNER_ATTN or head not in LEARNER_HEADS or len(set(extras)) != len(extras) or \
            any(x not in LEARNER_EXTRAS for x in extras):
        raise ValueError(f"learner variant {name!r}: write ATTN-HEAD[-compile][-gc] with ATTN one of "
                         f"{', '.join(LEARNER_ATTN)} and HEAD one of {', '.join(LEARNER_HEADS)}, e.g. varlen-fused-gc")
    over = {"learner.attn_implementation": attn, "learner.logprob_head": head,
            "learner.gradient_checkpointing": "gc" in extras}
    if "compile" in extras:  # only when asked: a checkout without the switch still runs every other variant
        over[LEARNER_EXTRAS["compile"]] = True
    return over


def learner_cpu_skip(over: dict) -> str | None:
    """Why the CPU rehearsal does not run a variant (recorded as skipped, never as passed), or None."""
    from common.config import triton_interpreted

    why = []
    attn = over["learner.attn_implementation"]
    if attn in ("varlen", "flash_attention_2"):
        why.append(f"attn_implementation {attn}: FlashAttention-2 varlen kernels need CUDA (on a CPU covrl's varlen "
                   f"runs one sdpa per sample, which says nothing about the kernels)")
    if over.get(LEARNER_EXTRAS["compile"]):
        why.append("compile_layers: torch.compile of the decoder layers takes minutes on a CPU and its speed there "
                   "says nothing about the GPU's")
    head = over["learner.logprob_head"]
    if head == "inductor":
        why.append("logprob_head inductor: torch.compile of the head's passes takes ~30 s a shape on a CPU and its "
                   "speed there says nothing about the GPU's (tests/unit/test_head_kernels.py checks its numbers)")
    if head == "triton" and not triton_interpreted():
        why.append("logprob_head triton: Triton kernels need CUDA (TRITON_INTERPRET=1 runs them on a CPU, slowly)")
    return "; ".join(why) + "; CPU rehearsal" if why else None


def learner_plan(args, shapes: dict) -> list[tuple[str, str]]:
    """The learner stage's (shape, variant) items in order: FIRST_LEASE_PLAN's (for the shapes asked) under
    --first-lease, else every variant of each shape in turn."""
    if args.first_lease:
        return [(shape, v) for shape, v in FIRST_LEASE_PLAN if shape in shapes]
    return [(shape, v) for shape in shapes for v in args.learner_variants]


def stage_learner(ctx) -> dict:
    """Today's learner path and the new one side by side (hardware/learner_bench.py): per shape, per variant, per
    packing budget tokens/s, MFU, the speed-up over the shape's baseline measured in this command, peak memory, one
    profiled step's split, what ran (read from the live objects), and the first step's agreement with the
    baseline."""
    from hardware.learner_bench import LEAK_LIMIT_GIB

    log, s, args = ctx.log, ctx.scale, ctx.args
    plan = learner_plan(args, s.learner_shapes)
    names = list(dict.fromkeys(v for _, v in plan))
    peak = None if args.rehearse_cpu else peak_flops(ctx.facts["device"])
    stage_end, hard_end = learner_deadlines(ctx)
    figures = {
        "baseline": names[0], "variants": names, "plan": [f"{shape} {v}" for shape, v in plan], "dtype": s.dtype,
        "zero_stage": 1, "warmup_steps": s.learner_warmup, "timed_steps": s.learner_timed,
        "budget_s": round(stage_end - time.monotonic(), 1),
        "peak_flops_bf16_dense": peak if peak else (None if args.rehearse_cpu else "unknown peak"),
        "mfu_definition": "(6 N tokens + causal attention 6 L d S(S+1) per sequence) / train_s / peak dense bf16 "
                          "FLOP/s; N = the parameters in matmuls (all of them, a tied embedding once as the head; an "
                          "untied input embedding is a lookup and not counted); model FLOPs, so gradient "
                          "checkpointing's recompute lowers MFU; one forward + one backward per step",
        "agreement_tolerance": {"first_step_rel": LEARNER_AGREE_REL[s.dtype],
                                "hidden_rel": LEARNER_HIDDEN_REL[s.dtype]},
        "memory_plan": {"tolerance": MEMPLAN_TOLERANCE, "within": {},
                        "what": "per budget: torch.cuda.max_memory_allocated over the budget (peak_bytes) against "
                                "common/memplan.py learner_gpu on one rank, rank 0, every term summed (plan_bytes); "
                                "within the tolerance or a finding (a verdict, not a check); None: no peak (CPU "
                                "rehearsal, out of memory)"},
        "leak_limit_gib": LEAK_LIMIT_GIB,
        "shapes": {},
    }
    for shape in dict.fromkeys(shape for shape, _ in plan):
        sh = s.learner_shapes[shape]
        figures["shapes"][shape] = {**{k: sh[k] for k in ("what", "samples", "prompt_tokens", "response_tokens")},
                                    "model_config": sh["model"], "micro_batch_tokens": list(sh["micro_batch_tokens"]),
                                    "variants": {}}
        log.say(f"{shape}: {sh['what']}, {sh['samples']} x ({sh['prompt_tokens']} + {sh['response_tokens']}) "
                f"tokens, micro_batch_tokens {', '.join(map(str, sh['micro_batch_tokens']))}")
    log.say(f"plan ({len(plan)} items, {stage_end - time.monotonic():.0f}s to start them in): "
            + ", ".join(f"{shape} {v}" for shape, v in plan))
    try:
        learner_run_plan(ctx, figures, learner_todo(ctx, figures, plan), stage_end, hard_end, peak)
    finally:
        if not args.keep_model:
            for shape in figures["shapes"]:
                shutil.rmtree(os.path.join(args.work, f"learner-model-{shape}"), ignore_errors=True)
    for shape, out in figures["shapes"].items():
        base = out["variants"].get(figures["baseline"], {})
        ctx.checks(f"{shape}: the baseline {figures['baseline']} measured",
                   base.get("status") in ("measured", "skipped"), base.get("error") or base.get("reason") or "")
    starts = {f"{shape} {name}": rec.get("allocated_at_start_gib") for shape, out in figures["shapes"].items()
              for name, rec in out["variants"].items() if rec.get("allocated_at_start_gib") is not None}
    if starts:
        ctx.checks(f"memory released between variants (each started with < {LEAK_LIMIT_GIB:g} GiB allocated)",
                   all(v < LEAK_LIMIT_GIB for v in starts.values()),
                   ", ".join(f"{k} {v:.2f}" for k, v in starts.items()))
    return figures


def learner_deadlines(ctx) -> tuple[float, float]:
    """(when the stage stops starting items, when its worker is killed at the latest), on the monotonic clock.
    --first-lease: FIRST_LEASE_TESTS_S and FIRST_LEASE_TESTS_MIN_S before the command's deadline (the tests stage
    comes after). Otherwise --learner-budget-s from now, LEARNER_GRACE_S more for the item under way; both within the
    command's --deadline-s (10 s kept for the logs)."""
    now = time.monotonic()
    if ctx.args.first_lease and ctx.deadline is not None:
        return ctx.deadline - FIRST_LEASE_TESTS_S, ctx.deadline - FIRST_LEASE_TESTS_MIN_S
    stage_end = now + ctx.scale.learner_budget_s
    hard_end = stage_end + LEARNER_GRACE_S
    if ctx.deadline is not None:
        stage_end, hard_end = min(stage_end, ctx.deadline - 10), min(hard_end, ctx.deadline - 10)
    return stage_end, hard_end


def learner_todo(ctx, figures: dict, plan: list[tuple[str, str]]) -> list[dict]:
    """The items a worker is to run ({shape, name, overrides}); on the CPU rehearsal those that cannot run there
    are recorded as skipped, with why. --learner-inject-oom marks a variant for the rehearsal's out-of-memory test."""
    todo = []
    for shape, name in plan:
        over = learner_variant(name)
        why = learner_cpu_skip(over) if ctx.args.rehearse_cpu else None
        if why:
            figures["shapes"][shape]["variants"][name] = {"status": "skipped", "reason": why, "overrides": over}
            ctx.log.say(f"{shape} {name}: skipped: {why}", key=True)
        else:
            item = {"shape": shape, "name": name, "overrides": over}
            if name in ctx.args.learner_inject_oom:
                item["inject"] = "oom"
            todo.append(item)
    return todo


def learner_line_handler(ctx, figures: dict, started: list[tuple[str, str]], peak: float | None):
    """The worker's result lines as they come: each shape's model, each item's start (into `started`), and each
    item's figures, recorded and saved at once (`ctx.save_partial`)."""

    def on_line(line: str) -> None:
        if not line.startswith(RESULT_TAG):
            return
        r = json.loads(line[len(RESULT_TAG):])
        out = figures["shapes"][r["shape"]]
        if r["event"] == "model":
            out.update(n_params=r["n_params"], model_build_s=r["build_s"] if r["built_now"] else 0.0)
        elif r["event"] == "start":
            started.append((r["shape"], r["variant"]))
        else:
            learner_record(ctx, figures, r["shape"], r, peak)
            if ctx.save_partial is not None:
                ctx.save_partial(figures)

    return on_line


def learner_run_plan(ctx, figures: dict, todo: list[dict], stage_end: float, hard_end: float,
                     peak: float | None) -> None:
    """The items in one worker (another one for the rest after a crash, a broken CUDA context or a leak, three
    workers at most), each recorded as its result line comes. The worker starts no item past `stage_end` (its own
    estimates) and is killed at `hard_end`."""
    from common.transport import free_port
    from hardware.learner_bench import CONTEXT_BROKEN_EXIT, LEAKED_EXIT

    s, args = ctx.scale, ctx.args
    device, code = ("cpu" if args.rehearse_cpu else "cuda"), None
    done = lambda item: item["name"] in figures["shapes"][item["shape"]]["variants"]  # noqa: E731
    for _ in range(3):
        if not todo:
            break
        started: list[tuple[str, str]] = []
        shapes = {item["shape"] for item in todo}
        spec = {"shapes": {shape: {"model": os.path.join(args.work, f"learner-model-{shape}"),
                                   "config": s.learner_shapes[shape]["model"],
                                   **{k: s.learner_shapes[shape][k]
                                      for k in ("samples", "prompt_tokens", "response_tokens")},
                                   "micro_batch_tokens": list(s.learner_shapes[shape]["micro_batch_tokens"])}
                           for shape in shapes},
                "dtype": s.dtype, "device": device, "port": free_port(), "warmup": s.learner_warmup,
                "timed": s.learner_timed, "baseline": figures["baseline"], "profile": args.learner_profile,
                "plan": todo, "deadline_unix": time.time() + (stage_end - time.monotonic())}
        timeout = max(1.0, hard_end - time.monotonic())
        code, _, _ = run_worker(ctx, None, spec, timeout_s=timeout,
                                on_line=learner_line_handler(ctx, figures, started, peak), module=LEARNER_WORKER)
        todo = [item for item in todo if not done(item)]
        if started and not done({"shape": started[-1][0], "name": started[-1][1]}):  # under way when it ended
            died = "timed out" if code == 124 else f"the worker died during it (exit {code}; learner.log has why)"
            learner_record(ctx, figures, started[-1][0], {
                "event": "variant", "variant": started[-1][1], "status": "not_run" if code == 124 else "error",
                "error": died, "reason": died}, peak)
            todo = [item for item in todo if not done(item)]
        if not todo or code == 124 or time.monotonic() > stage_end or not started:
            break
        why = {CONTEXT_BROKEN_EXIT: "its CUDA context broke", LEAKED_EXIT: "memory stayed allocated"}.get(code, "")
        ctx.log.say(f"a new worker for {', '.join(i['shape'] + ' ' + i['name'] for i in todo)} (the last exited "
                    f"{code}{': ' + why if why else ''})", key=True)
    why = ("the stage's time ran out (its worker was stopped)" if code == 124 else
           "the stage's time was spent" if time.monotonic() > stage_end else
           f"the worker exited (exit {code}) before it: learner.log has why")
    for item in todo:
        learner_record(ctx, figures, item["shape"], {"event": "not_run", "variant": item["name"], "reason": why},
                       peak)


def learner_record(ctx, figures: dict, shape: str, r: dict, peak: float | None) -> None:
    """One variant's result line into the figures, with what needs the baseline (speed-ups, agreement), its
    checks and one key line."""
    from hardware.learner_bench import OOM

    log, chk = ctx.log, ctx.checks
    out, name, base_name = figures["shapes"][shape], r["variant"], figures["baseline"]
    rec = {k: v for k, v in r.items() if k not in ("event", "variant")}
    if r["event"] == "not_run":
        rec["status"] = "not_run"
    out["variants"][name] = rec
    tag = f"{shape} {name}"
    if rec["status"] == "not_run":
        log.say(f"{tag}: not run: {rec['reason']}", key=True)
        return
    if rec["status"] == OOM:  # a finding (the 7B-shaped stack at 20k tokens may not fit): recorded, the stage goes on
        log.say(f"{tag}: out of memory: {rec.get('error', '')[:300]}", key=True)
        if not any("error" not in b for b in rec.get("budgets", [])):
            return
    elif not chk(f"{tag}: measured", rec["status"] == "measured", rec.get("error", "")):
        return
    base = out["variants"].get(base_name) if name != base_name else rec
    base_budgets = {b["micro_batch_tokens"]: b for b in (base or {}).get("budgets", []) if "error" not in b}
    timed = [b for b in rec["budgets"] if "error" not in b]
    for b in timed:
        b["mfu"] = round(b["model_flops_per_s"] / peak, 4) if peak else None
        ref = base_budgets.get(b["micro_batch_tokens"])
        b["speedup"] = round(b["tokens_per_s"] / ref["tokens_per_s"], 3) if ref else None
    chk(f"{tag}: every step trained (finite grad norm, none skipped)", rec["all_steps_applied"],
        "; ".join(f"{b['micro_batch_tokens']}: {[round(g, 4) for g in b['grad_norms']]}" for b in timed))
    learner_settings_check(ctx, tag, rec)
    for b in rec["budgets"]:
        b["memory_plan"] = learner_memory_plan(ctx, figures, shape, rec["overrides"], b)
        figures.setdefault("memory_plan", {"tolerance": MEMPLAN_TOLERANCE, "within": {}})["within"][
            f"{shape} {name} @{b['micro_batch_tokens']}"] = b["memory_plan"].get("within_tolerance")
    learner_memory_line(ctx, tag, rec["budgets"])
    rec["agreement"] = learner_agreement(figures, rec, base if name != base_name else None)
    ag = rec["agreement"]
    if name != base_name and ag.get("first_step_rel_diff"):
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in {**ag["first_step_rel_diff"],
                                                      "hidden": ag.get("hidden_rel_diff")}.items() if v is not None)
        chk(f"{tag}: its first step agrees with {base_name}'s (relative difference <= "
            f"{ag['tolerance']:g}, hidden states <= {ag['hidden_tolerance']:g})", not ag["flagged"],
            f"{diffs}" + (f"; FLAGGED: {', '.join(ag['flagged'])}" if ag["flagged"] else ""))
    parts = []
    for b in rec["budgets"]:
        mem = b.get("peak_allocated_gib")
        if "error" in b:
            parts.append(f"{b['micro_batch_tokens']}: out of memory" + (f" (peak {mem:.1f} GiB)" if mem else ""))
            continue
        parts.append(f"{b['micro_batch_tokens']}: {b['tokens_per_s']:.0f} tok/s"
                     + (f" ({b['speedup']:.2f}x)" if b["speedup"] is not None else "")
                     + (f", MFU {b['mfu']:.1%}" if b["mfu"] is not None else "")
                     + (f", peak {mem:.1f} GiB" if mem is not None else ""))
    prof = next((b["profile"] for b in reversed(rec["budgets"]) if b.get("profile")), None)
    if prof:
        parts.append(f"profile ({prof['clock']}, s): attention {prof['attention_s']:.3g}, head {prof['head_s']:.3g}, "
                     f"optimizer {prof['optimizer_s']:.3g}, body {prof['body_s']:.3g} of {prof['total_s']:.3g}")
    log.say(f"{tag}: " + "; ".join(parts), key=True)


def learner_memory_plan(ctx, figures: dict, shape: str, over: dict, b: dict) -> dict:
    """common/memplan.py's prediction for one budget of a variant: the config the worker runs (hardware/learner_bench.py
    `run_variant`: ZeRO-1, the stage's dtype, the variant's overrides, micro_batch_tokens = the budget) and
    `learner_gpu` on one rank, rank 0, every term summed (`plan_bytes`), beside the measured peak (`peak_bytes`:
    torch.cuda.max_memory_allocated over the budget) and their ratio, within MEMPLAN_TOLERANCE or not (a verdict,
    not a check). `plan_allocator_bytes` leaves out the CUDA runtime term, which torch's allocator does not count.
    The CPU rehearsal has no CUDA peak: the plan (for the CPU: cuda=False) and `peak_bytes` None, with why."""
    cuda = not ctx.args.rehearse_cpu
    out: dict = {"tolerance": MEMPLAN_TOLERANCE, "ranks": 1, "rank": 0, "cuda": cuda}
    try:
        from common import memplan
        from common.config import load_config
        from hardware.learner_bench import GROUP

        sh = figures["shapes"][shape]
        cfg = load_config(None, [
            f"model.dtype={json.dumps(figures['dtype'])}", f"learner.zero_stage={figures.get('zero_stage', 1)}",
            "learner.log_entropy_delta=false", f"rollout.max_new_tokens={sh['response_tokens']}",
            f"rollout.group_size={GROUP}", f"rollout.groups_per_step={max(1, sh['samples'] // GROUP)}",
            *(f"{k}={json.dumps(x)}" for k, x in over.items()),
            f"learner.micro_batch_tokens={b['micro_batch_tokens']}"])
        model = memplan.Shape.from_config({"model_type": "qwen2", **sh["model_config"]})  # save_random_model's Qwen2
        terms = memplan.learner_gpu(cfg, model, ranks=1, rank=0, cuda=cuda)
    except Exception as e:  # noqa: BLE001 - recorded: the figure is missing, the stage goes on
        return {**out, "error": f"{type(e).__name__}: {e}"[:500], "within_tolerance": None}
    plan = sum(t.bytes for t in terms)
    alloc = sum(t.bytes for t in terms if t.name != "CUDA runtime")
    out.update(plan_bytes=int(plan), plan_allocator_bytes=int(alloc), plan_params=model.params,
               terms={t.name: int(t.bytes) for t in terms}, peak_bytes=None, peak_over_plan=None,
               within_tolerance=None)
    gib = b.get("peak_allocated_gib")
    peak = b.get("peak_allocated_bytes") or (gib * 2**30 if gib is not None else None)
    if not cuda:
        out["why"] = ("CPU rehearsal: no CUDA peak (torch.cuda.max_memory_allocated); the process's peak RSS "
                      "(peak_rss_gib) holds Python, torch and the data too, and is not the plan's GPU figure")
    elif peak is None:
        out["why"] = "the worker recorded no peak for this budget"
    else:
        ratio = peak / plan
        out.update(peak_bytes=int(peak), peak_over_plan=round(ratio, 4),
                   peak_over_plan_allocator=round(peak / alloc, 4))
        if "peak_allocated_bytes" not in b:
            out["peak_bytes_from"] = "peak_allocated_gib (rounded to 0.01 GiB)"
        if "error" in b:
            out["why"] = "out of memory at this budget: the peak is where it stopped, not the step's (no verdict)"
        else:
            out["within_tolerance"] = abs(ratio - 1) <= MEMPLAN_TOLERANCE
    return out


def learner_memory_line(ctx, tag: str, budgets: list[dict]) -> None:
    """One key line per variant: each budget's plan, and its peak over the plan with the verdict."""
    parts = []
    for b in budgets:
        m = b.get("memory_plan", {})
        if "plan_bytes" not in m:
            parts.append(f"{b['micro_batch_tokens']}: no plan ({m.get('error')})")
        elif m["peak_over_plan"] is None:
            parts.append(f"{b['micro_batch_tokens']}: plan {m['plan_bytes'] / 2**30:.2f} GiB, no peak to compare")
        else:
            verdict = ("no verdict (out of memory)" if m["within_tolerance"] is None else
                       f"within {MEMPLAN_TOLERANCE:.0%}" if m["within_tolerance"] else
                       f"OUTSIDE {MEMPLAN_TOLERANCE:.0%}")
            parts.append(f"{b['micro_batch_tokens']}: peak {m['peak_bytes'] / 2**30:.2f} of plan "
                         f"{m['plan_bytes'] / 2**30:.2f} GiB ({m['peak_over_plan']:.2f}x, {verdict})")
    ctx.log.say(f"{tag} memory vs common/memplan.py: " + "; ".join(parts), key=True)


def learner_settings_check(ctx, tag: str, rec: dict) -> None:
    """What the variant ran, read from the live objects by the worker (`live`), against what it asks: a switch this
    checkout ignores, or a kernel that fell back, would measure the baseline twice. Varlen on a GPU must have run
    torch's varlen kernels in every attention call (never the per-sample sdpa fallback); the head its kernels; the
    optimizer fused AdamW (on a GPU; torch's plain AdamW on the CPU); the parameters in the stage's dtype; gradient
    checkpointing as asked. The trainer's 'learner:' line is kept beside it (`learner_line`) for the eye."""
    live, over = rec.get("live") or {}, rec["overrides"]
    gpu = not ctx.args.rehearse_cpu
    wrong = []
    if not live:
        wrong.append("the worker reported no live settings")
    else:
        calls = live["attention_calls"]
        compiled = bool(over.get(LEARNER_EXTRAS["compile"]))  # compiled layers do not count (attention.CALLS)
        if over["learner.attn_implementation"] == "varlen" and not compiled:
            if gpu and (calls["per_sample_sdpa"] or not calls["kernels"]):
                wrong.append(f"varlen fell back to per-sample sdpa ({calls})")
            if not gpu and not calls["per_sample_sdpa"]:
                wrong.append(f"varlen attention never called ({calls})")
        elif calls["kernels"] or calls["per_sample_sdpa"]:
            wrong.append(f"covrl's varlen attention ran under {over['learner.attn_implementation']} ({calls})")
        if live["head"] != over["learner.logprob_head"]:
            wrong.append(f"head {live['head']} (asked {over['learner.logprob_head']})")
        if live["fused_adamw"] != gpu:
            wrong.append(f"fused AdamW {live['fused_adamw']} ({live['optimizer']}) on {'a GPU' if gpu else 'the CPU'}")
        if live["param_dtype"] != ctx.scale.dtype:
            wrong.append(f"parameters in {live['param_dtype']} (the stage trains {ctx.scale.dtype})")
        if live["gradient_checkpointing"] != bool(over.get("learner.gradient_checkpointing")):
            wrong.append(f"gradient checkpointing {live['gradient_checkpointing']}")
    ctx.checks(f"{tag}: it ran what the variant asks (read from the live model and optimizer)", not wrong,
               "; ".join(wrong) or json.dumps(live))


def learner_agreement(figures: dict, rec: dict, base: dict | None) -> dict:
    """The first step against the baseline's: relative differences of grad norm, mean log pi(target) and entropy,
    and (from the worker) of the first micro-batch's hidden states; the ones over tolerance are `flagged`."""
    tol, htol = figures["agreement_tolerance"]["first_step_rel"], figures["agreement_tolerance"]["hidden_rel"]
    if base is None:
        return {"baseline": True}
    if base.get("status") != "measured" or not base.get("first_step") or not rec.get("first_step"):
        return {"note": f"no first step of this variant and of the baseline ({figures['baseline']}) to compare"}
    rel = {k: abs(rec["first_step"][k] - base["first_step"][k]) / max(abs(base["first_step"][k]), 1e-12)
           for k in ("grad_norm", "logp_mean", "entropy")}
    hidden = rec.get("hidden_rel_diff")
    flagged = [k for k, v in rel.items() if not v <= tol] + (["hidden"] if hidden is not None and not hidden <= htol
                                                             else [])
    return {"first_step_rel_diff": rel, "hidden_rel_diff": hidden, "tolerance": tol, "hidden_tolerance": htol,
            "flagged": flagged}


# ---------------------------------------------------------------------------------------------------------------
# driver


@dataclass
class Ctx:
    args: argparse.Namespace
    scale: Scale
    facts: dict
    deadline: float | None
    log: StageLog | None = None
    checks: Checks | None = None
    bundle: list | None = None
    bundle_runs: list | None = None
    skip_reason: str | None = None  # set by a stage that cannot run here (a GPU stage in the CPU rehearsal)
    # save_partial(figures): writes gpu_proof.json with the running stage's figures so far (marked in progress), so
    # a command stopped mid-stage keeps what was measured; set by run_proof for each stage.
    save_partial: object = None
    vllm_broken: str | None = None  # set by vllm-kit when vLLM cannot run: the other vLLM stages do not start

    def timeout(self, want: float) -> float:
        if self.deadline is None:
            return want
        return max(1.0, min(want, self.deadline - time.monotonic() - 10))


def short(stage: str, res: dict) -> str:
    f = res.get("figures", {})
    if res.get("not_run"):
        return res["not_run"]
    if res.get("skipped"):
        return f"skipped: {res['skipped']}"
    if stage in ("tests", "vllm-tests"):
        c = f.get("counts", {})
        return (f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('errors', 0)} errors, "
                f"{c.get('skipped', 0)} skipped")
    if stage == "vllm-kit":
        return (f"vLLM {f.get('vllm') or f.get('probe', {}).get('version')}: _C {'loads' if f.get('c_loaded') else 'FAILED'}, "
                f"rms_norm rel err {f.get('rms_norm_rel_err')}, FA3 {f.get('fa3')}, engine built in {f.get('build_s')}s, "
                f"seeded repeat {f.get('seeded_repeat_equal')}")
    if stage in ("vllm-run", "vllm-z3"):
        full = f.get("full_run", {})
        return (f"{full.get('steps_logged', 0)} steps ({f.get('engine')}, ZeRO-{f.get('zero_stage', 1)}), "
                f"{full.get('s_per_step_mean')} s/step, "
                f"{full.get('checksums_equal', 0)} checksums equal, is_weight_mean "
                f"{min(f.get('is_weight_mean') or [0])}..{max(f.get('is_weight_mean') or [0])}")
    if stage in ("z1", "z3"):
        full, rs = f.get("full_run", {}), f.get("resume")
        text = (f"{full.get('steps_logged', 0)} steps, {full.get('s_per_step_mean')} s/step, "
                f"{full.get('checksums_equal', 0)} checksums equal, ckpts {full.get('checkpoints')}")
        if rs:
            text += (f"; resume {rs.get('resumed_from')}->{rs.get('steps_logged')}: "
                     f"{rs.get('checksums_equal_after_resume', 0)} equal")
        return text
    if stage == "learner":
        return "; ".join(learner_short(f, shape, sh) for shape, sh in f.get("shapes", {}).items()) or "no figures"
    if stage == "generation":
        return gen_short(f)
    if stage == "throughput":
        parts = []
        if (lr := f.get("learner")) and "tokens_per_s" in lr:
            mfu = f"MFU {lr['mfu']:.1%}" if lr.get("mfu") is not None else "MFU null"
            parts.append(f"learner {lr['tokens_per_s']:.0f} tok/s, {mfu}")
        if (g := f.get("generation")) and "tokens_per_s" in g:
            parts.append(f"gen {g['tokens_per_s']:.0f} tok/s")
        if (g := f.get("vllm_generation")) and "tokens_per_s" in g:
            parts.append(f"vLLM gen {g['tokens_per_s']:.0f} tok/s")
        return "; ".join(parts) or "no figures"
    return ""


def gen_short(f: dict) -> str:
    """The generation stage in the table: the loop against its reference on the heavy workload, per engine, and
    the rpc publish."""
    parts = []
    for eng, g in f.get("goals", {}).get("loop", {}).get("by_engine", {}).items():
        loop = f["runs"][eng]["heavy"]["loop"]
        parts.append(f"{eng} heavy: loop {loop['tokens_per_s']:.0f} tok/s, {g['ratio']:.2f}x {g['reference']}")
    rpc = f.get("goals", {}).get("publish", {}).get("by_transport", {}).get("rpc")
    if rpc:
        parts.append(f"rpc publish {rpc['end_to_end_s']:.3f}s")
    return "; ".join(parts) or "no figures"


def learner_short(f: dict, shape: str, sh: dict) -> str:
    """One shape of the learner stage in the table: the baseline at the last budget, the fastest other variant's
    speed-up there, and how many variants ended how."""
    vs = sh.get("variants", {})
    counts = {}
    for v in vs.values():
        counts[v.get("status")] = counts.get(v.get("status"), 0) + 1
    tally = ", ".join(f"{n} {k}" for k, n in counts.items())
    base = vs.get(f.get("baseline"), {})
    if base.get("status") != "measured":
        return f"{shape}: baseline not measured ({tally})"
    last = [b for b in base["budgets"] if "error" not in b][-1]
    mfu = f", MFU {last['mfu']:.1%}" if last.get("mfu") is not None else ""
    others = [(b["speedup"], n) for n, v in vs.items() if n != f["baseline"] and v.get("status") == "measured"
              for b in v["budgets"] if b["micro_batch_tokens"] == last["micro_batch_tokens"] and b.get("speedup")]
    best = f", best {max(others)[1]} {max(others)[0]:.2f}x" if others else ""
    return (f"{shape}@{last['micro_batch_tokens']}: {f['baseline']} {last['tokens_per_s']:.0f} tok/s{mfu}{best} "
            f"({tally})")


def table(doc: dict) -> str:
    rows = [("stage", "passed", "seconds", "figures")]
    for name, res in doc["stages"].items():
        verdict = "skip" if res.get("skipped") else "yes" if res.get("passed") else "NO"
        rows.append((name, verdict, f"{res.get('seconds', 0):.0f}", short(name, res)))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}" for a, b, c, d in rows]
    head = f"GPU proof on {doc['device']} (torch {doc['versions'].get('torch')}, CUDA {doc['versions'].get('cuda')}), " \
           f"{doc['date']}, commit {doc['git_commit'][:12]}: {'ALL PASSED' if doc['all_passed'] else 'NOT ALL PASSED'}"
    return "\n".join([head, *lines])


def write_doc(path: str, doc: dict) -> None:
    ran = [r for r in doc["stages"].values() if not r.get("skipped")]
    doc["all_passed"] = bool(ran) and all(r.get("passed") for r in ran)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


def bundle_logs(out: str, work: str, files: list[str], runs: list[str]) -> str:
    """gpu_proof_logs.tar.gz: stage logs, the runs' logs, metrics and generator logs, the JUnit report."""
    path = os.path.join(out, "gpu_proof_logs.tar.gz")
    members = [(f, os.path.basename(f)) for f in sorted(glob.glob(os.path.join(out, "*.log"))) + files
               if os.path.isfile(f)]
    for run in runs:
        members += [(f, os.path.join(os.path.basename(run), os.path.relpath(f, run)))
                    for pattern in ("config.toml", "cluster.json", "metrics.jsonl", "logs/*.log", "generators/*.jsonl")
                    for f in glob.glob(os.path.join(run, pattern))]
    with tarfile.open(path + ".tmp", "w:gz") as tar:
        for f, arcname in members:
            tar.add(f, arcname=arcname)
    os.replace(path + ".tmp", path)
    return path


def proof_scale(args) -> Scale | None:
    """The stages' sizes: the GPU's or the rehearsal's, with the command line's overrides; None (after one line on
    stderr) for a --steps the checkpoints cannot divide."""
    over = {k: v for k, v in {"steps": args.steps, "samples": args.samples, "response_tokens": args.response_tokens,
                              "micro_batch_tokens": args.micro_batch_tokens, "warmup": args.warmup_steps,
                              "timed": args.timed_steps, "gen_prompts": args.gen_prompts,
                              "gen_samples": args.gen_samples, "gen_tokens": args.gen_tokens,
                              "run_timeout_s": args.run_timeout_s}.items() if v is not None}
    if "steps" in over:  # checkpoints at half, resume from half, its checkpoints every quarter
        n = over["steps"]
        if n < 4 or n % 4:
            print(f"error: --steps {n}: give a multiple of 4 (checkpoints at the half, the resume proof's every quarter)",
                  file=sys.stderr)
            return None
        over.update(ckpt_every=n // 2, resume_first=n // 2, resume_ckpt_every=n // 4)
    base = CPU if args.rehearse_cpu else GPU
    over["learner_shapes"] = {name: dict(base.learner_shapes[name], **({"micro_batch_tokens": b} if b else {}))
                              for name, b in args.learner_shapes}
    if args.learner_steps:
        over["learner_warmup"], over["learner_timed"] = args.learner_steps
    if args.learner_budget_s is not None:
        over["learner_budget_s"] = args.learner_budget_s
    return replace(base, **over)


def proof_doc(args, scale: Scale, facts: dict, warnings: list[str], doc_path: str) -> dict:
    """gpu_proof.json's head (machine, versions, code, command, scale), and the stages of an earlier document from
    the same device and sources that this call does not run."""
    commit, dirty = git_commit()
    digest = source_digest()
    doc = {
        "schema": 1, "rehearse_cpu": bool(args.rehearse_cpu), "device": facts["device"],
        "device_count": facts.get("device_count"), "gpu_memory_gib": facts.get("gpu_memory_gib"),
        "capability": facts.get("capability"), "driver": facts.get("driver"),
        "versions": {"python": facts["python"], "torch": facts["torch"], "cuda": facts["cuda"],
                     "transformers": facts["versions"].get("transformers"),
                     "deepspeed": facts["versions"].get("deepspeed"), "packages": facts["versions"]},
        "date": utc_now(), "git_commit": args.commit or commit, "git_dirty": dirty, "source_digest": digest,
        "command": " ".join([invocation(), *sys.argv[1:]]),
        "scale": {k: v for k, v in scale.__dict__.items()}, "placement": facts.get("placement"),
        "warnings": warnings, "stages": {},
    }
    if args.first_lease:
        doc["first_lease"] = first_lease_head(args)
    try:
        with open(doc_path) as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError):  # none yet, or unreadable: every stage is this call's
        return doc
    if (old.get("device"), old.get("source_digest"), old.get("rehearse_cpu")) == (doc["device"], digest,
                                                                                  doc["rehearse_cpu"]):
        doc["stages"] = {k: v for k, v in old.get("stages", {}).items() if k not in args.stages}
        if doc["stages"]:
            print(f"keeping stages {', '.join(doc['stages'])} from the earlier {doc_path}")
    return doc


def first_lease_schedule(shapes=None, budget_s: float = FIRST_LEASE_S) -> dict:
    """The first lease's command as its own estimates see it, on one H100: the kit's unpack and the preflight, then
    the learner worker's start and FIRST_LEASE_PLAN's items, each started only if it ends (by `estimate_s`, as the
    worker judges it) before the stage stops starting items, FIRST_LEASE_TESTS_S before the budget; the tests then
    have the rest. What the command does with estimates that hold (the worker rescales them by the overruns it
    sees; the stage's hard limit holds whatever they are). Seconds from the command's start."""
    from hardware.learner_bench import WORKER_START_S, Estimates

    plan = [(shape, v) for shape, v in FIRST_LEASE_PLAN if shapes is None or shape in shapes]
    t = FIRST_LEASE_UNPACK_S + FIRST_LEASE_PREFLIGHT_S + WORKER_START_S
    stage_stop = budget_s - FIRST_LEASE_TESTS_S
    est, started, cut = Estimates(), [], []
    for shape, name in plan:
        over = learner_variant(name)
        need = est.need(shape, over)
        if t + need > stage_stop:
            cut.append(f"{shape} {name}")
            continue
        started.append({"item": f"{shape} {name}", "start_s": round(t, 1), "end_s": round(t + need, 1)})
        t += need
        est.ran(shape, over)
    return {"budget_s": budget_s, "learner_stops_starting_s": stage_stop, "learner_ends_s": round(t, 1),
            "tests_s": round(budget_s - t, 1), "started": started, "not_started": cut}


def first_lease_head(args) -> dict:
    """The first lease's command as it went before the stages: its budget, when it started (the Makefile's clock,
    before the kit's unpack), the unpack's time and its own line (from --kit-log), the preflight's time."""
    head = {"budget_s": args.deadline_s, "command_start_unix": args.command_start_unix,
            "plan": [f"{shape} {v}" for shape, v in FIRST_LEASE_PLAN], "schedule_estimate": first_lease_schedule(),
            "estimates_s": {"unpack": FIRST_LEASE_UNPACK_S, "preflight": FIRST_LEASE_PREFLIGHT_S,
                            "tests_reserved": FIRST_LEASE_TESTS_S}}
    head["before_proof_s"] = round(args.proof_start_unix - args.command_start_unix, 1)
    if args.kit_log:
        try:
            with open(args.kit_log) as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError as e:
            lines = [f"could not read {args.kit_log}: {e}"]
        head["kit_unpack_lines"] = lines[-6:]
        m = next((re.search(r"unpacked .* in ([\d.]+) s", ln) for ln in lines if "unpacked" in ln), None)
        head["kit_unpack_s"] = float(m.group(1)) if m else None
    return head


def run_proof(args) -> int:
    scale = proof_scale(args)
    if scale is None:
        return 2
    # --command-start-unix: the deadline counts from the command's start (the Makefile's clock, before the kit's
    # unpack), not from this process's
    t_start = time.monotonic() - max(0.0, args.proof_start_unix - args.command_start_unix)
    facts, warnings = preflight(args, scale)
    doc_path = os.path.join(args.out, "gpu_proof.json")
    doc = proof_doc(args, scale, facts, warnings, doc_path)
    print(f"gpu_proof: {facts['device']}, torch {facts['torch']} (CUDA {facts['cuda']}), transformers "
          f"{doc['versions']['transformers']}, deepspeed {doc['versions']['deepspeed']}; stages {','.join(args.stages)}; "
          f"out {args.out}, work {args.work}")
    for w in warnings:
        print(f"warning: {w}")
    deadline = t_start + args.deadline_s if args.deadline_s else None
    if args.first_lease:
        doc["first_lease"]["preflight_s"] = round(time.monotonic() - t_start - doc["first_lease"]["before_proof_s"], 1)
        print(f"first lease: {args.deadline_s:.0f}s from the command's start, {deadline - time.monotonic():.0f}s "
              f"left after the kit ({doc['first_lease'].get('kit_unpack_s')} s) and the preflight "
              f"({doc['first_lease']['preflight_s']} s)")
    ctx = Ctx(args=args, scale=scale, facts=facts, deadline=deadline, bundle=[], bundle_runs=[])
    interrupted, stopped = False, None
    for name in args.stages:
        stamp = {"date": utc_now(), **{k: doc[k] for k in STAMP_KEYS[1:]}}
        broken = ctx.vllm_broken if name in VLLM_STAGES else None
        if stopped or broken or (deadline is not None and deadline - time.monotonic() < 60):
            why = f"not run: {stopped or broken or '--deadline-s reached'}"
            doc["stages"][name] = {"passed": False, "seconds": 0.0, "not_run": why, "figures": {}, "checks": {},
                                   "key_lines": []}
        else:
            ctx.save_partial = partial_writer(doc_path, doc, name, stamp)
            doc["stages"][name], stopped, interrupted = proof_stage(ctx, name)
        doc["stages"][name].update(stamp)
        write_doc(doc_path, doc)
        if interrupted:
            break
    doc["total_seconds"] = round(time.monotonic() - t_start, 1)
    write_doc(doc_path, doc)
    try:
        bundle_logs(args.out, args.work, ctx.bundle, ctx.bundle_runs)
    except OSError as e:
        print(f"warning: could not bundle the logs: {e}", file=sys.stderr)
    print()
    print(table(doc))
    print(f"-> {doc_path}")
    return proof_exit(doc, args.stages, stopped, interrupted)


def partial_writer(doc_path: str, doc: dict, name: str, stamp: dict):
    """gpu_proof.json as it is, plus stage `name` in progress with the figures given (its record at the stage's end
    replaces this one)."""

    def save(figures: dict) -> None:
        record = {"passed": False, "seconds": 0.0, "in_progress": "the stage was still running when this was written: "
                  "its figures so far", "figures": figures, "checks": {}, "key_lines": [], **stamp}
        write_doc(doc_path, {**doc, "stages": {**doc["stages"], name: record}})

    return save


def proof_stage(ctx, name: str) -> tuple[dict, str | None, bool]:
    """Run one stage with its own log and checks: (its record in gpu_proof.json, why the rest of the proof cannot
    run or None, whether it was interrupted). A bug or an unexpected layout fails the stage, and the proof goes on."""
    log = StageLog(os.path.join(ctx.args.out, f"{name}.log"), name)
    ctx.log, ctx.checks, ctx.skip_reason = log, Checks(log), None
    t0 = time.monotonic()
    figures, error, stopped, interrupted = {}, None, None, False
    try:
        figures = run_stage(ctx, name)
    except StopProof as e:
        error = stopped = str(e)
    except KeyboardInterrupt:
        error, interrupted = "interrupted", True
    except Exception as e:
        import traceback

        log.write(traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
    if error:
        ctx.checks("stage completed", False, error)
    seconds = time.monotonic() - t0
    passed = not ctx.checks.failed and bool(ctx.checks.results)
    skipped = ctx.skip_reason if passed else None
    log.say(f"{'SKIPPED: ' + skipped if skipped else 'PASSED' if passed else 'FAILED'} in {seconds:.0f}s", key=True)
    record = {"passed": passed, "seconds": round(seconds, 1), "figures": figures, "checks": ctx.checks.results,
              "key_lines": log.lines}
    if skipped:
        record["skipped"] = skipped
    log.close()
    return record, stopped, interrupted


def proof_exit(doc: dict, stages: list[str], stopped: str | None, interrupted: bool) -> int:
    """The proof's exit status: the kit failed, a stage failed or was interrupted (1), stages cut by the deadline,
    or 0."""
    if stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        return KIT_FAILED_EXIT
    ran = [doc["stages"][s] for s in stages if s in doc["stages"] and not doc["stages"][s].get("skipped")]
    cut = [r for r in ran if r.get("not_run")]
    if interrupted or not ran or not all(r.get("passed") for r in ran if not r.get("not_run")):
        return 1
    return DEADLINE_EXIT if cut else 0


def run_stage(ctx, name: str) -> dict:
    if name == "learner":
        return stage_learner(ctx)
    if name == "vllm-kit":
        return stage_vllm_kit(ctx)
    if name == "generation":
        return stage_generation(ctx)
    if name == "vllm-tests":
        return stage_vllm_tests(ctx)
    if name == "vllm-run":
        return stage_vllm_run(ctx)
    if name == "vllm-z3":
        return stage_vllm_run(ctx, name, zero=3)
    if name == "tests":
        return stage_tests(ctx)
    if name in ("z1", "z3"):
        return stage_zero(ctx, int(name[1]), resume=name == "z1" or ctx.args.z3_resume)
    return stage_throughput(ctx)


# ---------------------------------------------------------------------------------------------------------------
# --record


def load_proofs(files: list[str], force: bool) -> list[dict] | None:
    """The gpu_proof.json files, each stage stamped with its file's date, commit and digest where it carries none
    (files from before 2026-11-27), oldest first; None after a one-line error."""
    docs = []
    for path in files:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return None
        if "stages" not in doc or "device" not in doc:
            print(f"error: {path} is not a gpu_proof.json (no stages / device)", file=sys.stderr)
            return None
        if doc.get("rehearse_cpu") and not force:
            print(f"error: {path} is a CPU rehearsal, not a GPU proof; it does not go into results.json (--force to "
                  f"record it anyway)", file=sys.stderr)
            return None
        if docs and doc["device"] != docs[0]["device"] and not force:
            print(f"error: {path} ran on {doc['device']}, {files[0]} on {docs[0]['device']}: one device per record "
                  f"(--force to merge anyway)", file=sys.stderr)
            return None
        stages = doc["stages"]
        if (stages.get("vllm-run", {}).get("figures") or {}).get("zero_stage") == 3:
            stages["vllm-z3"] = stages.pop("vllm-run")  # the H200 lease of 2026-11-27 ran it as --vllm-zero 3
        for res in stages.values():
            for key in STAMP_KEYS:
                res.setdefault(key, doc.get(key))
        doc.setdefault("merged_from", [f"{','.join(stages)} run {doc.get('date')}"])
        docs.append(doc)
    return sorted(docs, key=lambda d: d["date"])  # stable: files of one date keep the order given


def record(files: list[str], force: bool, results_path: str = RESULTS) -> int:
    docs = load_proofs(files, force)
    if docs is None:
        return 2
    merged, stages = {}, {}
    for doc in docs:  # oldest first: a newer file's head and stages replace an older one's
        merged.update({k: v for k, v in doc.items() if k not in ("stages", "merged_from", "warnings")})
        stages.update(doc["stages"])
    merged["stages"] = stages
    merged["merged_from"] = [origin for doc in docs for origin in doc["merged_from"]]
    merged["warnings"] = sorted({w for doc in docs for w in doc.get("warnings", [])})
    merged["all_passed"] = all(r.get("passed") for r in merged["stages"].values() if not r.get("skipped"))
    here = source_digest()
    for res in [merged, *merged["stages"].values()]:
        if res.get("git_commit") == "unknown" and res.get("source_digest") == here:
            # The GPU machine's copy had no .git; this checkout has the very same sources.
            res["git_commit"], res["git_dirty"] = git_commit()
            res["git_commit_from"] = "this checkout (same source_digest)"
    merged.pop("command", None)
    merged.pop("scale", None)
    for res in merged["stages"].values():  # what the repo keeps: verdicts, figures, key lines
        res["key_lines"] = res.get("key_lines", [])[:40]
    with open(results_path) as f:
        results = json.load(f)
    proofs = results.setdefault("gpu_proofs", {})
    if "gpu_proof" in results:  # the one-record layout before 2026-11-27: it becomes its device's entry
        old = results.pop("gpu_proof")
        proofs.setdefault(old.get("device", "unknown device"), old)
    replaced = merged["device"] in proofs
    proofs[merged["device"]] = merged  # one record per device: another device's record stays as it is
    with open(results_path + ".tmp", "w") as f:  # the format tests/bench/common.py writes
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(results_path + ".tmp", results_path)
    print(f"recorded {', '.join(merged['stages'])} ({merged['device']}, {merged['date']}) into {results_path} "
          f"under \"gpu_proofs\" / {merged['device']!r}{' (replacing its earlier record)' if replaced else ''}: "
          f"{'all passed' if merged['all_passed'] else 'NOT all passed'}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m hardware.proof", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results: gpu_proof.json, stage logs, gpu_proof_logs.tar.gz "
                                  "(default runs/gpu-proof-<UTC timestamp>)")
    ap.add_argument("--work", help="run directories, checkpoints and the throughput model (default: --out)")
    ap.add_argument("--stages", default=None,
                    help=f"comma-separated, run in this order (default {','.join(STAGES)})")
    ap.add_argument("--throughput-parts", default="learner,gen,vllm-gen",
                    help="learner,gen,vllm-gen (default all; vllm-gen is not rehearsed on CPU)")
    ap.add_argument("--z3-resume", action=argparse.BooleanOptionalAction, default=True,
                    help="z3 also proves interrupt-and-resume (default); --no-z3-resume: only the full run")
    ap.add_argument("--rehearse-cpu", action="store_true", help="the same stages on CPU at toy scale (no GPU needed)")
    ap.add_argument("--deadline-s", type=float, default=0, help="stop starting work after this many seconds in all; "
                    "a stage cut short fails, later ones are recorded as not run (0: no deadline)")
    ap.add_argument("--steps", type=int, help="cluster steps of z1/z3 (a multiple of 4; default 24, rehearsal 4)")
    ap.add_argument("--samples", type=int, help="learner throughput: samples per step (default 64)")
    ap.add_argument("--response-tokens", type=int, help="learner throughput: response tokens per sample (default 512)")
    ap.add_argument("--micro-batch-tokens", type=lambda t: tuple(int(x) for x in t.split(",")),
                    help="learner throughput: learner.micro_batch_tokens values to measure, comma-separated; the best "
                         "is the headline (default 1024,4096,8192)")
    ap.add_argument("--warmup-steps", type=int, help="learner throughput warm-up steps (default 2)")
    ap.add_argument("--timed-steps", type=int, help="learner throughput timed steps (default 5)")
    ap.add_argument("--learner-variants", default=",".join(LEARNER_VARIANTS),
                    help="learner stage: variants ATTN-HEAD[-compile][-gc] (ATTN sdpa|varlen|flash_attention_2|eager, "
                         "HEAD chunked|fused|triton|inductor), comma-separated, run in this order; the first is the baseline of the "
                         f"speed-ups and the agreement (default {','.join(LEARNER_VARIANTS)})")
    ap.add_argument("--learner-shapes", default=",".join(LEARNER_SHAPES),
                    help="learner stage: shapes, comma-separated, each SHAPE or SHAPE:BUDGET[+BUDGET...] to choose its "
                         "micro_batch_tokens (default 0.5b,7b-4l, i.e. 0.5b:8192,7b-4l:8192+20480; the rehearsal's "
                         "stand-ins are tiny)")
    ap.add_argument("--learner-steps", help="learner stage: WARMUP,TIMED steps per budget (default 1,2; rehearsal 1,1)")
    ap.add_argument("--learner-budget-s", type=float, help="learner stage: the seconds its workers may start "
                    "variants in, shared equally by the shapes; a variant that would not fit is recorded as not run "
                    "(default 300; rehearsal 600)")
    ap.add_argument("--first-lease", action="store_true",
                    help=f"the first lease's command (make gpu-first-lease): stages learner,tests, the learner's items "
                         f"in FIRST_LEASE_PLAN's order, everything within --deadline-s (default {FIRST_LEASE_S:.0f}) of "
                         f"--command-start-unix; the tests get what the learner leaves, at least "
                         f"{FIRST_LEASE_TESTS_MIN_S:.0f} s")
    ap.add_argument("--command-start-unix", type=float, help="when the command began (before the kit's unpack), in "
                    "Unix seconds: --deadline-s counts from it (default: this process's start)")
    ap.add_argument("--kit-log", help="the kit's unpack output, recorded with --first-lease (its time is read there)")
    ap.add_argument("--learner-inject-oom", default="", help="CPU rehearsal only: the learner variants (comma-"
                    "separated) whose first budget raises an out-of-memory error, to test that it is recorded and "
                    "the stage goes on")
    ap.add_argument("--learner-profile", action=argparse.BooleanOptionalAction, default=True,
                    help="learner stage: one profiled step per variant (default; --no-learner-profile saves ~5 s each)")
    ap.add_argument("--gen-budget-s", type=float, help="generation stage: the seconds its worker may start runs, "
                    "engine builds and publishes in; what would not fit is recorded as not run (default 480; "
                    "rehearsal 300)")
    ap.add_argument("--gen-prompts", type=int, help="generation throughput: prompts (default 32)")
    ap.add_argument("--gen-samples", type=int, help="generation throughput: samples per prompt (default 8)")
    ap.add_argument("--gen-tokens", type=int, help="generation throughput: new tokens (default 256)")
    ap.add_argument("--run-timeout-s", type=float, help="limit of one cluster launch (default 360; rehearsal 900)")
    ap.add_argument("--keep-model", action="store_true", help="keep the throughput model in --work")
    ap.add_argument("--commit", help="the git commit to record where the copy has no .git")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children (default: this one)")
    ap.add_argument("--record", nargs="+", metavar="GPU_PROOF_JSON", help="merge finished gpu_proof.json file(s) into "
                    "tests/bench/results.json under \"gpu_proofs\" (one record per device: that device's is replaced) and exit")
    ap.add_argument("--force", action="store_true", help="--record: accept a CPU rehearsal, or mixed devices (filed under the first file's device)")
    return checked_args(ap, ap.parse_args(argv))


def checked_args(ap, args):
    """The parsed arguments completed and checked: --first-lease's stages and deadline, lists split, paths made
    absolute; a mistake is argparse's one-line error (exit 2)."""
    args.proof_start_unix = time.time()
    if args.command_start_unix is None:
        args.command_start_unix = args.proof_start_unix
    elif not 0 <= args.proof_start_unix - args.command_start_unix < 3600:
        ap.error(f"--command-start-unix {args.command_start_unix}: not within the hour before now "
                 f"({args.proof_start_unix:.0f}); pass the command's start, e.g. $(date +%s.%N)")
    if args.first_lease:
        if args.stages is not None:
            ap.error("--first-lease runs the stages learner,tests: leave out --stages")
        args.stages = "learner,tests"
        args.deadline_s = args.deadline_s or FIRST_LEASE_S
    args.stages = args.stages if args.stages is not None else ",".join(STAGES)
    args.learner_inject_oom = [s.strip() for s in args.learner_inject_oom.split(",") if s.strip()]
    if args.learner_inject_oom and not args.rehearse_cpu:
        ap.error("--learner-inject-oom is the CPU rehearsal's test hook: use it with --rehearse-cpu")
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if bad := [s for s in args.stages if s not in STAGES]:
        ap.error(f"--stages: unknown {', '.join(bad)}; choose from {', '.join(STAGES)}")
    args.learner_variants = [s.strip() for s in args.learner_variants.split(",") if s.strip()]
    for name in args.learner_variants:
        try:
            learner_variant(name)
        except ValueError as e:
            ap.error(f"--learner-variants: {e}")
    if not args.learner_variants or len(set(args.learner_variants)) != len(args.learner_variants):
        ap.error("--learner-variants: give each variant once, at least one (the first is the baseline)")
    args.learner_shapes = [learner_shape_arg(ap, x.strip()) for x in args.learner_shapes.split(",") if x.strip()]
    if args.learner_steps is not None:
        try:
            warmup, timed = (int(x) for x in args.learner_steps.split(","))
        except ValueError:
            ap.error(f"--learner-steps {args.learner_steps}: give WARMUP,TIMED, e.g. 1,2")
        if warmup < 1 or timed < 1:
            ap.error("--learner-steps: at least 1 warm-up step (the agreement's first step) and 1 timed step")
        args.learner_steps = (warmup, timed)
    args.throughput_parts = [s.strip() for s in args.throughput_parts.split(",") if s.strip()]
    if bad := [s for s in args.throughput_parts if s not in ("learner", "gen", "vllm-gen")]:
        ap.error(f"--throughput-parts: unknown {', '.join(bad)}; choose from learner, gen, vllm-gen")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out = os.path.abspath(args.out or os.path.join(REPO, "runs", f"gpu-proof-{stamp}"))
    args.work = os.path.abspath(args.work or args.out)
    return args


def learner_shape_arg(ap, text: str) -> tuple[str, tuple[int, ...] | None]:
    """SHAPE or SHAPE:BUDGET[+BUDGET...] -> (shape, budgets or None for the shape's own)."""
    name, _, budgets = text.partition(":")
    if name not in LEARNER_SHAPES:
        ap.error(f"--learner-shapes: unknown shape {name!r}; choose from {', '.join(LEARNER_SHAPES)}")
    if not budgets:
        return name, None
    try:
        values = tuple(int(b) for b in budgets.split("+"))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        ap.error(f"--learner-shapes {text}: budgets are micro_batch_tokens, positive integers joined by '+', "
                 f"e.g. 7b-4l:8192+20480")
    return name, values


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.record:
        return record(args.record, args.force)
    return run_proof(args)


if __name__ == "__main__":
    sys.exit(main())
