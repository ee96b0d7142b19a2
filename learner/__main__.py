"""One learner rank: `python -m learner --run-dir DIR` (rank and world from the torch env).

Rank 0 also runs the hub (a thread) and owns the weight channel. The loop is
the whole learner: take a batch, share it, train, publish, log.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from common import messages as M
from common import weights as W
from common.cluster import mark_learners_ready, read_cluster, read_run_config
from common.config import eval_versions
from common.data import PromptSource, eval_sets, model_dir
from common.metrics import MetricsWriter, keep_metrics
from common.transport import load_secret
from learner import batch as B
from learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from learner.hub import Hub
from learner.params import full_state_dict, param_buckets, scratch_for
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
    lengths = [M.n_tokens(s.token_ids) for r in groups for s in r.group.samples]
    stale = np.concatenate([version - M.as_array(s.versions, M.VERSION_DTYPE) for r in groups for s in r.group.samples])
    return {
        "critic/score/mean": float(np.mean(rewards)),
        "response_length/mean": float(np.mean(lengths)),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "reward/timeouts": float(sum(s.score_status == "timeout" for r in groups for s in r.group.samples)),
        "reward/errors": float(sum(s.score_status == "error" for r in groups for s in r.group.samples)),
    }


def fault_steps() -> set[int]:
    """COVRL_FAULT_NONFINITE_STEPS="3,5-6": steps whose loss is made NaN (fault-injection tests only)."""
    out: set[int] = set()
    for part in filter(None, os.environ.get("COVRL_FAULT_NONFINITE_STEPS", "").split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def agree(flag: bool) -> bool:
    """True on every rank if it is true on any."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m learner")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in RUN_DIR")
    args = ap.parse_args()
    # Ctrl-C / SIGTERM (the launcher's graceful stop): finish this step, write a checkpoint, exit.
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(name)s: %(message)s")
    cfg = read_run_config(args.run_dir)
    cluster = read_cluster(args.run_dir)
    thread_setup(cfg)
    torch.manual_seed(cfg.run.seed)
    rank, world = init_distributed()
    path = model_dir(cfg)
    trainer = Trainer(cfg, path)
    start, resumed = 0, None
    if args.resume and (found := latest_checkpoint(args.run_dir)) is not None:
        start, ckpt = found
        resumed = load_checkpoint(ckpt, trainer.engine, rank=rank)
        log.info("resumed from %s (step %d)", ckpt, start)
    elif args.resume:
        log.warning("no complete checkpoint in %s/checkpoints: starting from step 0", args.run_dir)
    hub = channel = writer = tokenizer = None
    lay = W.layout(trainer.module)
    zero3 = cfg.learner.zero_stage == 3  # parameters are shards: every rank takes part in each gather
    scratch = scratch_for(trainer.module, lay)  # one bucket's worth on the learner's device, reused by every publish
    par = ParSchedule(cfg.learner.par, cfg.run.steps)
    # The row of an evaluated version waits for its eval results, so metrics.jsonl keeps one row
    # per step (step 0: the base model's evaluation) and rows stay in step order.
    evaluated = set(eval_versions(cfg))
    held: dict[int, dict[str, float]] = {0: {}} if 0 in evaluated else {}
    if resumed is not None:
        par.load_state(resumed["par"])
        held = {int(k): v for k, v in resumed["held"].items()}
    if rank == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        host, port = cluster.hub_addr.rsplit(":", 1)
        whost, wport = cluster.weight_addr.rsplit(":", 1)
        channel = WeightPublisher(whost, int(wport), cfg.transport.weight_sync_timeout_s, device=trainer.device)
        hub = Hub(cfg, run_id=cluster.run_id, key=load_secret(args.run_dir), port=int(port),
                  source=PromptSource(cfg, tokenizer), weight_addr=cluster.weight_addr, n_generators=cluster.generators,
                  eval_prompts=eval_sets(cfg, tokenizer) if cfg.eval.every_steps else None, on_join=channel.join)
        if args.resume:
            # Rows the dead run wrote after its checkpoint go; a held row is written again when its eval is in.
            keep_metrics(args.run_dir, lambda row: row <= start and row not in held)
        if resumed is not None:
            hub.restore(resumed["hub"])
        writer = MetricsWriter(args.run_dir, purge_step=min([start + 1, *held]) if args.resume else None)

    def publish(version: int):
        """Rank 0 sends the weights to the generators: (seconds, bytes, checksum). Under ZeRO-3 every rank
        takes part in each bucket's gather, so the other ranks walk the buckets too (and get None)."""
        if rank == 0:
            return channel.publish(version, lay, param_buckets(trainer.module, lay, zero3, scratch))
        if zero3:
            for _ in param_buckets(trainer.module, lay, zero3, scratch):
                pass
        return None

    if resumed is not None:
        publish(start)  # generators start from the base model and are sent the latest version when they join
    dist.barrier()  # every rank's engine is built: its GPU memory is allocated (colocated generators start now)
    if rank == 0:
        hub.start()
        mark_learners_ready(args.run_dir)
        log.info("hub on %s, weight channel with %d generators ready", cluster.hub_addr, cluster.generators)
    last_filtered, last_tokens = hub.totals() if hub else (0, 0)
    last_t = time.perf_counter()
    wait_s = cfg.transport.generator_timeout_s * 5
    faults = fault_steps()
    skipped_in_row, exit_code = 0, 0

    def finish_version(v: int) -> float:
        """Wait for the generation pinned to version v; write its held row. Returns seconds waited."""
        waited = hub.wait_version_done(v, timeout_s=wait_s)
        if v in held:
            writer.write(v, {**held.pop(v), **hub.take_eval(v)})
        return waited

    def checkpoint(step: int) -> None:
        full = full_state_dict(trainer.module, lay, zero3) if zero3 else None  # a collective under ZeRO-3
        state = hub_blob = None
        if rank == 0:
            state = {"version": step, "par": par.state(), "held": {str(k): v for k, v in held.items()},
                     "learners": world}
            hub_blob = hub.snapshot()
        save_checkpoint(args.run_dir, step, trainer.engine, rank=rank, tokenizer=tokenizer, state=state,
                        hub_state=hub_blob, state_dict=full, keep_last=cfg.run.keep_checkpoints)

    step = start
    for step in range(start + 1, cfg.run.steps + 1):
        t0 = time.perf_counter()
        version = step - 1
        groups = extra = batch = None
        if rank == 0:
            groups = hub.take_batch(version, timeout_s=wait_s)
            extra = host_metrics(groups, version)
            batch = B.batch_from_config([r.group for r in groups], cfg, version=version, ranks=world,
                                        par_lambda=par.value(step))
        batch = share_batch(batch, rank)
        stats = trainer.train_step(batch, poison=step in faults)
        metrics = step_metrics(stats)
        skipped_in_row = skipped_in_row + len(stats.skipped) if all(stats.skipped) else 0
        if rank != 0:
            publish(step)  # rank 0 publishes below, once this version's generation is in
        if rank == 0:
            publish_wait_s = finish_version(version)
            # The hub moves first: a token stamped `step` may reach it the moment the broadcast
            # lands, and work issued for `step` just waits in the generator for these weights.
            hub.set_version(step)
            sync_s, nbytes, weights_sum = publish(step)
            now = time.perf_counter()
            filtered, gen_tokens = hub.totals()
            adv = np.array([s.advantage for s in batch.samples])
            metrics.update(extra)
            metrics.update(hub.counters())
            metrics.update(channel.counter_values())
            par.observe(metrics["actor/entropy"])
            metrics.update({
                "actor/par_lambda": batch.par_lambda,
                "filter/dropped_groups": float(filtered - last_filtered),
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
            last_tokens, last_t, last_filtered = gen_tokens, now, filtered
            if step in evaluated:
                held[step] = metrics
            else:
                writer.write(step, metrics)
        stop = agree(stop_requested.is_set())
        every = cfg.run.checkpoint_every_steps
        diverged = skipped_in_row >= cfg.learner.max_consecutive_skipped_steps
        if step == cfg.run.steps or (every and step % every == 0) or stop or diverged:
            checkpoint(step)
        if diverged:
            log.error("stopping: the last %d optimizer steps had a non-finite loss or gradient and were skipped "
                      "(learner.max_consecutive_skipped_steps=%d); the weights are those of the last good step, saved "
                      "in %s/checkpoints/step_%d. Lower learner.lr, check the reward and data, or resume with "
                      "--resume %s", skipped_in_row, cfg.learner.max_consecutive_skipped_steps, args.run_dir, step,
                      args.run_dir)
            exit_code = 3
            break
        if stop:
            log.info("stop requested: checkpoint of step %d written; continue with --resume %s", step, args.run_dir)
            break
    if rank == 0:
        if step == cfg.run.steps and exit_code == 0:
            finish_version(cfg.run.steps)
        channel.stop()
        hub.stop()
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
