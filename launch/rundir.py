"""The run directory of one launch: resolve the config, check everything, then write the directory.

A new run: defaults, --config, --set and --steps resolved; the placement, the host, the hub port, the batch's
shard count, W&B credentials, the model and every data row checked in this process; only then config.toml,
secret.key, cluster.json and generators.json written (nothing is written if a check fails). A resumed run
(`covrl resume RUN_DIR`): the run's own config (only --steps may change), its learner count, the generator count it
last ran with, fresh addresses, and the checkpoint it starts from: the newest that verifies (or --from's), every file
checksummed against its manifest; newer ones it passes over are set aside (`step_N.damaged`, `.superseded`), never
deleted.
"""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass

import msgspec

from common.checkpoint_dirs import (DAMAGED, LOAD_FAILED, UNVERIFIED, Choice, choose, read_load_failure, set_aside,
                                    step_dirs, step_name, verify)
from common.config import ConfigError, load_config, to_toml, with_absolute_paths
from common.data import check_inputs, resolve_model
from common.paths import unwritable
from common.runfiles import (ClusterInfo, Placement, check_colocation, place_gpus, read_cluster, read_generator_target,
                             write_cluster, write_generator_target)
from common.transport import create_secret, free_port, port_in_use
from common.memplan import Machine
from launch.plan import at_the_door, dtype_choice, explicit_keys


class RunComplete(Exception):
    """A resume of a run that already trained every step it was asked for: nothing to start."""


@dataclass
class RunDir:
    """What the checks resolved and the directory now holds: the launch's one placement goes along from here."""
    path: str
    cfg: object
    info: ClusterInfo
    notes: list[str]  # the data lines of the start banner
    placement: Placement  # this node's GPUs for the learner ranks and the starting generators
    resumed: Choice | None = None  # the checkpoint a resume starts from (None: a new run, or one with no checkpoint)


def resolved_config(args):
    """The config a launch with these arguments runs (and `--print-config` prints): defaults, --config, --set,
    --steps; with --resume, the run's own with --steps. Checked; nothing written."""
    overrides = [f"run.steps={args.steps}"] if args.steps is not None else []
    if getattr(args, "autoscale", None) is not None:
        overrides += [f"cluster.autoscale.min={args.autoscale[0]}", f"cluster.autoscale.max={args.autoscale[1]}"]
    if args.resume:
        path = os.path.join(os.path.abspath(args.resume), "config.toml")
        if not os.path.isfile(path):
            raise ConfigError(f"--resume {args.resume}: no config.toml, so this is not a covrl run directory")
        return load_config(path, overrides)
    return with_absolute_paths(load_config(args.config, list(args.set) + overrides), os.getcwd())


def printed_config(args) -> str:
    """What `--print-config` prints: `resolved_config` as TOML, a `model.dtype = "auto"` followed by what this launch
    resolves it to, the banner's line (RUN_DIR/config.toml will hold the resolved dtype itself)."""
    cfg = resolved_config(args)
    text = to_toml(cfg)
    if cfg.model.dtype != "auto":
        return text
    if getattr(args, "ray", None) is not None:
        said = ('model.dtype "auto": resolved once the Ray cluster is reached (bfloat16 where the learner ranks get '
                'GPUs, float32 where not)')
    else:
        from launch.local import visible_gpus
        from launch.plan import this_machine

        _, said = dtype_choice(cfg, this_machine(visible_gpus(args.gpus)))
    return text.replace('\ndtype = "auto"\n', f'\ndtype = "auto"  # {said}\n', 1)


