"""The launcher without its roles: RUN_DIR/generators.json (revisions, a damaged file: covrl scale replaces it, the
supervisor keeps its generators, --resume names the fix); the supervisor's scaling against a recording backend;
the one-node GPU layout; --print-config; --resume of a finished run."""

import json
import os

import pytest

from common.runfiles import EXIT_DRAINED, NOT_PLACED, ClusterInfo, PlacementError, place_gpus, read_generator_target, write_cluster, write_generator_target
from common.config import Config, ConfigError, load_config, to_toml
from launch import cluster as launcher
from launch.rundir import prepare_resume
from launch.supervisor import Supervisor
from launch import scale


def test_each_write_is_a_new_revision(tmp_path):
    run = str(tmp_path)
    assert read_generator_target(run) is None
    assert [write_generator_target(run, n).revision for n in (2, 4, 4)] == [0, 1, 2]
    t = read_generator_target(run)
    assert (t.generators, t.revision) == (4, 2)
    with pytest.raises(ValueError, match="at least one generator"):
        write_generator_target(run, 0)


def test_a_damaged_file_is_named_and_replaced_with_an_unseen_revision(tmp_path):
    run = str(tmp_path)
    write_generator_target(run, 2)
    (tmp_path / "generators.json").write_text('{"generators": 3')  # cut short by hand
    with pytest.raises(ValueError, match=r"generators.json is not a generator target .*covrl scale .* --gens N"):
        read_generator_target(run)
    t = write_generator_target(run, 3)
    assert t.revision > 1_000_000  # milliseconds since the epoch: no reader saw it
    assert read_generator_target(run) == t


def test_covrl_scale_repairs_a_damaged_file(tmp_path, capsys):
    run = str(tmp_path)
    write_cluster(run, ClusterInfo("r", "127.0.0.1:1", "127.0.0.1:2", generators=2, learners=1))
    (tmp_path / "generators.json").write_text("[1, 2]")
    assert scale.main([run, "--gens", "3"]) == 0
    err = capsys.readouterr().err
    assert "is not a generator target" in err and "replacing it" in err
    assert json.loads((tmp_path / "generators.json").read_text())["generators"] == 3


def test_the_supervisor_keeps_its_generators_while_the_file_is_damaged(tmp_path, capsys):
    run = str(tmp_path)
    started = []

    def make_generator(i, n):
        from launch.roles import generator_spec

        started.append(i)
        return generator_spec(run, i)

    sup = Supervisor(None, [], make_generator, run, Config(), quiet=True)
    write_generator_target(run, 2)
    sup.follow_target()
    assert (sup.target, started) == (2, [0, 1])
    (tmp_path / "generators.json").write_text("{not json")
    sup.follow_target()
    sup.follow_target()
    assert (sup.target, started) == (2, [0, 1])
    assert capsys.readouterr().err.count("keeping 2 generator(s)") == 1  # said once, not every tick
    write_generator_target(run, 3)
    sup.follow_target()
    assert (sup.target, started) == (3, [0, 1, 2])


def test_resume_with_a_damaged_file_asks_for_gens(tmp_path):
    run = str(tmp_path)
    (tmp_path / "config.toml").write_text(to_toml(Config()))
    (tmp_path / "secret.key").write_bytes(b"k" * 32)
    write_cluster(run, ClusterInfo("r", "127.0.0.1:1", "127.0.0.1:2", generators=2, learners=1))
    (tmp_path / "generators.json").write_text("{}")
    with pytest.raises(ConfigError, match="pass --gens N to --resume"):
        prepare_resume(launcher.parse_args(["--resume", run]))


