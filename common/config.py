"""The one typed configuration tree of a covrl run.

Every default lives here and only here. A run's config is built from these
defaults, then a TOML file (`--config`), then `--set a.b=c` overrides, and is
validated in one place: unknown keys and out-of-range values are rejected with
the dotted path of the offending field, before any process starts.

Names carry their units (`timeout_s`, `max_staleness_steps`, `kl_fraction` is a
fraction, never a percent).
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Fraction01 = Annotated[float, Meta(ge=0, le=1)]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class RunConfig(_Section):
    seed: NonNegInt = 0
    steps: PosInt = 100
    torch_threads: PosInt = 1  # per process; the CPU path runs one role per core
    # 0: none periodic (the last step and every stop the learners survive are checkpointed anyway).
    checkpoint_every_steps: NonNegInt = 0
    # Also a checkpoint once this long has passed on learner rank 0's clock since the last one (or the launch), so a
    # crash loses at most this much; 0: off. Rolling: the next checkpoint of any kind removes one written only for
    # this, so it adds at most one checkpoint on disk.
    checkpoint_every_s: NonNegFloat = 1800.0
    keep_checkpoints: NonNegInt = 0  # newest complete checkpoints kept on disk (0: all)
    # A graceful stop (Ctrl-C / SIGTERM, or the launcher's): seconds the learners get to checkpoint their last step.
    stop_grace_s: PosFloat = 300.0
    # Same seed, same numbers: all generation at policy version v finishes before v + 1 is
    # published, so every token's version is a function of its prompt's place in the stream and
    # no weights change mid-generation. Off: weights swap in mid-generation (more overlap when
    # response lengths are heavy-tailed), and versions depend on timing.
    deterministic: bool = True


class ModelConfig(_Section):
    # A local Hugging Face model directory, or a Hub id `org/name[@revision]` (the launcher resolves it once, through
    # the Hub cache, and the run's config.toml holds the local snapshot). Empty: the built-in `arith` base model.
    path: str = ""
    # The learner ranks' dtype (bfloat16: DeepSpeed's bf16 mixed precision; float32) and the torch generator's (vLLM
    # serves 16-bit: float32 is served in bfloat16). "auto": bfloat16 where the learner ranks run on CUDA GPUs of
    # compute capability 8.0 or more (A100, H100, ...), float32 on the CPU and older GPUs (`resolve_dtype`). `covrl
    # run` resolves it once, before any role starts, and RUN_DIR/config.toml holds the result: every role reads one
    # dtype, and a resume reads it again.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


class DataConfig(_Section):
    # "arith": the built-in synthetic task; "files": train_files / eval_files in the common RL layout
    # (common/datasets.py: prompt, reward_model.ground_truth or answer, data_source).
    task: Literal["arith", "files"] = "arith"
    train_files: tuple[str, ...] = ()
    # Held-out sets (.jsonl / .parquet), evaluated by data_source; with task "arith" and none given, the
    # built-in arith_easy / arith_hard.
    eval_files: tuple[str, ...] = ()
    data_source_from: Literal["row", "file"] = "row"  # row: the data_source field (else the file stem); file: the stem
    # arith difficulty levels to train on (1 easy .. 4 hard); the base model solves ~85 % of (seen)
    # level-1, ~16 % of level-2 and almost none of level 3-4 problems, so those add groups with no reward spread.
    levels: tuple[Annotated[int, Meta(ge=1, le=4)], ...] = (1, 2)
    train_size: PosInt = 4096
    eval_size: PosInt = 128
    # auto: the tokenizer's chat template if it has one (instruct models), else the plain completion template.
    template: Literal["auto", "chat", "plain"] = "auto"
    # Appended to plain-string prompts (chat-message prompts are used as written).
    instruction: str = "Put the final answer in \\boxed{}."
    system_prompt: str = ""  # chat template only; "" = none
    max_prompt_tokens: PosInt = 128
    truncation: Literal["drop", "left", "error"] = "drop"  # prompts over max_prompt_tokens: skip (counted), keep the end, or stop


class RolloutConfig(_Section):
    group_size: Annotated[int, Meta(ge=2)] = 8  # responses per prompt (GRPO needs >= 2)
    groups_per_step: PosInt = 16  # prompts per learner step
    max_new_tokens: PosInt = 64
    temperature: PosFloat = 1.0
    # Must stay 1 for training (`check` says why); evaluation has its own eval.top_p.
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    max_staleness_steps: NonNegInt = 1
    # Research: > 0 makes every trained token exactly this many versions older than the learner's weights (after
    # the first forced_lag steps, whose lag climbs 0, 1, ...): slots are issued forced_lag versions ahead and the
    # publish of v + 1 waits for the generation issued at v (broker/rules.py). Within max_staleness_steps. 0: off.
    forced_lag: NonNegInt = 0
    # At most this many groups in flight per generator; 0: as many as its engine holds at once
    # (generator.max_num_seqs // group_size) when it streams, one step's groups per Work in the batch loop of a
    # deterministic run (generator.loop). A streaming generator asks for its free room as groups finish.
    groups_per_request: NonNegInt = 0
    # Benchmark workload, not for training: > 0 imposes every response's length, drawn per sample from a
    # lognormal with this median and forced_length_sigma (capped at max_new_tokens); the torch engine withholds
    # the stop token until then and emits it there. Logprobs stay the policy's own. 0: off.
    forced_length_median: NonNegInt = 0
    forced_length_sigma: Annotated[float, Meta(ge=0)] = 1.0


class RewardConfig(_Section):
    workers: PosInt = 1
    timeout_s: PosFloat = 5.0
    # Answer extraction: the last \\boxed{}; or, when a completion has none, its last "Answer: ..." line
    # (the format DAPO-Math-17k prompts ask for).
    extract: Literal["boxed", "boxed_or_answer_line"] = "boxed"
    format_score: Fraction01 = 0.0  # reward of a wrong answer that is well-formed (an answer was found); 0: off
    # What a completion is graded as: "math", its extracted answer against the ground truth (math-verify); or
    # "grid_path", the whole completion as a walk that must be a shortest path (common/gridpath.py; the study's
    # `grid` task, whose ground truths read "(x,y)->(x,y) on WxH")
    verifier: Literal["math", "grid_path"] = "math"


class EvalConfig(_Section):
    """Held-out evaluation by the generators, at policy versions 0, every_steps, 2*every_steps, ... and the last."""

    every_steps: NonNegInt = 25  # 0: no evaluation
    k: PosInt = 4  # samples per prompt: eval/<data_source>/acc is avg@k, eval/<data_source>/pass@k
    # The policy as trained samples it (rollout.temperature 1.0); 0: greedy (then one sample per prompt).
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    # Per data source temperature, e.g. {aime = 0.6} as in Cui et al.; sources not named use `temperature`.
    temperatures: dict[str, Annotated[float, Meta(ge=0)]] = msgspec.field(default_factory=dict)
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    max_new_tokens: NonNegInt = 0  # 0: rollout.max_new_tokens


class ImportanceConfig(_Section):
    """w = f(pi_prox / pi_behav), detached (docs/DESIGN.md section 4)."""

    type: Literal["none", "tis", "seq_tis", "mis", "geo_mask"] = "tis"
    cap: PosFloat = 2.0  # C of (sequence-)truncated IS
    lo: Annotated[float, Meta(ge=0)] = 0.5  # mis keeps tokens with rho in [lo, hi]
    hi: PosFloat = 2.0
    geo_lo: Annotated[float, Meta(ge=0)] = 0.999  # geo_mask keeps sequences whose geometric-mean rho
    geo_hi: PosFloat = 1.001  # lies in [geo_lo, geo_hi]
    # pi_prox: recompute (a no-grad pass at the step start, free when mini_batches == 1),
    # behaviour (use the generator's logprobs; w = 1), or loglinear (AReaL's
    # interpolation between pi_behav and pi_theta by version: no extra pass).
    prox: Literal["recompute", "behaviour", "loglinear"] = "recompute"
    # M2PO (Zheng et al. 2025): drop the step's tokens with the largest (log pi_behav - log pi_prox)^2 until the
    # mean over the rest is below this (paper: 0.04), over the whole step on all ranks. Composes with every loss
    # and importance weight. 0: off.
    m2po_threshold: Annotated[float, Meta(ge=0)] = 0.0


class _Loss(_Section, tag_field="type"):
    pass


class PPOLoss(_Loss, tag="ppo"):
    clip_low: Annotated[float, Meta(ge=0, le=1)] = 0.2
    clip_high: Annotated[float, Meta(ge=0)] = 0.28
    dual_clip_c: Annotated[float, Meta(ge=0)] = 3.0  # dual-clip bound for A < 0; 0 turns it off


class ClipCovLoss(_Loss, tag="clip_cov"):
    # Cui et al. 2025 Clip-Cov recipe: clip ratios 1 (the covariance selection is the trust region).
    clip_low: Annotated[float, Meta(ge=0, le=1)] = 1.0
    clip_high: Annotated[float, Meta(ge=0)] = 1.0
    cov_fraction: Fraction01 = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    # "random": a control for the covariance choice. The same count of tokens a step as "covariance" would choose,
    # drawn uniformly among all valid tokens (learner.cov_scope = "step" only).
    selection: Literal["covariance", "random"] = "covariance"
    # The staleness-aware budget (a covrl extension, off at 0): each valid token counts 1 + lag / lag_ref_steps
    # towards the step's budget (lag: versions between the token's sampler and the step), so stale batches get a
    # larger budget (learner.cov_scope = "step" only).
    lag_ref_steps: Annotated[float, Meta(ge=0)] = 0.0


class KLCovLoss(_Loss, tag="kl_cov"):
    kl_fraction: Fraction01 = 2e-3  # 7B recipe; 2e-4 for 32B
    kl_coef: Annotated[float, Meta(ge=0)] = 1.0
    # "random": a control for the covariance choice. The same count of tokens a step as "covariance" would choose,
    # drawn uniformly among all valid tokens (learner.cov_scope = "step" only).
    selection: Literal["covariance", "random"] = "covariance"
    # The staleness-aware budget (a covrl extension, off at 0): each valid token counts 1 + lag / lag_ref_steps
    # towards the step's budget (lag: versions between the token's sampler and the step), so stale batches get a
    # larger budget (learner.cov_scope = "step" only).
    lag_ref_steps: Annotated[float, Meta(ge=0)] = 0.0


class GSPOLoss(_Loss, tag="gspo"):
    clip_low: Annotated[float, Meta(ge=0, le=1)] = 3e-4
    clip_high: Annotated[float, Meta(ge=0)] = 4e-4


class CISPOLoss(_Loss, tag="cispo"):
    clip_low: Annotated[float, Meta(ge=0, le=1)] = 1.0  # no lower bound on the IS weight
    clip_high: Annotated[float, Meta(ge=0)] = 0.28


LossConfig = PPOLoss | ClipCovLoss | KLCovLoss | GSPOLoss | CISPOLoss


class ParConfig(_Section):
    """Positive-advantage reweighting (Jin et al. 2025): A > 0 tokens weighted by lambda."""

    schedule: Literal["off", "constant", "linear", "entropy_guided"] = "off"
    lam: Fraction01 = 0.0  # constant lambda; lambda_0 of entropy_guided
    delta: Fraction01 = 0.05  # entropy_guided step
    target_entropy: Annotated[float, Meta(ge=0)] = 0.2  # entropy_guided threshold (delta in the paper)
    # > 0: the threshold is this fraction of the run's first step's batch entropy instead of target_entropy (a
    # covrl extension: the published absolute 0.2 is above every entropy a small model reaches, so PAR never acts)
    target_entropy_relative: Annotated[float, Meta(ge=0)] = 0.0


class KLRefConfig(_Section):
    coef: Annotated[float, Meta(ge=0)] = 0.0  # 0: no reference model is loaded
    estimator: Literal["k1", "k2", "k3"] = "k3"


class FilterConfig(_Section):
    dynamic_sampling: bool = True  # drop groups whose rewards all agree and refill (DAPO; the paper recipes turn it on)
    # Stop dropping after this many step-batches' worth of groups were filtered for one step
    # (DAPO: up to 10 generation batches), so a task the model always or never solves still trains.
    max_filtered_batches: PosInt = 10
    overlong_buffer_tokens: NonNegInt = 0  # DAPO soft overlong penalty window (0: off)
    overlong_penalty: Annotated[float, Meta(ge=0)] = 1.0


AdamBeta = Annotated[float, Meta(ge=0, lt=1)]


class LearnerConfig(_Section):
    lr: PosFloat = 1e-4
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    adam_betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.999)  # AdamW's (beta1, beta2)
    adam_eps: PosFloat = 1e-8  # AdamW's epsilon
    grad_clip: PosFloat = 1.0
    # An optimizer step whose loss or gradient is not finite is skipped (actor/skipped_steps); this many
    # in a row stop the run with a checkpoint.
    max_consecutive_skipped_steps: PosInt = 3
    zero_stage: Annotated[int, Meta(ge=0, le=3)] = 1
    offload_optimizer: bool = False  # ZeRO >= 1: optimizer states and step on the CPU (DeepSpeed offload)
    gradient_checkpointing: bool = False  # recompute activations in the backward: memory for ~30 % more compute
    # How packed rows are attended (learner/attention.py). "auto": "varlen" where torch's own FlashAttention-2
    # varlen kernels can run the model (CUDA, sm80+, bf16 / fp16, torch >= 2.10), else flash_attention_2 where
    # flash-attn is installed, else sdpa (the CPU, fp32). "varlen" and flash_attention_2 attend each packed sample
    # alone with no mask; sdpa and eager build transformers' dense [N x N] block-causal mask (correct, but every
    # score of the row is computed).
    attn_implementation: Literal["auto", "sdpa", "varlen", "flash_attention_2", "eager"] = "auto"
    # How log pi(target) and the entropy come out of the LM head (learner/logprobs.py). "fused": one custom
    # autograd op per micro-batch: the head's weight is read once (ZeRO-3 gathers it once), the backward forms
    # d logits directly from one recompute per chunk, no fp32 [tokens x vocab] tensor is kept; "chunked": the head
    # in logprob_chunk_tokens chunks under activation checkpointing, by autograd; "triton" / "inductor": the fused
    # op with its passes over a chunk's logits as Triton kernels / compiled reductions, one read of the model-dtype
    # logits each way (learner/head_kernels.py; triton needs CUDA). "auto": fused on CUDA, chunked elsewhere (the
    # CPU recordings were made with it; all agree to rounding, tested) until a GPU lease measures triton and inductor.
    logprob_head: Literal["auto", "fused", "chunked", "triton", "inductor"] = "auto"
    # torch.compile each decoder layer (regional compilation; the first steps pay the compile). Off by default.
    compile_layers: bool = False
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"] = "grpo"
    # Optimizer steps per rollout batch; >1 recomputes pi_prox first.
    mini_batches: PosInt = 1
    # CPU sdpa attends over a whole packed row under a block mask: cost grows with the row squared,
    # so rows stay short here; with flash-attn varlen on GPU a larger budget only costs memory.
    micro_batch_tokens: PosInt = 512
    loss: LossConfig = msgspec.field(default_factory=PPOLoss)
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    norm_tokens: NonNegInt = 0  # seq-mean-token-sum-norm horizon; 0: rollout.max_new_tokens
    # Covariance statistics (Clip-Cov / KL-Cov selection, actor/cov_mean) over the whole step's batch
    # ("step", exact: one no-grad pass first) or per micro-batch ("micro_batch", as verl does).
    cov_scope: Literal["step", "micro_batch"] = "step"
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    high_entropy_fraction: Fraction01 = 0.0  # train only the top-rho entropy tokens (0: off; paper 0.2)
    logprob_chunk_tokens: PosInt = 1024  # tokens per lm-head chunk when computing logprobs and entropy
    # Entropy after the update of tokens just trained on (actor/entropy_delta): one more no-grad pass, over every
    # entropy_delta_stride-th micro-batch of each rank from the first (1: the whole batch).
    log_entropy_delta: bool = True
    entropy_delta_stride: PosInt = 8
    importance: ImportanceConfig = msgspec.field(default_factory=ImportanceConfig)
    # VCPO (Huang et al. 2026): each optimizer step's lr times min(1, ESS / ess_base_ratio) ("linear") or its
    # square root ("sqrt", theirs for Adam), ESS the normalised effective sample size of the mini-batch's response
    # importance weights prod_t pi_theta / pi_behav. Off by default.
    ess_step_scaling: Literal["off", "sqrt", "linear"] = "off"
    ess_base_ratio: Annotated[float, Meta(gt=0, le=1)] = 1.0
    par: ParConfig = msgspec.field(default_factory=ParConfig)
    kl: KLRefConfig = msgspec.field(default_factory=KLRefConfig)
    filter: FilterConfig = msgspec.field(default_factory=FilterConfig)


class TransportConfig(_Section):
    """Every wait on another process has one of these deadlines (docs/reliability.md, "Which timeout governs
    what"). A generator the hub declares lost (silent, stuck, or failing its weight channel) is dropped from the
    weight channels, its work is re-issued, and the launcher stops its process group and restarts it
    (`broker/hub.py`, `Hub.lose`)."""

    host: str = "127.0.0.1"  # single-node runs stay on loopback
    hub_port: NonNegInt = 0  # 0: pick a free port
    # A generator's request for work waits this long for the hub's reply, then asks again.
    recv_timeout_s: PosFloat = 30.0
    # A starting generator waits this long for the hub's Welcome (or Refused), then exits with an error.
    welcome_timeout_s: PosFloat = 120.0
    # A generator silent for this long (no heartbeat, no message: dead, frozen, cut off) is lost.
    generator_timeout_s: PosFloat = 120.0
    heartbeat_s: PosFloat = 2.0
    # A generator that holds work and has returned nothing for this long is stuck, whatever its heartbeat says (a
    # hung engine), and lost. 0: derived, max(generator_progress_floor_s, generator_progress_factor x the slowest
    # reply seen in the run), a reply's time being from when the generator began to hold work, or from its previous
    # reply, to this one.
    generator_progress_timeout_s: NonNegFloat = 0.0
    generator_progress_floor_s: PosFloat = 600.0
    generator_progress_factor: PosFloat = 4.0
    # Learner rank 0 waits this long on one generator's weight channel: its rendezvous after the Welcome, and each
    # header and gloo bucket of a publish (a healthy generator's weight thread takes them at once). Missed: lost.
    weight_send_timeout_s: PosFloat = 60.0
    # Waits that span a learner step or a vLLM drain: a generator's wait for the weights its work names, its weight
    # channel between versions, and each NCCL bucket into vLLM workers (which drain first in "finish" mode).
    weight_sync_timeout_s: PosFloat = 1800.0
    # The learner waits this long for a step's batch, or for the generation its next publish waits on, then stops
    # the run with the hub's account of what it was waiting for (the last checkpoint stays).
    batch_timeout_s: PosFloat = 600.0
    # Every collective among the learner ranks (DeepSpeed's, the step's bookkeeping, barriers). Rank 0 alone waits for
    # the hub and the generators between two of them, so this must exceed batch_timeout_s, with room for a publish.
    learner_timeout_s: PosFloat = 2400.0


class GeneratorConfig(_Section):
    """The generator's engine (docs/DESIGN.md section 7; actors/vllm_engine.py)."""

    # auto: vLLM when the launcher gave this generator GPUs (--gpus, --tp), else the torch sampler.
    engine: Literal["auto", "torch", "vllm"] = "auto"
    # A weight update while requests are in flight: "finish" them on the old weights first, or "keep"
    # them and continue on the new weights (every token stamped with its version). vLLM only; the torch
    # sampler always swaps between decode steps.
    weight_update: Literal["finish", "keep"] = "finish"
    # rpc: over the CPU weight channel, then into the vLLM workers by RPC (works anywhere; the fallback when
    # learner and generator share a GPU); nccl: learner rank 0's GPU broadcasts straight into the workers (needs GPUs
    # of their own); ipc: learner rank 0 and one vLLM generator (tp 1) share a GPU, and the worker loads each bucket
    # from staging slots in the learner's GPU memory (CUDA IPC; common/runfiles.py checks the placement).
    weight_transport: Literal["rpc", "nccl", "ipc"] = "rpc"
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.85  # of each generator GPU, for vLLM
    # How a generator uses its engine (actors/actor.py). "stream": groups in flight up to the engine's capacity, each
    # sent the moment it is scored, new work asked for as room frees. "batch": one Work of rollout.groups_per_request
    # groups (0: one step's, rollout.groups_per_step) at a time, generated as one static batch, scored, sent, then
    # the next request. "auto": batch when the run is deterministic (run.deterministic or rollout.forced_lag), because a
    # continuous batch's samples depend in their last bits on what they were batched with, which depends on timing,
    # and when the engine decodes on the CPU, where a decode step's cost grows with its rows, so the next step's groups
    # slow the current step's longest responses (streaming trained 0.85x the batch loop's samples/s there, make bench
    # row 9, 2026-12-07); stream otherwise (vLLM, or the torch engine on a GPU).
    loop: Literal["auto", "stream", "batch"] = "auto"
    # Sequences a generator's engine decodes at once (vLLM's scheduler; the torch engine's continuous batch): its
    # capacity, which sizes how many groups it keeps in flight (rollout.groups_per_request caps that).
    max_num_seqs: PosInt = 256
    enforce_eager: bool = False  # skip CUDA graphs (faster start, slower decode)
    # vLLM: every call into the engine (start-up, one batch's generation, a weight update with its drain, a label)
    # that has not returned within this raises, and the generator exits to be restarted: a wedged engine core is
    # never waited on for ever. The hub's progress check (transport.generator_progress_timeout_s) usually acts first.
    engine_timeout_s: PosFloat = 3600.0
    # vLLM: give each request its prompt's seed, so a re-issued prompt reproduces its samples under the same
    # weights, whatever else is batched with it. Free on vLLM 0.33's default model runner (V2: Gumbel noise keyed
    # on seed, position and token); the legacy runner (VLLM_USE_V2_MODEL_RUNNER=0) samples each seeded request
    # with a torch.Generator of its own, one by one: turn this off there. (The torch engine always seeds.)
    seed_requests: bool = True


class AutoscaleConfig(_Section):
    """Generators that size themselves (learner/autoscale.py; README "Autoscaling"): off while max = 0. Learner rank 0
    reads each step's row and sets RUN_DIR/generators.json, as `covrl scale` does. Thresholds are shares of a step."""

    min: NonNegInt = 0  # the fewest generators the policy keeps (>= 1 when on)
    max: NonNegInt = 0  # the most; 0: autoscaling off
    window_steps: PosInt = 4  # each figure is the median of this many steps (an evaluation step's spike is ignored)
    settle_steps: NonNegInt = 2  # steps left out after a change took effect (new generators load weights, fill up)
    cooldown_steps: PosInt = 6  # steps between two changes, at least
    # Scale up when the learner waits for generation more than this share of its step...
    up_wait: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    # ...down when it waits less than this and the generators are idle (blocked by admission) more than down_idle.
    down_wait: Annotated[float, Meta(ge=0, lt=1)] = 0.05
    down_idle: Annotated[float, Meta(gt=0, lt=1)] = 0.3
    max_factor: Annotated[float, Meta(gt=1)] = 2.0  # one change at most multiplies (or divides) the count by this
    # A scale-up is undone when samples/s rose by less than min_gain x what it could give, min(new/old,
    # 1/(1 - wait)) - 1; a scale-down, when samples/s fell by more than max_loss. The count it left is then not tried
    # again for retry_after_steps steps (doubled each time the same undo repeats, up to 8x).
    min_gain: Annotated[float, Meta(ge=0, le=1)] = 0.25
    max_loss: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    retry_after_steps: PosInt = 50
    # New generators that have not all joined after this long: the scale-up gave nothing (no room for them).
    join_timeout_s: PosFloat = 600.0


class ClusterConfig(_Section):
    """The generator pool: its autoscaling, how failing generators are set aside, and (under Ray) how long a new
    generator waits for room."""

    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)
    # Ray: a generator whose bundle no node can hold after this long is given up (its placement group removed, the
    # launcher says so, with the cluster's free resources) and tried again later; the autoscaler is asked for it.
    placement_timeout_s: PosFloat = 300.0
    # A generator that fails (exits with an error, or is stopped on the hub's verdict) more than
    # generator_max_failures times within generator_failure_window_s is set aside: the run goes on with the others
    # (RUN_DIR/generators_launcher.jsonl, `cluster/generators_set_aside`), and its slot is tried again after
    # generator_retry_after_s (doubled each time it is set aside again, up to 8x), or at once when the generator
    # count is set again (covrl scale, the autoscale policy). The run stops, with a checkpoint, only when every
    # generator it wants is set aside. Below the limit a failed generator is restarted after 2, 4, 8 ... s (at most 60).
    generator_max_failures: PosInt = 3
    generator_failure_window_s: PosFloat = 600.0
    generator_retry_after_s: PosFloat = 600.0


