"""The Ray backend (`covrl run --ray [ADDRESS]`): the same roles, placed, watched and restarted by Ray.

- Learner ranks: one placement group, one bundle per rank (1 GPU, or 1 CPU on a CPU cluster), PACK. Rank r runs
  in bundle r; rank 0's node hosts the hub, the weight channel's store and torch.distributed's rendezvous, so
  `cluster.json` gets that node's address and ports free there (`addresses`).
- Generators: a placement group each, one bundle (`--tp` GPUs, or 1 CPU), and an actor with `max_restarts`. When a
  generator's node dies, Ray reschedules its bundle on any node with room and restarts the actor there; the launcher
  starts the generator again in it, and the hub re-issues the prompts it held.
- A role is a process (`python -m learner` / `python -m actors`) started by its actor (`RoleActor`), in a process
  group of its own, its output in RUN_DIR/logs/<role>.log. The process dies with its actor (`common.lifeline`).
- RUN_DIR must be on a filesystem every node sees (config.toml, cluster.json, secret.key, logs, checkpoints,
  metrics), and the model and covrl at the same paths on every node: the usual shared home or project
  directory of a cluster. Each start appends the role's node to RUN_DIR/placement.jsonl.
- `ADDRESS`: "auto" (the cluster this machine belongs to) or host:port; covrl only connects, and disconnects at
  the end: it never stops a cluster it did not start. No address: covrl starts a local Ray instance and stops it.
- Room: Ray's autoscaler is asked for the bundles of the generators waiting for room
  (`ray.autoscaler.sdk.request_resources(bundles=...)`, renewed whenever that set changes, empty once all are placed),
  so a cluster with an autoscaler adds a node for a new generator at once, and removes it when the generator is let
  go after a scale-down (its placement group removed); the request is cluster-wide and replaced by the next one (two
  runs on one cluster replace each other's; their pending placement groups still ask for themselves). A generator whose bundle is not ready after a few seconds is said once, with the cluster's free
  resources; after `cluster.placement_timeout_s` its placement group is removed, the supervisor says so and tries
  again (`NOT_PLACED`): a scale-up beyond the cluster never waits in silence.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.transport import free_port
from common.runfiles import NOT_PLACED, PlacementError
from common.lifeline import LIFELINE_ENV
from launch.process_group import signal_group
from launch.roles import GEN_MAX_RESTARTS, RoleSpec, base_env

PLACEMENT_FILE = "placement.jsonl"
STOP_ANSWER_S = 5.0  # how long the supervisor waits for a generator's actor to say it stopped a lost process
NODE_LOST = -1  # poll's code for a role whose actor died for good (its node lost and no restart left)
WAITING_SAID_S = 5.0  # a generator's bundle not ready after this long is said (once)


@ray.remote(max_concurrency=4)  # `run` blocks; `signal` and `where` answer meanwhile
class RoleActor:
    def __init__(self, name: str, run_dir: str, argv: list[str], env: dict[str, str]):
        self.name, self.run_dir, self.argv, self.env = name, run_dir, argv, env
        self.proc: subprocess.Popen | None = None

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname()}

    def run(self) -> int:
        """Start the role's process and wait for it; its exit code. Called again while that process lives (the
        launcher resubmits after a transient `ActorUnavailableError`), it waits for the same process."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.wait()
        if not os.path.exists(os.path.join(self.run_dir, "config.toml")):
            raise RuntimeError(f"{self.name}: {self.run_dir}/config.toml is not visible on node "
                               f"{socket.gethostname()}: put --run-dir on a filesystem every Ray node shares")
        here = self.where()
        with open(os.path.join(self.run_dir, PLACEMENT_FILE), "a") as f:
            f.write(json.dumps({"role": self.name, **here, "pid": os.getpid(), "t": time.time(),
                                "restarted": ray.get_runtime_context().was_current_actor_reconstructed}) + "\n")
        env = {**os.environ, **self.env, LIFELINE_ENV: str(os.getpid())}
        with open(os.path.join(self.run_dir, "logs", f"{self.name}.log"), "ab") as log:
            log.write(f"--- {self.name} starting on {here['host']} ({here['ip']}, Ray node {here['node_id'][:12]})\n"
                      .encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, *self.argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            code = self.proc.wait()
        signal_group(self.proc.pid, signal.SIGKILL)  # whatever it left in its group (reward workers) goes with it
        return code

    def stop_child(self, pid: int) -> bool:
        """SIGKILL the role's process group if its process is `pid` (the hub declared it lost); `run` then returns
        its exit code. A stopped (frozen) process dies too: SIGKILL needs no cooperation."""
        if self.proc is None or self.proc.pid != pid or self.proc.poll() is not None:
            return False
        return signal_group(self.proc.pid, signal.SIGKILL)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, sig)