def prepare(args, gpus: int = 0) -> RunDir:
    """Check everything (config, placement, model, every data row: `check_inputs`), then write the run directory;
    nothing is written if a check fails."""
    if args.resume:
        return prepare_resume(args, gpus)
    if args.from_ is not None:
        raise ConfigError(f"--from {args.from_} picks the checkpoint a resume starts from: use it with --resume RUN_DIR "
                          f"(covrl resume RUN_DIR --from {args.from_})")
    check_tp(args, gpus)
    cfg = resolved_config(args)
    args.gens = (cfg.cluster.autoscale.min or 1) if args.gens is None else args.gens
    args.learners = 1 if args.learners is None else args.learners
    if args.gens < 1 or args.learners < 1:
        raise ConfigError(f"--gens {args.gens} --learners {args.learners}: need at least one of each")
    check_autoscale_start(cfg, args.gens)
    placement = place_gpus(gpus, args.learners, args.gens, args.tp)  # a placement that cannot fit
    check_colocation(placement, cfg.generator)
    check_host(cfg.transport.host)
    check_hub_port(cfg)
    check_batch(cfg, args.learners)
    check_new_run_dir(run_dir := run_dir_of(args))
    check_wandb(cfg)
    local, hub = resolve_model(cfg.model.path)  # a Hub id: its snapshot in the cache, fetched here once if missing
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=local))
    notes = check_inputs(cfg)  # the model and every data row, in this process, before anything starts
    cfg, memory = at_the_door(args, cfg, gpus, args.learners, args.gens, explicit_keys(args.config, args.set))
    notes += memory
    if hub:
        notes.insert(0, f"model: {hub} from the Hugging Face cache ({local})")
    check_writable(run_dir)
    write_config(run_dir, cfg)
    create_secret(run_dir)
    info = write_addresses(run_dir, cfg, uuid.uuid4().hex[:12], args.gens, args.learners)
    write_generator_target(run_dir, args.gens)
    return RunDir(run_dir, cfg, info, notes, placement)


def prepare_resume(args, gpus: int = 0) -> RunDir:
    """The run directory of a stopped run, its config (only --steps may change), fresh addresses."""
    run_dir = os.path.abspath(args.resume)
    if args.config or args.set or (args.run_dir and os.path.abspath(args.run_dir) != run_dir):
        raise ConfigError("--resume continues a run with the config it was started with (RUN_DIR/config.toml); "
                          "drop --config / --set / --run-dir (only --steps, --gens may change)")
    for name in ("config.toml", "cluster.json", "secret.key"):
        if not os.path.exists(os.path.join(run_dir, name)):
            raise ConfigError(f"--resume {args.resume}: {name} is missing, so this is not a covrl run directory; "
                              f"give the RUN_DIR a run was started with")
    check_tp(args, gpus)
    cfg = resolved_config(args)
    choice = choose(run_dir, checksums=True, from_step=None if args.from_ is None else step_name(args.from_))
    if choice is not None and choice.step >= cfg.run.steps:
        raise RunComplete(f"{run_dir} is complete: it trained {choice.step} of {cfg.run.steps} steps (checkpoint "
                          f"{choice.path}); nothing to resume. To train further: covrl resume {run_dir} --steps N "
                          f"(N > {choice.step})")
    old = read_cluster(run_dir)
    learners = old.learners if args.learners is None else args.learners
    if learners != old.learners:
        raise ConfigError(f"--learners {learners}: the run's checkpoints are sharded over {old.learners} learner ranks; "
                          f"resume with --learners {old.learners}")
    gens = resumed_generators(args, run_dir, old)
    if args.gens is None:  # the count it last had, within the autoscale bounds it has now
        gens = within_autoscale(cfg, gens)
    check_autoscale_start(cfg, gens)
    check_host(cfg.transport.host)
    placement = place_gpus(gpus, learners, gens, args.tp)
    check_colocation(placement, cfg.generator)
    notes = check_inputs(cfg)  # the data and model may have moved since the run started
    _, memory = at_the_door(args, cfg, gpus, learners, gens, None)
    notes += memory
    if args.steps is not None or getattr(args, "autoscale", None) is not None:
        write_config(run_dir, cfg)
    check_hub_port(cfg)
    notes = [*resume_lines(run_dir, choice), *notes]
    info = write_addresses(run_dir, cfg, old.run_id, gens, learners)
    write_generator_target(run_dir, gens)
    for name in ("progress.json", LOAD_FAILED):  # the last launch's last step, and its failure to load a checkpoint
        if os.path.exists(stale := os.path.join(run_dir, name)):
            os.remove(stale)
    return RunDir(run_dir, cfg, info, notes, placement, choice)