class WandbConfig(_Section):
    """Weights & Biases as a second logger (`pip install -e '.[wandb]'`), same tags as TensorBoard."""

    project: str = ""  # "" = off
    entity: str = ""  # "" = your default entity
    name: str = ""  # "" = the run directory's name
    mode: Literal["online", "offline"] = "online"  # offline: RUN_DIR/wandb only; `wandb sync` uploads it later


class LoggingConfig(_Section):
    """What a run writes besides metrics.jsonl and TensorBoard scalars."""

    # RUN_DIR/rollouts/step_N.jsonl: one record per response of the written groups (prompt, response, reward,
    # extracted answer, advantage, length, token versions, staleness). off | sample (rollout_groups groups per
    # step, picked by a seeded draw) | all.
    rollouts: Literal["off", "sample", "all"] = "sample"
    rollout_groups: PosInt = 2
    # Of every evaluated version, the responses to the first eval_samples prompts of each data source
    # (RUN_DIR/rollouts/eval_step_N.jsonl); 0 = none.
    eval_samples: NonNegInt = 2
    text_samples: NonNegInt = 2  # responses per step also shown as TensorBoard text (rollouts/train, rollouts/eval)
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)


class ConfigError(ValueError):
    """A config that cannot run, with the field path and the fix."""


def _parse_value(text: str):
    """`--set` values are TOML literals; a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(tree: dict, dotted: str, value) -> None:
    node = tree
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{key}' is a value, not a section")
    node[keys[-1]] = value


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (), *, validate: bool = True) -> Config:
    """Defaults <- TOML file <- `key.path=value` overrides, validated once (`validate=False`: types and
    bounds only, not the cross-field rules of `check`, e.g. to read a recipe on a machine without its data)."""
    tree: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                tree = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist; pass an existing TOML file to --config") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set rollout.group_size=8")
        key, text = item.split("=", 1)
        _apply_override(tree, key.strip(), _parse_value(text.strip()))
    return from_dict(tree, validate=validate)


def from_dict(tree: dict, *, validate: bool = True) -> Config:
    loss = tree.get("learner", {}).get("loss")
    if isinstance(loss, dict) and "type" not in loss:
        loss["type"] = "ppo"  # the union's default member, so `[learner.loss] clip_low = 0.1` just works
    try:
        cfg = msgspec.convert(tree, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid config: {explain(str(e), tree)}") from None
    if validate:
        check(cfg)
    return cfg


def _node(path: list[str]):
    """msgspec's description of the config field at `path` (None where the path leaves the tree)."""
    t = msgspec.inspect.type_info(Config)
    for key in path:
        structs = [t] if isinstance(t, msgspec.inspect.StructType) else [
            m for m in getattr(t, "types", ()) if isinstance(m, msgspec.inspect.StructType)]
        t = next((f.type for s in structs for f in s.fields if f.name == key), None)
        if t is None:
            return None
    return t


