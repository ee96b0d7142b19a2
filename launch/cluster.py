"""The one entry point: `covrl-cluster --gens G --learners L [...]` (also `python -m launch.cluster` or
`python launch/cluster.py` from the repo root, with covrl installed: `make venv`).

Resolves the config, prepares the run directory (config.toml, secret.key,
cluster.json), starts L learner ranks and G generators from one list of
`RoleSpec`s, shows a live progress line, and supervises:
- a generator that exits with an error is restarted (3 retries, backoff 2, 4, 8 s); it rejoins
  with a weight channel of its own and catches up on the latest version;
- a learner rank that fails stops the run; the last checkpoint stays intact, and
  `--resume RUN_DIR` continues from it;
- Ctrl-C / SIGTERM: the learners finish their step and write a checkpoint (up to
  run.stop_grace_s), then every process group this launcher started is stopped, and only
  those; a second Ctrl-C stops at once.
Every role runs in its own session (process group), so stopping a role also
stops whatever it spawned (reward workers), and nothing else on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from common.checkpoints import complete_checkpoints, latest_checkpoint
from common.cluster import (MEMORY_FRACTION_ENV, ClusterInfo, PlacementError, check_colocation, clear_learners_ready,
                            colocated_memory_fractions, learners_ready, place_gpus, read_cluster, write_cluster)
from common.config import ConfigError, load_config, to_toml, with_absolute_paths
from common.data import REPO_ROOT, model_dir
from common.metrics import read_metrics
from common.transport import create_secret, free_port, port_in_use

GRACE_S = 10.0


@dataclass
class RoleSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    restartable: bool
    max_restarts: int = 3
    restarts: int = 0
    proc: subprocess.Popen | None = None
    log: object = None
    next_start: float = 0.0
    done: bool = False
    # Start only once the learner ranks are built (RUN_DIR/learners.ready): a generator that shares a GPU with a
    # learner rank. vLLM measures the GPU's free memory as it starts and fails if another process frees some
    # meanwhile, which a learner does while it loads the model and builds its DeepSpeed engine.
    after_learners: bool = False


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
    ap.add_argument("--remote-gens", type=int, default=0, metavar="N",
                    help="of the --gens generators, the last N are started on other hosts (python -m actors "
                         "--run-dir RUN_DIR --gen-id I); bind the hub to a reachable address with --set transport.host=IP")
    ap.add_argument("--quiet", action="store_true", help="no live progress line")
    return ap.parse_args(argv)


def prepare_resume(args, gpus: int = 0) -> tuple[str, object, ClusterInfo]:
    """The run directory of a stopped run, its config (only --steps may change) and fresh addresses."""
    run_dir = os.path.abspath(args.resume)
    if args.config or args.set or (args.run_dir and os.path.abspath(args.run_dir) != run_dir):
        raise ConfigError("--resume continues a run with the config it was started with (RUN_DIR/config.toml); "
                          "drop --config / --set / --run-dir (only --steps, --gens may change)")
    for name in ("config.toml", "cluster.json", "secret.key"):
        if not os.path.exists(os.path.join(run_dir, name)):
            raise ConfigError(f"--resume {args.resume}: {name} is missing, so this is not a covrl run directory; "
                              f"give the RUN_DIR a run was started with")
    overrides = [f"run.steps={args.steps}"] if args.steps is not None else []
    cfg = load_config(os.path.join(run_dir, "config.toml"), overrides)
    old = read_cluster(run_dir)
    learners = old.learners if args.learners is None else args.learners
    if learners != old.learners:
        raise ConfigError(f"--learners {learners}: the run's checkpoints are sharded over {old.learners} learner ranks; "
                          f"resume with --learners {old.learners}")
    gens = old.generators if args.gens is None else args.gens
    if gens < 1:
        raise ConfigError(f"--gens {gens}: need at least one generator")
    check_remote(args, gens, cfg.transport.host)
    check_colocation(place_gpus(gpus, learners, gens - args.remote_gens, args.tp), cfg.generator)
    if args.steps is not None:
        with open(os.path.join(run_dir, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    _check_hub_port(cfg)
    info = write_addresses(run_dir, cfg, old.run_id, gens, learners)
    return run_dir, cfg, info


def write_addresses(run_dir: str, cfg, run_id: str, gens: int, learners: int) -> ClusterInfo:
    """cluster.json with this launch's addresses: the hub's (transport.hub_port, or a free port) and the weight
    channel's store (a free port), both on transport.host."""
    host = cfg.transport.host
    info = ClusterInfo(run_id=run_id, hub_addr=f"{host}:{cfg.transport.hub_port or free_port(host)}",
                       weight_addr=f"{host}:{free_port(host)}", generators=gens, learners=learners)
    write_cluster(run_dir, info)
    return info