class Backend:
    """Records what the supervisor asks of a backend; `exits` are the codes its roles end with, by name."""

    def __init__(self):
        self.started, self.released, self.exits, self.stopped = [], [], {}, []
        self.pids = {}  # role -> the pid of the process this backend runs for it

    def stop_lost(self, s, pid):
        if self.pids.get(s.name) != pid:
            return False
        self.stopped.append((s.name, pid))
        return True

    def start(self, s):
        self.started.append(s.name)

    def poll(self, s):
        return self.exits.pop(s.name, None)

    def release(self, s):
        self.released.append(s.name)

    def describe(self, s, code):
        return "could not be placed: no room" if code == NOT_PLACED else f"exited with code {code}"

    def pid(self, s):
        return self.pids.get(s.name)

    def placing(self, s):
        return s.name in self.waiting_for_room

    waiting_for_room: set = set()


def _supervisor(run, make=None):
    from launch.roles import RoleSpec, generator_spec

    backend = Backend()
    learner = RoleSpec("learner0", "learner", [], {})
    sup = Supervisor(backend, [learner], make or (lambda i, n: generator_spec(run, i)), run, Config(),
                              quiet=True)
    return sup, backend


def test_generators_scaled_away_while_starting_or_restarting_leave_without_failing_the_run(tmp_path):
    """1 -> 3 -> 1 while gen1 and gen2 are still starting: the hub refuses them (exit 1) and that is a leave, not a
    failure; one waiting for a restart is dropped; 1 -> 3 again starts fresh ones."""
    run = str(tmp_path)
    write_generator_target(run, 1)
    sup, backend = _supervisor(run)
    assert sup.poll() is None and backend.started == ["learner0", "gen0"]
    write_generator_target(run, 3)
    assert sup.poll() is None and backend.started[-2:] == ["gen1", "gen2"]
    backend.exits["gen2"] = 1  # crashed: restart after a backoff
    assert sup.poll() is None and len(sup.gens[2].failures) == 1 and not sup.gens[2].running
    write_generator_target(run, 1)
    backend.exits["gen1"] = 1  # refused by the hub: its id is above the target now
    assert sup.poll() is None, "a generator that left after a scale-down must not stop the run"
    assert sorted(sup.gens) == [0] and sorted(backend.released) == ["gen1", "gen2"]
    write_generator_target(run, 3)
    assert sup.poll() is None and sorted(sup.gens) == [0, 1, 2] and backend.started[-2:] == ["gen1", "gen2"]
    assert all(sup.gens[i].failures == [] for i in (1, 2))
    backend.exits["gen1"] = EXIT_DRAINED  # drained although wanted again (the hub saw the dip): a fresh one next tick
    assert sup.poll() is None and 1 not in sup.gens
    assert sup.poll() is None and 1 in sup.gens and backend.started[-1] == "gen1"


def test_a_count_written_by_hand_is_followed_and_an_unplaceable_id_is_retried(tmp_path, capsys):
    run = str(tmp_path)
    write_generator_target(run, 2)
    room = [2]

    def make(i, n):
        from launch.roles import generator_spec

        if i >= room[0]:
            raise PlacementError(f"no GPU left for generator {i}")
        return generator_spec(run, i)

    sup, backend = _supervisor(run, make)
    sup.poll()
    (tmp_path / "generators.json").write_text('{"generators": 3}')  # revision 0 again, as DESIGN allows
    sup.poll()
    sup.poll()
    assert sup.target == 3 and sorted(sup.gens) == [0, 1]
    assert capsys.readouterr().err.count("cannot start generator 2: no GPU left") == 1  # said once
    room[0] = 3
    sup.poll()
    assert sorted(sup.gens) == [0, 1, 2] and backend.started[-1] == "gen2"


