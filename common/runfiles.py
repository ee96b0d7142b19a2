"""Where the roles of one run live: RUN_DIR/cluster.json (addresses) and the GPU placement on a node.

cluster.json is written once by the launcher before any role starts; read by learners and
generators. Remote generators need only this file and the secret. `place_gpus` decides which
GPUs each role sees (apart, or colocated when learner and generator must share GPUs).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from dataclasses import dataclass

import msgspec


class ClusterInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: str
    hub_addr: str  # host:port the hub binds (learner rank 0)
    weight_addr: str  # host:port of the weight channel's TCPStore (learner rank 0)
    generators: int
    learners: int


class PlacementError(ValueError):
    """More GPUs asked for than the node has; the message says how to fit."""


# Colocated roles: the learner rank's share of its GPU is what the generator leaves, less this margin for the
# CUDA contexts and communication buffers that no allocator cap counts (vLLM refuses to start when less than
# gpu_memory_utilization x total is free).
COLOCATION_MARGIN = 0.05
MAX_COLOCATED_GENERATOR_SHARE = 0.9
MEMORY_FRACTION_ENV = "COVRL_GPU_MEMORY_FRACTION"


@dataclass(frozen=True)
class Placement:
    learners: list[list[int]]  # GPU indices of each learner rank (one each)
    generators: list[list[int]]  # GPU indices of each generator (its tensor-parallel group)
    colocated: bool = False  # generators share their GPUs with learner ranks


def place_gpus(gpus: int, learners: int, gens: int, tp: int) -> Placement:
    """GPU indices of each learner rank and each generator on one node.

    Apart, when the node has enough GPUs: learners take the first `learners` GPUs (one each), then each generator
    takes `tp` consecutive GPUs (its tensor-parallel group). Colocated, when it has not but the roles fit by
    sharing: learners on GPUs 0.., generators on GPUs 0.. again, so each GPU holds at most one learner rank and one
    generator (the generator takes `generator.gpu_memory_utilization` of it, the learner the rest; see
    `check_colocation`). This is how one or two GPUs run both roles. No GPUs (`gpus == 0`): every role runs on
    the CPU and every list is empty."""
    if gpus == 0:
        return Placement([[] for _ in range(learners)], [[] for _ in range(gens)])
    if tp < 1:
        raise PlacementError(f"--tp {tp}: each generator needs at least one GPU")
    need = learners + gens * tp
    if need <= gpus:
        return Placement([[r] for r in range(learners)],
                         [list(range(learners + g * tp, learners + (g + 1) * tp)) for g in range(gens)])
    if learners <= gpus and gens * tp <= gpus:
        return Placement([[r] for r in range(learners)], [list(range(g * tp, (g + 1) * tp)) for g in range(gens)],
                         colocated=True)
    raise PlacementError(f"{learners} learner rank(s) + {gens} generator(s) x {tp} GPU(s) need {need} GPUs apart, or, "
                         f"sharing GPUs (colocated: at most one learner rank and one generator per GPU), at most {gpus} "
                         f"learner ranks and {gpus} generator GPUs; this node has {gpus}: lower --learners, --gens or --tp")


def colocated_memory_fractions(generator_share: float) -> tuple[float, float]:
    """(learner, generator) shares of a GPU that both roles use: the generator's is `generator.gpu_memory_utilization`;
    the learner gets the rest less COLOCATION_MARGIN. Each role caps its own allocator at its share
    (`apply_memory_fraction`), so one cannot starve the other."""
    return round(1.0 - generator_share - COLOCATION_MARGIN, 4), generator_share


def check_colocation(placement: Placement, gen_cfg) -> None:
    """The rules a colocated run must meet, and the ipc transport's placement (`gen_cfg`: the config's `generator`
    section); ValueError naming the fix."""
    if gen_cfg.weight_transport == "ipc" and (refusal := ipc_placement_refusal(placement)):
        raise PlacementError(refusal)
    if not placement.colocated:
        return
    if gen_cfg.weight_transport == "nccl":
        raise PlacementError("learner and generator share GPUs here (colocated), and NCCL cannot put two ranks of one "
                             "group on one GPU: set generator.weight_transport = \"rpc\" (or \"ipc\" with one "
                             "generator, --tp 1, on learner rank 0's GPU), or give every role GPUs of its own (more "
                             "--gpus, fewer --gens)")
    share = gen_cfg.gpu_memory_utilization
    if share > MAX_COLOCATED_GENERATOR_SHARE:
        raise PlacementError(f"learner and generator share GPUs here (colocated) and generator.gpu_memory_utilization="
                             f"{share} leaves the learner {1 - share - COLOCATION_MARGIN:.0%} of its GPU; set it to at most "
                             f"{MAX_COLOCATED_GENERATOR_SHARE} (e.g. 0.35 for a 1.5B model on 80 GB), or give every role "
                             f"GPUs of its own")


def ipc_placement_refusal(placement: Placement) -> str | None:
    """None when every generator runs on exactly learner rank 0's GPU (colocated; in practice --gens 1 --tp 1), which
    the ipc transport needs (CUDA IPC maps memory only within one GPU, and learner rank 0 alone publishes); else the
    one-line refusal with the fix. Checked before anything starts; the learner checks the GPUs' UUIDs again at the
    channel's set-up (`common/ipc_weights.same_gpu`)."""
    lead = placement.learners[0] if placement.learners else []
    fix = ("run one generator with --tp 1 on learner rank 0's GPU (e.g. --gpus 1 --gens 1 --tp 1), or set "
           "generator.weight_transport = \"rpc\"")
    head = "generator.weight_transport = \"ipc\" maps learner rank 0's GPU memory into a vLLM generator on that GPU"
    if not lead:
        return (f"{head}, but here no role has a GPU (--gpus 0, or Ray, which places every role itself, maybe on "
                f"other GPUs or hosts): {fix}")
    if not placement.colocated:
        return (f"{head}, but here learner rank 0 is on GPU {lead} and the generators on GPUs of their own "
                f"{placement.generators}: {fix}")
    elsewhere = [(g, gpus) for g, gpus in enumerate(placement.generators) if gpus != lead]
    if elsewhere:
        g, gpus = elsewhere[0]
        where = (f"spans {len(gpus)} GPUs {gpus} (--tp {len(gpus)}; ipc maps the slots into one worker)"
                 if len(gpus) > 1 else f"is on GPU {gpus}, not learner rank 0's {lead}")
        return f"{head}, but here generator {g} {where}: {fix}"
    return None