def _check_hub_port(cfg) -> None:
    t = cfg.transport
    if t.hub_port and (why := port_in_use(t.host, t.hub_port)):
        raise ConfigError(f"transport.hub_port {t.hub_port} on {t.host} cannot be bound ({why}); pick another port, "
                          f"or 0 for a free one")


def check_remote(args, gens: int, host: str) -> None:
    if not 0 <= args.remote_gens <= gens:
        raise ConfigError(f"--remote-gens {args.remote_gens}: must be between 0 and --gens {gens}")
    if args.remote_gens and host in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"--remote-gens {args.remote_gens}: the hub binds {host}, which other hosts cannot reach; "
                          f"add --set transport.host=<this host's address on the cluster network>")
    if host in ("0.0.0.0", "::", ""):
        raise ConfigError(f"transport.host {host!r}: generators connect to this address, so give one of this host's "
                          f"own addresses, not a wildcard")


def prepare(args, gpus: int = 0) -> tuple[str, object, ClusterInfo]:
    """Check everything, then write the run directory; nothing is written if a check fails."""
    if args.resume:
        return prepare_resume(args, gpus)
    args.gens = 1 if args.gens is None else args.gens
    args.learners = 1 if args.learners is None else args.learners
    if args.gens < 1 or args.learners < 1:
        raise ConfigError(f"--gens {args.gens} --learners {args.learners}: need at least one of each")
    placement = place_gpus(gpus, args.learners, args.gens - args.remote_gens, args.tp)  # a placement that cannot fit
    overrides = list(args.set) + ([f"run.steps={args.steps}"] if args.steps is not None else [])
    cfg = with_absolute_paths(load_config(args.config, overrides), os.getcwd())
    check_colocation(placement, cfg.generator)
    model_dir(cfg)  # fail now, not in every child, if the model is missing
    check_remote(args, args.gens, cfg.transport.host)
    r = cfg.rollout
    _check_hub_port(cfg)
    per_update = r.groups_per_step * r.group_size // cfg.learner.mini_batches
    if args.learners > per_update:
        raise ConfigError(f"--learners {args.learners}: an optimizer step has only {per_update} samples (groups_per_step "
                          f"x group_size / mini_batches) to shard; use at most {per_update} learner ranks or a bigger batch")
    run_dir = os.path.abspath(args.run_dir or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    try:
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        probe = os.path.join(run_dir, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"run directory {run_dir!r} is not writable ({e.strerror}); pass a writable --run-dir") from None
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise ConfigError(f"{run_dir} already holds a run (metrics.jsonl); pick a new --run-dir")
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    create_secret(run_dir)
    info = write_addresses(run_dir, cfg, uuid.uuid4().hex[:12], args.gens, args.learners)
    return run_dir, cfg, info


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


def role_specs(run_dir: str, info: ClusterInfo, cfg, gpus: int = 0, tp: int = 1, resume: bool = False,
               remote_gens: int = 0) -> list[RoleSpec]:
    """The processes this launcher starts: every learner rank, and generators 0 .. gens - remote_gens - 1."""
    local_gens = info.generators - remote_gens
    placement = place_gpus(gpus, info.learners, local_gens, tp)
    devices = lambda ids: {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}  # noqa: E731  ("" with no GPUs: CPU only)
    all_learner_gpus = [g for ids in placement.learners for g in ids]
    # Colocated roles cap their own CUDA allocators at their share of the GPU they share.
    learner_share, gen_share = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
    learner_mem = {MEMORY_FRACTION_ENV: str(learner_share)} if placement.colocated else {}
    gen_mem = {MEMORY_FRACTION_ENV: str(gen_share)} if placement.colocated else {}
    base = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": str(cfg.run.torch_threads), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    master_port = str(free_port())
    specs = [
        RoleSpec(f"learner{r}", [sys.executable, "-m", "learner", "--run-dir", run_dir, *(["--resume"] if resume else [])],
                 {**base, **devices(all_learner_gpus), **learner_mem, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(info.learners),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port}, restartable=False)
        for r in range(info.learners)
    ]
    # A generator that dies is restarted (bounded, with backoff): it rejoins with a weight channel of its own and
    # is sent the latest version before it generates; the hub re-issues the prompts it held.
    specs += [
        RoleSpec(f"gen{i}", [sys.executable, "-m", "actors", "--run-dir", run_dir, "--gen-id", str(i)],
                 {**base, **devices(placement.generators[i]), **gen_mem}, restartable=True, max_restarts=3,
                 after_learners=placement.colocated)
        for i in range(local_gens)
    ]
    return specs


def placement_line(placement, cfg) -> str:
    """One line of the start banner: which GPUs each role got, and how colocated roles split their memory."""
    line = f"GPUs: learner ranks on {placement.learners}, generators on {placement.generators}"
    if placement.colocated:
        learner_share, gen_share = colocated_memory_fractions(cfg.generator.gpu_memory_utilization)
        line += (f" (colocated: each generator takes {gen_share:.0%} of its GPUs' memory, "
                 f"generator.gpu_memory_utilization; a learner rank at most {learner_share:.0%}; weights over rpc)")
    return line


def spawn(spec: RoleSpec, run_dir: str) -> None:
    if spec.log is None:  # a restarted role appends to the same log
        spec.log = open(os.path.join(run_dir, "logs", f"{spec.name}.log"), "ab")
    spec.proc = subprocess.Popen(spec.argv, env=spec.env, cwd=REPO_ROOT, stdout=spec.log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)


def _term_and_wait(procs: list[subprocess.Popen], grace_s: float) -> list[subprocess.Popen]:
    """SIGTERM each running process's group; wait up to `grace_s` in all. Returns those still running."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p for p in procs if p.poll() is None]


def drain_learners(specs: list[RoleSpec], grace_s: float) -> None:
    """Graceful stop: SIGTERM the learner ranks (they finish the step, checkpoint and exit) while the
    generators keep serving them; wait up to `grace_s`."""
    for p in _term_and_wait([s.proc for s in specs if not s.restartable and s.proc is not None], grace_s):
        print(f"learner pid {p.pid} did not finish within run.stop_grace_s={grace_s:.0f}s; stopping it without a "
              f"final checkpoint", file=sys.stderr)


def stop_all(specs: list[RoleSpec], extra: list[subprocess.Popen]) -> None:
    """SIGTERM each process group we started, then SIGKILL what is left after a grace period."""
    procs = [s.proc for s in specs if s.proc is not None] + extra
    _term_and_wait(procs, GRACE_S)
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # also reaps children left in the group
        if p.poll() is None:
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the group id is the pid: start_new_session=True
    except ProcessLookupError:
        pass


def log_tail(run_dir: str, name: str, lines: int = 25) -> str:
    path = os.path.join(run_dir, "logs", f"{name}.log")
    with open(path, "rb") as f:
        return b"".join(f.readlines()[-lines:]).decode(errors="replace")


def progress_line(row: dict, steps: int, k: int) -> str:
    evals = " ".join(f"{key.split('/')[1]} {v:.3f}" for key, v in sorted(row.items())
                     if key.startswith("eval/") and key.endswith("/acc") and v is not None)
    evals = f" | eval acc {evals}" if evals else ""
    if row.get("critic/score/mean") is None:  # row 0: the base model's evaluation only
        return f"step {row['step']}/{steps}{evals}"
    return (f"step {row['step']}/{steps} | reward {row.get('critic/score/mean', 0):.3f} | "
            f"entropy {row.get('actor/entropy', 0):.3f} | gen {row.get('perf/gen_tokens_per_s', 0):.0f} tok/s | "
            f"staleness {row.get('staleness/mean', 0):.2f} (max {row.get('staleness/max', 0):.0f}, bound {k}) | "
            f"{row.get('timing_s/step', 0):.2f} s/step{evals}")


def summary(run_dir: str, cfg, elapsed: float) -> str:
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("critic/score/mean") is not None]
    if not train:
        return f"no steps recorded in {run_dir}/metrics.jsonl"
    q = max(1, len(train) // 4)
    avg = lambda rs, k: sum(r.get(k) or 0.0 for r in rs) / len(rs)  # noqa: E731
    last = complete_checkpoints(run_dir)
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
        f"  checkpoint: {last[-1][1] if last else 'none'}" + (f" (continue with --resume {run_dir})" if last and
                                                               last[-1][0] < cfg.run.steps else ""),
    ]
    return "\n".join(lines)


def supervise(specs: list[RoleSpec], run_dir: str, cfg, quiet: bool) -> int:
    shown = 0
    while True:
        time.sleep(0.5)
        for s in specs:
            if s.done:
                continue
            if s.proc is None:
                if due(s, run_dir):
                    spawn(s, run_dir)
                continue
            code = s.proc.poll()
            if code is None:
                continue
            if not s.restartable:  # a learner rank: its failure ends the run
                if code != 0:
                    print(f"\n{s.name} exited with code {code}; stopping the run. Last lines of its log:\n{log_tail(run_dir, s.name)}",
                          file=sys.stderr)
                    return 1
                s.done = True
            elif code == 0:
                s.done = True
            elif s.restarts < s.max_restarts:
                s.restarts += 1
                delay = 2.0 ** s.restarts
                print(f"\n{s.name} exited with code {code}; restart {s.restarts}/{s.max_restarts} in {delay:.0f}s", file=sys.stderr)
                s.proc, s.next_start = None, time.monotonic() + delay
            else:
                print(f"\n{s.name} failed {s.restarts + 1} times; stopping the run. Last lines of its log:\n{log_tail(run_dir, s.name)}",
                      file=sys.stderr)
                return 1
        rows = read_metrics(run_dir)
        if rows and len(rows) != shown and not quiet:
            shown = len(rows)
            end = "\n" if not sys.stdout.isatty() else ""
            print("\r" + progress_line(rows[-1], cfg.run.steps, cfg.rollout.max_staleness_steps), end=end, flush=True)
        if all(s.done for s in specs if not s.restartable):
            # Learners finished: generators got Stop from the hub; give them a moment to exit.
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(s.proc.poll() is None for s in specs if s.proc and not s.done):
                time.sleep(0.2)
            return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        gpus = visible_gpus(args.gpus)
        run_dir, cfg, info = prepare(args, gpus)
    except (ConfigError, FileNotFoundError, PlacementError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    specs = role_specs(run_dir, info, cfg, gpus, args.tp, resume=bool(args.resume), remote_gens=args.remote_gens)
    extra: list[subprocess.Popen] = []
    if args.tensorboard:
        port = free_port()
        extra.append(subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", os.path.join(run_dir, "tb"),
                                       "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        print(f"TensorBoard: http://127.0.0.1:{port}/")
    resumed = f", resuming from {ckpt[1]}" if args.resume and (ckpt := latest_checkpoint(run_dir)) else ""
    print(f"covrl run {info.run_id}: {info.learners} learner rank(s), {info.generators} generator(s), {cfg.run.steps} "
          f"steps -> {run_dir}{resumed}")
    if gpus:
        print("  " + placement_line(place_gpus(gpus, info.learners, info.generators - args.remote_gens, args.tp), cfg))
    for i in range(info.generators - args.remote_gens, info.generators):
        print(f"  generator {i} is remote: on its host, with {run_dir} there too (config.toml, cluster.json, secret.key):"
              f" python -m actors --run-dir {run_dir} --gen-id {i}")

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    clear_learners_ready(run_dir)
    for s in specs:
        if due(s, run_dir):
            spawn(s, run_dir)  # the others start from the supervision loop once due
    try:
        code = supervise(specs, run_dir, cfg, args.quiet)
    except KeyboardInterrupt:
        code = 130
        print(f"\ninterrupted: the learners finish their step and write a checkpoint (up to {cfg.run.stop_grace_s:.0f}s; "
              f"Ctrl-C again stops at once)", file=sys.stderr)
        try:
            drain_learners(specs, cfg.run.stop_grace_s)
        except KeyboardInterrupt:
            print("second interrupt: not waiting for the checkpoint", file=sys.stderr)
        print("stopping every process this run started", file=sys.stderr)
    finally:
        stop_all(specs, extra)
        for s in specs:
            if s.log:
                s.log.close()
    print()
    print(summary(run_dir, cfg, time.monotonic() - t0))
    return code


if __name__ == "__main__":
    sys.exit(main())