def _variants(t) -> list[msgspec.inspect.StructType]:
    """The members of a tagged section (learner.loss), else []."""
    return [m for m in getattr(t, "types", ()) if isinstance(m, msgspec.inspect.StructType) and m.tag is not None]


def explain(message: str, tree: dict) -> str:
    """msgspec's validation message said as a user writes the config (`rollout.group_size`, not
    `$.rollout.group_size`), with the valid values of an enum, the variant a field belongs to, or the
    field a typo meant."""
    import difflib

    message = message.replace("$.", "")
    at = re.search(r" - at `([^`]+)`$", message)
    path = at.group(1).split(".") if at else []
    if m := re.match(r"Invalid (?:enum )?value (.+) - at", message):
        t = _node(path)
        if isinstance(t, msgspec.inspect.LiteralType):
            return f"{'.'.join(path)} = {m.group(1)} is not one of " + ", ".join(f'"{v}"' for v in t.values)
        if path and (vs := _variants(_node(path[:-1]))) and path[-1] == vs[0].tag_field:
            return f"{'.'.join(path)} = {m.group(1)} is not one of " + ", ".join(f'"{v.tag}"' for v in vs)
    if m := re.match(r"Object contains unknown field `([^`]+)`", message):
        field, section, t = m.group(1), ".".join(path), _node(path)
        if vs := _variants(t):
            node = tree
            for key in path:
                node = node.get(key, {}) if isinstance(node, dict) else {}
            chosen = node.get(vs[0].tag_field) if isinstance(node, dict) else None
            owners = [v.tag for v in vs if any(f.name == field for f in v.fields)]
            if owners:
                tag = vs[0].tag_field
                belongs = " and ".join(f'{tag} = "{o}"' for o in owners)
                return (f'{section}.{field} is not a field of {section}.{tag} = "{chosen}"; it belongs to {belongs}: '
                        f'set {section}.{tag} = "{owners[0]}" as well')
            names = sorted({f.name for v in vs if v.tag == chosen for f in v.fields})
        else:
            names = [f.name for f in getattr(t, "fields", ())]
        close = difflib.get_close_matches(field, names, n=1)
        hint = f"did you mean {section + '.' if section else ''}{close[0]}?" if close else \
            f"its fields are {', '.join(names)}"
        return f"{section + '.' if section else ''}{field} is not a config key; {hint}"
    return message


