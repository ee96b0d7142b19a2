"""`covrl run`: start a training run (the same command as `covrl-cluster`).

    covrl run --gens G --learners L [--config FILE] [--set KEY=VALUE ...] [--ray [ADDRESS]] [...]
    covrl resume RUN_DIR [--steps N] [--gens G] [...]

Resolves and checks the config and writes the run directory (`launch/rundir.py`), places the roles on this node's
GPUs once (`launch/local.py`) or on a Ray cluster (`launch/ray_backend.py`), starts L learner ranks and G
generators (`launch/roles.py`), shows a live progress line, and supervises them (`launch/supervisor.py`): failed
generators are restarted, lost ones stopped and restarted, the generator count follows `covrl scale`.
Ctrl-C / SIGTERM: the learners finish their step and write a checkpoint (up to run.stop_grace_s), then every role
this launcher started is stopped, and only those; a second Ctrl-C stops at once. The end: the run's summary and
plots (`launch/summary.py`); TensorBoard with --tensorboard (`launch/board.py`).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import threading
import time

from common.cli import USER_ERRORS, fail
from common.runfiles import clear_learner_beats, clear_learners_ready
from launch.rundir import RunComplete, RunDir, prepare, printed_config, settle_dtype_on_ray, write_addresses
from launch.summary import print_plots, summary
from launch.supervisor import GRACE_S, Supervisor

LOCAL_RAY = "local"


def resume_options() -> argparse.ArgumentParser:
    """The flags a resumed run takes as well as a new one (`covrl resume` is built from these)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--steps", type=int, help="learner steps (same as --set run.steps=N; with --resume: extend the run)")
    ap.add_argument("--gens", type=int, default=None,
                    help="generator processes (default 1; on --resume, the count the run last had)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs on this node to place roles on (default: all "
                    "CUDA devices torch sees; 0: CPU only). Learners take one each, then generators --tp each")
    ap.add_argument("--autoscale", type=_bounds, default=None, metavar="MIN:MAX",
                    help="let the run size its generator pool between MIN and MAX from what it measures (same as "
                         "--set cluster.autoscale.min=MIN --set cluster.autoscale.max=MAX; on --resume it changes the "
                         "run's config); it starts at --gens, default MIN. 0:0 turns it off")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per generator (default 1)")
    ap.add_argument("--ray", nargs="?", const=LOCAL_RAY, default=None, metavar="ADDRESS",
                    help="place the roles with Ray: ADDRESS of a running cluster (host:port, or auto: the one this "
                         "machine belongs to; covrl never stops it), or no ADDRESS: start a local Ray instance. "
                         "RUN_DIR must be on a filesystem every node shares")
    ap.add_argument("--ray-learner-resources", type=_resources, default=None, metavar="JSON",
                    help='extra Ray resources in each learner rank\'s bundle, e.g. \'{"trainer_node": 1}\'')
    ap.add_argument("--ray-generator-resources", type=_resources, default=None, metavar="JSON",
                    help="extra Ray resources in each generator's bundle")
    ap.add_argument("--from", dest="from_", metavar="step_N", default=None,
                    help="with --resume: start from this checkpoint instead of the newest one that verifies; newer "
                         "ones are set aside (renamed step_M.superseded), not deleted")
    ap.add_argument("--tensorboard", action="store_true", help="also serve TensorBoard for this run on 127.0.0.1")
    ap.add_argument("--quiet", action="store_true", help="no live progress line")
    ap.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                    help="when stdout is not a terminal: seconds between progress lines (default 10)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config (defaults, --config, --set, --steps; with --resume, the run's) as "
                         "TOML and exit, starting nothing")
    return ap


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="covrl run", description="Run covrl: generators + learner ranks.",
                                 parents=[resume_options()])
    ap.add_argument("--learners", type=int, default=None,
                    help="learner ranks in one DeepSpeed world (default 1; on --resume it must stay as it was)")
    ap.add_argument("--config", help="TOML config file (default: the built-in arith task)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. rollout.group_size=8")
    ap.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or crashed run from its newest checkpoint "
                                                        "(`covrl resume RUN_DIR`)")
    return ap


def parse_args(argv=None):
    return parser().parse_args(argv)