def apply_memory_fraction(device, environ=os.environ) -> float | None:
    """Cap this process's CUDA allocator at its share of a colocated GPU (`COVRL_GPU_MEMORY_FRACTION`, set by the
    launcher only for colocated roles). A no-op on the CPU or without the variable. Returns the fraction applied."""
    text = environ.get(MEMORY_FRACTION_ENV)
    if not text:
        return None
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{MEMORY_FRACTION_ENV}={text!r}: a fraction of the GPU's memory in (0, 1] (the launcher sets it "
                         f"for roles that share a GPU); unset it or give e.g. 0.5")
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:  # "cuda": the current device (torch's cap wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


READY_FILE = "learners.ready"


def mark_learners_ready(run_dir: str) -> None:
    """Learner rank 0, once every rank has built its engine (its GPU memory is allocated and stays cached)."""
    path = os.path.join(run_dir, READY_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def learners_ready(run_dir: str) -> bool:
    return os.path.exists(os.path.join(run_dir, READY_FILE))


def clear_learners_ready(run_dir: str) -> None:
    """The launcher, before it starts a run (or resumes one): a marker from an earlier launch means nothing."""
    try:
        os.remove(os.path.join(run_dir, READY_FILE))
    except FileNotFoundError:
        pass


def write_cluster(run_dir: str, info: ClusterInfo) -> None:
    tmp = os.path.join(run_dir, "cluster.json.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(info))
    os.replace(tmp, os.path.join(run_dir, "cluster.json"))


def read_cluster(run_dir: str) -> ClusterInfo:
    path = os.path.join(run_dir, "cluster.json")
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=ClusterInfo)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: start the run with `covrl run`, which writes it") from None


TARGET_FILE = "generators.json"
# A generator that the hub drained (its id is beyond the run's generator target) exits with this code, so the
# launcher can tell it from one that finished with the run (0) or failed (anything else).
EXIT_DRAINED = 64
# A backend's poll code for a generator whose resources never became free (Ray: its placement group not ready
# within cluster.placement_timeout_s): it was never started, its bundle is given back, and it is tried again.
NOT_PLACED = -2


class GeneratorTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """RUN_DIR/generators.json: how many generators the run should have now (ids 0 .. generators - 1).

    Written by the launcher as a run starts (its --gens) and by `covrl scale RUN_DIR --gens N` while it runs; read
    by the launcher (which starts the missing ids) and by the hub (which drains ids >= generators: no new work,
    then Stop once what they hold is in). `revision` counts the changes, so a reader can tell a new request;
    `reason` says why (the autoscale policy's decision, learner/autoscale.py; empty from covrl scale and the launcher),
    and the launcher repeats it when it follows the change."""
    generators: int
    revision: int = 0
    reason: str = ""


def write_generator_target(run_dir: str, generators: int, reason: str = "",
                           expect: int | None = None) -> GeneratorTarget | None:
    """Atomically set the run's generator count; returns what was written (its revision one past the last).

    Writers (the launcher, `covrl scale`, the autoscale policy) read and write under an exclusive lock on
    generators.json.lock, so no two give the same revision. `expect`: write only if the revision is still this one
    (the autoscale policy's decision was made on it); None (not written) if someone wrote since. A damaged file (not
    ours, or cut short by hand) is replaced: its revision is unknown, so the new one is the time in milliseconds,
    which no reader has seen."""
    if generators < 1:
        raise ValueError(f"--gens {generators}: a run needs at least one generator")
    path = os.path.join(run_dir, TARGET_FILE)
    with _locked(path + ".lock"):
        try:
            old = read_generator_target(run_dir)
            revision = 0 if old is None else old.revision + 1
        except ValueError:
            old, revision = None, time.time_ns() // 1_000_000
        if expect is not None and (old is None or old.revision != expect):
            return None
        target = GeneratorTarget(generators, revision, reason)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(target))
        os.replace(tmp, path)
    return target


