"""Pinned files (common/pinned.py) on a throwaway git repository, with real git: a file pinned and committed away
comes back from history byte for byte, a second restore touches nothing, a blob the clone lacks and a checkout
without .git fail in one line naming the fix, a file with other bytes is refused and left alone unless forced, and
the command's exit statuses (0 right, 1 missing or refused, 2 bad input)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from common import pinned
from tests.helpers.paths import REPO

DATA = os.urandom(1) + bytes(range(256)) * 300  # 76,801 bytes, one random byte so no other test's blob matches
REBUILD = "covrl warmstart --task toy"


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def cli(capsys, repo, *args) -> tuple[int, str, str]:
    """`python -m common.pinned --repo REPO ARGS` in this process (a subprocess each costs ~0.2 s): status, out, err."""
    try:
        code = pinned.main(["--repo", str(repo), *args])
    except SystemExit as e:  # argparse refusing the arguments
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def plain_git(monkeypatch, tmp_path):
    """git without the user's or the system's configuration (no signing, no hooks path, a known identity)."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for key in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(key, raising=False)
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "t")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "t@example.com")


@pytest.fixture
def repo(tmp_path):
    """A repository whose first commit tracks assets/toy/model.bin and whose second pins it: the tip no longer
    tracks the file, which stays on disk, git-ignored."""
    root = tmp_path / "repo"
    (root / "assets" / "toy").mkdir(parents=True)
    (root / "assets" / "toy" / "model.bin").write_bytes(DATA)
    (root / "README").write_text("toy\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "track the model")
    lines = pinned.pin(root, [str(root / "assets" / "toy" / "model.bin")], REBUILD)
    assert "left the index" in lines[0]
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "pin the model")
    return root


def test_pin_records_the_committed_blob_and_moves_the_file_out_of_the_tree(repo):
    entry = pinned.load(repo)["assets/toy/model.bin"]
    assert entry == pinned.Entry(blob=git(repo, "rev-parse", "HEAD~1:assets/toy/model.bin"),
                                 sha256=hashlib.sha256(DATA).hexdigest(), bytes=len(DATA), rebuild=REBUILD)
    assert git(repo, "ls-files").split() == [".gitignore", "README", "assets/pinned.json"]
    assert git(repo, "status", "--porcelain") == ""  # on disk, ignored
    assert (repo / ".gitignore").read_text() == f"{pinned.IGNORE_HEADER}\n/assets/toy/model.bin\n"
    assert json.loads((repo / pinned.MANIFEST).read_text())["_about"] == pinned.ABOUT


def test_restore_after_deletion_gives_the_same_bytes_and_a_second_restore_touches_nothing(repo):
    path = repo / "assets" / "toy" / "model.bin"
    path.unlink()
    assert pinned.check(repo) == {"assets/toy/model.bin": "missing"}
    lines = pinned.restore(repo)
    assert path.read_bytes() == DATA and lines[0].startswith("pinned: restored assets/toy/model.bin from blob")
    assert sorted(os.listdir(path.parent)) == ["model.bin"]  # no temp file left beside it
    before = path.stat()
    assert pinned.restore(repo) == [f"pinned: 1 file(s) present with their pinned sha256 ({pinned.MANIFEST})"]
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_blob_missing_from_history_fails_in_one_line_naming_both_ways_out(repo, tmp_path):
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow))
    assert not (shallow / "assets" / "toy" / "model.bin").exists()  # the tip does not carry it
    with pytest.raises(pinned.PinError) as got:
        pinned.restore(shallow)
    text = str(got.value)
    assert "\n" not in text and "not in this clone's history" in text
    assert "git fetch --unshallow" in text and REBUILD in text
    git(shallow, "fetch", "-q", "--unshallow")
    pinned.restore(shallow)
    assert (shallow / "assets" / "toy" / "model.bin").read_bytes() == DATA


def test_a_copy_without_git_says_so_and_names_the_rebuild(repo, tmp_path):
    copy = tmp_path / "copy"
    (copy / "assets").mkdir(parents=True)
    (copy / pinned.MANIFEST).write_bytes((repo / pinned.MANIFEST).read_bytes())
    with pytest.raises(pinned.PinError, match=rf"is not a git checkout, .*rebuild it with `{REBUILD}`"):
        pinned.restore(copy)


