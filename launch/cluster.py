"""The one entry point: `covrl-cluster --gens G --learners L [--ray [ADDRESS]] [...]` (also
`python -m launch.cluster` or `python launch/cluster.py` from the repo root, with covrl installed: `make venv`).

Resolves the config, prepares the run directory (config.toml, secret.key, cluster.json, generators.json), starts
L learner ranks and G generators (`launch/roles.py`) on this machine (`launch/local.py`) or on a Ray cluster
(`launch/ray_backend.py`), shows a live progress line, and supervises, the same way on both:
- a generator that exits with an error is restarted (3 retries, backoff 2, 4, 8 s); it rejoins with a weight
  channel of its own and catches up on the latest version. Under Ray, one whose node is lost is restarted by Ray
  on any node with room;
- a generator the hub declared lost (silent, stuck, or failing its weight channel: RUN_DIR/generators_lost.jsonl)
  is stopped, its whole process group, and restarted the same way: a frozen or hung process never holds up the
  run, even though it has not exited;
- the generator count follows RUN_DIR/generators.json (`covrl-scale RUN_DIR --gens N`, `launch/scale.py`): missing
  ids are started; ids beyond it are drained by the hub and leave (exit code EXIT_DRAINED);
- a learner rank that fails stops the run; the last checkpoint stays intact, and `--resume RUN_DIR` continues
  from it;
- Ctrl-C / SIGTERM: the learners finish their step and write a checkpoint (up to run.stop_grace_s), then every
  role this launcher started is stopped, and only those; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import msgspec

from common.checkpoint_dirs import complete_checkpoints, latest_checkpoint
from common.runfiles import (EXIT_DRAINED, MEMORY_FRACTION_ENV, ClusterInfo, LostGenerators, PlacementError,
                            check_colocation, clear_learners_ready, colocated_memory_fractions, learners_ready,
                            place_gpus, read_cluster, read_generator_target, write_cluster, write_generator_target)
from common.config import ConfigError, load_config, to_toml, with_absolute_paths
from common.cli import USER_ERRORS, fail
from common.data import check_inputs, resolve_model
from common.metrics import read_metrics
from common.transport import create_secret, free_port, port_in_use
from launch.progress import Progress
from launch.roles import RoleSpec, generator_spec, learner_specs

GRACE_S = 10.0
TENSORBOARD = [sys.executable, "-m", "tensorboard.main"]


def due(spec: RoleSpec, run_dir: str) -> bool:
    """Whether a role that is not running should be started now."""
    return time.monotonic() >= spec.next_start and (not spec.after_learners or learners_ready(run_dir))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="covrl-cluster", description="Run covrl: generators + learner ranks.")
    ap.add_argument("--gens", type=int, default=None, help="generator processes (default 1; on --resume, as before)")
    ap.add_argument("--learners", type=int, default=None,
                    help="learner ranks in one DeepSpeed world (default 1; on --resume it must stay as it was)")
    ap.add_argument("--config", help="TOML config file (default: the built-in arith task)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. rollout.group_size=8")
    ap.add_argument("--steps", type=int, help="learner steps (same as --set run.steps=N; with --resume: extend the run)")
    ap.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or crashed run from its newest checkpoint")
    ap.add_argument("--tensorboard", action="store_true", help="also serve TensorBoard for this run on 127.0.0.1")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs on this node to place roles on (default: all "
                    "CUDA devices torch sees; 0: CPU only). Learners take one each, then generators --tp each")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per generator (default 1)")
    ap.add_argument("--ray", nargs="?", const=LOCAL_RAY, default=None, metavar="ADDRESS",
                    help="place the roles with Ray: ADDRESS of a running cluster (host:port, or auto: the one this "
                         "machine belongs to; covrl never stops it), or no ADDRESS: start a local Ray instance. "
                         "RUN_DIR must be on a filesystem every node shares")
    ap.add_argument("--ray-learner-resources", type=_resources, default=None, metavar="JSON",
                    help='extra Ray resources in each learner rank\'s bundle, e.g. \'{"trainer_node": 1}\'')
    ap.add_argument("--ray-generator-resources", type=_resources, default=None, metavar="JSON",
                    help="extra Ray resources in each generator's bundle")
    ap.add_argument("--quiet", action="store_true", help="no live progress line")
    ap.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                    help="when stdout is not a terminal: seconds between progress lines (default 10)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config (defaults, --config, --set, --steps; with --resume, the run's) as "
                         "TOML and exit, starting nothing")
    return ap.parse_args(argv)


LOCAL_RAY = "local"


def _resources(text: str) -> dict[str, float]:
    try:
        got = json.loads(text)
        if isinstance(got, dict) and all(isinstance(k, str) and isinstance(v, (int, float)) and v > 0
                                         for k, v in got.items()):
            return {k: float(v) for k, v in got.items()}
    except json.JSONDecodeError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object of resource names to positive amounts, "
                                     f"e.g. '{{\"trainer_node\": 1}}'")


class RunComplete(Exception):
    """--resume of a run that already trained every step it was asked for: nothing to start."""


def resolved_config(args):
    """The config a launch with these arguments runs (and `--print-config` prints): defaults, --config, --set,
    --steps; with --resume, the run's own with --steps. Checked; nothing written."""
    overrides = [f"run.steps={args.steps}"] if args.steps is not None else []
    if args.resume:
        path = os.path.join(os.path.abspath(args.resume), "config.toml")
        if not os.path.isfile(path):
            raise ConfigError(f"--resume {args.resume}: no config.toml, so this is not a covrl run directory")
        return load_config(path, overrides)
    return with_absolute_paths(load_config(args.config, list(args.set) + overrides), os.getcwd())