@contextlib.contextmanager
def _locked(path: str, timeout_s: float = 10.0):
    """An exclusive flock on `path`, held for the block (a writer holds it for a read and a rename: microseconds)."""
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while not _try_lock(f):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} stayed locked for {timeout_s:.0f}s: another writer of the generator "
                                   f"target hung; remove the file if no covrl process of this run is alive")
            time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def read_generator_target(run_dir: str) -> GeneratorTarget | None:
    """The current target, or None if the file is absent (a run started before it existed).

    Raises ValueError naming the file and the fix when it is not a generator target."""
    path = os.path.join(run_dir, TARGET_FILE)
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=GeneratorTarget)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{path} is not a generator target ({e}); rewrite it with "
                         f"`covrl scale {run_dir} --gens N`") from None


LOST_FILE = "generators_lost.jsonl"  # the hub's verdicts (learner rank 0 writes it)
# The launcher's account of its generator processes: one exited with an error, a slot set aside, tried again,
# released by a scale-down, a launch began (`launch/supervisor.py` writes it). A file of its own: one writer per
# file, since on a shared filesystem (Ray) appends from two hosts are not atomic.
LAUNCHER_FILE = "generators_launcher.jsonl"
EXITED, SET_ASIDE, RETRIED, RELEASED, LAUNCH = "exited", "set_aside", "retried", "released", "launch"
# A generator told by the hub that it was declared lost (it came back after its verdict) exits with this code: a
# failure, so the launcher restarts it (if it has not stopped it already).
EXIT_LOST = 65


