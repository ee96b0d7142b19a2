"""The `covrl` command: sub-commands for everything in launch/, each with its own complete help."""

from __future__ import annotations

import pytest

from launch.covrl import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, about) in COMMANDS.items():
        assert f"  {name}" in out and about in out


@pytest.mark.parametrize("name, flag", [("run", "--gens"), ("resume", "--steps"), ("scale", "--gens"),
                                        ("study", "--methods"), ("fit-law", "--on"), ("plots", "--key"),
                                        ("prepare-data", "--prompt-key"), ("warmstart", "--out")])
def test_each_command_has_its_own_complete_help(name, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and flag in capsys.readouterr().out


def test_resume_forwards_to_the_launcher_and_unknown_commands_are_refused(tmp_path, capsys):
    assert main(["resume", str(tmp_path)]) == 2  # not a run: the launcher's own one-line refusal
    assert "not a covrl run directory" in capsys.readouterr().err
    assert main(["trian"]) == 2 and "unknown command 'trian'" in capsys.readouterr().err


def test_resume_takes_the_launchers_own_resume_flags(monkeypatch):
    from launch import cluster

    got = []
    monkeypatch.setattr(cluster, "start", lambda args: got.append(args) or 0)  # the launcher's arguments, not a run
    assert main(["resume", "R", "--steps", "200", "--gens", "3", "--tp", "2", "--gpus", "4", "--ray", "10.0.0.1:6379",
                 "--ray-learner-resources", '{"t": 1}', "--progress-every", "30", "--quiet"]) == 0
    expected = cluster.parse_args(["--resume", "R", "--ray", "10.0.0.1:6379", "--steps", "200", "--gens", "3",
                                   "--gpus", "4", "--tp", "2", "--ray-learner-resources", '{"t": 1}',
                                   "--progress-every", "30", "--quiet"])
    assert vars(got[-1]) == vars(expected)  # what `covrl run --resume` would parse, every other flag at its default
    main(["resume", "--ray", "--", "R"])  # --ray without an address: a local Ray instance
    assert vars(got[-1]) == vars(cluster.parse_args(["--resume", "R", "--ray"]))
    resume_flags = {a.dest for a in cluster.resume_options()._actions}
    assert {"steps", "gens", "gpus", "tp", "ray", "tensorboard", "quiet", "print_config"} <= resume_flags
    assert not {"config", "set", "run_dir", "learners"} & resume_flags  # a resume keeps the run's own