def check(cfg: Config) -> None:
    """Cross-field rules that a single field's bounds cannot express."""
    import importlib.util

    if cfg.logging.wandb.project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.project is set but wandb is not installed: pip install -e '.[wandb]', or "
                          "clear logging.wandb.project")
    d = cfg.data
    if d.task == "files" and not d.train_files:
        raise ConfigError("data.task = \"files\" needs data.train_files, e.g. --set 'data.train_files=[\"train.parquet\"]'")
    if d.task == "arith" and cfg.reward.verifier != "math":
        raise ConfigError(f"reward.verifier = \"{cfg.reward.verifier}\" grades walks, but data.task is \"arith\" (math "
                          "answers); set reward.verifier = \"math\", or data.task = \"files\" with a grid dataset")
    if d.task == "arith" and d.train_files:
        raise ConfigError("data.train_files is set but data.task is \"arith\"; set data.task = \"files\" to train on them")
    for path in d.train_files + d.eval_files:
        if not os.path.isfile(path):
            raise ConfigError(f"data file {path!r} does not exist (paths are relative to the directory you launch from)")
    t = cfg.transport
    if t.learner_timeout_s <= t.batch_timeout_s + t.weight_send_timeout_s:
        raise ConfigError(f"transport.learner_timeout_s = {t.learner_timeout_s:g} must exceed batch_timeout_s + "
                          f"weight_send_timeout_s ({t.batch_timeout_s:g} + {t.weight_send_timeout_s:g}): the other learner "
                          f"ranks wait that long for rank 0 while it waits for the generators; raise it")
    if cfg.rollout.top_p < 1:
        # The learner does not re-derive the nucleus. Both engines report pi_behav under the
        # nucleus they sampled from (renormalised over the top-p tokens; vLLM's processed_logprobs), the learner
        # scores pi_prox and pi_theta under the full tempered softmax, so every ratio would carry the nucleus mass.
        raise ConfigError(
            f"rollout.top_p={cfg.rollout.top_p}: generators report each token's logprob under the top-p nucleus they "
            f"sampled from, but the learner scores the full tempered softmax, so every importance weight pi_prox/pi_behav "
            f"would be scaled by the nucleus mass (below 1 even at staleness 0; learner.importance mis and geo_mask would "
            f"drop tokens) and the update biased. Train with rollout.top_p = 1 (the paper recipes do); eval.top_p may be < 1")
    g = cfg.generator
    if cfg.rollout.forced_length_median and g.engine == "vllm":
        raise ConfigError("rollout.forced_length_median (the generation-heavy benchmark workload) is implemented by the "
                          "torch engine only; set generator.engine = \"torch\" or rollout.forced_length_median = 0")
    if cfg.rollout.forced_lag > cfg.rollout.max_staleness_steps:
        raise ConfigError(f"rollout.forced_lag = {cfg.rollout.forced_lag} exceeds rollout.max_staleness_steps = "
                          f"{cfg.rollout.max_staleness_steps}: a forced lag lies within the staleness bound; set "
                          f"rollout.max_staleness_steps = {cfg.rollout.forced_lag} or more")
    check_weight_transport(cfg)
    check_autoscale(cfg.cluster.autoscale)
    loss = cfg.learner.loss
    if isinstance(loss, PPOLoss) and 0 < loss.dual_clip_c <= 1:
        raise ConfigError(f"learner.loss.dual_clip_c={loss.dual_clip_c} must be > 1 (published 3) or 0 to turn dual-clip off")
    if isinstance(loss, ClipCovLoss) and loss.cov_lb >= loss.cov_ub:
        raise ConfigError(f"learner.loss.cov_lb={loss.cov_lb} must be below cov_ub={loss.cov_ub} (paper: 1 and 5)")
    if getattr(loss, "selection", "covariance") == "random" and cfg.learner.cov_scope != "step":
        raise ConfigError("learner.loss.selection = \"random\" draws its tokens over the whole step; set "
                          "learner.cov_scope = \"step\" (the default) or selection = \"covariance\"")
    if getattr(loss, "lag_ref_steps", 0.0) > 0 and cfg.learner.cov_scope != "step":
        raise ConfigError(f"learner.loss.lag_ref_steps={loss.lag_ref_steps} scales the step's token budget by its lags; set "
                          "learner.cov_scope = \"step\" (the default) or lag_ref_steps = 0")
    imp = cfg.learner.importance
    if imp.lo >= imp.hi or imp.geo_lo >= imp.geo_hi:
        raise ConfigError(f"learner.importance: lo ({imp.lo}) must be below hi ({imp.hi}) and geo_lo ({imp.geo_lo}) below geo_hi ({imp.geo_hi})")
    if cfg.learner.offload_optimizer and cfg.learner.zero_stage == 0:
        raise ConfigError("learner.offload_optimizer needs ZeRO: set learner.zero_stage to 1, 2 or 3")
    if cfg.learner.compile_layers and cfg.learner.zero_stage == 3:
        raise ConfigError("learner.compile_layers = true with learner.zero_stage = 3: ZeRO-3 gathers parameters in "
                          "hooks inside each layer, which torch.compile would split into pieces; turn one of them off")
    if cfg.rollout.groups_per_step % cfg.learner.mini_batches:
        raise ConfigError(
            f"learner.mini_batches={cfg.learner.mini_batches} must divide rollout.groups_per_step="
            f"{cfg.rollout.groups_per_step} so every optimizer step sees whole groups; change one of them"
        )


