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
