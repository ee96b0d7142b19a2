"""The learner role of hardware/check.py: one model directory published as one version through the learner's
own publish path (`ModelPublisher` over `WeightPublisher`), to one generator (`python -m actors.vllm_engine --check`).

    python -m hardware.check_learner --model DIR --weights HOST:PORT --out OUT.json --until GEN_OUT.json
                                [--version 1] [--incarnation gpu_check] [--timeout-s 900]

It hosts the weight store at HOST:PORT, as learner rank 0 does, lets generator 0 of incarnation INCARNATION join
its pair channel (over gloo, or with the NCCL group it announces), publishes VERSION from this process's cuda:0
(the CPU where there is no CUDA: the gloo path alone), and writes {"weight_sync_s", "bytes_sent", "checksum"} to
OUT: the publish's own (seconds, bytes sent to the generator as fp32, checksum), as a run's `timing_s/weight_sync`,
`weights/bytes` and `weights/checksum` report them. It keeps the channel open until GEN_OUT exists (the generator
has loaded, generated and reported) or the timeout passes, then stops it. hardware/check.py starts it as a process
of its own, on the first GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from learner.nccl import wait_until
from learner.publisher import ModelPublisher, WeightPublisher

log = logging.getLogger("covrl.gpu_check")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hardware.check_learner")
    ap.add_argument("--model", required=True, help="local Hugging Face model directory: the weights to publish")
    ap.add_argument("--weights", required=True, help="host:port of the weight-channel store this process hosts")
    ap.add_argument("--out", required=True, help="JSON: weight_sync_s, bytes_sent, checksum")
    ap.add_argument("--until", required=True, help="keep the channel open until this file exists")
    ap.add_argument("--version", type=int, default=1)
    ap.add_argument("--incarnation", default="gpu_check", help="the generator's pair channel is W.pair_prefix(0, this)")
    ap.add_argument("--timeout-s", type=float, default=900)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(name)s: %(message)s")
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    host, port = args.weights.rsplit(":", 1)
    channel = WeightPublisher(host, int(port), args.timeout_s, device=device)
    publisher = ModelPublisher(model, zero3=False, channel=channel)
    try:
        channel.join(0, args.incarnation)
        wait_until(lambda: channel.channels or channel.pending_direct
                   or channel.counter_values().get("weights/join_failures"), args.timeout_s, 0.05)
        if not (channel.channels or channel.pending_direct):
            raise SystemExit(f"gpu_check learner: generator 0 ({args.incarnation}) did not complete its weight-channel "
                             f"rendezvous within {args.timeout_s:.0f}s; see the generator's log")
        seconds, nbytes, checksum = publisher.publish(args.version)
        if not channel.channels:
            raise SystemExit("gpu_check learner: the generator's channel was dropped during the publish (its NCCL "
                             "group or gloo channel failed); see the generator's log")
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"weight_sync_s": seconds, "bytes_sent": nbytes, "checksum": checksum}, f)
        os.replace(tmp, args.out)
        log.info("published version %d in %.1f ms; waiting for the generator's report", args.version, seconds * 1e3)
        if not wait_until(lambda: os.path.exists(args.until), args.timeout_s, 0.2):
            raise SystemExit(f"gpu_check learner: no generator report at {args.until} within {args.timeout_s}s")
    finally:
        publisher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