def prepare_resume(args, gpus: int = 0) -> tuple[str, object, ClusterInfo, list[str]]:
    """The run directory of a stopped run, its config (only --steps may change), fresh addresses and the data
    lines of the start banner."""
    run_dir = os.path.abspath(args.resume)
    if args.config or args.set or (args.run_dir and os.path.abspath(args.run_dir) != run_dir):
        raise ConfigError("--resume continues a run with the config it was started with (RUN_DIR/config.toml); "
                          "drop --config / --set / --run-dir (only --steps, --gens may change)")
    for name in ("config.toml", "cluster.json", "secret.key"):
        if not os.path.exists(os.path.join(run_dir, name)):
            raise ConfigError(f"--resume {args.resume}: {name} is missing, so this is not a covrl run directory; "
                              f"give the RUN_DIR a run was started with")
    cfg = resolved_config(args)
    if (last := latest_checkpoint(run_dir)) is not None and last[0] >= cfg.run.steps:
        raise RunComplete(f"{run_dir} is complete: it trained {last[0]} of {cfg.run.steps} steps (checkpoint {last[1]}); "
                          f"nothing to resume. To train further: covrl-cluster --resume {run_dir} --steps N "
                          f"(N > {last[0]})")
    old = read_cluster(run_dir)
    learners = old.learners if args.learners is None else args.learners
    if learners != old.learners:
        raise ConfigError(f"--learners {learners}: the run's checkpoints are sharded over {old.learners} learner ranks; "
                          f"resume with --learners {old.learners}")
    try:
        scaled = read_generator_target(run_dir)  # the count it last ran with (covrl-scale may have changed it)
    except ValueError as e:
        if args.gens is None:
            raise ConfigError(f"{e}, or pass --gens N to --resume") from None
        scaled = None
    gens = (scaled.generators if scaled else old.generators) if args.gens is None else args.gens
    if gens < 1:
        raise ConfigError(f"--gens {gens}: need at least one generator")
    check_host(cfg.transport.host)
    check_colocation(place_gpus(gpus, learners, gens, args.tp), cfg.generator)
    notes = check_inputs(cfg)  # the data and model may have moved since the run started
    if args.steps is not None:
        with open(os.path.join(run_dir, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    _check_hub_port(cfg)
    info = write_addresses(run_dir, cfg, old.run_id, gens, learners)
    write_generator_target(run_dir, gens)
    if os.path.exists(stale := os.path.join(run_dir, "progress.json")):
        os.remove(stale)  # the dead run's last step, past the checkpoint the learner resumes from
    return run_dir, cfg, info, notes


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


def _check_hub_port(cfg) -> None:
    t = cfg.transport
    if t.hub_port and (why := port_in_use(t.host, t.hub_port)):
        raise ConfigError(f"transport.hub_port {t.hub_port} on {t.host} cannot be bound ({why}); pick another port, "
                          f"or 0 for a free one")


def check_host(host: str) -> None:
    if host in ("0.0.0.0", "::", ""):
        raise ConfigError(f"transport.host {host!r}: generators connect to this address, so give one of this host's "
                          f"own addresses, not a wildcard")


def prepare(args, gpus: int = 0) -> tuple[str, object, ClusterInfo, list[str]]:
    """Check everything (config, placement, model, every data row: `check_inputs`), then write the run directory;
    nothing is written if a check fails. Returns it, the config, the addresses and the banner's data lines."""
    if args.resume:
        return prepare_resume(args, gpus)
    args.gens = 1 if args.gens is None else args.gens
    args.learners = 1 if args.learners is None else args.learners
    if args.gens < 1 or args.learners < 1:
        raise ConfigError(f"--gens {args.gens} --learners {args.learners}: need at least one of each")
    placement = place_gpus(gpus, args.learners, args.gens, args.tp)  # a placement that cannot fit
    cfg = resolved_config(args)
    check_colocation(placement, cfg.generator)
    check_host(cfg.transport.host)
    r = cfg.rollout
    _check_hub_port(cfg)
    per_update = r.groups_per_step * r.group_size // cfg.learner.mini_batches
    if args.learners > per_update:
        raise ConfigError(f"--learners {args.learners}: an optimizer step has only {per_update} samples (groups_per_step "
                          f"x group_size / mini_batches) to shard; use at most {per_update} learner ranks or a bigger batch")
    if os.path.exists(os.path.join(run_dir := run_dir_of(args), "metrics.jsonl")):
        raise ConfigError(f"{run_dir} already holds a run (metrics.jsonl); pick a new --run-dir")
    check_wandb(cfg)
    local, hub = resolve_model(cfg.model.path)  # a Hub id: its snapshot in the cache, fetched here once if missing
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=local))
    notes = check_inputs(cfg)  # the model and every data row, in this process, before anything starts
    if hub:
        notes.insert(0, f"model: {hub} from the Hugging Face cache ({local})")
    try:
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        probe = os.path.join(run_dir, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"run directory {run_dir!r} is not writable ({e.strerror}); pass a writable --run-dir") from None
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    create_secret(run_dir)
    info = write_addresses(run_dir, cfg, uuid.uuid4().hex[:12], args.gens, args.learners)
    write_generator_target(run_dir, args.gens)
    return run_dir, cfg, info, notes


