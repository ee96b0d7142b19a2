"""Bad configuration and environment: each is a one-line error with the fix, before anything starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow


def _launch(run_dir, *args):
    return subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("case", ["unwritable run dir", "missing model dir", "port in use", "too many learners"])
def test_refused_before_anything_starts(tmp_path, busy_port, case):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir, args, needle = {
        "unwritable run dir": (blocker / "run", [], "is not writable"),
        "missing model dir": (tmp_path / "r", ["--set", f"model.path={tmp_path / 'no-model'}"], "no-model' is not a directory"),
        "port in use": (tmp_path / "r", ["--set", f"transport.hub_port={busy_port}"], f"hub_port {busy_port}"),
        "too many learners": (tmp_path / "r", ["--learners", "40", "--set", "rollout.groups_per_step=4",
                                              "--set", "rollout.group_size=8"], "use at most 32 learner ranks"),
    }[case]
    p = _launch(run_dir, *args)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], p.stderr
    assert not (tmp_path / "r").exists()  # refused before the run directory was made, so nothing started
