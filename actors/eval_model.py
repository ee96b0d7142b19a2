"""Standalone evaluation of one model directory, with the generator's own code path.

    python -m actors.eval_model --model DIR [--config FILE] [--set key=value ...] [--data FILE ...] [--out FILE]

(`launch/evaluate.py` runs this.) It builds the same EvalWork chunks the hub issues during training
(`common.heldout`), runs them through `actors.actor.evaluate` on the same engine, and computes the
metrics with the same function: for the same model, data, config and seed it reports what the
in-training evaluation of that model reported. `--data` replaces `data.eval_files`; without it the
configured eval sets are used (the built-in `arith_easy` / `arith_hard` by default).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from actors.actor import evaluate, make_reward_pool
from actors.factory import load_engine
from common import messages
from common.cli import USER_ERRORS, fail
from common.config import load_config
from common.data import check_model_dir, eval_sets, resolve_model
from common.datasets import DatasetError
from common.heldout import batch_groups, eval_item, eval_metrics, eval_params, eval_room


def run(cfg, model: str, sets: dict) -> dict[str, float]:
    """The eval metrics of `model` on `sets` (`eval_sets` of the config, built by the caller)."""
    engine, tokenizer = load_engine(cfg, model)
    results: dict[str, list[messages.EvalResult]] = {}
    ticket = 0
    with make_reward_pool(cfg) as pool:
        for ds, prompts in sets.items():
            sampling, k = eval_params(cfg, ds)
            # Chunks as a deterministic run's generator evaluates them (its batch loop's room).
            room = eval_room(cfg, k, batch_groups(cfg, max(1, engine.max_num_seqs // cfg.rollout.group_size)))
            for start in range(0, len(prompts), room):
                indices = range(start, min(start + room, len(prompts)))
                items = [eval_item(cfg, ticket + j, ds, i, prompts[i], messages.to_bytes(prompts[i].ids, messages.TOKEN_DTYPE))
                         for j, i in enumerate(indices)]
                ticket += len(items)
                work = messages.EvalWork(items=items, k=k, sampling=sampling, policy_version=engine.version)
                results.setdefault(ds, []).extend(evaluate(work, engine=engine, tokenizer=tokenizer, pool=pool, receiver=None,
                                                           gen_id=0, incarnation="standalone", wait_s=0.0))
    return eval_metrics(results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m actors.eval_model", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (a checkpoint: RUN_DIR/checkpoints/step_N) or Hub id org/name[@revision]")
    ap.add_argument("--config", help="TOML config, e.g. RUN_DIR/config.toml to match a run's evaluation")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--data", nargs="+", metavar="FILE", help=".jsonl / .parquet eval files (replaces data.eval_files)")
    ap.add_argument("--out", help="also write the metrics to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s evaluate %(levelname)s %(name)s: %(message)s")
    sets = list(args.set)
    if args.data:
        sets.append("data.eval_files=" + json.dumps(args.data))
    try:
        cfg = load_config(args.config, sets)
        args.model, _ = resolve_model(args.model, "--model")  # a Hub id: its snapshot in the Hugging Face cache
        sets = eval_sets(cfg, check_model_dir(args.model, "--model"))  # every eval row, before the model loads
        if not sets:
            raise DatasetError("no eval sets: pass --data FILE ... or set data.eval_files")
    except USER_ERRORS as e:
        return fail(e)
    torch.set_num_threads(cfg.run.torch_threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the "Loading weights" bar: this command prints its metrics, nothing else
    t0 = time.perf_counter()
    try:
        metrics = run(cfg, args.model, sets)
    except USER_ERRORS as e:
        return fail(e)
    for key, value in metrics.items():
        print(f"{key:40s} {value:.4f}")
    print(f"evaluated {args.model} in {time.perf_counter() - t0:.1f}s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(metrics, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