def run_dir_of(args) -> str:
    if args.run_dir is None:  # chosen once, so every check and the directory agree on it
        args.run_dir = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return os.path.abspath(args.run_dir)


def check_wandb(cfg) -> None:
    """W&B online needs credentials; without them wandb.init would fail in learner rank 0 after the start."""
    w = cfg.logging.wandb
    if not w.project or w.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    import netrc

    try:
        found = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError):
        found = None
    if found is None:
        raise ConfigError("logging.wandb.mode = \"online\" but no W&B credentials (WANDB_API_KEY, or `wandb login`); "
                          "log in, or set logging.wandb.mode = \"offline\" and `wandb sync` later")


def visible_gpus(requested: int | None) -> int:
    if requested is not None:
        if requested < 0:
            raise ConfigError(f"--gpus {requested}: give a count, 0 for CPU only")
        return requested
    import glob

    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0  # no NVIDIA device on this host: skip importing torch (1-2 s) in the launcher
    import torch

    return torch.cuda.device_count()


def local_generator(run_dir: str, cfg, gen_id: int, learners: int, gens: int, gpus: int = 0, tp: int = 1,
                    colocated: bool | None = None) -> RoleSpec:
    """Generator `gen_id` of `gens` on this node: its GPUs (`place_gpus`), and its memory share when colocated.
    `colocated`: the layout the run started with; a count that would change it (and move running roles' GPUs)
    is refused."""
    placement = place_gpus(gpus, learners, gens, tp)
    if colocated is not None and placement.colocated != colocated:
        raise PlacementError(
            f"{gens} generator(s) would place learners and generators {'together' if placement.colocated else 'apart'} "
            f"on this node's {gpus} GPU(s), but the run started with them {'together' if colocated else 'apart'}; "
            f"the running roles keep their GPUs, so scale within that layout")
    _, gen_share = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
    return generator_spec(run_dir, gen_id, devices=placement.generators[gen_id],
                          extra_env={MEMORY_FRACTION_ENV: str(gen_share)} if placement.colocated else None,
                          after_learners=placement.colocated)


