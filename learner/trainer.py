"""The train step of one learner rank: DeepSpeed engine, packed micro-batches, the policy loss.

One `train_step` = for each mini-batch: forward/backward every micro-batch of
this rank, then one optimizer step. The loss of a micro-batch is its share of
the token-mean over the *whole mini-batch on all ranks* (`mini_tokens`), times
the data-parallel world size because DeepSpeed averages gradients over ranks;
so the update is the same however the batch is split.

pi_prox: with one mini-batch, the policy at the start of the step is the
current one, so log pi_prox = logp.detach() and no extra forward is needed.
With several, a no-grad pass before the first update records it.

DeepSpeed on CPU: two JIT-compiled ops would cost every run about a minute
(the shared-memory comm op, built for inference all-reduce that training never
calls; and fused Adam, built when the optimizer comes from the DeepSpeed
config). We disable the first and pass our own torch AdamW, so nothing compiles.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import Config
from learner import losses
from learner.batch import StepBatch, pack


def _quiet_deepspeed():
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed() -> tuple[int, int]:
    """torch.distributed from the standard env (RANK, WORLD_SIZE, MASTER_ADDR/PORT), gloo on CPU."""
    deepspeed = _quiet_deepspeed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class StepStats:
    sums: torch.Tensor  # float64 [len(SUM_KEYS)], reduced over ranks
    grad_norm: float
    train_s: float


SUM_KEYS = (
    "tokens", "entropy", "pg_loss", "pg_clipfrac", "ppo_kl", "is_weight", "is_weight_clipfrac",
    "logp", "adv", "logp_adv", "seq_tokens", "ranks",
)


class Trainer:
    def __init__(self, cfg: Config, model_path: str):
        from transformers import AutoModelForCausalLM

        deepspeed = _quiet_deepspeed()
        self.cfg = cfg
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        lc = cfg.learner
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.999), eps=1e-8)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": lc.grad_clip,
            "zero_optimization": {"stage": lc.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _forward(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi_theta of each target and the full-vocabulary entropy, both [1, N-1]."""
        out = self.engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False)
        logits = out.logits[:, :-1].float() / self.cfg.rollout.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, mb["targets"][..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def _prox_logprobs(self, batch: StepBatch) -> dict[tuple[int, int], torch.Tensor]:
        self.engine.eval()
        out = {}
        for m, per_rank in enumerate(batch.plan):
            for k, idx in enumerate(per_rank[self.rank]):
                out[(m, k)] = self._forward(pack(batch.samples, idx, self.pad_id))[0]
        self.engine.train()
        return out

    def train_step(self, batch: StepBatch) -> StepStats:
        t0 = time.perf_counter()
        lc = self.cfg.learner
        loss_cfg = lc.loss
        dual = loss_cfg.dual_clip_c or None
        prox = self._prox_logprobs(batch) if len(batch.plan) > 1 else None
        sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        grad_norms = []
        self.engine.train()
        for m, per_rank in enumerate(batch.plan):
            micro = per_rank[self.rank]
            for k, idx in enumerate(micro):
                self.engine.set_gradient_accumulation_boundary(k == len(micro) - 1)
                mb = pack(batch.samples, idx, self.pad_id)
                logp, entropy = self._forward(mb)
                mask = mb["mask"]
                old = logp.detach() if prox is None else prox[(m, k)]
                w, w_metrics = losses.importance_weights(old, mb["behav"], mask, kind=lc.importance.type, cap=lc.importance.cap)
                tok_loss, pg_metrics = losses.ppo_loss(
                    logp, old, mb["adv"], mask, clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high, dual_clip_c=dual
                )
                tok_loss = tok_loss * w
                loss = losses.token_mean(tok_loss, mask, float(batch.mini_tokens[m])) * self.world
                if not idx:
                    # Empty micro-batch: touch every parameter with a zero gradient so
                    # ZeRO's reduction hooks fire on this rank like on the others.
                    loss = loss + 0.0 * sum(p.sum() for p in self.engine.module.parameters())
                self.engine.backward(loss, scale_wrt_gas=False)
                with torch.no_grad():
                    lp = old * mask
                    a = mb["adv"] * mask
                    sums += torch.stack([
                        mask.sum(), (entropy * mask).sum(), tok_loss.detach().sum(), pg_metrics["pg_clipfrac"].sum(),
                        pg_metrics["ppo_kl"].sum(), w_metrics["is_weight"].sum(), w_metrics["is_weight_clipfrac"].sum(),
                        lp.sum(), a.sum(), (lp * a).sum(), torch.tensor(float(mb["input_ids"].numel() if idx else 0)),
                        torch.tensor(0.0),
                    ]).double()
            self.engine.step()
            gn = self.engine.get_global_grad_norm()
            if gn is not None:
                grad_norms.append(float(gn))
        sums[SUM_KEYS.index("ranks")] = 1.0 if sums[SUM_KEYS.index("tokens")] > 0 else 0.0
        dist.all_reduce(sums)
        return StepStats(sums=sums, grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
                         train_s=time.perf_counter() - t0)


def step_metrics(stats: StepStats) -> dict[str, float]:
    s = dict(zip(SUM_KEYS, stats.sums.tolist()))
    n = max(s["tokens"], 1.0)
    mean_lp, mean_a = s["logp"] / n, s["adv"] / n
    return {
        "actor/entropy": s["entropy"] / n,
        # Mean over tokens of (logp - mean logp)(A - mean A) = E[logp A] - E[logp] E[A] (Cui et al. Eq. 10).
        "actor/cov_mean": s["logp_adv"] / n - mean_lp * mean_a,
        "actor/pg_loss": s["pg_loss"] / n,
        "actor/pg_clipfrac": s["pg_clipfrac"] / n,
        "actor/ppo_kl": s["ppo_kl"] / n,
        "actor/grad_norm": stats.grad_norm,
        "actor/is_weight_mean": s["is_weight"] / n,
        "actor/is_weight_clipfrac": s["is_weight_clipfrac"] / n,
        "learner/ranks_participating": s["ranks"],
        "perf/learner_tokens_per_s": s["seq_tokens"] / max(stats.train_s, 1e-9),
    }


def thread_setup(cfg: Config) -> None:
    torch.set_num_threads(cfg.run.torch_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.run.torch_threads))
