"""`covrl`: one command for everything in launch/, as sub-commands.

    covrl run [--gens G --learners L ...]       a training run (covrl-cluster)
    covrl resume RUN_DIR [--steps N] [--gens G] [--ray [ADDRESS]]
    covrl scale RUN_DIR --gens N                change a running run's generator count
    covrl eval --model DIR [--data FILE ...]    avg@k / pass@k of a model directory
    covrl study [--preset P] [--methods ...]    several methods, then the report
    covrl fit-law RUN_DIR [--on eval|train]     fit R = -a exp(H) + b
    covrl plots RUN_DIR [...]                   metrics against step
    covrl prepare-data IN OUT                   convert a math dataset to covrl's layout
    covrl warmstart                             rebuild the built-in base model
    covrl gpu-check / covrl gpu-proof           GPU self-checks

`covrl SUB --help` is the sub-command's complete help (the same as `covrl-SUB --help`; `covrl run` is
`covrl-cluster`). The `covrl-*` scripts and `python launch/cluster.py` keep working.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv), one line for `covrl --help`)
COMMANDS = {
    "run": ("launch.cluster", "start a training run: learner ranks and generators, here or on Ray (covrl-cluster)"),
    "resume": (None, "continue a stopped or crashed run from its newest checkpoint (covrl-cluster --resume)"),
    "scale": ("launch.scale", "change the number of generators of a running run"),
    "eval": ("launch.evaluate", "avg@k / pass@k of a model directory on held-out sets"),
    "study": ("launch.study", "several methods on one preset, then the report"),
    "fit-law": ("launch.fit_law", "fit R = -a exp(H) + b on a run"),
    "plots": ("launch.plots", "metrics of one or more runs against step"),
    "prepare-data": ("launch.prepare_data", "convert a math dataset to covrl's layout"),
    "warmstart": ("launch.warmstart", "rebuild the built-in base model (assets/arith-base)"),
    "gpu-check": ("launch.gpu_check", "the vLLM self-check (GPU)"),
    "gpu-proof": ("launch.gpu_proof", "the one-command GPU proof"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: covrl COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "`covrl COMMAND --help` shows a command's options."]
    return "\n".join(lines)


# The covrl-cluster flags a resume takes: (flag, takes a value, help).
RESUME_FLAGS = [
    ("--steps", True, "train to this many steps (more than the run was started with)"),
    ("--gens", True, "generators (default: as many as the run last had)"),
    ("--gpus", True, "GPUs of this node to place roles on (default: every CUDA device; 0: CPU only)"),
    ("--tp", True, "tensor-parallel GPUs per generator, as the run was started with (default 1)"),
    ("--ray-learner-resources", True, "extra Ray resources in each learner rank's bundle (JSON)"),
    ("--ray-generator-resources", True, "extra Ray resources in each generator's bundle (JSON)"),
    ("--progress-every", True, "seconds between progress lines when stdout is not a terminal (default 10)"),
    ("--tensorboard", False, "also serve TensorBoard for this run"),
    ("--quiet", False, "no live progress line"),
    ("--print-config", False, "print the run's config (with --steps) and exit"),
]


def resume(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="covrl resume", description=COMMANDS["resume"][1])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the run to continue")
    ap.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="continue on Ray: ADDRESS of a running cluster, or none for a local instance")
    for flag, value, about in RESUME_FLAGS:
        ap.add_argument(flag, help=about, **({"metavar": flag[2:].upper().replace("-", "_")} if value
                                             else {"action": "store_true"}))
    args = ap.parse_args(argv)
    from launch import cluster

    forward = ["--resume", args.run_dir]
    if args.ray is not None:
        forward += ["--ray"] + ([args.ray] if args.ray != "local" else [])
    for flag, value, _ in RESUME_FLAGS:
        got = getattr(args, flag[2:].replace("-", "_"))
        if value and got is not None:
            forward += [flag, got]
        elif not value and got:
            forward.append(flag)
    return cluster.main(forward)


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
