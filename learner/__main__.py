"""One learner rank: `python -m learner --run-dir DIR` (rank and world from the torch env).

This file builds the rank's collaborators (trainer, publisher, and on rank 0 the broker and the metrics sink),
resumes them from a checkpoint if asked, and hands them to `learner.loop.Learner`, whose step reads as phases.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from broker.hub import Hub
from common.runfiles import (ExitedGenerators, LostGenerator, SetAsideGenerators, mark_learners_ready, read_cluster,
                             read_generator_target, read_run_config, record_lost_generator)
from common.config import eval_versions
from common.data import PromptSource, eval_sets, model_dir
from common.lifeline import watch_parent
from common.metrics import MetricsWriter, keep_metrics
from common.transport import load_secret
from common.wandb_log import open_wandb
from learner.autoscale import Autoscaler
from learner.beat import Beat, beat_interval_s
from learner.checkpoint import load_checkpoint, restoring, resume_point, save_checkpoint
from learner.loop import Follower, Lead, Learner, Ranks, fault_steps
from learner.params import full_state_dict
from learner.par import ParSchedule
from learner.publisher import ModelPublisher, WeightPublisher
from learner.rollout_log import RolloutLog
from learner.trainer import Trainer, init_distributed, thread_setup

log = logging.getLogger("covrl.learner")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m learner")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN_DIR that verifies")
    args = ap.parse_args()
    watch_parent()  # die with the launcher or Ray actor that started this process
    # Ctrl-C / SIGTERM (the launcher's graceful stop): finish this step, or stop waiting for the next batch, write a
    # checkpoint of the last step trained, exit (learner/loop.py).
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(name)s: %(message)s")
    cfg = read_run_config(args.run_dir)
    cluster = read_cluster(args.run_dir)
    # The launcher's watch reads this rank's record (learner/beat.py) from now on: written before anything slow.
    beat = Beat(args.run_dir, int(os.environ.get("RANK", "0")), beat_interval_s(cfg.transport.learner_timeout_s),
                phase="joining the learner ranks")
    thread_setup(cfg)
    torch.manual_seed(cfg.run.seed)
    rank, world = init_distributed(timeout_s=cfg.transport.learner_timeout_s)
    path = model_dir(cfg)
    beat.phase("loading the model and building the DeepSpeed engine", 0)
    trainer = Trainer(cfg, path)
    trainer.progress = beat.advance  # a long step moves the record on, micro-batch by micro-batch
    start, resumed = 0, None
    if args.resume:
        beat.phase("resuming from a checkpoint", 0)
        if (found := resume_point(args.run_dir, rank)) is not None:
            start, ckpt = found
            resumed = load_checkpoint(ckpt, trainer.engine, rank=rank)
            log.info("resumed from %s (step %d)", ckpt, start)
        else:
            log.warning("no complete checkpoint in %s/checkpoints: starting from step 0", args.run_dir)
    zero3 = cfg.learner.zero_stage == 3  # parameters are shards: every rank takes part in each gather
    tokenizer = channel = None
    beat.phase("building the hub and the weight channel" if rank == 0 else "building the weight publisher", start)
    if rank == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        whost, wport = cluster.weight_addr.rsplit(":", 1)
        channel = WeightPublisher(whost, int(wport), cfg.transport.weight_sync_timeout_s, device=trainer.device,
                                  send_timeout_s=cfg.transport.weight_send_timeout_s)
    publisher = ModelPublisher(trainer.module, zero3=zero3, channel=channel)
    role = (lead(cfg, args, cluster, tokenizer, publisher, world, start, resumed, beat) if rank == 0 else
            Follower(publisher, beat))
    if resumed is not None:
        beat.phase(f"publishing the resumed version {start}", start)
        publisher.publish(start)  # generators start from the base model and are sent the latest version when they join
    beat.phase("start-up barrier: every rank's engine built", start)
    dist.barrier()  # every rank's engine is built: its GPU memory is allocated (colocated generators start now)
    if rank == 0:
        role.hub.start()
        mark_learners_ready(args.run_dir)
        log.info("hub on %s, weight channels ready for %d generators", cluster.hub_addr, role.hub.target)

    def save(step: int, state: dict | None, hub_blob: bytes | None) -> None:
        # a collective under ZeRO-3; rank 0, which writes the model, keeps it on the host
        full = full_state_dict(trainer.module, publisher.layout, zero3, keep=rank == 0) if zero3 else None
        save_checkpoint(args.run_dir, step, trainer.engine, rank=rank, tokenizer=tokenizer, state=state,
                        hub_state=hub_blob, state_dict=full, keep_last=cfg.run.keep_checkpoints)

    learner = Learner(cfg, trainer=trainer, ranks=Ranks(rank), role=role, world=world, save=save,
                      stop_requested=stop_requested, run_dir=args.run_dir, faults=fault_steps(), beat=beat,
                      clock=time.monotonic if rank == 0 else None)  # rank 0's clock times checkpoint_every_s
    code = learner.run(start)
    beat.phase(f"final barrier (exit code {code})", learner.trained)
    dist.barrier()
    beat.phase(f"exiting (exit code {code})", learner.trained, waits_on="none")  # past the last collective
    dist.destroy_process_group()
    beat.close()
    return code


class GeneratorTargetReader:
    """The run's generator target, read again at each call (the hub polls it about once a second):
    RUN_DIR/generators.json, which `covrl scale` rewrites while the run goes on, else cluster.json's count. A file
    that cannot be read, or that names fewer than one generator, keeps the last good value (and says so once)."""

    def __init__(self, run_dir: str, default: int):
        self.run_dir, self.default, self.last, self.warned = run_dir, default, default, ""

    def __call__(self) -> int:
        try:
            t = read_generator_target(self.run_dir)
            n = self.default if t is None else t.generators
            if n < 1:
                raise ValueError(f"generators={n}, and a run needs at least one")
        except (OSError, ValueError) as e:  # msgspec's DecodeError and ValidationError are ValueErrors
            if str(e) != self.warned:
                log.warning("%s/generators.json: %s; the target stays %d (set it with covrl scale RUN_DIR --gens N)",
                            self.run_dir, e, self.last)
                self.warned = str(e)
            return self.last
        self.last, self.warned = n, ""
        return n


class GeneratorEvents:
    """The hub's `GeneratorHooks` (broker/hooks.py) on learner rank 0: a joined or drained incarnation's weight
    channel is built or closed; a lost one's goes at once, and the launcher stops its process and restarts it (it
    follows RUN_DIR/generators_lost.jsonl)."""

    def __init__(self, channel: WeightPublisher, run_dir: str):
        self.channel, self.run_dir = channel, run_dir

    def join(self, gen_id: int, incarnation: str) -> None:
        self.channel.join(gen_id, incarnation)

    def leave(self, gen_id: int, incarnation: str) -> None:
        self.channel.leave(gen_id, incarnation)

    def lost(self, gen_id: int, incarnation: str, pid: int, why: str, detail: str) -> None:
        self.channel.drop(gen_id, incarnation)
        record_lost_generator(self.run_dir, LostGenerator(gen_id, incarnation, pid, why, detail, time.time()))


def lead(cfg, args, cluster, tokenizer, publisher: ModelPublisher, world: int, start: int, resumed: dict | None,
         beat: Beat) -> Lead:
    """Rank 0's role: the broker (restored on resume), the metrics sink (rows after the checkpoint purged), PAR.
    The hub binds cluster.json's hub_addr (the launcher's choice of this node's address), not transport.host."""
    host, port = cluster.hub_addr.rsplit(":", 1)
    source, evals = PromptSource(cfg, tokenizer), eval_sets(cfg, tokenizer) if cfg.eval.every_steps else None
    channel = publisher.channel
    hub = Hub(cfg, run_id=cluster.run_id, key=load_secret(args.run_dir), host=host, port=int(port),
              source=source, weight_addr=cluster.weight_addr,
              generators=GeneratorTargetReader(args.run_dir, cluster.generators), eval_prompts=evals,
              hooks=GeneratorEvents(channel, args.run_dir), exited=ExitedGenerators(args.run_dir))
    channel.report = hub.lose  # a weight channel that fails or misses its deadline: the hub decides
    par = ParSchedule(cfg.learner.par, cfg.run.steps)
    # An evaluated version's row waits for its eval results; step 0's row is the base model's evaluation.
    held = {0: {}} if 0 in eval_versions(cfg) else {}
    if resumed is not None:
        with restoring(resumed["path"], rank=0):  # a checkpoint without a manifest may be damaged here too
            par.load_state(resumed["par"])
            held = {int(k): v for k, v in resumed["held"].items()}
            hub.restore(resumed["hub"])
    if args.resume:
        # Rows the dead run wrote after its checkpoint go; a held row is written again when its eval is in.
        keep_metrics(args.run_dir, lambda row: row <= start and row not in held)
    sink = MetricsWriter(args.run_dir, purge_step=min([start + 1, *held]) if args.resume else None,
                         wandb=open_wandb(cfg, args.run_dir, cluster.run_id))
    rollouts = RolloutLog(cfg, args.run_dir, tokenizer, source, evals, sink)
    autoscale = Autoscaler(cfg.cluster.autoscale, args.run_dir, sink, start) if cfg.cluster.autoscale.max else None
    if autoscale is not None and resumed is not None and "autoscale" in resumed:
        with restoring(resumed["path"], rank=0):
            autoscale.policy.load_state(resumed["autoscale"], start, time.time())  # what it learnt: ceilings, floors
    return Lead(cfg, hub=hub, publisher=publisher, sink=sink, par=par, world=world, held=held, start=start,
                rollouts=rollouts, autoscale=autoscale, beat=beat, set_aside=SetAsideGenerators(args.run_dir).count)


if __name__ == "__main__":
    sys.exit(main())
