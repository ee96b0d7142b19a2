"""The hub under load: 32 fake fast generators against one hub, with a trainer thread that takes every batch as
soon as it is ready: 10 s here (make test), 60 s for the figures of docs/reliability.md (make bench:
tests/bench/test_bench_hub_load.py, the same function, tests/helpers/hub_load.py's run_load). Checks: no group lost (every group a generator sent is trained, waiting, or
rejected with a counted reason), staleness never above the bound, the ledger at 0, memory growth bounded.
Reports request-to-work latency percentiles and throughput (printed; figures in docs/reliability.md)."""

from __future__ import annotations

import pytest

from tests.helpers.hub_load import run_load

pytestmark = pytest.mark.slow


def test_thirty_two_generators_for_ten_seconds(tiny_model_dir, tmp_path):
    run_load(tiny_model_dir, tmp_path, 10.0)
