"""`covrl plan`: the memory plan of a run (common/memplan.py) for a machine you describe, without starting anything.

    covrl plan --config launch/recipes/qwen2.5-7b-kl-cov.toml --gens 4 --learners 4 --gpus 8 --gpu-memory 80GB

Every device's terms, largest first, each with the setting that changes it; the settings the plan chose where the
config leaves them to it (on GPUs: `learner.micro_batch_tokens` and `learner.gradient_checkpointing`); exit 2 with
one line when the run would not fit. `covrl run` checks the same plan at the door (`at_the_door`) for the machine
it is on.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib

from common import memplan as M
from common.cli import USER_ERRORS, fail
from common.config import ConfigError, load_config, resolve_dtype, triton_refusal, with_dtype

# The learner settings the plan chooses on GPUs when neither the config file nor --set gives them.
CHOSEN = ("learner.micro_batch_tokens", "learner.gradient_checkpointing")
MICRO_BATCH_CHOICES = (32768, 16384, 8192, 4096, 2048, 1024)  # tokens per micro-batch, most first


def size(text: str) -> float:
    """'80GB', '80GiB', '141G', '2TB' -> bytes (GB and GiB both 2^30, as GPU memory is quoted)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT])?i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 80GB, 141GiB or 2TB")
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, None: 1}[(m.group(2) or "").upper() or None]
    return float(m.group(1)) * unit


def explicit_keys(config_path: str | None, sets: list[str]) -> set[str]:
    """Dotted keys the user gave: in the TOML file or as --set."""
    out = {s.split("=", 1)[0].strip() for s in sets if "=" in s}
    if config_path and os.path.isfile(config_path):
        with open(config_path, "rb") as f:
            out |= set(_leaves(tomllib.load(f)))
    return out


def _leaves(node: dict, prefix: str = ""):
    for k, v in node.items():
        yield from _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]


def choose(cfg, shape: M.Shape, learners: int, gens: int, tp: int, machine: M.Machine,
           explicit: set[str]) -> dict[str, int | bool]:
    """The learner settings (of `CHOSEN`) the plan chooses on GPUs where the user left them open: the largest
    micro-batch (of MICRO_BATCH_CHOICES) that fits with headroom, without gradient checkpointing if that fits at
    8k tokens or more, else with it. Nothing on the CPU, or where both are given."""
    if machine.gpus == 0 or machine.gpu_bytes is None:
        return {}
    free_t = "learner.micro_batch_tokens" not in explicit
    free_ckpt = "learner.gradient_checkpointing" not in explicit
    if not (free_t or free_ckpt):
        return {}
    ckpts = [False, True] if free_ckpt else [cfg.learner.gradient_checkpointing]
    sizes = MICRO_BATCH_CHOICES if free_t else (cfg.learner.micro_batch_tokens,)
    for ckpt in ckpts:
        for t in sizes:
            if not ckpt and free_ckpt and free_t and t < 8192:
                break  # below 8k a GPU step is launch-bound: checkpointing at a larger batch is the better trade
            if M.plan(_with(cfg, t, ckpt), shape, learners, gens, tp, machine).fits:
                return {k: v for k, v, free in ((CHOSEN[0], t, free_t), (CHOSEN[1], ckpt, free_ckpt)) if free}
    return {}  # nothing fits: the config as given is checked and refused with its largest term


def applied(cfg, chosen: dict[str, int | bool]):
    """`cfg` with the plan's choices."""
    return _with(cfg, chosen.get(CHOSEN[0], cfg.learner.micro_batch_tokens),
                 chosen.get(CHOSEN[1], cfg.learner.gradient_checkpointing))


def shown(chosen: dict[str, int | bool]) -> str:
    """The choices as --set would give them."""
    return ", ".join(f"{k}={str(v).lower()}" for k, v in chosen.items())


def _with(cfg, tokens: int, ckpt: bool):
    import msgspec

    learner = msgspec.structs.replace(cfg.learner, micro_batch_tokens=tokens, gradient_checkpointing=ckpt)
    return msgspec.structs.replace(cfg, learner=learner)


def this_machine(gpus: int) -> M.Machine:
    """The GPUs the launcher will place on (their memory and the oldest compute capability, from torch) and this
    host's memory."""
    gpu_bytes = capability = None
    if gpus:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= gpus:  # else unknown: nothing is checked
            props = [torch.cuda.get_device_properties(i) for i in range(gpus)]
            gpu_bytes = min(p.total_memory for p in props)
            capability = min((p.major, p.minor) for p in props)
    return M.Machine(gpus, gpu_bytes, host_memory(), capability)


def dtype_choice(cfg, machine: M.Machine, where: str = ""):
    """(`cfg` with `model.dtype = "auto"` resolved for the learner ranks of `machine`, the line that says so), the one
    place a launch resolves it (common/config.py `resolve_dtype`: bfloat16 on GPUs of compute capability 8.0 or more,
    float32 on the CPU and older GPUs; GPUs whose capability is not known here, `where`, are taken to be sm80+).
    A dtype the config names: `cfg` unchanged and no line."""
    if cfg.model.dtype != "auto":
        return cfg, None
    dtype = resolve_dtype("auto", machine.learner_capability())
    if not machine.gpus:
        why = "the learner ranks run on the CPU"
    elif machine.capability:
        why = f"the learner ranks' GPUs are sm{machine.capability[0]}{machine.capability[1]}"
    else:
        why = f"{where or 'GPUs not seen from here'}: sm80+ assumed; set model.dtype = \"float32\" for older GPUs"
    return with_dtype(cfg, dtype), f'model.dtype "auto": {dtype} ({why})'