def test_a_file_with_other_bytes_is_refused_and_left_alone_unless_forced(repo):
    path = repo / "assets" / "toy" / "model.bin"
    mine = b"rebuilt by hand" * 100
    path.write_bytes(mine)
    assert pinned.check(repo) == {"assets/toy/model.bin": "differs"}
    with pytest.raises(pinned.PinError, match=r"assets/toy/model.bin: present with bytes other .* restore --force"):
        pinned.restore(repo)
    assert path.read_bytes() == mine
    pinned.restore(repo, force=True)
    assert path.read_bytes() == DATA


def test_the_command_exit_statuses(repo, capsys):
    path = repo / "assets" / "toy" / "model.bin"
    assert cli(capsys, repo, "check")[0] == 0
    path.unlink()
    assert cli(capsys, repo, "check")[:2] == (1, "missing  assets/toy/model.bin\n")
    assert cli(capsys, repo, "restore")[0] == 0 and cli(capsys, repo, "check")[0] == 0
    path.write_bytes(b"other")
    code, _, err = cli(capsys, repo, "restore")
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "--force" in err
    assert cli(capsys, repo, "check")[0] == 1 and cli(capsys, repo, "restore", "--force")[0] == 0
    (repo / "notes.txt").write_text("untracked\n")
    code, _, err = cli(capsys, repo, "pin", str(repo / "notes.txt"), "--rebuild", "x")
    assert code == 2 and "notes.txt is not tracked by git" in err
    assert cli(capsys, repo, "pin", str(path), "--rebuild", "x")[0] == 2  # pinned already
    assert cli(capsys, repo, "pin", str(repo / "README"))[0] == 2  # no --rebuild
    assert cli(capsys, repo, "pin", "/etc/hostname", "--rebuild", "x")[0] == 2  # outside the repository
    (repo / pinned.MANIFEST).write_text("[]")
    assert cli(capsys, repo, "check")[0] == 2
    (repo / pinned.MANIFEST).write_text(json.dumps({"files": {"../x": {"blob": "0", "sha256": "0", "bytes": 0,
                                                                       "rebuild": "x"}}}))
    code, _, err = cli(capsys, repo, "restore")
    assert code == 2 and "outside the repository" in err


def test_it_runs_as_a_module_with_the_standard_library_only(repo):
    (repo / "assets" / "toy" / "model.bin").unlink()
    code = "import runpy, sys; sys.argv[0] = 'pinned'; runpy.run_module('common.pinned', run_name='__main__')"
    done = subprocess.run([sys.executable, "-S", "-c", code, "--repo", str(repo), "check"], cwd=REPO,
                          capture_output=True, text=True)  # -S: no site-packages
    assert done.returncode == 1 and done.stdout == "missing  assets/toy/model.bin\n", done.stderr


def test_pin_refuses_a_file_that_differs_from_its_commit(repo):
    (repo / "README").write_text("edited, not committed\n")
    with pytest.raises(pinned.BadInput, match=r"README on disk differs from its blob at HEAD"):
        pinned.pin(repo, [str(repo / "README")], REBUILD)
    assert "README" in git(repo, "ls-files").split() and "README" not in pinned.load(repo)


def test_a_new_version_is_pinned_again_once_committed(repo):
    path = repo / "assets" / "toy" / "model.bin"
    path.write_bytes(b"version 2")
    git(repo, "add", "-f", "assets/toy/model.bin")
    git(repo, "commit", "-q", "-m", "model v2")
    pinned.pin(repo, [str(path)], REBUILD)
    assert pinned.load(repo)["assets/toy/model.bin"].sha256 == hashlib.sha256(b"version 2").hexdigest()
    assert (repo / ".gitignore").read_text().count("/assets/toy/model.bin") == 1
    path.unlink()
    pinned.restore(repo)
    assert path.read_bytes() == b"version 2"


def test_a_model_folder_missing_its_pinned_weights_says_how_to_get_them(repo):
    """The error a run gives for a model folder without weights (common/data.py) names the restore when the weights
    are pinned, and adds nothing for a folder with nothing pinned in it."""
    hint = pinned.missing_hint(str(repo / "assets" / "toy"), repo)
    assert "assets/toy/model.bin is pinned" in hint and "python -m common.pinned restore" in hint and REBUILD in hint
    assert pinned.missing_hint(str(repo / "elsewhere"), repo) == ""
    assert pinned.missing_hint(str(repo / "assets" / "toy"), repo / "no-such-repo") == ""
