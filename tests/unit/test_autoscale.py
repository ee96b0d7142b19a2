"""The autoscale policy (learner/autoscale.py) on figures whose cause is known: a pool whose throughput follows a
stage model (generators, a shared service, the learner), closed loop, and single situations the rule must get right."""

from __future__ import annotations

import json
import math

import pytest

from common.config import AutoscaleConfig, ConfigError, load_config
from common.runfiles import read_generator_target, write_generator_target
from learner.autoscale import Autoscaler, Figures, Policy, read_decisions

CFG = AutoscaleConfig(min=1, max=8, window_steps=4, settle_steps=1, cooldown_steps=6, retry_after_steps=30)


def plant(g: int, per_gen: float = 10.0, learner: float = 35.0, shared: float = math.inf) -> Figures:
    """Samples/s of a pool of g generators (each per_gen), through a shared service (shared) into a learner (learner):
    the slowest stage sets the rate; the learner waits the rest of its time, the generators idle the rest of theirs."""
    rate = min(g * per_gen, shared, learner)
    return Figures(wait_share=1 - rate / learner, idle_share=1 - rate / (g * per_gen), samples_per_s=rate, live=g)


def run(policy: Policy, steps: int, model, start: int = 1, join_after: int = 0):
    """Closed loop: the live count follows the target `join_after` steps later. Returns (counts, decisions)."""
    live, counts, decisions, since = policy.target, [], [], 0
    for step in range(start, start + steps):
        since = 0 if live == policy.target else since + 1
        if live != policy.target and since >= join_after:
            live = policy.target
        f = model(live)
        d = policy.observe(step, Figures(f.wait_share, f.idle_share, f.samples_per_s, live), now=float(step))
        if d is not None:
            decisions.append(d)
        counts.append(policy.target)
    return counts, decisions


def test_a_starved_learner_scales_up_until_it_no_longer_waits():
    counts, decisions = run(Policy(CFG, 1), 60, lambda g: plant(g))
    assert counts[-1] == 4 == math.ceil(35 / 10)  # the fewest generators that keep the learner busy
    ups = [d for d in decisions if d.kind == "up"]
    assert [(d.before, d.after) for d in ups] == [(1, 2), (2, 4)]  # at most max_factor x per change
    assert plant(4).wait_share == 0 and all(d.kind != "undo" for d in decisions)
    assert [d.kind for d in decisions].count("kept") == 2  # each scale-up judged, and kept


def test_a_busy_learner_scales_down_to_what_it_uses_and_stops_at_min():
    counts, decisions = run(Policy(CFG, 8), 80, lambda g: plant(g, per_gen=10, learner=12))
    assert counts[-1] == 2  # 12 samples/s need 1.2 generators' worth: 2 (1 would starve the learner)
    assert decisions[0].kind == "down" and decisions[0].after == 4  # at most halved
    counts, decisions = run(Policy(CFG, 8), 80, lambda g: plant(g, per_gen=10, learner=5))
    assert counts[-1] == 1 == CFG.min
    assert decisions[-1].kind == "hold" and "cluster.autoscale.min = 1" in decisions[-1].reason


def test_a_scale_up_that_gains_nothing_is_undone_and_not_retried_for_a_while():
    policy = Policy(CFG, 1)
    counts, decisions = run(policy, 60, lambda g: plant(g, shared=10))  # a shared service serves 10/s, whatever g
    kinds = [d.kind for d in decisions]
    assert kinds[:3] == ["up", "undo", "hold"], kinds
    assert "the bottleneck is elsewhere" in decisions[1].reason and "+0%" in decisions[1].reason
    assert counts[-1] == 1 and max(counts) == 2
    assert "tried again from step" in decisions[2].reason
    more, later = run(policy, 100, lambda g: plant(g, shared=10), start=61)
    every = decisions + later
    ups, undos = [d.step for d in every if d.kind == "up"], [d.step for d in every if d.kind == "undo"]
    # retried once the ceiling expired, and each repeat of the same undo waits twice as long
    assert [u - d for u, d in zip(ups[1:], undos)] == [CFG.retry_after_steps, 2 * CFG.retry_after_steps], every


