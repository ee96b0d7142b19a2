"""The train step of one learner rank: DeepSpeed engine, packed micro-batches, the objective.

One `train_step`:
1. `_survey` (no grad, only when something needs it): log pi_prox, the entropy
   before the update, pi_ref, and the token choices that must see the *whole*
   batch on all ranks, which the objective makes (`Objective.select`: the loss's
   own, e.g. Clip-Cov / KL-Cov over the step, and the high-entropy mask).
2. for each mini-batch: forward/backward every micro-batch of this rank, then
   one optimizer step. A micro-batch's loss is its share of the aggregate over
   the *whole mini-batch on all ranks*, times the data-parallel world size
   because DeepSpeed averages gradients over ranks; so the update does not
   depend on how the batch was split.
3. optionally the entropy of the same batch after the update (`entropy_delta`).
Metrics are gathered by name per micro-batch and summed over ranks in one
all_reduce of a vector laid out in `SUM_KEYS` order.

pi_prox: with one mini-batch and no survey, the policy at the start of the step
is the current one, so log pi_prox = logp.detach() and no extra pass is needed.

DeepSpeed on CPU: two JIT-compiled ops would cost every run about a minute
(the shared-memory comm op, built for inference all-reduce that training never
calls; and fused Adam, built when the optimizer comes from the DeepSpeed
config). We disable the first and pass our own torch AdamW, so nothing compiles.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.runfiles import apply_memory_fraction
from common.config import BF16_CAPABILITY, ClipCovLoss, Config, TransportConfig, dtype_on, with_dtype
from learner import attention, offpolicy
from learner.batch import Packed, StepBatch, pack
from learner.logprobs import install_token_forward, resolve_head
from learner.objective import Objective, covariance_profile
from learner.tokens import Choices, Seen, Surveyed, Tokens

log = logging.getLogger("covrl.trainer")


def _quiet_deepspeed():
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed(timeout_s: float = TransportConfig().learner_timeout_s) -> tuple[int, int]:
    """torch.distributed from the standard env (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK); every collective
    and the rendezvous wait at most `timeout_s` (transport.learner_timeout_s).

    CPU: gloo. GPU: NCCL for CUDA tensors (DeepSpeed's gradient and parameter collectives) and gloo
    for CPU tensors: the step's bookkeeping (batch broadcast, metric sums, global top-k) stays on the
    host on both paths, so the trainer has one code path and a device, not a GPU branch.
    """
    deepspeed = _quiet_deepspeed()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        apply_memory_fraction(device)  # colocated with a generator: stay inside the learner's share of the GPU
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    deadline = datetime.timedelta(seconds=timeout_s)
    # A group made later without a timeout of its own (DeepSpeed's data-parallel groups: `new_group(ranks)`) gets
    # torch's default for its backend (30 min gloo, 10 min NCCL), not the world group's; a frozen rank then held the
    # others 600 s past a 40 s learner_timeout_s. torch reads these module defaults at each `new_group`; they are
    # this process's own, and every group it makes is a learner rank's, so they all take the learner deadline.
    c10d.default_pg_timeout = deadline
    c10d.default_pg_nccl_timeout = deadline
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=deadline)
    return dist.get_rank(), dist.get_world_size()


def my_groups() -> list:
    """Every process group this rank is in."""
    return [pg for pg in list(c10d._world.pg_map) if not c10d._rank_not_in_group(pg)]


def bound_every_group(timeout_s: float) -> int:
    """Give every process group this rank is in the deadline `timeout_s` (transport.learner_timeout_s), whatever it
    was made with; call once the groups exist (after the DeepSpeed engine is built). Returns how many were set."""
    deadline = datetime.timedelta(seconds=timeout_s)
    groups = my_groups()
    for pg in groups:
        c10d._set_pg_timeout(deadline, pg)
    return len(groups)


def group_deadlines() -> dict[str, float]:
    """What a collective waits at most, in seconds, on each gloo or NCCL backend of every group this rank is in, by
    "<group name>/<device>"."""
    out = {}
    for pg in my_groups():
        for device in pg._device_types:
            options = getattr(pg._get_backend(device), "options", None)
            if options is not None and hasattr(options, "_timeout"):
                out[f"{c10d._world.pg_names.get(pg, '?')}/{device.type}"] = options._timeout.total_seconds()
    return out


def unbounded_groups(timeout_s: float) -> dict[str, float]:
    """The groups (as `group_deadlines` names them) whose timeout is not `timeout_s`: empty when all are bounded."""
    return {name: s for name, s in group_deadlines().items() if abs(s - timeout_s) > 1e-3}


def ds_config(cfg: Config) -> dict:
    """The DeepSpeed config of the learner (our own torch AdamW is passed in, so nothing compiles on CPU)."""
    lc = cfg.learner
    zero: dict = {"stage": lc.zero_stage}
    if lc.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    out = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload with our torch AdamW, not DeepSpeedCPUAdam (a JIT build)
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16":
        out["bf16"] = {"enabled": True}  # bf16 weights and activations; ZeRO keeps fp32 master weights and moments
    return out


# The step's named sums, in the layout of the one all_reduce that adds them over ranks. Every rank
# builds the vector by name in this order; a key missing on a rank (e.g. no `cov_selected` for PPO) is 0.
SUM_KEYS = (
    "tokens", "entropy", "pg_loss", "pg_clipfrac", "ppo_kl", "is_weight", "is_weight_clipfrac",
    "logp", "adv", "logp_adv", "seq_tokens", "ranks", "cov_selected", "entropy_after", "kl_ref",
    "entropy_sampled", "tokens_sampled", "seqs",
)


@dataclass
class StepStats:
    sums: torch.Tensor  # float64 [len(SUM_KEYS)], reduced over ranks
    grad_norm: float  # mean over the optimizer steps that were applied
    train_s: float
    entropy_delta_logged: bool
    skipped: list[bool]  # per optimizer step: skipped for a non-finite loss or gradient (same on every rank)
    # learner.objective.covariance_profile of the step (the same on every rank); empty in tests that build stats
    profile: dict[str, float] = field(default_factory=dict)
    # learner.offpolicy.offpolicy_profile of the step and its ess_lr_scale (the same on every rank)
    offpolicy: dict[str, float] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        """The step's sums by name."""
        return dict(zip(SUM_KEYS, self.sums.tolist()))


def _seen(start: Surveyed, choices: Choices, met: dict[str, torch.Tensor]) -> Seen:
    """A micro-batch with what the loss did to it, for the step's profiles: the tokens the loss chose as it reports
    them (`cov_selected`: the step's choice, or its own within the micro-batch with cov_scope = "micro_batch"),
    the tokens its trust region clipped and those the off-policy correction capped or masked (the IS weight's cut,
    M2PO's drop)."""
    masked = met["is_weight_clipfrac"] > 0
    if choices.m2po_keep is not None:
        masked = masked | ((choices.m2po_keep == 0) & (start.mask > 0))
    chosen = dataclasses.replace(choices, selected=met["cov_selected"] > 0 if "cov_selected" in met else None)
    return Seen(start=start, choices=chosen, clipped=(met["pg_clipfrac"] > 0).float(), masked=masked.float())


def micro_sums(t: Tokens, metrics: dict[str, torch.Tensor], entropy_before: torch.Tensor,
               seq_tokens: int, seqs: int = 0) -> dict[str, torch.Tensor]:
    """One micro-batch's named contributions to the step's sums, 0-d tensors on its device: every per-token
    metric of the objective summed over the tokens, plus the token and response counts, the entropy before the
    update and the log pi_prox / advantage sums behind actor/cov_mean."""
    lp, a = t.old * t.mask, t.adv * t.mask
    own = {"tokens": t.mask.sum(), "entropy": (entropy_before * t.mask).sum(), "logp": lp.sum(), "adv": a.sum(),
           "logp_adv": (lp * a).sum(), "seq_tokens": t.mask.new_zeros(()) + float(seq_tokens),
           "seqs": t.mask.new_zeros(()) + float(seqs)}
    return own | {name: v.sum() for name, v in metrics.items()}


def accumulate(totals: dict[str, torch.Tensor], named: dict[str, torch.Tensor]) -> None:
    """totals[name] += named[name] in float64 on the named values' device: no copy to the host (the step copies its
    totals once, `host_totals`)."""
    keys = sorted(named)
    for key, v in zip(keys, torch.stack([named[k] for k in keys]).double()):
        totals[key] = totals.get(key, v.new_zeros(())) + v


def host_totals(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """The step's device totals as host floats, in one device-to-host copy."""
    keys = sorted(totals)
    if not keys:
        return {}
    return dict(zip(keys, torch.stack([totals[k] for k in keys]).cpu().tolist()))


def sum_vector(totals: dict[str, torch.Tensor | float]) -> torch.Tensor:
    """The named totals as the float64 vector the all_reduce adds, in `SUM_KEYS` order, 0 where absent."""
    unknown = sorted(set(totals) - set(SUM_KEYS))
    if unknown:
        raise KeyError(f"metric sums {unknown} have no slot in learner/trainer.py SUM_KEYS, so ranks could not add "
                       f"them; add each name there (and its ratio to step_metrics)")
    return torch.tensor([float(totals.get(k, 0.0)) for k in SUM_KEYS], dtype=torch.float64)


class DataParallel:
    """The step-wide choices' collectives over the learner ranks (`learner.objective.Collectives`), on host tensors."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def kth_largest(self, values: torch.Tensor, k: int) -> torch.Tensor:
        """The k-th largest of the union of every rank's `values` (1-D); -inf if fewer than k exist,
        so `>= kth` then keeps them all."""
        return self.top_values(values, k)[-1]

    def top_values(self, values: torch.Tensor, k: int) -> torch.Tensor:
        """The k largest of the union of every rank's `values` (1-D), descending, padded with -inf: one all_gather
        of k values per rank."""
        local = values.topk(min(k, values.numel())).values if values.numel() else values
        buf = torch.full((k,), float("-inf"), dtype=torch.float64)
        buf[: local.numel()] = local.double()
        gathered = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(gathered, buf)
        return torch.cat(gathered).topk(k).values


class Trainer:
    def __init__(self, cfg: Config, model_path: str):
        from transformers import AutoModelForCausalLM

        deepspeed = _quiet_deepspeed()
        cuda = torch.cuda.is_available()
        # A run's config.toml names the dtype the launcher resolved; "auto" here only outside a run (tests, tools).
        self.cfg = cfg = with_dtype(cfg, dtype_on(cfg.model.dtype, "cuda" if cuda else "cpu"))
        if cfg.model.dtype == "bfloat16" and not cuda:
            raise RuntimeError("model.dtype = \"bfloat16\" trains with DeepSpeed's bf16 optimizer, which needs a GPU; "
                               "use model.dtype = \"float32\" (or \"auto\") on CPU")
        if cfg.model.dtype == "bfloat16" and torch.cuda.get_device_capability() < BF16_CAPABILITY:
            log.warning("model.dtype = \"bfloat16\" on a GPU of compute capability %s (bf16 has tensor cores from 8.0 on; "
                        "Ray's GPUs are taken to have them): set model.dtype = \"float32\" if steps are slow or fail",
                        torch.cuda.get_device_capability())
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        lc = cfg.learner
        attn = attention.resolve(lc.attn_implementation, cuda, dtype)
        head = resolve_head(lc.logprob_head, cuda)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn)
        model.config.use_cache = False
        # the root module computes what the objective needs: ZeRO-3's hooks see it
        install_token_forward(model, head=head)
        if lc.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lc.compile_layers:
            compile_layers(model)
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.ref = None
        if lc.kl.coef:
            self.ref = install_token_forward(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                                                  attn_implementation=attn), head=head)
            self.ref.eval().requires_grad_(False)
        # Fused AdamW (one kernel over all parameters) where the optimizer steps on the GPU; torch's default on
        # the CPU, where the recorded runs were made with it.
        fused = cuda and not lc.offload_optimizer
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=lc.adam_betas,
                                eps=lc.adam_eps, fused=fused or None)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
        # DeepSpeed made its groups just now: each collective on them waits at most transport.learner_timeout_s.
        bound_every_group(cfg.transport.learner_timeout_s)
        if slack := unbounded_groups(cfg.transport.learner_timeout_s):
            log.warning("process groups that wait past transport.learner_timeout_s=%gs (a frozen rank holds the others "
                        "that long): %s", cfg.transport.learner_timeout_s, slack)
        self.device = self.engine.device  # cpu here; the rank's GPU on the GPU path
        if dist.get_rank() == 0:  # what DeepSpeed and transformers actually set up, not what was asked
            log.info("learner: ZeRO-%d, optimizer offload %s, bf16 %s, attention %s, gradient checkpointing %s, device %s, "
                     "head %s, compiled layers %s, fused AdamW %s",
                     self.engine.zero_optimization_stage(), self.engine.zero_cpu_offload(),
                     self.engine.bfloat16_enabled(), model.config._attn_implementation, model.is_gradient_checkpointing,
                     self.device, head, lc.compile_layers, fused)
        if self.ref is not None:
            self.ref.to(self.device)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.comm = DataParallel()
        self.objective = Objective(lc, cfg.rollout.max_new_tokens)
        self.ess = offpolicy.EssStepScale(lc.ess_step_scaling, lc.ess_base_ratio)
        self.progress: Callable[[], None] = lambda: None  # called after each micro-batch (learner/beat.py: advance)
        # Clip-Cov's candidate band, logged for every loss (actor/cov_candidates): the run's, else the published one.
        band = lc.loss if isinstance(lc.loss, ClipCovLoss) else ClipCovLoss()
        self.cov_band = (band.cov_lb, band.cov_ub)
        # With one mini-batch the training forward itself sees pi_prox and the entropy before the
        # update, so the survey pass is only paid for when something needs the whole step first.
        self.needs_survey = lc.mini_batches > 1 or self.objective.selects_over_step or self.ref is not None

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _logp_entropy(self, model, mb: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, N-1] log pi(target) and full-vocabulary entropy. `model` is called as the root module
        (`install_token_forward`), so under ZeRO-3 each call resets DeepSpeed's fetch trace and the parameters are
        prefetched in the recorded order; the row's sample boundaries travel with it for varlen attention."""
        return model(input_ids=mb.input_ids, position_ids=mb.position_ids, targets=mb.targets,
                     temperature=self.cfg.rollout.temperature, chunk=self.cfg.learner.logprob_chunk_tokens,
                     **mb.attn_kwargs())

    def _micro(self, batch: StepBatch) -> list[tuple[int, int, Packed]]:
        """(mini index, micro index, packed micro-batch on this rank's device) for this rank, in training order.

        Packed once per step and shared by the survey, the training loop and the entropy-after pass.
        """
        return [(m, k, pack(batch.samples, idx, self.pad_id).to(self.device))
                for m, per_rank in enumerate(batch.plan) for k, idx in enumerate(per_rank[self.rank])]

    def _generator(self, batch: StepBatch) -> torch.Generator:
        """This rank's seeded stream for the step's random token choices."""
        return torch.Generator().manual_seed(batch.seed * 1009 + self.rank)

    @torch.no_grad()
    def _survey(self, batch: StepBatch, micro: list) -> dict[tuple[int, int], tuple[Surveyed, Choices]]:
        """Everything that must be known about the whole step before the first update, by (mini, micro) index:
        each micro-batch as the step start sees it, and the step-wide token choices made from all of them."""
        self.engine.eval()
        per = {}
        for m, k, mb in micro:
            logp, ent = self._logp_entropy(self.module, mb)
            ref = self._logp_entropy(self.ref, mb)[0] if self.ref is not None else None
            per[(m, k)] = Surveyed.of(mb, logp, ent, version=batch.version, ref=ref)
        self.engine.train()
        choices = self.objective.select(list(per.values()), self.comm, self._generator(batch))
        return {key: (start, c) for (key, start), c in zip(per.items(), choices, strict=True)}

    def _prox(self, before: Surveyed, m: int, logp: torch.Tensor, mb: Packed, batch: StepBatch) -> torch.Tensor:
        imp = self.cfg.learner.importance
        if imp.prox == "behaviour":
            return mb.behav
        if imp.prox == "loglinear" and m > 0:
            # AReaL's approximation, no extra pass: interpolate in log space between pi_behav and the
            # current policy by version, treating mini-batch m of M as version v + m / M.
            v = float(batch.version)
            ver = mb.versions.double()
            alpha = ((v - ver) / (v + m / len(batch.plan) - ver)).clamp(0.0, 1.0).float()
            return mb.behav + alpha * (logp.detach() - mb.behav)
        return before.old

    def _optimizer_step(self) -> bool:
        """One optimizer step at a gradient-accumulation boundary; False if it was skipped because the
        gradient was not finite. ZeRO-1/2/3 find that themselves (the global grad norm is inf or NaN: the
        gradients are dropped and the step, Adam moments included, is not applied; `engine.skipped_steps`
        counts it). Without ZeRO (stage 0) we check the all-reduced gradients ourselves (the same on every
        rank) and drop them without calling the optimizer."""
        if self.cfg.learner.zero_stage == 0:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                self.module.zero_grad(set_to_none=True)
                return False
            self.engine.step()
            return True
        before = self.engine.skipped_steps
        self.engine.step()
        return self.engine.skipped_steps == before

    def _backward(self, batch: StepBatch, survey, gen: torch.Generator, poison: bool, m: int, k: int, mb: Packed,
                  last: bool) -> tuple[Tokens, dict[str, torch.Tensor], Seen]:
        """Forward and backward of one micro-batch (its share of the mini-batch's loss); returns its tokens, the
        objective's per-token metrics and what the loss did to it (`Seen`)."""
        self.engine.set_gradient_accumulation_boundary(last)
        # We call the module, not engine.forward (which would also hook our outputs for loss scaling), so do
        # what engine.forward does first: ZeRO-3 counts micro-steps there, and with the count stuck at 0 each
        # backward overwrites the gradient shards instead of accumulating them.
        if hasattr(self.engine.optimizer, "clear_backward_seen_flag"):
            self.engine.optimizer.clear_backward_seen_flag()
        logp, entropy = self._logp_entropy(self.module, mb)
        # The policy at the step start: surveyed, or (one mini-batch, no survey) the one just run.
        start, choices = survey[(m, k)] if survey is not None else (
            Surveyed.of(mb, logp.detach(), entropy.detach(), version=batch.version), Choices())
        t = Tokens.of(start, logp, entropy, self._prox(start, m, logp, mb, batch), choices)
        loss, met = self.objective(t, global_tokens=float(batch.mini_tokens[m]), global_seqs=float(batch.mini_seqs[m]),
                                   par_lambda=batch.par_lambda, generator=gen)
        loss = loss * self.world
        if poison:
            loss = loss * float("nan")
        if not mb.num_seqs and self.cfg.learner.zero_stage < 3:
            # Empty micro-batch: touch every parameter with a zero gradient so ZeRO's reduction hooks
            # fire on this rank like on the others. (ZeRO-3 shards are empty outside a forward; there
            # the forward on the placeholder input already reaches every parameter.)
            loss = loss + 0.0 * sum(p.sum() for p in self.module.parameters())
        self.engine.backward(loss, scale_wrt_gas=False)
        return t, met, _seen(start, choices, met)

    def train_step(self, batch: StepBatch, poison: bool = False) -> StepStats:
        """`poison`: fault injection for tests (COVRL_FAULT_NONFINITE_STEPS): make this step's loss NaN."""
        t0 = time.perf_counter()
        micro = self._micro(batch)
        survey = self._survey(batch, micro) if self.needs_survey else None
        totals: dict[str, torch.Tensor] = {}
        grad_norms, skipped, lr_scales = [], [], []
        gen = self._generator(batch)
        self.engine.train()
        n_micro = [len(per_rank[self.rank]) for per_rank in batch.plan]
        sampled = self._entropy_sample(micro)
        seen: list[Seen] = []  # each micro-batch at the step start, with what the loss cut: the step's profiles
        # Nothing in this loop reads a value back from the device (tested): the sums stay there until the step ends.
        for i, (m, k, mb) in enumerate(micro):
            t, met, s = self._backward(batch, survey, gen, poison, m, k, mb, last=k == n_micro[m] - 1)
            self.progress()
            with torch.no_grad():  # s.start.entropy: the policy *before* this step's updates
                own = micro_sums(t, met, s.start.entropy, mb.row_tokens, mb.num_seqs)
                seen.append(s)
                self.ess.add(t)
                if i in sampled:  # the tokens whose entropy is measured again after the update
                    own |= {"entropy_sampled": own["entropy"], "tokens_sampled": own["tokens"]}
                accumulate(totals, own)
            if k == n_micro[m] - 1:
                lr_scales.append(self.ess.factor(self.comm))
                with offpolicy.scaled_lr(self.engine.optimizer, lr_scales[-1]), \
                        torch.profiler.record_function("covrl/optimizer"):
                    applied = self._optimizer_step()
                skipped.append(not applied)
                gn = self.engine.get_global_grad_norm()
                if applied and gn is not None:
                    grad_norms.append(float(gn))
        logged_after = self.cfg.learner.log_entropy_delta
        if logged_after:
            accumulate(totals, {"entropy_after": self._entropy_sum([micro[i] for i in sorted(sampled)])})
        host = host_totals(totals)
        host["ranks"] = 1.0 if host.get("tokens", 0.0) > 0 else 0.0
        sums = sum_vector(host)
        dist.all_reduce(sums)
        profile = covariance_profile(seen, self.comm, self.cov_band)
        offp = offpolicy.offpolicy_profile(seen, self.comm) | {"ess_lr_scale": sum(lr_scales) / len(lr_scales)}
        return StepStats(sums=sums, grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
                         train_s=time.perf_counter() - t0, entropy_delta_logged=logged_after, skipped=skipped,
                         profile=profile, offpolicy=offp)

    def _entropy_sample(self, micro: list) -> set[int]:
        """Positions in `micro` of the micro-batches whose entropy is measured again after the update
        (actor/entropy_delta): every `learner.entropy_delta_stride`-th non-empty one of this rank, from the first.
        Empty when the metric is off."""
        if not self.cfg.learner.log_entropy_delta:
            return set()
        filled = [i for i, (_, _, mb) in enumerate(micro) if mb.num_seqs]
        return set(filled[::self.cfg.learner.entropy_delta_stride])

    @torch.no_grad()
    def _entropy_sum(self, micro: list) -> torch.Tensor:
        """Sum of token entropies of these micro-batches (just trained on), under the updated policy: a float64
        0-d tensor on the device, added in the order a host float would be."""
        self.engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for _, _, mb in micro:
            if mb.num_seqs:
                total = total + (self._logp_entropy(self.module, mb)[1] * mb.mask).sum().double()
        self.engine.train()
        return total


def step_metrics(stats: StepStats) -> dict[str, float]:
    s = stats.totals()
    n = max(s["tokens"], 1.0)
    mean_lp, mean_a = s["logp"] / n, s["adv"] / n
    out = {
        "actor/entropy": s["entropy"] / n,
        # Mean over tokens of (logp - mean logp)(A - mean A) = E[logp A] - E[logp] E[A] (Cui et al. Eq. 10),
        # with logp of pi_prox (the policy at the step start) over the whole step's batch.
        "actor/cov_mean": s["logp_adv"] / n - mean_lp * mean_a,
        "actor/cov_selected_frac": s["cov_selected"] / n,
        "actor/entropy_per_response": s["entropy"] / max(s["seqs"], 1.0),
        "actor/pg_loss": s["pg_loss"] / n,
        "actor/pg_clipfrac": s["pg_clipfrac"] / n,
        "actor/ppo_kl": s["ppo_kl"] / n,
        "actor/grad_norm": stats.grad_norm,
        "actor/skipped_steps": float(sum(stats.skipped)),
        "actor/is_weight_mean": s["is_weight"] / n,
        "actor/is_weight_clipfrac": s["is_weight_clipfrac"] / n,
        "actor/kl_ref": s["kl_ref"] / n,
        "learner/ranks_participating": s["ranks"],
        "perf/learner_tokens_per_s": s["seq_tokens"] / max(stats.train_s, 1e-9),
        "timing_s/train": stats.train_s,
    }
    out |= {f"actor/{name}": v for name, v in stats.profile.items()}
    out |= {f"offpolicy/{name}": v for name, v in stats.offpolicy.items()}
    if stats.entropy_delta_logged:  # over the sampled tokens (all of them with entropy_delta_stride = 1)
        n_sampled = max(s["tokens_sampled"], 1.0)
        out["actor/entropy_after"] = s["entropy_after"] / n_sampled
        out["actor/entropy_delta"] = (s["entropy_after"] - s["entropy_sampled"]) / n_sampled
    return out


def thread_setup(cfg: Config) -> None:
    torch.set_num_threads(cfg.run.torch_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.run.torch_threads))


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> None:
    """`learner.compile_layers`: torch.compile each decoder layer in place (regional compilation: the layers share
    one compiled graph, so the cost is one layer's compile, not the model's), dynamic in the row length so a new
    packing does not recompile. `backend`: inductor (fused kernels); tests trace with "eager"."""
    for layer in model.model.layers:
        layer.compile(dynamic=True, backend=backend)