def role_specs(run_dir: str, info: ClusterInfo, cfg, gpus: int = 0, tp: int = 1, resume: bool = False) -> list[RoleSpec]:
    """The roles of a run on this node: every learner rank, and generators 0 .. info.generators - 1."""
    placement = place_gpus(gpus, info.learners, info.generators, tp)
    all_learner_gpus = [g for ids in placement.learners for g in ids]  # one node: every rank sees them all
    # Colocated roles cap their own CUDA allocators at their share of the GPU they share.
    learner_share, _ = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
    learner_mem = {MEMORY_FRACTION_ENV: str(learner_share)} if placement.colocated else None
    specs = learner_specs(run_dir, info, ("127.0.0.1", free_port()), resume,
                          devices=[all_learner_gpus] * info.learners, extra_env=learner_mem)
    return specs + [local_generator(run_dir, cfg, i, info.learners, info.generators, gpus, tp)
                    for i in range(info.generators)]


def placement_line(placement, cfg) -> str:
    """One line of the start banner: which GPUs each role got, and how colocated roles split their memory."""
    line = f"GPUs: learner ranks on {placement.learners}, generators on {placement.generators}"
    if placement.colocated:
        learner_share, gen_share = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
        line += (f" (colocated: each generator takes {gen_share:.0%} of its GPUs' memory, "
                 f"generator.gpu_memory_utilization; a learner rank at most {learner_share:.0%}; weights over rpc)")
    return line


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_CAUSE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt)\b|\b(?:ERROR|CRITICAL)\b")


def log_cause(run_dir: str, name: str) -> str:
    """One line on why a role ended, pointing at its log: the log's last exception or ERROR line (the traceback
    stays in the log), else its last line."""
    path = os.path.join(run_dir, "logs", f"{name}.log")
    try:
        with open(path, "rb") as f:
            tail = [_RANK_PREFIX.sub("", ln.decode(errors="replace").rstrip()) for ln in f.readlines()[-200:]]
    except FileNotFoundError:
        return f"its log {path} is missing"
    tail = [ln for ln in tail if ln.strip()]
    causes = [ln for ln in tail if _CAUSE.search(ln) and not ln.startswith("Exception ignored")]  # shutdown noise
    cause = causes[-1] if causes else tail[-1] if tail else "its log is empty"
    return f"{cause[:300]} (full log: {path})"


def summary(run_dir: str, cfg, elapsed: float, ray: str | None = None) -> str:
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("critic/score/mean") is not None]
    if not train:
        return f"no steps recorded in {run_dir}/metrics.jsonl"
    q = max(1, len(train) // 4)
    avg = lambda rs, k: sum(r.get(k) or 0.0 for r in rs) / len(rs)  # noqa: E731
    last = complete_checkpoints(run_dir)
    again = "" if ray is None else " --ray" if ray == LOCAL_RAY else f" --ray {ray}"
    lines = [
        f"covrl: {len(train)} steps in {elapsed:.0f}s -> {run_dir}",
        f"  reward (critic/score/mean): first quarter {avg(train[:q], 'critic/score/mean'):.3f} -> last quarter {avg(train[-q:], 'critic/score/mean'):.3f}",
        f"  entropy (actor/entropy):    first quarter {avg(train[:q], 'actor/entropy'):.3f} -> last quarter {avg(train[-q:], 'actor/entropy'):.3f}",
    ]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    sources = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.endswith("/acc")})
    for ds in sources:
        pts = [r for r in evals if r.get(f"eval/{ds}/acc") is not None]
        first, end = pts[0], pts[-1]
        lines.append(f"  eval {ds}: acc (avg@{cfg.eval.k}) {first[f'eval/{ds}/acc']:.3f} at step {first['step']} -> "
                     f"{end[f'eval/{ds}/acc']:.3f} at step {end['step']}; pass@k {first[f'eval/{ds}/pass@k']:.3f} -> "
                     f"{end[f'eval/{ds}/pass@k']:.3f}")
    lines += [
        f"  staleness max {max(r.get('staleness/max') or 0 for r in train):.0f} (bound {cfg.rollout.max_staleness_steps})",
        f"  metrics: {run_dir}/metrics.jsonl  tensorboard: {run_dir}/tb",
        f"  checkpoint: {last[-1][1] if last else 'none'}" + (f" (continue with --resume {run_dir}{again})" if last and
                                                               last[-1][0] < cfg.run.steps else ""),
    ]
    return "\n".join(lines)


