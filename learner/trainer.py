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

import datetime
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.runfiles import apply_memory_fraction
from common.config import ClipCovLoss, Config, TransportConfig
from learner.batch import StepBatch, pack
from learner.logprobs import install_token_forward
from learner import offpolicy
from learner.objective import Objective, Surveyed, Tokens, covariance_profile

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
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def attn_implementation(choice: str) -> str:
    """"auto": flash-attn 2 (varlen over the packed rows) when CUDA and flash_attn are there, else sdpa."""
    if choice != "auto":
        return choice
    import importlib.util

    return "flash_attention_2" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"


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


def _seen(e: Surveyed, met: dict[str, torch.Tensor]) -> Surveyed:
    """A micro-batch at the step start with what the loss did to it, for the step's profiles: the loss's
    step-wide choice (`selected`), the tokens its trust region clipped and those the off-policy correction
    capped or masked (the IS weight's cut, M2PO's drop)."""
    masked = met["is_weight_clipfrac"] > 0
    if e.m2po_keep is not None:
        masked = masked | ((e.m2po_keep == 0) & (e.mask > 0))
    return Surveyed(old=e.old.detach(), entropy=e.entropy, adv=e.adv, mask=e.mask, behav=e.behav, seq_ids=e.seq_ids,
                    num_seqs=e.num_seqs, m2po_keep=e.m2po_keep,
                    selected=met["cov_selected"] > 0 if "cov_selected" in met else None,
                    clipped=(met["pg_clipfrac"] > 0).float(), masked=masked.float())


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
    """totals[name] += named[name] in float64 on the host, with one device-to-host copy for all names."""
    keys = sorted(named)
    for key, v in zip(keys, torch.stack([named[k] for k in keys]).double().cpu()):
        totals[key] = totals.get(key, torch.zeros((), dtype=torch.float64)) + v


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
        self.cfg = cfg
        if cfg.model.dtype == "bfloat16" and not torch.cuda.is_available():
            raise RuntimeError("model.dtype = \"bfloat16\" trains with DeepSpeed's bf16 optimizer, which needs a GPU; "
                               "use model.dtype = \"float32\" on CPU")
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        attn = attn_implementation(cfg.learner.attn_implementation)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn)
        model.config.use_cache = False
        install_token_forward(model)  # the root module computes what the objective needs: ZeRO-3's hooks see it
        if cfg.learner.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        lc = cfg.learner
        self.ref = None
        if lc.kl.coef:
            self.ref = install_token_forward(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                                                  attn_implementation=attn))
            self.ref.eval().requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=lc.adam_betas,
                                eps=lc.adam_eps)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg))
        self.device = self.engine.device  # cpu here; the rank's GPU on the GPU path
        if dist.get_rank() == 0:  # what DeepSpeed and transformers actually set up, not what was asked
            log.info("learner: ZeRO-%d, optimizer offload %s, bf16 %s, attention %s, gradient checkpointing %s, device %s",
                     self.engine.zero_optimization_stage(), self.engine.zero_cpu_offload(),
                     self.engine.bfloat16_enabled(), model.config._attn_implementation, model.is_gradient_checkpointing,
                     self.device)
        if self.ref is not None:
            self.ref.to(self.device)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.comm = DataParallel()
        self.objective = Objective(lc, cfg.rollout.max_new_tokens)
        self.ess = offpolicy.EssStepScale(lc.ess_step_scaling, lc.ess_base_ratio)
        # Clip-Cov's candidate band, logged for every loss (actor/cov_candidates): the run's, else the published one.
        band = lc.loss if isinstance(lc.loss, ClipCovLoss) else ClipCovLoss()
        self.cov_band = (band.cov_lb, band.cov_ub)
        # With one mini-batch the training forward itself sees pi_prox and the entropy before the
        # update, so the survey pass is only paid for when something needs the whole step first.
        self.needs_survey = lc.mini_batches > 1 or self.objective.selects_over_step or self.ref is not None

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _logp_entropy(self, model, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, N-1] log pi(target) and full-vocabulary entropy, the lm head run in chunks. `model` is called as the
        root module (`install_token_forward`), so under ZeRO-3 each call resets DeepSpeed's fetch trace and the
        parameters are prefetched in the recorded order."""
        return model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], targets=mb["targets"],
                     temperature=self.cfg.rollout.temperature, chunk=self.cfg.learner.logprob_chunk_tokens)

    def _micro(self, batch: StepBatch) -> list[tuple[int, int, list[int], dict]]:
        """(mini index, micro index, sample indices, packed tensors) for this rank, in training order.

        Packed once per step and shared by the survey, the training loop and the entropy-after pass.
        """
        return [(m, k, idx, {name: t.to(self.device) for name, t in pack(batch.samples, idx, self.pad_id).items()})
                for m, per_rank in enumerate(batch.plan) for k, idx in enumerate(per_rank[self.rank])]

    def _generator(self, batch: StepBatch) -> torch.Generator:
        """This rank's seeded stream for the step's random token choices."""
        return torch.Generator().manual_seed(batch.seed * 1009 + self.rank)

    @torch.no_grad()
    def _survey(self, batch: StepBatch, micro: list) -> dict[tuple[int, int], Surveyed]:
        """Everything that must be known about the whole step before the first update, by (mini, micro) index."""
        self.engine.eval()
        per = {}
        for m, k, idx, mb in micro:
            logp, ent = self._logp_entropy(self.module, mb)
            ref = self._logp_entropy(self.ref, mb)[0] if self.ref is not None else None
            per[(m, k)] = Surveyed(old=logp, entropy=ent, adv=mb["adv"], mask=mb["mask"], ref=ref, behav=mb["behav"],
                                   seq_ids=mb["seq_ids"], num_seqs=max(len(idx), 1),
                                   lag=batch.version - mb["versions"].double())
        self.engine.train()
        self.objective.select(list(per.values()), self.comm, self._generator(batch))
        return per

    def _prox(self, before: Surveyed, m: int, logp: torch.Tensor, mb: dict, batch: StepBatch) -> torch.Tensor:
        imp = self.cfg.learner.importance
        if imp.prox == "behaviour":
            return mb["behav"]
        if imp.prox == "loglinear" and m > 0:
            # AReaL's approximation, no extra pass: interpolate in log space between pi_behav and the
            # current policy by version, treating mini-batch m of M as version v + m / M.
            v = float(batch.version)
            ver = mb["versions"].double()
            alpha = ((v - ver) / (v + m / len(batch.plan) - ver)).clamp(0.0, 1.0).float()
            return mb["behav"] + alpha * (logp.detach() - mb["behav"])
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

    def _backward(self, batch: StepBatch, survey, gen: torch.Generator, poison: bool, m: int, k: int, idx: list[int],
                  mb: dict, last: bool) -> tuple[Tokens, dict[str, torch.Tensor], Surveyed]:
        """Forward and backward of one micro-batch (its share of the mini-batch's loss); returns its tokens, the
        objective's per-token metrics and the micro-batch as the step start saw it."""
        self.engine.set_gradient_accumulation_boundary(last)
        # We call the module, not engine.forward (which would also hook our outputs for loss scaling), so do
        # what engine.forward does first: ZeRO-3 counts micro-steps there, and with the count stuck at 0 each
        # backward overwrites the gradient shards instead of accumulating them.
        if hasattr(self.engine.optimizer, "clear_backward_seen_flag"):
            self.engine.optimizer.clear_backward_seen_flag()
        logp, entropy = self._logp_entropy(self.module, mb)
        # The policy at the step start: surveyed, or (one mini-batch, no survey) the one just run.
        e = survey[(m, k)] if survey is not None else Surveyed(
            old=logp.detach(), entropy=entropy, adv=mb["adv"], mask=mb["mask"], behav=mb["behav"],
            seq_ids=mb["seq_ids"], num_seqs=max(len(idx), 1))
        t = Tokens(logp=logp, entropy=entropy, old=self._prox(e, m, logp, mb, batch), behav=mb["behav"],
                   adv=mb["adv"], mask=mb["mask"], seq_ids=mb["seq_ids"], num_seqs=max(len(idx), 1),
                   ref=e.ref, selected=e.selected, keep=e.keep, m2po_keep=e.m2po_keep)
        loss, met = self.objective(t, global_tokens=float(batch.mini_tokens[m]), global_seqs=float(batch.mini_seqs[m]),
                                   par_lambda=batch.par_lambda, generator=gen)
        loss = loss * self.world
        if poison:
            loss = loss * float("nan")
        if not idx and self.cfg.learner.zero_stage < 3:
            # Empty micro-batch: touch every parameter with a zero gradient so ZeRO's reduction hooks
            # fire on this rank like on the others. (ZeRO-3 shards are empty outside a forward; there
            # the forward on the placeholder input already reaches every parameter.)
            loss = loss + 0.0 * sum(p.sum() for p in self.module.parameters())
        self.engine.backward(loss, scale_wrt_gas=False)
        return t, met, e

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
        seen: list[Surveyed] = []  # each micro-batch at the step start, with what the loss cut: the step's profiles
        for i, (m, k, idx, mb) in enumerate(micro):
            t, met, e = self._backward(batch, survey, gen, poison, m, k, idx, mb, last=k == n_micro[m] - 1)
            with torch.no_grad():  # e.entropy: the policy *before* this step's updates
                own = micro_sums(t, met, e.entropy, mb["input_ids"].numel() if idx else 0, len(idx))
                seen.append(_seen(e, met))
                self.ess.add(t)
                if i in sampled:  # the tokens whose entropy is measured again after the update
                    own |= {"entropy_sampled": own["entropy"], "tokens_sampled": own["tokens"]}
                accumulate(totals, own)
            if k == n_micro[m] - 1:
                lr_scales.append(self.ess.factor(self.comm))
                with offpolicy.scaled_lr(self.engine.optimizer, lr_scales[-1]):
                    applied = self._optimizer_step()
                skipped.append(not applied)
                gn = self.engine.get_global_grad_norm()
                if applied and gn is not None:
                    grad_norms.append(float(gn))
        logged_after = self.cfg.learner.log_entropy_delta
        if logged_after:
            totals["entropy_after"] = self._entropy_sum([micro[i] for i in sorted(sampled)])
        totals["ranks"] = 1.0 if totals.get("tokens", 0.0) > 0 else 0.0
        sums = sum_vector(totals)
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
        filled = [i for i, (_, _, idx, _) in enumerate(micro) if idx]
        return set(filled[::self.cfg.learner.entropy_delta_stride])

    @torch.no_grad()
    def _entropy_sum(self, micro: list) -> float:
        """Sum of token entropies of these micro-batches (just trained on), under the updated policy."""
        self.engine.eval()
        total = 0.0
        for _, _, idx, mb in micro:
            if idx:
                total += float((self._logp_entropy(self.module, mb)[1] * mb["mask"]).sum())
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