def check_weight_transport(cfg: Config) -> None:
    """What generator.weight_transport needs of the rest of the config (its placement is checked by the launcher:
    common/runfiles.py, check_colocation)."""
    g = cfg.generator
    direct = g.weight_transport in ("nccl", "ipc")
    if direct and g.weight_update == "finish" and not publish_waits_for_generation(cfg):
        raise ConfigError(
            f"generator.weight_transport = \"{g.weight_transport}\" with weight_update = \"finish\" and "
            f"run.deterministic = false: a vLLM generator can take {g.weight_transport} weights only after its "
            "in-flight requests finish, so learner rank 0 would wait for the longest response in flight at every "
            "publish. Use weight_update = \"keep\" (requests continue on the new weights, every token stamped with its "
            "version), weight_transport = \"rpc\" (weights staged in the generator's host memory; the learner never "
            "waits), or run.deterministic = true or a rollout.forced_lag (nothing is in flight when a version is "
            "published)")
    if g.weight_transport == "ipc" and g.engine == "torch":
        raise ConfigError("generator.weight_transport = \"ipc\" maps learner rank 0's GPU slots into a vLLM worker, "
                          "but generator.engine = \"torch\" has no such worker (it would take every version over the "
                          "gloo channel, as with \"rpc\"): set generator.engine = \"vllm\" (or \"auto\") or "
                          "weight_transport = \"rpc\"")
    if g.weight_transport == "ipc" and cfg.cluster.autoscale.max > 1:
        raise ConfigError(f"generator.weight_transport = \"ipc\" serves the one generator on learner rank 0's GPU, "
                          f"but cluster.autoscale.max = {cfg.cluster.autoscale.max} would start more: set "
                          "cluster.autoscale.max = 0 (off), or weight_transport = \"rpc\"")


