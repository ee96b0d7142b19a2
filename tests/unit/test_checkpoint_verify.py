"""Checkpoint manifests, verification, the resume's choice and `covrl verify`, on checkpoint directories laid out as
learner/checkpoint.py lays them out (no training: tests/integration/test_resume.py damages real ones)."""

from __future__ import annotations

import json
import os

import pytest

from common.checkpoint_dirs import (DAMAGED, GOOD, MANIFEST, UNVERIFIED, CheckpointError, choose, complete_checkpoints,
                                    owner, set_aside, set_aside_dirs, step_name, verify, write_manifest,
                                    write_rank_part)
from launch import cluster, verify as verify_cmd

SHARD = "deepspeed/mp_rank_00_model_states.pt"
OPTIM_1 = "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def checkpoint(run, step: int, manifest: bool = True, world: int = 2) -> str:
    """A checkpoint of `world` learner ranks, written in the order save_checkpoint writes it: the files, each
    rank's part of the manifest, the manifest by rank 0, the rename."""
    tmp = run / "checkpoints" / f"step_{step}.tmp"
    files = {SHARD: 4000, "model.safetensors": 3000, "config.json": 50, "covrl_state.json": 20, "hub.msgpack": 10}
    for r in range(world):
        files[f"deepspeed/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = 2000 + r
        files[f"rng/rank_{r}.pt"] = 100
    for rel, size in files.items():
        os.makedirs(os.path.dirname(tmp / rel), exist_ok=True)
        (tmp / rel).write_bytes(bytes((step * 7 + i) % 251 for i in range(size)))
    if manifest:
        for r in range(1, world):
            write_rank_part(str(tmp), r, world)
        write_manifest(str(tmp), world)
    final = run / "checkpoints" / f"step_{step}"
    os.replace(tmp, final)
    return str(final)


def test_every_file_is_in_the_manifest_and_each_rank_checksums_its_own(tmp_path):
    assert [owner(OPTIM_1), owner("rng/rank_3.pt"), owner(SHARD), owner("deepspeed/bf16_zero_pp_rank_2_x.pt")] == [1, 3, 0, 2]
    path = checkpoint(tmp_path, 2)
    tmp = tmp_path / "t"
    for rel in (OPTIM_1, SHARD, "deepspeed/zero_pp_rank_2_mp_rank_00_optim_states.pt", "model.safetensors"):
        os.makedirs(os.path.dirname(tmp / rel), exist_ok=True)
        (tmp / rel).write_bytes(b"abc")
    write_rank_part(str(tmp), 1, 3)  # a middle rank: its own files only
    assert json.load(open(tmp / "manifest.rank_1.json")) == {OPTIM_1: {"bytes": 3, "crc32": "352441c2"}}  # CRC-32("abc")
    write_rank_part(str(tmp), 2, 3)  # the last rank: its own and rank 0's engine state, not the export rank 0 writes
    assert sorted(json.load(open(tmp / "manifest.rank_2.json"))) == [SHARD, "deepspeed/zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    with open(tmp / "manifest.rank_1.json", "w") as f:  # rank 0 merges the parts; it does not read those files again
        json.dump({OPTIM_1: {"bytes": 3, "crc32": "0000abcd"}}, f)
    assert write_manifest(str(tmp), 3)["files"][OPTIM_1]["crc32"] == "0000abcd"
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    assert manifest["learners"] == 2 and len(manifest["files"]) == 9 and "manifest.rank_1.json" not in manifest["files"]
    assert not [n for n in os.listdir(path) if n.startswith("manifest.rank_")], "the parts were not merged away"
    check = verify(path)
    assert (check.state, check.files, check.step, check.problems) == (GOOD, 9, 2, [])


@pytest.mark.parametrize("damage, problem, fast_sees_it", [
    (lambda p: os.truncate(os.path.join(p, SHARD), 1000), f"{SHARD} is 1,000 bytes, expected 4,000", True),
    (lambda p: os.remove(os.path.join(p, OPTIM_1)), f"{OPTIM_1} is missing", True),
    (lambda p: flip(os.path.join(p, "model.safetensors"), 1234), "model.safetensors has CRC-32 ", False),
    (lambda p: open(os.path.join(p, MANIFEST), "w").write('{"files": {'), "manifest.json cannot be read", True),
])
def test_damage_is_named_file_by_file(tmp_path, damage, problem, fast_sees_it):
    path = checkpoint(tmp_path, 4)
    damage(path)
    check = verify(path)
    assert check.state == DAMAGED and check.problems[0].startswith(problem), check.problems
    assert (verify(path, checksums=False).state == DAMAGED) == fast_sees_it  # sizes alone miss a flipped byte


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_checkpoint_without_a_manifest_is_unverified_not_damaged(tmp_path):
    path = checkpoint(tmp_path, 2, manifest=False)
    assert verify(path).state == UNVERIFIED
    assert choose(str(tmp_path)).path == path


@pytest.mark.parametrize("manifest", [True, False])
def test_a_step_directory_that_lost_its_state_file_is_damaged_not_ignored(tmp_path, manifest):
    """Renamed into place only once complete, so a step_N without covrl_state.json was damaged since: reported,
    passed over, set aside like any other, not silently skipped (a resume would then miss why)."""
    checkpoint(tmp_path, 2)
    os.remove(os.path.join(checkpoint(tmp_path, 4, manifest=manifest), "covrl_state.json"))
    choice = choose(str(tmp_path))
    assert choice.step == 2 and [(c.step, c.problems) for c in choice.skipped] == [(4, ["covrl_state.json is missing"])]


def test_choose_takes_the_newest_that_verifies_and_names_what_it_passed_over(tmp_path):
    assert choose(str(tmp_path)) is None  # no checkpoint: a resume starts from step 0
    for s in (2, 4, 6):
        checkpoint(tmp_path, s)
    os.truncate(tmp_path / "checkpoints" / "step_6" / SHARD, 1000)
    flip(str(tmp_path / "checkpoints" / "step_4" / OPTIM_1), 7)
    choice = choose(str(tmp_path))
    assert choice.step == 2 and [c.step for c in choice.skipped] == [6, 4]
    assert choose(str(tmp_path), checksums=False).step == 4  # sizes only: the flipped byte goes unseen
    assert choose(str(tmp_path), from_step=2).step == 2
    with pytest.raises(CheckpointError, match=r"--from step_4: it is damaged: .*CRC-32.*--from step_2"):
        choose(str(tmp_path), from_step=4)
    with pytest.raises(CheckpointError, match=r"has no step_5 \(it has: step_2, step_4, step_6; one a resume set aside"):
        choose(str(tmp_path), from_step=5)
    flip(str(tmp_path / "checkpoints" / "step_2" / "rng" / "rank_0.pt"), 0)
    with pytest.raises(CheckpointError, match=r"no checkpoint verifies \(step_6: deepspeed/mp_rank_00_model_states.pt "
                                              r"is 1,000 bytes, expected 4,000; step_4: .*; step_2: .*\); restore"):
        choose(str(tmp_path))


def test_set_aside_keeps_the_directory_under_a_name_no_resume_takes(tmp_path):
    first = checkpoint(tmp_path, 4)
    assert set_aside(first, "damaged").endswith("step_4.damaged")
    second = checkpoint(tmp_path, 4)
    assert set_aside(second, "damaged").endswith("step_4.damaged.2")
    checkpoint(tmp_path, 2)
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [2]
    assert [os.path.basename(p) for p in set_aside_dirs(str(tmp_path))] == ["step_4.damaged", "step_4.damaged.2"]
    assert [step_name("step_4"), step_name("4")] == [4, 4]
    with pytest.raises(CheckpointError, match="name a checkpoint as step_N"):
        step_name("latest")


def test_verify_command_lists_every_state(tmp_path, capsys):
    run = tmp_path / "run"
    for s in (2, 4, 6):
        checkpoint(run, s)
    os.remove(run / "checkpoints" / "step_4" / MANIFEST)  # as a checkpoint from before manifests
    os.truncate(run / "checkpoints" / "step_6" / "model.safetensors", 10)
    os.makedirs(run / "checkpoints" / "step_8.tmp")
    set_aside(checkpoint(run, 5), "superseded")
    assert verify_cmd.main([str(run)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["step_2", "good:", "9", "files,", "11.3", "kB,", "sizes", "and", "checksums", "match"]
    assert "step_4" in out[2] and "unverified: no manifest.json" in out[2]
    assert "step_6" in out[3] and "damaged: model.safetensors is 10 bytes, expected 3,000" in out[3]
    assert "step_8.tmp" in out[4] and "incomplete" in out[4]
    assert "step_5.superseded" in out[5] and "set aside by a resume: good" in out[5]
    assert out[6] == "the checkpoint a resume takes: step_4, passing over step_6 (it sets them aside, renamed step_N.damaged)"
    assert verify_cmd.main([str(run / "checkpoints" / "step_2"), "--fast"]) == 0
    assert "good: 9 files, 11.3 kB, sizes match (checksums not read: --fast)" in capsys.readouterr().out
    assert verify_cmd.main([str(run / "checkpoints" / "step_8.tmp")]) == 1
    assert "incomplete: a checkpoint write that never finished" in capsys.readouterr().out
    assert verify_cmd.main([str(tmp_path)]) == 2
    assert "neither a run directory with checkpoints/ nor a checkpoint directory" in capsys.readouterr().err


@pytest.fixture
def old_run(tmp_path):
    run = tmp_path / "run"
    cluster.prepare(cluster.parse_args(["--run-dir", str(run), "--learners", "2", "--gens", "1", "--steps", "8"]))
    return run


def test_resume_sets_aside_what_it_passes_over_and_says_why(old_run):
    for s in (2, 4, 6):
        checkpoint(old_run, s)
    os.truncate(old_run / "checkpoints" / "step_6" / SHARD, 1000)
    run = cluster.prepare(cluster.parse_args(["--resume", str(old_run), "--from", "step_2"]))
    assert run.resumed.step == 2 and [s for s, _ in complete_checkpoints(str(old_run))] == [2]
    assert run.notes[:3] == [
        "step_4 is newer than --from step_2: set aside as checkpoints/step_4.superseded",
        f"step_6 is damaged ({SHARD} is 1,000 bytes, expected 4,000): set aside as checkpoints/step_6.damaged",
        run.notes[2]]
    assert run.notes[2].startswith("resuming from step_2 (verified: 9 files, 0.0 MB checksummed in ")


@pytest.mark.parametrize("argv, message", [
    (["--from", "step_3"], "--from step_3: "),
    (["--from", "three"], "name a checkpoint as step_N"),
])
def test_resume_refuses_a_checkpoint_it_cannot_take_before_anything_starts(old_run, capsys, argv, message):
    checkpoint(old_run, 2)
    before = sorted(os.listdir(old_run))
    assert cluster.main(["--resume", str(old_run), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(old_run)) == before


def test_resume_with_no_good_checkpoint_stops_in_one_line(old_run, capsys):
    checkpoint(old_run, 2)
    os.remove(old_run / "checkpoints" / "step_2" / "rng" / "rank_1.pt")
    assert cluster.main(["--resume", str(old_run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoint verifies (step_2: rng/rank_1.pt is missing)" in err
    assert f"covrl verify {old_run}" in err
    assert (old_run / "checkpoints" / "step_2").is_dir()  # never deleted, never set aside


def test_from_needs_resume(tmp_path, capsys):
    assert cluster.main(["--run-dir", str(tmp_path / "r"), "--from", "step_2"]) == 2
    assert "--from step_2 picks the checkpoint a resume starts from: use it with --resume" in capsys.readouterr().err


def test_the_summary_counts_this_launchs_steps_and_offers_only_a_resume_that_can_work(old_run):
    """A resume from step_4 whose learners failed before training: rows 5-6 of the launch before it are still in
    metrics.jsonl (the learner purges them only once it has loaded the checkpoint) and progress.json is gone."""
    from common.config import load_config
    from launch.summary import summary

    cfg = load_config(str(old_run / "config.toml"))
    with open(old_run / "metrics.jsonl", "w") as f:
        for s in range(1, 7):
            f.write(json.dumps({"step": s, "critic/score/mean": s / 10, "actor/entropy": 1.0}) + "\n")
    checkpoint(old_run, 2)
    checkpoint(old_run, 4)
    failed = summary(str(old_run), cfg, 9.0, "", start=4).splitlines()  # e.g. a port taken: resuming can work
    assert failed[0] == f"covrl: no step trained in this launch (9s); the run is at step 4 of 8 -> {old_run}"
    assert "last quarter 0.400" in failed[1], "rows past the checkpoint, of the launch before, were counted"
    assert failed[-1] == f"  checkpoint: {old_run}/checkpoints/step_4 (continue with covrl resume {old_run})"
    # A learner could not load step_4 (learner/checkpoint.py leaves the file): the same resume fails the same way.
    (old_run / "load_failed.json").write_text('{"checkpoint": "step_4", "rank": 1, "error": "EOFError"}')
    failed = summary(str(old_run), cfg, 9.0, "", start=4).splitlines()
    assert "continue with" not in failed[-1] and "could not load it: resuming from it fails the same way" in failed[-1]
    assert failed[-1].endswith(f"an earlier one: covrl resume {old_run} --from step_2")
    os.remove(old_run / "load_failed.json")
    (old_run / "progress.json").write_text('{"step": 6}')  # this launch trained steps 5 and 6, then a generator failed
    trained = summary(str(old_run), cfg, 9.0, " --ray", start=4).splitlines()
    assert trained[0].startswith("covrl: 2 steps in this launch (steps 5-6) in 9s; the run is at step 6 of 8")
    assert trained[-1] == f"  checkpoint: {old_run}/checkpoints/step_4 (continue with covrl resume {old_run} --ray)"
    os.truncate(old_run / "checkpoints" / "step_4" / SHARD, 10)
    assert summary(str(old_run), cfg, 9.0, "", start=4).splitlines()[-1] == (
        f"  checkpoint: {old_run}/checkpoints/step_2 (newer, damaged: step_4) (continue with covrl resume {old_run})")
    os.truncate(old_run / "checkpoints" / "step_2" / SHARD, 10)
    assert "none verifies, so a resume cannot start" in summary(str(old_run), cfg, 9.0, start=4)


def test_a_resume_clears_the_last_launchs_load_failure(old_run):
    checkpoint(old_run, 2)
    (old_run / "load_failed.json").write_text('{"checkpoint": "step_2"}')
    cluster.prepare(cluster.parse_args(["--resume", str(old_run)]))
    assert not (old_run / "load_failed.json").exists()


def test_a_load_failure_is_recorded_whole_and_the_next_from_sets_that_checkpoint_aside_as_damaged(old_run, capsys):
    from learner.checkpoint import restoring

    checkpoint(old_run, 2)
    path = checkpoint(old_run, 4, manifest=False)  # an old checkpoint: nothing to verify it against
    with pytest.raises(RuntimeError, match=r"^step_4 could not be loaded by learner rank 1: it is unverified: .* "
                                           r"--from step_2 \(EOFError: cut short\)$"):
        with restoring(path, rank=1):  # as around the engine's load, and rank 0's hub and PAR restore
            raise EOFError("cut short")
    assert json.load(open(old_run / "load_failed.json")) == {"checkpoint": "step_4", "rank": 1,
                                                             "error": "EOFError: cut short"}
    assert not [n for n in os.listdir(old_run) if n.startswith("load_failed.json.")], "a rank's own file was left"
    run = cluster.prepare(cluster.parse_args(["--resume", str(old_run), "--from", "step_2"]))
    assert run.notes[0] == ("step_4 is damaged (a learner could not load it: EOFError: cut short): set aside as "
                            "checkpoints/step_4.damaged")
    assert not (old_run / "load_failed.json").exists()


def test_a_torn_load_failure_still_withholds_the_resume_and_from_names_a_usable_checkpoint(old_run):
    from common.checkpoint_dirs import earlier_usable, read_load_failure
    from common.config import load_config
    from launch.summary import summary

    for s in (2, 4, 6):
        checkpoint(old_run, s)
    os.truncate(old_run / "checkpoints" / "step_4" / SHARD, 10)
    assert earlier_usable(str(old_run), 6) == 2  # step_4 is damaged: --from must not name it
    (old_run / "load_failed.json").write_text('{"checkpoint": "step_6", "rank"')
    assert read_load_failure(str(old_run))["checkpoint"] == "?"
    line = summary(str(old_run), load_config(str(old_run / "config.toml")), 1.0, start=6).splitlines()[-1]
    assert "continue with" not in line and line.endswith(f"covrl resume {old_run} --from step_2"), line


def test_verify_names_what_a_lone_checkpoint_directory_lost(tmp_path, capsys):
    path = checkpoint(tmp_path, 2, manifest=False)
    os.remove(os.path.join(path, "covrl_state.json"))
    assert verify_cmd.main([path]) == 1
    assert "damaged: covrl_state.json is missing" in capsys.readouterr().out