def write_config(run_dir: str, cfg) -> None:
    """RUN_DIR/config.toml, the run's resolved config that every role and every resume reads (atomically)."""
    path = os.path.join(run_dir, "config.toml")
    with open(path + ".tmp", "w") as f:
        f.write(to_toml(cfg))
    os.replace(path + ".tmp", path)


def settle_dtype_on_ray(run: RunDir, gpus: int) -> None:
    """Under Ray, `model.dtype = "auto"` resolved once the cluster is reached (`gpus`: the GPUs the run is given there,
    `RayBackend.gpus`; each learner rank takes one, or none when it is 0), written into RUN_DIR/config.toml before
    any role starts, and said in the banner. Ray's nodes are not seen from here: GPUs are taken to be sm80+
    (launch/plan.py `dtype_choice`). A dtype the run's config names already (every resume) is kept."""
    cfg, said = dtype_choice(run.cfg, Machine(gpus, None, None), "GPUs on the Ray cluster, not seen from here")
    if said is not None:
        write_config(run.path, cfg)
        run.cfg = cfg
        run.notes.append(said)


def resume_lines(run_dir: str, choice: Choice | None) -> list[str]:
    """Set aside every checkpoint newer than the one the resume starts from (a damaged one, or a good one --from
    rewinds past: its steps are trained again, so a later resume must not take it), and say so: the banner's lines."""
    if choice is None:
        return ["no checkpoint yet: the run starts again from step 0"]
    lines, failed = [], read_load_failure(run_dir)  # the last launch's learners could not load one (an old one)
    for step, path in step_dirs(run_dir):
        if step > choice.step:
            why = damage_of(step, path, choice, failed)
            moved = os.path.basename(set_aside(path, "damaged" if why else "superseded"))
            what = f"is damaged ({why})" if why else f"is newer than --from step_{choice.step}"
            lines.append(f"step_{step} {what}: set aside as checkpoints/{moved}")
    check = choice.check
    how = (f"verified: {check.files} files, {check.bytes / 1e6:.1f} MB checksummed in {check.seconds:.1f}s"
           if check.state != UNVERIFIED else "unverified: it has no manifest, written before covrl verified checkpoints")
    return [*lines, f"resuming from step_{choice.step} ({how})"]


def damage_of(step: int, path: str, choice: Choice, failed: dict) -> str | None:
    """Why a checkpoint newer than the one the resume starts from is damaged (passed over by `choose`, or named by
    the last launch's load failure, `failed`); None: it is good, only superseded."""
    if (check := next((c for c in choice.skipped if c.step == step), None)) is not None:
        return check.why()
    if failed.get("checkpoint") == f"step_{step}":
        return f"a learner could not load it: {failed.get('error', '?')}"
    check = verify(path, checksums=False, step=step)  # under --from, not verified yet: its sizes
    return check.why() if check.state == DAMAGED else None


def resumed_generators(args, run_dir: str, old: ClusterInfo) -> int:
    """--gens, else the count the run last ran with (`covrl scale` may have changed it since it started)."""
    try:
        scaled = read_generator_target(run_dir)
    except ValueError as e:
        if args.gens is None:
            raise ConfigError(f"{e}, or pass --gens N to --resume") from None
        scaled = None
    gens = (scaled.generators if scaled else old.generators) if args.gens is None else args.gens
    if gens < 1:
        raise ConfigError(f"--gens {gens}: need at least one generator")
    return gens


def write_addresses(run_dir: str, cfg, run_id: str, gens: int, learners: int, host: str | None = None,
                    ports: tuple[int, int] | None = None) -> ClusterInfo:
    """cluster.json with this launch's addresses: the hub's (transport.hub_port, or a free port) and the weight
    channel's store (a free port), both on `host` (default transport.host; under Ray, learner rank 0's node, with
    `ports` free there)."""
    host = host or cfg.transport.host
    hub_port, weight_port = ports or (free_port(host), free_port(host))
    info = ClusterInfo(run_id=run_id, hub_addr=f"{host}:{cfg.transport.hub_port or hub_port}",
                       weight_addr=f"{host}:{weight_port}", generators=gens, learners=learners)
    write_cluster(run_dir, info)
    return info