def check_autoscale(a: AutoscaleConfig) -> None:
    if not a.max:
        if a.min:
            raise ConfigError(f"cluster.autoscale.min = {a.min} with max = 0: set cluster.autoscale.max (autoscaling is "
                              f"off while it is 0), e.g. covrl run --autoscale {a.min}:{max(a.min, 4)}")
        return
    if not 1 <= a.min <= a.max:
        raise ConfigError(f"cluster.autoscale: min = {a.min}, max = {a.max}; need 1 <= min <= max, e.g. --autoscale 1:4")
    if a.down_wait >= a.up_wait:
        raise ConfigError(f"cluster.autoscale.down_wait = {a.down_wait} must be below up_wait = {a.up_wait}: between "
                          f"the two the policy holds (its hysteresis)")


def with_absolute_paths(cfg: Config, base: str) -> Config:
    """The config with model and data paths made absolute against `base` (the launcher's directory): roles
    run elsewhere and read RUN_DIR/config.toml, so relative paths must be resolved once, where the user typed them."""
    absolute = lambda p: p if not p or os.path.isabs(p) else os.path.normpath(os.path.join(base, p))  # noqa: E731
    data = msgspec.structs.replace(cfg.data, train_files=tuple(map(absolute, cfg.data.train_files)),
                                   eval_files=tuple(map(absolute, cfg.data.eval_files)))
    model = cfg.model.path
    if not (is_hub_id(model) and not os.path.exists(os.path.join(base, model))):  # a Hub id stays one
        model = absolute(model)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=model), data=data)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(path: str) -> bool:
    """`org/name` or `org/name@revision`: a Hugging Face Hub model id (where no local path of that name exists)."""
    return bool(_HUB_ID.match(path))


