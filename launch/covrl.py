"""`covrl`: one command for every tool (launch/, study/, hardware/), as sub-commands.

    covrl run [--gens G --learners L ...]       a training run
    covrl plan [--config F] [--gpus N --gpu-memory 80GB]   the run's memory plan, per GPU and host
    covrl resume RUN_DIR [--from step_N] [--steps N] [--gens G] [--ray [ADDRESS]]
    covrl scale RUN_DIR --gens N                change a running run's generator count
    covrl verify RUN_DIR [--fast]               every checkpoint's state (good, damaged: which file)
    covrl eval --model DIR [--data FILE ...]    avg@k / pass@k of a model directory
    covrl study [--preset P] [--methods ...]    several methods, then the report
    covrl fit-law RUN_DIR [--on eval|train]     fit R = -a exp(H) + b
    covrl plots RUN_DIR [...]                   metrics against step
    covrl prepare-data IN OUT                   convert a math dataset to covrl's layout
    covrl warmstart                             rebuild the built-in base model
    covrl gpu-check / covrl gpu-proof           GPU self-checks

`covrl SUB --help` is the sub-command's complete help (the same as `covrl-SUB --help`; `covrl run` is
`covrl-cluster`, which keeps working).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv), one line for `covrl --help`)
COMMANDS = {
    "run": ("launch.cluster", "start a training run: learner ranks and generators, here or on Ray"),
    "plan": ("launch.plan", "the memory plan of a run for a machine you describe; starts nothing"),
    "resume": (None, "continue a stopped or crashed run from its newest checkpoint that verifies"),
    "scale": ("launch.scale", "change the number of generators of a running run"),
    "verify": ("launch.verify", "check a run's checkpoints against their manifests"),
    "eval": ("launch.evaluate", "avg@k / pass@k of a model directory on held-out sets"),
    "study": ("study.runs", "several methods on one preset, then the report"),
    "fit-law": ("study.fit_law", "fit R = -a exp(H) + b on a run"),
    "plots": ("study.plots", "metrics of one or more runs against step"),
    "prepare-data": ("launch.prepare_data", "convert a math dataset to covrl's layout"),
    "warmstart": ("study.warmstart_cli", "rebuild a built-in base model (assets/<task>-base: arith, chain, grid)"),
    "gpu-check": ("hardware.check", "the vLLM self-check (GPU)"),
    "gpu-proof": ("hardware.proof", "the one-command GPU proof"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: covrl COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "`covrl COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def resume(argv: list[str]) -> int:
    """`covrl resume RUN_DIR [...]`: the launcher's own flags that a resume takes (`cluster.resume_options`), the
    rest at the launcher's defaults."""
    from launch import cluster

    ap = argparse.ArgumentParser(prog="covrl resume", description=COMMANDS["resume"][1],
                                 parents=[cluster.resume_options()])
    ap.add_argument("resume", metavar="RUN_DIR", help="the run directory of the run to continue")
    args = cluster.parse_args([])
    vars(args).update(vars(ap.parse_args(argv)))
    return cluster.start(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; commands: {', '.join(COMMANDS)} (covrl --help)", file=sys.stderr)
        return 2
    if name == "resume":
        return resume(rest)
    return importlib.import_module(COMMANDS[name][0]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
