"""One learner rank: `python -m learner --run-dir DIR` (rank and world from the torch env).

Rank 0 also runs the hub (a thread) and owns the weight channel. The loop is
the whole learner: take a batch, share it, train, publish, log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from common import messages as M
from common import weights as W
from common.cluster import read_cluster, read_run_config
from common.config import eval_versions
from common.data import PromptSource, eval_sets, model_dir
from common.metrics import MetricsWriter
from common.transport import load_secret
from learner import batch as B
from learner.checkpoint import save_checkpoint
from learner.hub import Hub
from learner.params import full_state_dict, param_buckets
from learner.publisher import WeightPublisher
from learner.par import ParSchedule
from learner.trainer import Trainer, init_distributed, step_metrics, thread_setup

log = logging.getLogger("covrl.learner")


def share_batch(batch: B.StepBatch | None, rank: int) -> B.StepBatch:
    """Rank 0's batch to every rank: msgpack bytes in a broadcast (no pickles of our structs)."""
    box = [B.encode(batch) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return B.decode(box[0])


def host_metrics(groups: list, version: int) -> dict[str, float]:
    """What rank 0 can read off the rollouts themselves."""
    rewards = [s.reward for r in groups for s in r.group.samples]
    lengths = [len(s.token_ids) // 4 for r in groups for s in r.group.samples]
    stale = np.concatenate([version - M.as_array(s.versions, M.VERSION_DTYPE) for r in groups for s in r.group.samples])
    return {
        "critic/score/mean": float(np.mean(rewards)),
        "response_length/mean": float(np.mean(lengths)),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "reward/timeouts": float(sum(s.score_status == "timeout" for r in groups for s in r.group.samples)),
        "reward/errors": float(sum(s.score_status == "error" for r in groups for s in r.group.samples)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m learner")
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(name)s: %(message)s")
    cfg = read_run_config(args.run_dir)
    cluster = read_cluster(args.run_dir)
    thread_setup(cfg)
    torch.manual_seed(cfg.run.seed)
    rank, world = init_distributed()
    path = model_dir(cfg)
    trainer = Trainer(cfg, path)
    hub = channel = writer = tokenizer = None
    lay = W.layout(trainer.module)
    zero3 = cfg.learner.zero_stage == 3  # parameters are shards: every rank takes part in each gather
    if rank == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        host, port = cluster.hub_addr.rsplit(":", 1)
        whost, wport = cluster.weight_addr.rsplit(":", 1)
        channel = WeightPublisher(whost, int(wport), cfg.transport.weight_sync_timeout_s)
        hub = Hub(cfg, run_id=cluster.run_id, key=load_secret(args.run_dir), port=int(port),
                  source=PromptSource(cfg, tokenizer), weight_addr=cluster.weight_addr, n_generators=cluster.generators,
                  eval_prompts=eval_sets(cfg, tokenizer) if cfg.eval.every_steps else None, on_join=channel.join)
        hub.start()
        writer = MetricsWriter(args.run_dir)
        log.info("hub on %s, weight channel with %d generators ready", cluster.hub_addr, cluster.generators)
    last_tokens, last_t, last_filtered = 0, time.perf_counter(), 0
    par = ParSchedule(cfg.learner.par, cfg.run.steps)
    # The row of an evaluated version waits for its eval results, so metrics.jsonl keeps one row
    # per step (step 0: the base model's evaluation) and rows stay in step order.
    evaluated = set(eval_versions(cfg))
    held: dict[int, dict[str, float]] = {0: {}} if 0 in evaluated else {}
    wait_s = cfg.transport.generator_timeout_s * 5

    def finish_version(v: int) -> float:
        """Wait for the generation pinned to version v; write its held row. Returns seconds waited."""
        waited = hub.wait_version_done(v, timeout_s=wait_s)
        if v in held:
            writer.write(v, {**held.pop(v), **hub.take_eval(v)})
        return waited

    for step in range(1, cfg.run.steps + 1):
        t0 = time.perf_counter()
        version = step - 1
        groups = extra = batch = None
        if rank == 0:
            groups = hub.take_batch(version, timeout_s=wait_s)
            extra = host_metrics(groups, version)
            batch = B.batch_from_config([r.group for r in groups], cfg, version=version, ranks=world,
                                        par_lambda=par.value(step))
        batch = share_batch(batch, rank)
        stats = trainer.train_step(batch)
        metrics = step_metrics(stats)
        if rank != 0 and zero3:
            for _ in param_buckets(trainer.module, lay, zero3):
                pass  # rank 0 sends each gathered bucket to the generators
        if rank == 0:
            publish_wait_s = finish_version(version)
            # The hub moves first: a token stamped `step` may reach it the moment the broadcast
            # lands, and work issued for `step` just waits in the generator for these weights.
            hub.set_version(step)
            sync_s, nbytes, weights_sum = channel.publish(step, lay, param_buckets(trainer.module, lay, zero3))
            now = time.perf_counter()
            gen_tokens = hub.stats.gen_tokens
            adv = np.array([s.advantage for s in batch.samples])
            metrics.update(extra)
            metrics.update(hub.counters())
            metrics.update(channel.counter_values())
            par.observe(metrics["actor/entropy"])
            metrics.update({
                "actor/par_lambda": batch.par_lambda,
                "filter/dropped_groups": float(hub.filtered - last_filtered),
                "critic/advantages/mean": float(adv.mean()),
                "perf/gen_tokens_per_s": (gen_tokens - last_tokens) / max(now - last_t, 1e-9),
                "timing_s/step": now - t0,
                "timing_s/train": stats.train_s,
                "timing_s/weight_sync": sync_s,
                "timing_s/publish_wait": publish_wait_s,
                "weights/bytes": float(nbytes),
                "weights/checksum": weights_sum,
                "weights/version": float(step),
            })
            last_tokens, last_t, last_filtered = gen_tokens, now, hub.filtered
            if step in evaluated:
                held[step] = metrics
            else:
                writer.write(step, metrics)
        every = cfg.run.checkpoint_every_steps
        if step == cfg.run.steps or (every and step % every == 0):
            full = full_state_dict(trainer.module, lay, zero3) if zero3 else None  # a collective under ZeRO-3
            if rank == 0:
                save_checkpoint(args.run_dir, step, trainer.module, tokenizer,
                                {"version": step, "hub_slots": hub.slots, "epoch": hub.epoch, "pos": hub.pos,
                                 "par": par.state()}, state_dict=full)
    if rank == 0:
        finish_version(cfg.run.steps)
        channel.stop()
        hub.stop()
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
