"""One generator: `python -m actors --run-dir DIR --gen-id I [--hub HOST:PORT]`."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from actors.actor import run_actor
from actors.factory import load_engine
from common.runfiles import read_cluster, read_run_config
from common.data import model_dir
from common.lifeline import watch_parent
from common.transport import load_secret


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m actors")
    ap.add_argument("--run-dir", required=True, help="run directory with config.toml, cluster.json and secret.key")
    ap.add_argument("--gen-id", type=int, required=True)
    ap.add_argument("--hub", default=None, help="host:port of the hub (default: from cluster.json)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s gen{args.gen_id} %(levelname)s %(name)s: %(message)s")
    watch_parent()  # die with the launcher or Ray actor that started this process
    cfg = read_run_config(args.run_dir)
    cluster = read_cluster(args.run_dir)
    torch.set_num_threads(cfg.run.torch_threads)
    try:
        engine, tokenizer = load_engine(cfg, model_dir(cfg))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return run_actor(cfg, engine=engine, tokenizer=tokenizer, hub_addr=args.hub or cluster.hub_addr,
                     key=load_secret(args.run_dir), run_id=cluster.run_id, gen_id=args.gen_id, run_dir=args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