class LostGenerator(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of RUN_DIR/generators_lost.jsonl or RUN_DIR/generators_launcher.jsonl.

    generators_lost.jsonl: the hub declared a generator incarnation lost (`Hub._lose`), appended by learner rank 0;
    followed by the launcher's supervisor, which stops the process group of the generator it runs under that id if
    its pid is `pid` (and restarts it as a failed one). `why`: timeout, stuck, weight_channel, restarted or exited
    (`hub/generator_lost/<why>`).
    generators_launcher.jsonl: the launcher's lines (no incarnation): `why` EXITED (process `pid` exited with an
    error: the hub declares that incarnation lost at once), SET_ASIDE, RETRIED, RELEASED (a slot; pid 0), LAUNCH (a
    launch began; gen_id -1)."""
    gen_id: int
    incarnation: str
    pid: int
    why: str
    detail: str
    t: float  # time.time() of the verdict


def record_lost_generator(run_dir: str, lost: LostGenerator, name: str = LOST_FILE) -> None:
    """Append one line to RUN_DIR/`name`: a single write (O_APPEND), so a reader never sees half of one."""
    fd = os.open(os.path.join(run_dir, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, msgspec.json.encode(lost) + b"\n")
    finally:
        os.close(fd)


class LostGenerators:
    """Follows RUN_DIR/`name`: `new()` returns the lines appended since the last call (those present when it was
    built are taken as seen, unless `from_start`: a resumed run's old verdicts name processes long gone). A file
    that cannot be read now (a shared filesystem's hiccup) gives nothing this time and is read again next time:
    callers on the hub thread must not raise."""

    def __init__(self, run_dir: str, name: str = LOST_FILE, from_start: bool = False):
        self.path = os.path.join(run_dir, name)
        self.offset = os.path.getsize(self.path) if os.path.exists(self.path) and not from_start else 0
        self.damaged: list[str] = []  # lines that could not be read, for the caller to say and clear

    def new(self) -> list[LostGenerator]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:  # not there yet, or not readable now: next time
            return []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(msgspec.json.decode(line, type=LostGenerator))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:  # not ours: said by the caller, not fatal
                self.damaged.append(f"{self.path}: a line that is not a verdict ({e}): {line[:120]!r}")
        return out


class ExitedGenerators:
    """The generator processes the launcher saw exit with an error since the last call (its EXITED lines, written
    after this hub was built), as (gen_id, pid, how): the hub's `exited` poll."""

    def __init__(self, run_dir: str):
        self.follow = LostGenerators(run_dir, LAUNCHER_FILE)

    def __call__(self) -> list[tuple[int, int, str]]:
        got = [(v.gen_id, v.pid, v.detail) for v in self.follow.new() if v.why == EXITED and v.pid]
        self.follow.damaged.clear()  # the launcher says those
        return got


class SetAsideGenerators:
    """The generator slots the launcher has set aside now: its SET_ASIDE lines since the last LAUNCH line, less those
    tried again or released since (read from the file's start, so a slot set aside while this learner was still
    loading counts): learner rank 0's `cluster/generators_set_aside`."""

    def __init__(self, run_dir: str):
        self.follow, self.now = LostGenerators(run_dir, LAUNCHER_FILE, from_start=True), set()

    def count(self) -> int:
        for v in self.follow.new():
            if v.why == LAUNCH:
                self.now.clear()
            elif v.why == SET_ASIDE:
                self.now.add(v.gen_id)
            elif v.why in (RETRIED, RELEASED):
                self.now.discard(v.gen_id)
        self.follow.damaged.clear()  # the launcher says those
        return len(self.now)


LEARNER_WATCH_DIR = "learners"  # RUN_DIR/learners/rank_R.json: each learner rank's phase and heartbeat
BEAT_MAX_INTERVAL_S = 5.0


def beat_interval_s(learner_timeout_s: float) -> float:
    """How often a learner rank's heartbeat moves: ten beats within transport.learner_timeout_s, the scale the
    launcher's watch judges it on, and at least every 5 s."""
    return min(BEAT_MAX_INTERVAL_S, learner_timeout_s / 10)


class LearnerBeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """RUN_DIR/learners/rank_R.json, rewritten whole (write then rename) by learner rank R: what it is doing and that
    it is alive. The launcher's watch (`launch/watch.py`) compares what it reads over time on its own clock, so the
    ranks' clocks (other nodes under Ray) never enter its verdict: `beat` must change every few seconds while the
    process lives (a thread of its own), `phase_seq` whenever the rank enters a new phase.

    `phase` says what it does in a few words ("waiting for step 5's batch", "step 5: training", "checkpoint step_4");
    `waits_on`: "generators" while the rank waits for generation (bounded by transport.batch_timeout_s, which the
    config keeps below the learner ranks' deadline), "learners" while it works or waits with its peers (a peer waits
    on it with that deadline), "none" once it is past its last collective (exiting: not judged stuck); `step`: the
    step it is on; `t`: time.time() on its own clock, for people reading the file. A training step moves
    `phase_seq` at each micro-batch."""
    rank: int
    pid: int
    beat: int
    phase_seq: int
    phase: str
    waits_on: str
    step: int
    t: float


def learner_beat_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, LEARNER_WATCH_DIR, f"rank_{rank}.json")


def write_learner_beat(run_dir: str, beat: LearnerBeat) -> None:
    """Whole or not at all: a reader never sees half a record."""
    path = learner_beat_path(run_dir, beat.rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{beat.pid}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(beat))
    os.replace(tmp, path)


def read_learner_beat(run_dir: str, rank: int) -> LearnerBeat | None:
    """None: no record yet (the rank has not started its watch), or one that cannot be read."""
    try:
        with open(learner_beat_path(run_dir, rank), "rb") as f:
            return msgspec.json.decode(f.read(), type=LearnerBeat)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def clear_learner_beats(run_dir: str) -> None:
    """A launch starts with no record of an earlier launch's ranks."""
    shutil.rmtree(os.path.join(run_dir, LEARNER_WATCH_DIR), ignore_errors=True)


def read_run_config(run_dir: str):
    from common.config import load_config

    return load_config(os.path.join(run_dir, "config.toml"))