def _bounds(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if sep and lo.strip().isdigit() and hi.strip().isdigit():
        return int(lo), int(hi)
    raise argparse.ArgumentTypeError(f"{text!r}: give the fewest and the most generators as MIN:MAX, e.g. 1:8")


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


def build(args, run: RunDir, gpus: int):
    """The backend and the supervisor for this launch. Under Ray, the learner ranks are placed first: their
    node's address and free ports there go into cluster.json."""
    if args.ray is None:
        from launch.local import LocalBackend, NodePlacement, local_generator, role_specs

        backend = LocalBackend(run.path, run.cfg)
        specs = role_specs(run.path, run.info, run.cfg, run.placement, resume=bool(args.resume))
        node = NodePlacement(gpus, run.info.learners, args.tp, run.placement)
        make = lambda i, n: local_generator(run.path, run.cfg, i, node.of(n))  # noqa: E731
        learners = [s for s in specs if not s.is_generator]
        return backend, Supervisor(backend, learners, make, run.path, run.cfg, args.quiet, args.progress_every)
    from launch.ray_backend import RayBackend
    from launch.roles import generator_spec, learner_specs

    info = run.info
    backend = RayBackend(run.path, run.cfg, None if args.ray == LOCAL_RAY else args.ray, gpus=args.gpus, tp=args.tp,
                         learners=info.learners, learner_resources=args.ray_learner_resources,
                         generator_resources=args.ray_generator_resources)
    try:
        settle_dtype_on_ray(run, backend.gpus)  # before any role reads config.toml
        backend.cfg = run.cfg
        host, (hub_port, weight_port, master_port) = backend.place_learners(info.learners)
    except BaseException:
        backend.close(0)
        raise
    run.info = write_addresses(run.path, run.cfg, info.run_id, info.generators, info.learners, host,
                               (hub_port, weight_port))
    learners = learner_specs(run.path, run.info, (host, master_port), bool(args.resume), local_rank=False)
    make = lambda i, n: generator_spec(run.path, i)  # noqa: E731
    return backend, Supervisor(backend, learners, make, run.path, run.cfg, args.quiet, args.progress_every)


def main(argv=None) -> int:
    return start(parse_args(argv))


def start(args) -> int:
    """One launch from parsed arguments (`covrl run`, `covrl resume`)."""
    try:
        if args.print_config:
            print(printed_config(args), end="")
            return 0
        from launch.local import visible_gpus

        gpus = visible_gpus(args.gpus) if args.ray is None else 0  # under Ray, Ray places the GPUs
        prepared = prepare(args, gpus)
        backend, sup = build(args, prepared, gpus)
    except RunComplete as e:
        print(e)
        return 0
    except USER_ERRORS as e:
        return fail(e)
    tensorboard = None
    try:
        if args.tensorboard:
            from launch.board import start_tensorboard

            tensorboard = start_tensorboard(prepared.path)
        code = supervised(args, sup, backend, prepared, gpus)
        if tensorboard is not None:
            from launch.board import keep_serving

            keep_serving(tensorboard, prepared.path, code)
        return code
    finally:
        if tensorboard is not None:  # whatever ended the launcher: its whole group
            from launch.board import stop_tensorboard

            stop_tensorboard(tensorboard)


def banner(args, run: RunDir, gpus: int) -> None:
    info, cfg = run.info, run.cfg
    resumed = f", resuming from {run.resumed.path}" if run.resumed else ""
    where = "" if args.ray is None else f" on Ray ({'a local instance' if args.ray == LOCAL_RAY else args.ray})"
    print(f"covrl run {info.run_id}: {info.learners} learner rank(s), {info.generators} generator(s), {cfg.run.steps} "
          f"steps{where} -> {run.path}{resumed}")
    for line in run.notes:
        print("  " + line)
    if gpus:
        from launch.local import placement_line

        print("  " + placement_line(run.placement, cfg))
    if args.ray is not None:
        print(f"  hub on {info.hub_addr} (learner rank 0's node); roles' nodes: {run.path}/placement.jsonl")
    a = cfg.cluster.autoscale
    if a.max:
        print(f"  autoscaling generators between {a.min} and {a.max} (cluster.autoscale; its decisions: "
              f"{run.path}/autoscale.jsonl); covrl scale {run.path} --gens N sets a count it goes on from")
    else:
        print(f"  scale generators while it runs: covrl scale {run.path} --gens N (or let it: --autoscale MIN:MAX)")


def stacks_on_sigusr1() -> None:
    """`kill -USR1 <launcher pid>` prints every thread's Python stack on stderr, even while the main thread is blocked
    in C (a launcher that does not answer Ctrl-C); the run goes on."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError: stderr is not a file (pytest's capture)
        return  # nowhere to write the stacks to
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)


def on_stop_signals(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def supervised(args, sup: Supervisor, backend, run: RunDir, gpus: int) -> int:
    """Everything after the checks: the banner, the supervised run, the summary and plots."""
    banner(args, run, gpus)
    stacks_on_sigusr1()
    stop = threading.Event()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C, SIGTERM, SIGHUP (the terminal closed): a stop, taken by the supervisor's loop (Supervisor.run).
    on_stop_signals(lambda signum, frame: stop.set())
    t0 = time.monotonic()
    clear_learners_ready(run.path)
    clear_learner_beats(run.path)
    try:
        code = sup.run(stop)
        if code is None or sup.drain:  # interrupted, or stopped by the supervisor with the learners alive
            code = 130 if code is None else code
            why = "interrupted" if sup.drain == "" else "stopping the run"
            try:
                on_stop_signals(interrupt)  # again: stop at once
                sup.say(f"{why}: the learners write a checkpoint of their last step (up to "
                        f"{run.cfg.run.stop_grace_s:.0f}s; Ctrl-C again stops at once)")
                sup.drain_learners(run.cfg.run.stop_grace_s)
            except KeyboardInterrupt:
                print("second interrupt: not waiting for the checkpoint", file=sys.stderr)
            print("stopping every process this run started", file=sys.stderr)
    finally:
        backend.close(GRACE_S)
    sup.progress.finish()
    again = "" if args.ray is None else " --ray" if args.ray == LOCAL_RAY else f" --ray {args.ray}"
    print(summary(run.path, run.cfg, time.monotonic() - t0, again, run.resumed.step if run.resumed else 0))
    print_plots(run.path)
    return code


if __name__ == "__main__":
    sys.exit(main())