def within_autoscale(cfg, gens: int) -> int:
    """`gens` moved into cluster.autoscale's [min, max] (as it is when autoscaling is off)."""
    a = cfg.cluster.autoscale
    return min(max(gens, a.min), a.max) if a.max else gens


def check_autoscale_start(cfg, gens: int) -> None:
    a = cfg.cluster.autoscale
    if (fit := within_autoscale(cfg, gens)) != gens:
        raise ConfigError(f"--gens {gens} is outside the autoscale bounds {a.min}:{a.max}; start within them (--gens "
                          f"{fit}) or widen --autoscale")


def check_hub_port(cfg) -> None:
    transport = cfg.transport
    if transport.hub_port and (why := port_in_use(transport.host, transport.hub_port)):
        raise ConfigError(f"transport.hub_port {transport.hub_port} on {transport.host} cannot be bound ({why}); "
                          f"pick another port, or 0 for a free one")


def check_host(host: str) -> None:
    if host in ("0.0.0.0", "::", ""):
        raise ConfigError(f"transport.host {host!r}: generators connect to this address, so give one of this host's "
                          f"own addresses, not a wildcard")


def check_batch(cfg, learners: int) -> None:
    """Each learner rank needs at least one sample of every optimizer step."""
    rollout = cfg.rollout
    per_update = rollout.groups_per_step * rollout.group_size // cfg.learner.mini_batches
    if learners > per_update:
        raise ConfigError(f"--learners {learners}: an optimizer step has only {per_update} samples (groups_per_step "
                          f"x group_size / mini_batches) to shard; use at most {per_update} learner ranks or a bigger batch")


def check_writable(run_dir: str) -> None:
    why = unwritable(run_dir) or unwritable(os.path.join(run_dir, "logs"))
    if why is not None:
        raise ConfigError(f"run directory {run_dir!r} is not writable ({why}); pass a writable --run-dir")


def check_new_run_dir(run_dir: str) -> None:
    """A new run's directory is new or empty: a run's files never mix with others', and a finished or stopped run
    is continued with covrl resume, not overwritten."""
    try:
        present = sorted(os.listdir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return  # made later; a path that is a file is said by check_writable
    if ours := [n for n in ("config.toml", "cluster.json", "metrics.jsonl") if n in present]:
        raise ConfigError(f"{run_dir} already holds a run ({', '.join(ours)}); continue it with covrl resume "
                          f"{run_dir}, or pick a new --run-dir")
    if present:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise ConfigError(f"--run-dir {run_dir} is not empty and not a covrl run (it holds {shown}); a run writes many "
                          f"files of its own there: pick a new or empty directory")


def check_tp(args, gpus: int) -> None:
    """--tp splits a vLLM generator over GPUs: on a launch placed on no GPU it would be ignored, so it is refused."""
    if args.tp < 1:
        raise ConfigError(f"--tp {args.tp}: give the GPUs per generator, 1 or more")
    if args.tp > 1 and args.ray is None and gpus == 0:
        raise ConfigError(f"--tp {args.tp} splits each generator over {args.tp} GPUs, and this launch has none "
                          f"(--gpus 0, or no CUDA device visible): drop --tp, or run where there are GPUs")


def run_dir_of(args) -> str:
    if args.run_dir is None:  # chosen once, so every check and the directory agree on it
        args.run_dir = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return os.path.abspath(args.run_dir)


def check_wandb(cfg) -> None:
    """W&B online needs credentials; without them wandb.init would fail in learner rank 0 after the start."""
    wandb = cfg.logging.wandb
    if not wandb.project or wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    import netrc

    try:
        found = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError):
        found = None
    if found is None:
        raise ConfigError("logging.wandb.mode = \"online\" but no W&B credentials (WANDB_API_KEY, or `wandb login`); "
                          "log in, or set logging.wandb.mode = \"offline\" and `wandb sync` later")