def test_hysteresis_holds_between_the_thresholds_and_a_lone_spike_moves_nothing():
    steady = Figures(wait_share=0.12, idle_share=0.1, samples_per_s=10, live=3)  # between down_wait 0.05 and up_wait 0.2
    policy = Policy(CFG, 3)
    assert all(policy.observe(s, steady, float(s)) is None for s in range(1, 40))
    quiet = Figures(wait_share=0.1, idle_share=0.1, samples_per_s=10, live=3)
    spike = Figures(wait_share=0.9, idle_share=0.1, samples_per_s=3, live=3)  # an evaluation step
    policy = Policy(CFG, 3)
    got = [policy.observe(s, spike if s % 4 == 0 else quiet, float(s)) for s in range(1, 40)]
    assert got == [None] * 39


def test_cooldown_and_settle_space_the_changes():
    policy = Policy(CFG, 1)
    counts, decisions = run(policy, 40, lambda g: plant(g, per_gen=1, learner=100))  # starved at every count
    steps = [d.step for d in decisions if d.after != d.before]
    assert all(b - a >= CFG.cooldown_steps for a, b in zip(steps, steps[1:])), steps
    assert counts[-1] == CFG.max


def test_generators_that_never_join_give_the_scale_up_up():
    policy = Policy(AutoscaleConfig(min=1, max=4, window_steps=2, cooldown_steps=2, join_timeout_s=30), 1)
    starved = Figures(wait_share=0.8, idle_share=0.0, samples_per_s=2, live=1)
    decisions = [d for s in range(1, 60) if (d := policy.observe(s, starved, now=float(s))) is not None]
    assert [d.kind for d in decisions][:3] == ["up", "gave_up", "hold"]
    assert "had not joined after 30s" in decisions[1].reason and decisions[1].after == 1


def test_a_target_set_by_hand_is_adopted_and_a_short_pool_is_not_judged():
    policy = Policy(CFG, 2)
    d = policy.adopt(5, 6, now=5.0)
    assert (d.kind, d.before, d.after, policy.target) == ("by_hand", 2, 6, 6)
    short = Figures(wait_share=0.9, idle_share=0.0, samples_per_s=1, live=5)  # one of the 6 restarting
    assert all(policy.observe(s, short, float(s)) is None for s in range(6, 30))


def test_state_round_trips_with_its_ceiling():
    policy = Policy(CFG, 1)
    run(policy, 30, lambda g: plant(g, shared=10))
    again = Policy(CFG, policy.target, 30, 30.0)
    again.load_state(json.loads(json.dumps(policy.state())), 30, 30.0)
    assert again.ceiling == policy.ceiling and again.highest(31) == 1


def test_the_autoscaler_writes_the_target_with_its_reason_and_logs_every_decision(tmp_path):
    class Sink:
        texts = []

        def text(self, tag, text, step):
            self.texts.append((tag, step, text))

    write_generator_target(str(tmp_path), 1)
    a = Autoscaler(CFG, str(tmp_path), Sink(), 0)
    rows = []
    for step in range(1, 12):
        f = plant(read_generator_target(str(tmp_path)).generators)
        row = {"perf/learner_wait_share": f.wait_share, "perf/gen_idle_share": f.idle_share, "perf/samples_per_s": f.samples_per_s,
               "cluster/generators": float(f.live)}
        rows.append(a.observe(step, row))
    target = read_generator_target(str(tmp_path))
    assert target.generators == 2 and target.reason.startswith("autoscale: the learner waited 71% of each step")
    assert [r["cluster/autoscale/change"] for r in rows].count(1.0) == 1
    logged = read_decisions(str(tmp_path))
    assert [d["kind"] for d in logged] == ["up"] and logged[0]["figures"]["wait_share"] == pytest.approx(1 - 10 / 35)
    assert Sink.texts[0][0] == "cluster/autoscale"
    write_generator_target(str(tmp_path), 5)  # by hand
    a.observe(12, {**row, "cluster/generators": 2.0})
    assert read_decisions(str(tmp_path))[-1]["kind"] == "by_hand" and a.policy.target == 5