def host_memory() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def at_the_door(args, cfg, gpus: int, learners: int, gens: int, explicit: set[str] | None):
    """`covrl run`'s check before anything is written or started (launch/rundir.py): the plan of this launch on this
    node; on GPUs, the learner settings the config leaves open (`CHOSEN`; `explicit` None: none, as on a resume)
    set as the plan chooses. A run that will not fit its GPUs or this host is refused with one line (ConfigError).
    Returns the config to run and the banner's lines; `model.dtype = "auto"` resolved for this node's GPUs
    (`dtype_choice`). Under Ray nothing is checked (other nodes' memory is not known here) and the dtype is resolved
    once the cluster is reached (launch/rundir.py `settle_dtype_on_ray`). `cfg.model.path` is a local directory by
    now (rundir resolves Hub ids first)."""
    if getattr(args, "ray", None) is not None:
        return cfg, ["memory plan: not checked under Ray (covrl plan --gpus N --gpu-memory SIZE shows it)"]
    machine = this_machine(gpus)
    if cfg.learner.logprob_head == "triton" and not machine.gpus:
        if (why := triton_refusal(cuda=False)) is not None:  # refused here, not by each learner rank at its start
            raise ConfigError(why)
    shape = M.shape_of(cfg.model.path)
    cfg, said = dtype_choice(cfg, machine)
    lines = [said] if said else []
    if explicit is not None and (chosen := choose(cfg, shape, learners, gens, args.tp, machine, explicit)):
        cfg = applied(cfg, chosen)
        lines.append(f"chosen by the memory plan for {M.gib(machine.gpu_bytes)} GPUs: {shown(chosen)}")
    p = M.plan(cfg, shape, learners, gens, args.tp, machine)
    if (line := M.refusal(p)) is not None:
        raise ConfigError(line)
    return cfg, [M.totals_line(p), *lines]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="covrl plan", description="The memory plan of a run, for a machine you describe; "
                                 "starts nothing.")
    ap.add_argument("--config", help="TOML config file (default: the built-in arith task)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--learners", type=int, default=1, help="learner ranks (default 1)")
    ap.add_argument("--gens", type=int, default=1, help="generators (default 1)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per generator (default 1)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: this machine's)")
    ap.add_argument("--gpu-memory", type=size, default=None, metavar="SIZE",
                    help="memory of each GPU, e.g. 80GB (default: this machine's)")
    ap.add_argument("--host-memory", type=size, default=None, metavar="SIZE",
                    help="host memory per node, e.g. 1TB (default: this machine's)")
    ap.add_argument("--model-shape", choices=sorted(M.KNOWN), default=None,
                    help="plan for a known shape instead of reading model.path's config.json")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set, validate=False)  # a recipe plans without its data at hand
        if min(args.learners, args.gens, args.tp) < 1:
            raise ConfigError("--learners, --gens and --tp must be at least 1")
        here = this_machine(_local_gpus()) if args.gpus is None or args.gpu_memory is None else None
        gpus = args.gpus if args.gpus is not None else here.gpus
        gpu_bytes = args.gpu_memory if args.gpu_memory is not None else (here.gpu_bytes if gpus else None)
        if gpus and gpu_bytes is None:
            raise ConfigError(f"--gpus {gpus} with no GPU here: give --gpu-memory too, e.g. --gpu-memory 80GB")
        machine = M.Machine(gpus, gpu_bytes if gpus else None,
                            args.host_memory if args.host_memory is not None else host_memory(),
                            here.capability if here is not None and gpus == here.gpus else None)
        cfg, said = dtype_choice(cfg, machine, "GPUs described")
        shape = M.KNOWN[args.model_shape] if args.model_shape else M.shape_of(cfg.model.path)
        chosen = choose(cfg, shape, args.learners, args.gens, args.tp, machine,
                        explicit_keys(args.config, args.set))
        cfg = applied(cfg, chosen)
        p = M.plan(cfg, shape, args.learners, args.gens, args.tp, machine)
    except USER_ERRORS as e:
        return fail(e)
    print(f"model: {shape.params / 1e9:.2f} B parameters ({shape.layers} layers, hidden {shape.hidden}, vocabulary "
          f"{shape.vocab}), {said or cfg.model.dtype}; {args.learners} learner rank(s), {args.gens} generator(s) at tp "
          f"{args.tp}, {machine.gpus} GPU(s) of {M.gib(machine.gpu_bytes)}, host {M.gib(machine.host_bytes)}")
    if chosen:
        print(f"chosen by the plan (the config leaves them open): {shown(chosen)}")
    print(M.render(p))
    if (line := M.refusal(p)) is not None:
        return fail(line)
    return 0


def _local_gpus() -> int:
    from launch.local import visible_gpus

    return visible_gpus(None)


if __name__ == "__main__":
    sys.exit(main())