def test_a_scale_that_would_change_the_gpu_layout_is_refused():
    from launch.local import NodePlacement, local_generator

    node = NodePlacement(gpus=4, learners=1, tp=1, start=place_gpus(4, 1, 1, 1))
    assert local_generator("/r", Config(), 2, node.of(3)).devices == [3]
    with pytest.raises(PlacementError, match="started with them apart"):
        node.of(4)


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import tomllib

    monkeypatch.chdir(tmp_path)
    assert launcher.main(["--print-config", "--set", "rollout.group_size=4", "--steps", "7"]) == 0
    out = capsys.readouterr().out
    printed = tomllib.loads(out)
    assert printed["rollout"]["group_size"] == 4 and printed["run"]["steps"] == 7
    # model.dtype as given, "auto", with what this launch (no GPU here) resolves it to: the banner's line
    assert printed["model"]["dtype"] == "auto"
    assert 'dtype = "auto"  # model.dtype "auto": float32 (the learner ranks run on the CPU)\n' in out
    assert printed["learner"]["entropy_delta_stride"] == Config().learner.entropy_delta_stride  # the defaults too
    assert os.listdir(tmp_path) == []  # no run directory
    assert launcher.main(["--print-config", "--set", "rollout.group_size=1"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


def test_a_launch_resolves_model_dtype_auto_once_and_the_run_keeps_it(tmp_path, tiny_model_dir, monkeypatch):
    """`model.dtype = "auto"` is resolved at the door for the learner ranks' device and written into config.toml, which
    every role and every resume reads: bfloat16 on sm80+ GPUs, float32 on older ones and on the CPU; the banner says
    which. A named dtype is kept as it is. Under Ray, once the cluster is reached (its GPUs taken to be sm80+)."""
    from common import memplan as M
    from launch import plan
    from launch.rundir import settle_dtype_on_ray

    capability = [(9, 0)]
    monkeypatch.setattr(plan, "this_machine", lambda gpus: M.Machine(gpus, 80 * M.GiB if gpus else None, 64 * M.GiB,
                                                                      capability[0] if gpus else None))

    def launch(name, gpus, *flags):
        args = launcher.parse_args(["--gens", "1", "--learners", "1", "--gpus", str(gpus), "--run-dir",
                                    str(tmp_path / name), "--set", f'model.path="{tiny_model_dir}"', "--set",
                                    "generator.gpu_memory_utilization=0.3", "--set", "eval.every_steps=0", *flags])
        run = launcher.prepare(args, gpus=0 if args.ray else gpus)
        return run, load_config(str(tmp_path / name / "config.toml")).model.dtype

    run, written = launch("h100", 1)
    assert run.cfg.model.dtype == written == "bfloat16"
    assert "model.dtype \"auto\": bfloat16 (the learner ranks' GPUs are sm90)" in run.notes
    resumed = prepare_resume(launcher.parse_args(["--resume", run.path]), gpus=0)  # even where no GPU is seen
    assert resumed.cfg.model.dtype == "bfloat16" and not any("model.dtype" in n for n in resumed.notes)
    capability[0] = (7, 5)
    run, written = launch("t4", 1)
    assert written == "float32" and "model.dtype \"auto\": float32 (the learner ranks' GPUs are sm75)" in run.notes
    run, written = launch("cpu", 0)
    assert written == "float32" and "model.dtype \"auto\": float32 (the learner ranks run on the CPU)" in run.notes
    run, written = launch("named", 1, "--set", 'model.dtype="float32"')
    assert written == "float32" and not any("model.dtype" in n for n in run.notes)
    for gpus, dtype in ((4, "bfloat16"), (0, "float32")):
        run, written = launch(f"ray{gpus}", gpus, "--ray", "127.0.0.1:1")
        assert written == "auto"  # not yet: Ray's GPUs are known once the cluster is reached
        settle_dtype_on_ray(run, gpus)
        assert run.cfg.model.dtype == dtype == load_config(os.path.join(run.path, "config.toml")).model.dtype
        assert run.notes[-1].startswith(f'model.dtype "auto": {dtype} (')
    run, _ = launch("ray-said", 4, "--ray", "a:1")
    settle_dtype_on_ray(run, 4)
    assert "GPUs on the Ray cluster, not seen from here: sm80+ assumed" in run.notes[-1]
    settle_dtype_on_ray(run, 0)  # resolved already: a later settle (a resume) keeps it
    assert run.cfg.model.dtype == "bfloat16"


def test_resume_of_a_finished_run_starts_nothing_and_says_how_to_continue(tmp_path, capsys):
    from common.checkpoint_dirs import DS_TAG, STATE_FILE

    run = str(tmp_path)
    (tmp_path / "config.toml").write_text(to_toml(load_config(None, ["run.steps=3"])))
    (tmp_path / "secret.key").write_bytes(b"k" * 32)
    write_cluster(run, ClusterInfo("r", "127.0.0.1:1", "127.0.0.1:2", generators=1, learners=1))
    step = tmp_path / "checkpoints" / "step_3"
    (step / DS_TAG).mkdir(parents=True)
    (step / STATE_FILE).write_text("{}")
    before = (tmp_path / "cluster.json").read_bytes()
    assert launcher.main(["--resume", run]) == 0
    out = capsys.readouterr().out
    assert "is complete: it trained 3 of 3 steps" in out and f"covrl resume {run} --steps N" in out
    assert (tmp_path / "cluster.json").read_bytes() == before and not (tmp_path / "logs").exists()
    assert not (tmp_path / "generators.json").exists()  # nothing rewritten, nothing started
    assert launcher.main(["--resume", run, "--print-config", "--steps", "5"]) == 0
    import tomllib

    assert tomllib.loads(capsys.readouterr().out)["run"]["steps"] == 5  # what --resume --steps 5 would run
    assert tomllib.loads((tmp_path / "config.toml").read_text())["run"]["steps"] == 3  # and the run is untouched


def test_a_failed_role_is_said_in_one_line_from_its_log(tmp_path):
    from launch.supervisor import log_cause

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "learner0.log").write_text(
        "[WARNING] Setting accelerator to CPU.\n[rank0]: Traceback (most recent call last):\n"
        "[rank0]:   File \"x.py\", line 1, in <module>\n[rank0]: OSError: no file named model.safetensors\n"
        "Exception ignored in: <function _after_fork at 0x7f>\n")
    assert log_cause(str(tmp_path), "learner0") == \
        f"OSError: no file named model.safetensors (full log: {logs / 'learner0.log'})"
    (logs / "gen0.log").write_text("2026 gen0 ERROR covrl.actor: hub refused us: protocol version 4 != 5\n"
                                   "2026 gen0 INFO covrl.actor: closing\n")
    assert log_cause(str(tmp_path), "gen0").startswith("2026 gen0 ERROR covrl.actor: hub refused us")
    assert log_cause(str(tmp_path), "gen1").startswith("its log ") and "is missing" in log_cause(str(tmp_path), "gen1")


def test_a_generator_the_hub_declared_lost_is_stopped_and_restarted(tmp_path, capsys):
    """The hub's verdicts (RUN_DIR/generators_lost.jsonl) are followed: the running process of that id is stopped if
    its pid matches, and its exit is a failure, restarted with the verdict as the reason. A verdict on a pid this
    launcher does not run, on a replaced incarnation, or from before the launcher started stops nothing."""
    import time

    from common.runfiles import LostGenerator, record_lost_generator

    run = str(tmp_path)
    write_generator_target(run, 2)
    record_lost_generator(run, LostGenerator(1, "old", 4242, "timeout", "from the run this one resumes", time.time()))
    sup, backend = _supervisor(run)
    assert sup.poll() is None and backend.started == ["learner0", "gen0", "gen1"]
    backend.pids = {"gen0": 100, "gen1": 4242}
    assert sup.poll() is None and backend.stopped == []  # the verdict before the start names a process long gone
    record_lost_generator(run, LostGenerator(0, "a", 999, "stuck", "a pid this launcher does not run", time.time()))
    record_lost_generator(run, LostGenerator(1, "b", 4242, "restarted", "a new incarnation said hello", time.time()))
    with open(tmp_path / "generators_lost.jsonl", "a") as f:
        f.write("not a verdict\n")
    record_lost_generator(run, LostGenerator(1, "c", 4242, "stuck", "its main loop has sent nothing for 9.0s",
                                             time.time()))
    assert sup.poll() is None and backend.stopped == [("gen1", 4242)]
    err = capsys.readouterr().err
    assert "gen1 (pid 4242) is being stopped: the hub declared it lost (stuck: its main loop" in err
    assert "not a verdict" in err  # a damaged line is said, not fatal
    backend.exits["gen1"] = -9
    assert sup.poll() is None and len(sup.gens[1].failures) == 1 and not sup.gens[1].running
    assert ("gen1 exited with code -9; restart in 2s (failure 1 of 3 allowed within 10m00s): the hub declared it lost "
            "(stuck") in capsys.readouterr().err


def test_a_generator_with_no_room_is_said_and_asked_for_again_and_dropped_when_scaled_away(tmp_path, capsys):
    """Ray gives up on a bundle after cluster.placement_timeout_s (NOT_PLACED): the supervisor says why and asks
    again, without spending a restart; a scale-down lets go of a generator still waiting for room (it never joined
    the hub, so nothing would drain it)."""
    run = str(tmp_path)
    write_generator_target(run, 2)
    sup, backend = _supervisor(run)
    backend.waiting_for_room = {"gen1"}
    assert sup.poll() is None and backend.started == ["learner0", "gen0", "gen1"]
    backend.exits["gen1"] = NOT_PLACED
    assert sup.poll() is None
    assert "gen1 could not be placed: no room; asking again" in capsys.readouterr().err
    assert sup.poll() is None and backend.started[-1] == "gen1" and sup.gens[1].failures == []
    write_generator_target(run, 1, reason="autoscale: the learner is the bottleneck")
    assert sup.poll() is None and backend.released == ["gen1"] and 1 not in sup.gens
    assert "scaling to 1 generator(s) (was 2): autoscale: the learner is the bottleneck" in capsys.readouterr().err


def _write_targets(run: str, n: int, go, out) -> None:
    go.wait(timeout=60)  # both writers at once
    out.put([write_generator_target(run, 2).revision for _ in range(n)])


def test_writers_of_the_generator_target_never_give_one_revision_twice(tmp_path):
    """covrl scale and the autoscale policy (learner rank 0) may write at once: under the lock each write gets its
    own revision, so no reader takes one change for another; and a write that expects a revision someone else moved
    past is not made."""
    import multiprocessing

    run = str(tmp_path)
    write_generator_target(run, 1)
    ctx = multiprocessing.get_context("spawn")
    out, go, n = ctx.Queue(), ctx.Barrier(2), 400
    procs = [ctx.Process(target=_write_targets, args=(run, n, go, out)) for _ in range(2)]
    for p in procs:
        p.start()
    revisions = out.get(timeout=60) + out.get(timeout=60)
    for p in procs:
        p.join(timeout=60)
    assert sorted(revisions) == list(range(1, 2 * n + 1)) and read_generator_target(run).revision == 2 * n
    assert write_generator_target(run, 3, expect=2 * n - 1) is None and read_generator_target(run).generators == 2
    assert write_generator_target(run, 3, expect=2 * n).revision == 2 * n + 1


def _fail(sup, backend, name, times):
    """`name` fails `times` times in a row, each restart started at once (its backoff skipped)."""
    for _ in range(times):
        backend.exits[name] = 1
        code = sup.poll()
        if code is not None:
            return code
        s = sup.gens[int(name[3:])]
        if not s.set_aside_until:
            s.next_start = 0.0
            assert sup.poll() is None and s.running
    return None


def test_a_generator_failing_past_its_limit_within_the_window_is_set_aside_and_the_run_goes_on(tmp_path, capsys):
    """cluster.generator_max_failures = 3: the 4th failure within the window sets the slot aside (said once,
    recorded in generators_lost.jsonl), the others keep serving; failures older than the window do not count; the
    slot is tried again after its backoff, and at once when the count is set again (covrl scale)."""
    from common.runfiles import LAUNCHER_FILE, LostGenerators

    run = str(tmp_path)
    write_generator_target(run, 2)
    follow = LostGenerators(run, LAUNCHER_FILE)
    sup, backend = _supervisor(run)
    assert [(v.gen_id, v.why) for v in follow.new()] == [(-1, "launch")]
    assert sup.poll() is None and backend.started == ["learner0", "gen0", "gen1"]
    sup.gens[1].failures = [-1e9, -1e9]  # two failures long ago, outside the 600 s window
    backend.pids = {"gen1": 4321}
    assert _fail(sup, backend, "gen1", 1) is None  # the hub is told at once which process exited (its pid)
    assert [(v.gen_id, v.why, v.pid, v.detail) for v in follow.new()] == [(1, "exited", 4321, "exited with code 1")]
    backend.pids = {}
    sup.gens[1].failures = [-1e9, -1e9]
    assert _fail(sup, backend, "gen1", 3) is None and not sup.gens[1].set_aside_until
    assert "restart in 8s (failure 3 of 3 allowed within 10m00s)" in capsys.readouterr().err
    assert _fail(sup, backend, "gen1", 1) is None, "one generator's failures must not stop the run"
    s = sup.gens[1]
    assert s.set_aside_until > 0 and not s.running and s.set_aside == 1
    err = capsys.readouterr().err
    assert err.count("gen1 set aside: failed 4 times within 10m00s (cluster.generator_max_failures=3)") == 1
    assert "the run goes on with 1 generator(s), and tries its slot again in 10m00s" in err
    lines = follow.new()
    assert [(v.gen_id, v.why) for v in lines] == [(1, "set_aside")]
    assert sup.poll() is None and backend.started.count("gen1") == 5  # not started again before its backoff
    s.set_aside_until = s.next_start = 1.0  # its backoff has passed
    assert sup.poll() is None and s.running and s.set_aside_until == 0.0
    assert "gen1: trying its slot again (set aside 1 time(s))" in capsys.readouterr().err
    assert [(v.gen_id, v.why) for v in follow.new()] == [(1, "retried")]
    assert _fail(sup, backend, "gen1", 4) is None and s.set_aside == 2
    assert "tries its slot again in 20m00s" in capsys.readouterr().err  # the backoff doubles
    write_generator_target(run, 2, reason="covrl scale")  # the count set again: the slot is tried at once
    assert sup.poll() is None and s.running and backend.started.count("gen1") == 10


def test_a_run_whose_every_generator_is_set_aside_stops_with_the_learners_checkpointing_first(tmp_path, capsys):
    run = str(tmp_path)
    write_generator_target(run, 2)
    sup, backend = _supervisor(run)
    assert sup.poll() is None
    assert _fail(sup, backend, "gen0", 4) is None and sup.drain == ""
    assert _fail(sup, backend, "gen1", 4) == 1
    assert sup.drain == "no generator can serve: all 2 set aside after failing"
    assert "gen1 set aside: failed 4 times" in capsys.readouterr().err


def test_the_supervisor_ends_a_complete_run_whose_last_rank_hangs_on_its_way_out(tmp_path, capsys):
    from launch import supervisor as sv
    from launch.roles import RoleSpec, generator_spec

    run = str(tmp_path)
    write_generator_target(run, 1)
    backend = Backend()
    learners = [RoleSpec("learner0", "learner", [], {}), RoleSpec("learner1", "learner", [], {})]
    sup = sv.Supervisor(backend, learners, lambda i, n: generator_spec(run, i), run, Config(), quiet=True)
    assert sup.poll() is None
    backend.exits["learner0"] = 0
    assert sup.poll() is None and sup.done_at is not None
    sup.done_at -= sv.GRACE_S + 1  # learner1 still runs GRACE_S later
    assert sup.poll() == 0
    assert "learner1 did not exit within 10s after learner0 finished the run; stopping it" in capsys.readouterr().err