class Supervisor:
    """Starts, restarts, scales and stops the roles through a backend (`launch/local.py`, `launch/ray_backend.py`):
    `poll` once per tick; a run ends when every learner rank has finished (0) or one failed (1)."""

    def __init__(self, backend, learners: list[RoleSpec], make_generator, run_dir: str, cfg, quiet: bool,
                 progress_every_s: float = 10.0):
        self.backend, self.learners, self.make_generator = backend, learners, make_generator
        self.run_dir, self.cfg = run_dir, cfg
        self.progress = Progress(run_dir, cfg.run.steps, cfg.rollout.max_staleness_steps, quiet=quiet,
                                 every_s=progress_every_s)
        self.gens: dict[int, RoleSpec] = {}
        self.target, self.revision = 0, None
        self.bad_target = ""
        self.unplaced = ""
        self.lost = LostGenerators(run_dir)  # the hub's verdicts, followed
        self.stopped: dict[str, str] = {}  # role -> why this supervisor stopped it (a verdict), said at its exit

    def roles(self) -> list[RoleSpec]:
        return [*self.learners, *self.gens.values()]

    def follow_target(self) -> None:
        """Follow generators.json: on a new count (or revision), forget the ids above it that are not running (the
        hub drains the running ones); on every tick, add the missing ids below it (one that cannot be placed is
        said once and tried again each tick)."""
        try:
            t = read_generator_target(self.run_dir)
        except (ValueError, OSError) as e:  # damaged by hand, or a shared filesystem hiccup: keep what we have
            if str(e) != self.bad_target:
                self.say(f"{e}; keeping {self.target} generator(s)")
                self.bad_target = str(e)
            return
        self.bad_target = ""
        if t is not None and (t.revision, t.generators) != (self.revision, self.target):
            if self.revision is not None:
                self.say(f"scaling to {t.generators} generator(s) (was {self.target})")
            self.target, self.revision = t.generators, t.revision
            for s in [s for s in self.gens.values() if s.gen_id >= self.target and not s.running]:
                self.backend.release(s)  # waiting for a (re)start, or finished: no longer wanted
                del self.gens[s.gen_id]
        for i in range(self.target):
            if i not in self.gens:
                try:
                    self.gens[i] = self.make_generator(i, self.target)
                except PlacementError as e:
                    if str(e) != self.unplaced:
                        self.say(f"cannot start generator {i}: {e}; trying again while the run goes on")
                        self.unplaced = str(e)
                    break
        else:
            self.unplaced = ""

    def follow_verdicts(self) -> None:
        """Stop the process group of every running generator the hub declared lost (matched by pid, so a verdict on
        an incarnation already replaced stops nothing); its exit is then handled as any failure: a restart."""
        for v in self.lost.new():
            if v.why == "restarted":  # a new incarnation replaced it: nothing left to stop
                continue
            s = self.gens.get(v.gen_id)
            if s is not None and s.running and self.backend.stop_lost(s, v.pid):
                self.stopped[s.name] = f"the hub declared it lost ({v.why}: {v.detail})"
                self.say(f"{s.name} (pid {v.pid}) is being stopped: {self.stopped[s.name]}")
        for line in self.lost.damaged:
            self.say(line)
        self.lost.damaged.clear()

    def start_due(self) -> None:
        for s in self.roles():
            if not s.running and not s.done and due(s, self.run_dir):
                self.backend.start(s)
                s.running = True

    def poll(self) -> int | None:
        """One tick: follow the target, (re)start what is due, react to exits. The run's exit code once it ends."""
        self.follow_target()
        self.follow_verdicts()
        self.start_due()
        for s in self.roles():
            if not s.running:
                continue
            code = self.backend.poll(s)
            if code is None:
                continue
            s.running = False
            if (stop := self._exited(s, code)) is not None:
                return stop
        self.progress.update()
        if all(s.done for s in self.learners):
            # Learners finished: generators got Stop from the hub; give them a moment to exit.
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(s.running and self.backend.poll(s) is None
                                                      for s in self.gens.values()):
                time.sleep(0.2)
            return 0
        return None

    def _exited(self, s: RoleSpec, code: int) -> int | None:
        stopped = self.stopped.pop(s.name, None)  # killed on a verdict: say why rather than its log's last line
        if not s.is_generator:  # a learner rank: its failure ends the run
            if code != 0:
                self.say(f"{s.name} {self.backend.describe(s, code)}; stopping the run: {log_cause(self.run_dir, s.name)}")
                return 1
            s.done = True
        elif code == EXIT_DRAINED or (code != 0 and s.gen_id >= self.target):
            # Drained; or it ended (refused, killed) after the run was scaled below its id: it left, not failed.
            # A fresh one starts on the next tick if the target has grown past its id again.
            self.backend.release(s)
            del self.gens[s.gen_id]
        elif code == 0:
            s.done = True
        elif s.restarts < s.max_restarts:
            s.restarts += 1
            delay = 2.0 ** s.restarts
            self.say(f"{s.name} {self.backend.describe(s, code)}; restart {s.restarts}/{s.max_restarts} in {delay:.0f}s: "
                     f"{stopped or log_cause(self.run_dir, s.name)}")
            s.next_start = time.monotonic() + delay
        else:
            self.say(f"{s.name} failed {s.restarts + 1} times ({self.backend.describe(s, code)}); stopping the run: "
                     f"{log_cause(self.run_dir, s.name)}")
            return 1
        return None

    def say(self, message: str) -> None:
        """A message on stderr, on a line of its own (the progress line is ended first)."""
        self.progress.interrupt()
        print(message, file=sys.stderr)

    def run(self) -> int:
        while True:
            if (code := self.poll()) is not None:
                return code
            time.sleep(0.5)

    def drain_learners(self, grace_s: float) -> None:
        """Graceful stop: SIGTERM the learner ranks (they finish the step, checkpoint and exit) while the
        generators keep serving them; wait up to `grace_s`."""
        for s in self.backend.terminate([s for s in self.learners if s.running], grace_s):
            print(f"{s.name} did not finish within run.stop_grace_s={grace_s:.0f}s; stopping it without a final "
                  f"checkpoint", file=sys.stderr)


