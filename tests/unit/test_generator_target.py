"""RUN_DIR/generators.json, the run's generator target: its revisions, and a damaged file. covrl-scale replaces a
damaged file, the launcher's supervisor keeps the generators it has meanwhile, and --resume names the fix."""

import json

import pytest

from common.cluster import ClusterInfo, read_generator_target, write_cluster, write_generator_target
from common.config import Config, ConfigError, to_toml
from launch import cluster as launcher
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
    with pytest.raises(ValueError, match=r"generators.json is not a generator target .*covrl-scale .* --gens N"):
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
        started.append(i)
        return i

    sup = launcher.Supervisor(None, [], make_generator, run, Config(), quiet=True)
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
        launcher.prepare_resume(launcher.parse_args(["--resume", run]))
