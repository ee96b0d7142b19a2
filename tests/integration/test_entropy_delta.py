"""actor/entropy_delta measured on a subsample (`learner.entropy_delta_stride`): the logged entropy after the
update, and its change, are those of exactly the picked micro-batches, paired token for token; stride 1 is the
whole batch. One real DeepSpeed train step per case, in a child process (it owns torch.distributed)."""

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stride", [1, 3])
def test_entropy_delta_is_measured_on_the_picked_micro_batches(stride):
    p = subprocess.run([sys.executable, "-m", "tests.integration.entropy_delta_check", str(stride)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    n = got["micro_batches"]
    assert n >= 4, f"only {n} micro-batches: the check needs several to pick from"
    assert got["picked"] == list(range(0, n, stride))  # one rank: every micro-batch holds samples
    if stride == 1:
        assert got["tokens_picked"] == got["tokens_all"]
    else:
        assert 0 < got["tokens_picked"] < got["tokens_all"]
    assert got["by_hand"]["delta"] != 0.0  # the step moved the policy: this compares something
    for key in ("after", "delta"):
        assert got["logged"][key] == pytest.approx(got["by_hand"][key], rel=1e-5, abs=1e-7), key