def build(args, run_dir: str, cfg, info: ClusterInfo, gpus: int):
    """The backend and the supervisor for this launch. Under Ray, the learner ranks are placed first: their
    node's address and free ports there go into cluster.json."""
    resume = bool(args.resume)
    if args.ray is None:
        from launch.local import LocalBackend

        backend = LocalBackend(run_dir, cfg)
        specs = role_specs(run_dir, info, cfg, gpus, args.tp, resume=resume)
        learners = [s for s in specs if not s.is_generator]
        layout = place_gpus(gpus, info.learners, info.generators, args.tp).colocated if gpus else None
        make = lambda i, n: local_generator(run_dir, cfg, i, info.learners, n, gpus, args.tp, layout)  # noqa: E731
        return backend, Supervisor(backend, learners, make, run_dir, cfg, args.quiet, args.progress_every), info
    from launch.ray_backend import RayBackend

    backend = RayBackend(run_dir, cfg, None if args.ray == LOCAL_RAY else args.ray, gpus=args.gpus, tp=args.tp,
                         learners=info.learners, learner_resources=args.ray_learner_resources,
                         generator_resources=args.ray_generator_resources)
    try:
        host, (hub_port, weight_port, master_port) = backend.place_learners(info.learners)
    except BaseException:
        backend.close(0)
        raise
    info = write_addresses(run_dir, cfg, info.run_id, info.generators, info.learners, host, (hub_port, weight_port))
    learners = learner_specs(run_dir, info, (host, master_port), resume, local_rank=False)
    make = lambda i, n: generator_spec(run_dir, i)  # noqa: E731
    return backend, Supervisor(backend, learners, make, run_dir, cfg, args.quiet, args.progress_every), info


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.print_config:
            print(to_toml(resolved_config(args)), end="")
            return 0
        gpus = visible_gpus(args.gpus) if args.ray is None else 0  # under Ray, Ray places the GPUs
        run_dir, cfg, info, notes = prepare(args, gpus)
        backend, sup, info = build(args, run_dir, cfg, info, gpus)
    except RunComplete as e:
        print(e)
        return 0
    except USER_ERRORS as e:
        return fail(e)
    extra: list[subprocess.Popen] = []
    try:
        return launched(args, sup, backend, run_dir, cfg, info, notes, gpus, extra)
    finally:
        for p in extra:  # TensorBoard, in a session of its own: its whole group, whatever ended the launcher
            stop_group(p)