def test_bad_bounds_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="need 1 <= min <= max"):
        load_config(None, ["cluster.autoscale.min=3", "cluster.autoscale.max=2"])
    with pytest.raises(ConfigError, match="set cluster.autoscale.max"):
        load_config(None, ["cluster.autoscale.min=2"])
    with pytest.raises(ConfigError, match="hysteresis"):
        load_config(None, ["cluster.autoscale.max=2", "cluster.autoscale.min=1", "cluster.autoscale.down_wait=0.3"])


def test_one_change_stays_within_max_factor_and_moves_by_one_at_least():
    starved = Figures(wait_share=0.99, idle_share=0.0, samples_per_s=1, live=3)
    policy = Policy(AutoscaleConfig(min=1, max=64, window_steps=1, settle_steps=0, cooldown_steps=1, max_factor=1.5), 3)
    d = next(d for s in range(1, 5) if (d := policy.observe(s, starved, float(s))) is not None)
    assert (d.before, d.after) == (3, 4)  # floor(3 x 1.5); the wait alone would ask for 300
    idle = Figures(wait_share=0.0, idle_share=0.99, samples_per_s=1, live=3)
    policy = Policy(AutoscaleConfig(min=1, max=8, window_steps=1, settle_steps=0, cooldown_steps=1), 3)
    d = next(d for s in range(1, 5) if (d := policy.observe(s, idle, float(s))) is not None)
    assert (d.before, d.after) == (3, 2)  # at most halved, rounded up: 3 -> 2, not 1
    policy = Policy(AutoscaleConfig(min=1, max=8, window_steps=1, settle_steps=0, cooldown_steps=1,
                                    max_factor=1.1), 5)
    d = next(d for s in range(1, 5) if (d := policy.observe(s, Figures(0.0, 0.99, 1, 5), float(s))) is not None)
    assert (d.before, d.after) == (5, 4)  # a factor that rounds to no change still moves by one


def test_generators_set_by_hand_that_never_join_are_said_and_waited_for():
    policy = Policy(AutoscaleConfig(min=1, max=8, join_timeout_s=10), 2)
    policy.adopt(1, 6, now=1.0)
    short = Figures(wait_share=0.9, idle_share=0.0, samples_per_s=1, live=4)
    got = [d for s in range(2, 40) if (d := policy.observe(s, short, float(s))) is not None]
    assert [d.kind for d in got] == ["hold"] and "2 of the 6 generators have not joined after 10s" in got[0].reason
    assert policy.target == 6  # the count set by hand is not overridden


def test_a_decision_loses_to_a_target_written_meanwhile(tmp_path):
    class Sink:
        def text(self, tag, text, step):
            pass

    write_generator_target(str(tmp_path), 1)
    a = Autoscaler(CFG, str(tmp_path), Sink(), 0)
    row = lambda f: {"perf/learner_wait_share": f.wait_share, "perf/gen_idle_share": f.idle_share,  # noqa: E731
                     "perf/samples_per_s": f.samples_per_s, "cluster/generators": float(f.live)}
    for step in range(1, 6):
        a.observe(step, row(plant(1)))
    real = write_generator_target
    import learner.autoscale as mod

    def meanwhile(run_dir, n, reason="", expect=None):  # covrl scale lands between the read and the write
        real(run_dir, 3)
        return real(run_dir, n, reason, expect)

    mod.write_generator_target = meanwhile
    try:
        a.observe(6, row(plant(1)))
    finally:
        mod.write_generator_target = real
    assert read_generator_target(str(tmp_path)).generators == 3 and a.policy.target == 3
    assert [d["kind"] for d in read_decisions(str(tmp_path))] == ["by_hand"]  # the lost decision is not logged


def test_covrl_scale_says_when_the_run_autoscales(tmp_path):
    from common.config import to_toml
    from launch.scale import autoscale_bounds

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, ["cluster.autoscale.min=2", "cluster.autoscale.max=6"])))
    assert autoscale_bounds(str(run)) == (2, 6)
    (run / "config.toml").write_text(to_toml(load_config(None, [])))
    assert autoscale_bounds(str(run)) is None
    assert autoscale_bounds(str(tmp_path / "nowhere")) is None
