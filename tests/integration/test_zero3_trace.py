"""ZeRO-3 prefetching: under ZeRO-3, DeepSpeed prefetches parameters only once its fetch trace is complete, and it
completes the trace in the pre-forward hook of the root module. The trainer calls the root module
(`learner.logprobs.install_token_forward`); calling `model.model` and `model.lm_head` one by one, as it once did,
leaves the trace invalid forever (correct, but every parameter fetched on demand)."""

import json
import os
import subprocess
import sys

import pytest

from common.transport import free_port
from tests.helpers.paths import BASE_MODEL, REPO

pytestmark = pytest.mark.slow


def test_zero3_fetch_trace_completes_so_parameters_are_prefetched():
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-m", "tests.integration.zero3_trace", BASE_MODEL],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Every micro-batch forward starts at the root: the first records the trace, the second completes it.
    assert result["complete"][-1], result
