"""Benchmark: the hub under load for a minute (tests/helpers/hub_load.py's run and checks, as
tests/integration/test_hub_load.py runs them, 60 s instead of make test's 10 s). Its report is docs/reliability.md's
figure for 32 generators against one hub."""

from __future__ import annotations

from tests.bench.common import record
from tests.helpers.hub_load import run_load


def test_thirty_two_generators_for_a_minute(tiny_model_dir, tmp_path):
    record("hub_load", run_load(tiny_model_dir, tmp_path, 60.0))
