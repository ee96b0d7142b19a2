"""Elastic generators: `covrl scale RUN_DIR --gens N` while a run trains, on this machine (no Ray).

One run goes 1 -> 3 -> 1 generators. Every version published while a generator was connected reaches it with the
learner's checksum; the two drained ones leave through the hub (exit EXIT_DRAINED, not killed); no prompt is lost
or trained twice, and no trained token is older than the staleness bound.
"""

from __future__ import annotations

import os

import pytest

from common.metrics import read_metrics
from launch import scale
from tests.helpers.run_records import check_weights_followed, weight_log
from tests.helpers.runs import SMALL, start, wait_for_steps

pytestmark = pytest.mark.slow


def finish(p, timeout_s: float = 420) -> str:
    try:
        out, err = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, f"launcher exited {p.returncode}\n{out}\n{err}"
    return err


@pytest.mark.long  # make bench, for time: test_autoscale.py's 1 -> 2 -> 4 -> 2 -> 1 run makes the same checks
def test_generators_scale_one_three_one_during_a_run(tmp_path):
    run = tmp_path / "scale"
    steps, k = 30, 1
    p = start(run, "--gens", "1", "--learners", "1", "--steps", str(steps), *SMALL,
              "--set", f"rollout.max_staleness_steps={k}")
    try:
        wait_for_steps(run, 3)
        assert scale.main([str(run), "--gens", "3", "--wait", "180"]) == 0
        up = len(read_metrics(str(run)))
        wait_for_steps(run, up + 2)
        assert scale.main([str(run), "--gens", "1", "--wait", "180"]) == 0
        down = len(read_metrics(str(run)))
        assert down < steps, "the run ended before the scale-down was seen: make it longer"
    except BaseException:
        p.kill()
        raise
    err = finish(p)
    assert "scaling to 3 generator(s) (was 1)" in err and "scaling to 1 generator(s) (was 3)" in err

    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    gens = [int(r["cluster/generators"]) for r in rows]
    first3 = gens.index(3)
    assert gens[0] == 1 and 1 in gens[first3:], gens  # 1 -> 3 -> 1
    assert all(r["staleness/max"] <= k for r in rows)
    last = rows[-1]
    assert last["hub/lost_prompts"] == 0 and last.get("hub/duplicate_trained_prompts", 0) == 0
    assert last["hub/generators_drained"] == 2
    assert last.get("weights/dropped_channels", 0) == 0  # the drained ones left cleanly, not by failing a send

    check_weights_followed(run, rows, range(3))
    assert [e["version"] for c in weight_log(run, 0).values() for e in c] == list(range(1, steps + 1))
    for g in (1, 2):  # joined mid-run, left mid-run, through the hub
        assert weight_log(run, g), f"generator {g} never received weights"
        assert max(e["version"] for c in weight_log(run, g).values() for e in c) < steps
        assert "drained" in open(os.path.join(run, "logs", f"gen{g}.log")).read()