DTYPES = ("auto", "bfloat16", "float32")  # model.dtype's choices (in the order msgspec names them)
BF16_CAPABILITY = (8, 0)  # sm80 (A100) and newer: bf16 tensor cores, and torch's varlen FlashAttention-2 kernels


def resolve_dtype(choice: str, capability: tuple[int, int] | None) -> str:
    """"float32" or "bfloat16": `model.dtype` for learner ranks on a CUDA device of compute capability `capability`
    ((major, minor)), or on the CPU (`capability` None). "auto" is bfloat16 from sm80 on, where bf16 runs on tensor
    cores and packed rows can take the varlen attention kernels (learner/attention.py takes them in 16-bit only),
    and float32 on older GPUs and on the CPU (DeepSpeed's bf16 optimizer needs a GPU, and every recorded CPU run is
    fp32). A named dtype passes through. The launcher calls this once per run (launch/plan.py `dtype_choice`)."""
    if choice not in DTYPES:
        raise ConfigError(f"model.dtype = {choice!r} is not one of " + ", ".join(f'"{d}"' for d in DTYPES)
                          + ' ("auto": bfloat16 on GPUs of compute capability 8.0 or more, float32 elsewhere)')
    if choice != "auto":
        return choice
    return "bfloat16" if capability is not None and tuple(capability) >= BF16_CAPABILITY else "float32"