def launched(args, sup, backend, run_dir: str, cfg, info, notes: list[str], gpus: int, extra: list) -> int:
    """Everything after the checks: TensorBoard, the banner, the supervised run, the summary and plots."""
    if args.tensorboard:
        port = free_port()
        extra.append(subprocess.Popen(TENSORBOARD + ["--logdir", os.path.join(run_dir, "tb"), "--host", "127.0.0.1",
                                                     "--port", str(port)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        print(f"TensorBoard: http://127.0.0.1:{port}/")
    resumed = f", resuming from {ckpt[1]}" if args.resume and (ckpt := latest_checkpoint(run_dir)) else ""
    where = "" if args.ray is None else f" on Ray ({'a local instance' if args.ray == LOCAL_RAY else args.ray})"
    print(f"covrl run {info.run_id}: {info.learners} learner rank(s), {info.generators} generator(s), {cfg.run.steps} "
          f"steps{where} -> {run_dir}{resumed}")
    for line in notes:
        print("  " + line)
    if gpus:
        print("  " + placement_line(place_gpus(gpus, info.learners, info.generators, args.tp), cfg))
    if args.ray is not None:
        print(f"  hub on {info.hub_addr} (learner rank 0's node); roles' nodes: {run_dir}/placement.jsonl")
    print(f"  scale generators while it runs: covrl-scale {run_dir} --gens N")

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)  # the terminal closed: stop as gracefully as for SIGTERM
    t0 = time.monotonic()
    clear_learners_ready(run_dir)
    try:
        code = sup.run()
    except KeyboardInterrupt:
        code = 130
        sup.say(f"interrupted: the learners finish their step and write a checkpoint (up to "
                f"{cfg.run.stop_grace_s:.0f}s; Ctrl-C again stops at once)")
        try:
            sup.drain_learners(cfg.run.stop_grace_s)
        except KeyboardInterrupt:
            print("second interrupt: not waiting for the checkpoint", file=sys.stderr)
        print("stopping every process this run started", file=sys.stderr)
    finally:
        backend.close(GRACE_S)
    sup.progress.finish()
    print(summary(run_dir, cfg, time.monotonic() - t0, args.ray))
    if read_metrics(run_dir):
        try:
            from launch.plots import run_plots

            print(f"  plots: {os.path.dirname(run_plots(run_dir)[0])}/ (reward, entropy, response length, "
                  f"held-out accuracy vs step; accuracy vs entropy with the law's fit)")
        except Exception as e:  # a picture must not cost the user the summary or the exit status
            print(f"  plots could not be drawn ({type(e).__name__}: {e}); `covrl-plots {run_dir}` draws them "
                  f"later", file=sys.stderr)
    for p in extra:
        keep_serving(p, run_dir, code)
    return code


def in_foreground() -> bool:
    """Stdin and stdout are a terminal and this process's group owns it (not a `&` background job)."""
    try:
        return sys.stdout.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False


def stop_group(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group `p` leads, SIGKILL it after `grace_s`."""
    if p.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    p.wait()


def keep_serving(tensorboard: subprocess.Popen, run_dir: str, code: int) -> None:
    """After the run: at a terminal, TensorBoard keeps serving until Ctrl-C; otherwise (a script, a pipe) it is
    stopped, with the command that reopens it. Stopped as the process group it was started as."""
    reopen = shlex.join(TENSORBOARD + ["--logdir", os.path.join(run_dir, "tb")])
    if code != 130 and in_foreground():
        print("TensorBoard keeps serving the finished run; Ctrl-C stops it")
        try:
            tensorboard.wait()
        except KeyboardInterrupt:
            pass
    stop_group(tensorboard)
    print(f"TensorBoard stopped; reopen it with: {reopen}")


if __name__ == "__main__":
    sys.exit(main())