@ray.remote(num_cpus=0)
def _node_ports(n: int) -> tuple[str, list[int]]:
    """On rank 0's node: its address, and `n` different ports free there, below its ephemeral range (free_port: a
    port from bind(0) was taken by an outgoing connection before the learner bound its weight store, EADDRINUSE)."""
    ip = ray.util.get_node_ip_address()
    return ip, [free_port(ip) for _ in range(n)]


def free_of(bundle: dict[str, float]) -> dict[str, float]:
    """The cluster's free amounts of what `bundle` asks for (and CPU, GPU): the part of Ray's list a reader needs."""
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", *bundle)}


class RayBackend:
    name = "ray"

    def __init__(self, run_dir: str, cfg, address: str | None, *, gpus: int | None, tp: int, learners: int,
                 learner_resources: dict[str, float] | None = None, generator_resources: dict[str, float] | None = None):
        self.run_dir, self.cfg, self.tp = run_dir, cfg, tp
        self.placement_timeout_s = cfg.cluster.placement_timeout_s
        self.pending: dict[str, tuple[ray.ObjectRef, float, bool]] = {}  # generator -> (its bundle's ready, since, said)
        self.unplaced: dict[str, str] = {}  # generator -> why it could not be placed (describe's text)
        self.asked: list[dict] | None = None  # what the autoscaler was last asked for
        self.started_ray = address is None
        if address is None:  # a local instance, ours to stop: logical CPUs for every role and room to scale
            ray.init(num_cpus=max(os.cpu_count() or 1, learners + 32), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        have_gpus = int(ray.cluster_resources().get("GPU", 0))
        self.gpus = have_gpus if gpus is None else gpus
        if self.gpus and self.gpus > have_gpus:
            raise PlacementError(f"--gpus {gpus}: the Ray cluster has {have_gpus} GPUs")
        self.learner_bundle = {"CPU": 1.0, **({"GPU": 1.0} if self.gpus else {}), **(learner_resources or {})}
        self.gen_bundle = {"CPU": 1.0, **({"GPU": float(tp)} if self.gpus else {}), **(generator_resources or {})}
        self.learner_pg = None
        self.actors: dict[str, tuple] = {}  # role -> (actor, placement group or None, bundle index)
        self.refs: dict[str, ray.ObjectRef] = {}
        self.resubmit_at: dict[str, float] = {}
        # covrl's variables; the rest of a role's environment is its node's (Ray sets CUDA_VISIBLE_DEVICES there)
        self.base = base_env(cfg, environ={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})

    # ---- placement ----------------------------------------------------------------------

    def place_learners(self, learners: int) -> tuple[str, list[int]]:
        """Reserve the learner ranks' bundles; returns rank 0's node address and three ports free there
        (hub, weight channel store, torch.distributed rendezvous)."""
        self.learner_pg = placement_group([dict(self.learner_bundle) for _ in range(learners)], strategy="PACK",
                                          name=f"covrl-learners-{os.path.basename(self.run_dir)}")
        self._wait_ready(self.learner_pg, f"{learners} learner rank(s), each {self.learner_bundle}")
        strategy = PlacementGroupSchedulingStrategy(self.learner_pg, placement_group_bundle_index=0)
        return ray.get(_node_ports.options(scheduling_strategy=strategy).remote(3))

    def _wait_ready(self, pg, what: str) -> None:
        ready, _ = ray.wait([pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise PlacementError(f"the Ray cluster has no room for {what} after {self.placement_timeout_s:.0f}s "
                                 f"(cluster.placement_timeout_s; free now: {free_of(self.learner_bundle)}); add nodes, "
                                 f"or lower --learners / --gens")

    def _ask_autoscaler(self) -> None:
        """Ask Ray's autoscaler for the bundles of the generators still waiting for room, and nothing more (a
        cluster without an autoscaler ignores it); only when that set changed. Ray 2.60's autoscaler (v2) keeps nodes
        for a request on top of what is in use (measured: with one generator running on a node, a request for one
        generator bundle kept a second, idle node for 60 s and more), so a placed generator is taken out of the
        request at once and a scaled-down run asks for nothing, and its idle nodes go. Not the learners': they are
        placed once, at the start, and their pending placement group asks for itself."""
        want = [dict(self.gen_bundle) for _ in self.pending]
        if want != self.asked:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=want)
            self.asked = want

    def _placed(self, spec: RoleSpec) -> bool:
        """Whether generator `spec`'s bundle is ready; one still waiting is said after WAITING_SAID_S, and after
        cluster.placement_timeout_s it is let go (its actor and placement group) with the reason kept for `describe`."""
        ready, since, said = self.pending.get(spec.name, (None, 0.0, True))
        if ready is None or ray.wait([ready], timeout=0)[0]:
            if self.pending.pop(spec.name, None) is not None:
                self._ask_autoscaler()  # placed: no longer asked for
            return True
        waited = time.monotonic() - since
        if waited >= self.placement_timeout_s:
            self.unplaced[spec.name] = (f"could not be placed: no Ray node had room for {self._room()} within "
                                        f"cluster.placement_timeout_s = {self.placement_timeout_s:.0f}s")
            self.release(spec)
            return False
        if not said and waited >= WAITING_SAID_S:
            print(f"\n{spec.name} is waiting for room on the Ray cluster for {self._room()}; it is given up after "
                  f"{self.placement_timeout_s:.0f}s (cluster.placement_timeout_s)", file=sys.stderr)
            self.pending[spec.name] = (ready, since, True)
        return True

    def _room(self) -> str:
        """What a generator waits for, and what the cluster has free of it now (asked of Ray only when said)."""
        return f"its bundle {self.gen_bundle} (free now: {free_of(self.gen_bundle)}; the autoscaler was asked for it)"

    # ---- the backend interface (launch/supervisor.py) ------------------------------------

    def start(self, spec: RoleSpec) -> None:
        if spec.name not in self.actors:
            self.actors[spec.name] = self._actor(spec)
            self._ask_autoscaler()  # a generator's bundle waits for room until Ray places it
        self.refs[spec.name] = self.actors[spec.name][0].run.remote()

    def _actor(self, spec: RoleSpec) -> tuple:
        argv = ["-m", spec.module, *spec.args]
        env = {**self.base, **spec.env}
        if spec.is_generator:  # its own bundle, rescheduled by Ray on any node with room if its node dies
            pg = placement_group([dict(self.gen_bundle)], strategy="STRICT_PACK",
                                 name=f"covrl-{spec.name}-{os.path.basename(self.run_dir)}")
            index, restarts = 0, GEN_MAX_RESTARTS
            self.pending[spec.name] = (pg.ready(), time.monotonic(), False)
        else:
            pg, index, restarts = self.learner_pg, int(spec.env["RANK"]), 0
        bundle = self.gen_bundle if spec.is_generator else self.learner_bundle
        actor = RoleActor.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
            max_restarts=restarts, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            name=f"covrl-{spec.name}-{os.path.basename(self.run_dir)}-{time.time_ns()}",
        ).remote(spec.name, self.run_dir, argv, env)
        return actor, pg if spec.is_generator else None, index

    def poll(self, spec: RoleSpec) -> int | None:
        """The role's exit code once it has ended; None while it runs, or while Ray restarts its actor after its
        node was lost (the launcher then sees it run again: Ray's restart, not the launcher's)."""
        if spec.is_generator and not self._placed(spec):
            return NOT_PLACED
        ref = self.refs.get(spec.name)
        if ref is None:
            if time.monotonic() >= self.resubmit_at.get(spec.name, 0):
                self.refs[spec.name] = self.actors[spec.name][0].run.remote()
            return None
        done, _ = ray.wait([ref], timeout=0)
        if not done:
            return None
        try:
            return ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            if spec.is_generator:  # its node is gone or its actor restarting: ask again once Ray has it back
                print(f"\n{spec.name}: its Ray actor is restarting (node lost?); it starts again where Ray puts it",
                      file=sys.stderr)
                del self.refs[spec.name]
                self.resubmit_at[spec.name] = time.monotonic() + 1.0
                return None
            return NODE_LOST
        except (ray.exceptions.ActorDiedError, ray.exceptions.RayActorError):
            if spec.is_generator:  # dead for good (Ray's restarts spent): a restart gets a new actor and bundle
                self.release(spec)
            return NODE_LOST
        except ray.exceptions.RayTaskError as e:
            print(f"\n{spec.name}: {e}", file=sys.stderr)
            return NODE_LOST

    def placing(self, spec: RoleSpec) -> bool:
        """Whether generator `spec` is still waiting for its bundle (its process not started), asked of Ray now."""
        return spec.name in self.pending and not ray.wait([self.pending[spec.name][0]], timeout=0)[0]

    def stop_lost(self, spec: RoleSpec, pid: int) -> bool:
        """The hub declared generator `spec` lost: its actor kills the process if it is `pid` (its node's pid space).
        Waits at most STOP_ANSWER_S for the answer: an actor that does not answer in time (its node unreachable) is
        taken to have been asked, and when its node is gone Ray restarts the actor anyway."""
        if spec.name not in self.actors:
            return False
        ref = self.actors[spec.name][0].stop_child.remote(pid)
        try:
            return bool(ray.get(ref, timeout=STOP_ANSWER_S))
        except ray.exceptions.GetTimeoutError:
            return True
        except ray.exceptions.RayError:  # the actor is dead or restarting: the process is gone with it
            return False

    def pid(self, spec: RoleSpec) -> int | None:
        """Unknown here: the process runs in its Ray actor, on its node (the hub's own verdicts then cover it)."""
        return None

    def describe(self, spec: RoleSpec, code: int) -> str:
        if code == NOT_PLACED:
            return self.unplaced.pop(spec.name, "could not be placed")
        if code == NODE_LOST:
            return "was lost with its Ray node (or its actor died and Ray has no restart left)"
        return f"exited with code {code}"

    def signal(self, spec: RoleSpec, sig: int) -> None:
        if spec.name in self.actors:
            self.actors[spec.name][0].signal.remote(sig)

    def terminate(self, specs: list[RoleSpec], grace_s: float) -> list[RoleSpec]:
        live = [s for s in specs if self.refs.get(s.name) is not None]
        for s in live:
            self.signal(s, signal.SIGTERM)
        ray.wait([self.refs[s.name] for s in live], num_returns=len(live), timeout=grace_s)
        return [s for s in live if not ray.wait([self.refs[s.name]], timeout=0)[0]]

    def release(self, spec: RoleSpec) -> None:
        """A drained generator has exited: end its actor and free its bundle."""
        actor, pg, _ = self.actors.pop(spec.name, (None, None, 0))
        self.refs.pop(spec.name, None)
        waiting = self.pending.pop(spec.name, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        if waiting is not None:
            self._ask_autoscaler()  # no longer asked for

    def close(self, grace_s: float) -> None:
        """Stop every role (SIGTERM, then SIGKILL after `grace_s`), end the actors, free the bundles; stop Ray
        only if covrl started it, else disconnect."""
        specs = [RoleSpec(name, "", [], {}) for name in self.actors]
        try:
            self.terminate(specs, grace_s)
            for name in list(self.actors):
                self.actors[name][0].signal.remote(signal.SIGKILL)
            time.sleep(0.5)
            for name, (actor, pg, _) in list(self.actors.items()):
                ray.kill(actor, no_restart=True)
                if pg is not None:
                    remove_placement_group(pg)
            if self.learner_pg is not None:
                remove_placement_group(self.learner_pg)
            if self.asked:  # nothing wanted any more: the cluster may shrink
                from ray.autoscaler.sdk import request_resources

                request_resources(bundles=[])
        finally:
            self.actors.clear()
            ray.shutdown()  # a local instance we started: stopped; a cluster we joined: only disconnected