def dtype_on(choice: str, device) -> str:
    """`resolve_dtype` for this process's `device` ("cpu", "cuda", "cuda:1", a torch.device). In a run the roles
    read the dtype the launcher resolved (RUN_DIR/config.toml), which passes through; "auto" reaches here only in a
    role built outside `covrl run` (covrl evaluate, tests, the hardware workers), and is resolved on its own device.
    Looks at CUDA only for "auto"."""
    if choice != "auto":
        return resolve_dtype(choice, None)
    import torch

    device = torch.device(device)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    return resolve_dtype(choice, tuple(torch.cuda.get_device_capability(device)) if on_cuda else None)


def with_dtype(cfg: Config, dtype: str) -> Config:
    """`cfg` with `model.dtype` = `dtype` (a resolved one: `resolve_dtype`, `dtype_on`)."""
    if dtype == cfg.model.dtype:
        return cfg
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, dtype=dtype))


def triton_interpreted() -> bool:
    """Triton's interpreter is on (`TRITON_INTERPRET=1`): its kernels run on CPU tensors, slowly; tests only."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_refusal(cuda: bool) -> str | None:
    """Why learner.logprob_head = "triton" (learner/head_kernels.py) cannot run here, or None: here so the launcher
    refuses it at the door (launch/plan.py) with the learner's own words."""
    if not cuda and not triton_interpreted():
        return ("learner.logprob_head = \"triton\" runs Triton kernels, which need CUDA (TRITON_INTERPRET=1 runs "
                "them on a CPU for tests, slowly): use \"chunked\" or \"fused\" on a CPU")
    try:
        import triton  # noqa: F401
    except ImportError:
        return ("learner.logprob_head = \"triton\" needs the triton package (it comes with torch's CUDA builds): "
                "install it or use \"fused\"")
    return None


def generator_loop(cfg: Config, on_cpu: bool) -> str:
    """"stream" or "batch": `generator.loop`, with "auto" resolved: batch for a deterministic run, or where the
    engine decodes on the CPU (`on_cpu`), stream otherwise."""
    if cfg.generator.loop != "auto":
        return cfg.generator.loop
    return "batch" if publish_waits_for_generation(cfg) or on_cpu else "stream"


def publish_waits_for_generation(cfg: Config) -> bool:
    """Whether the publish of version v + 1 waits for all training work issued at v (`run.deterministic`, or a
    `rollout.forced_lag`): then every token's version is its slot's issue version and nothing is in flight at a
    publish."""
    return cfg.run.deterministic or cfg.rollout.forced_lag > 0


def eval_versions(cfg: Config) -> list[int]:
    """Policy versions the generators evaluate: 0 (the base model), every `every_steps`, and the last."""
    every = cfg.eval.every_steps
    if not every:
        return []
    return sorted({0, cfg.run.steps, *range(every, cfg.run.steps, every)})


def eval_sampling(cfg: Config, data_source: str) -> tuple[float, int]:
    """(temperature, samples per prompt) of one eval set: greedy decoding takes one sample."""
    t = cfg.eval.temperatures.get(data_source, cfg.eval.temperature)
    return t, (cfg.eval.k if t > 0 else 1)


def to_toml(cfg: Config) -> str:
    return msgspec.toml.encode(cfg).decode()
