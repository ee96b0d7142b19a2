"""A real generator (`run_actor`, torch engine on the tiny model, real reward pool) against a real hub and weight
publisher on loopback: scaled away while it runs, its groups are trained, it exits EXIT_DRAINED saying it was
drained, and its weight channel is closed as a leave, not a failure; declared lost while it runs, it is told to stop
and exits EXIT_LOST, its channel dropped."""

import logging

from common.runfiles import EXIT_DRAINED
from learner.nccl import wait_until
from tests.helpers.actor_hub import generator_and_hub as _generator_and_hub
from tests.helpers.hooks import Hooks


def test_a_generator_scaled_away_delivers_its_groups_then_exits_0(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="covrl.actor")
    target = [2]
    with _generator_and_hub(tiny_model_dir, lambda: target[0],
                            lambda pub: Hooks(join=pub.join, leave=pub.leave)) as (hub, pub, exit_code, gen):
        def issued() -> bool:
            with hub.cv:
                return hub.slots == 2
        assert wait_until(issued, 30, 0.01), "the generator never got work"
        target[0] = 1  # scaled down while it holds (or has just delivered) the step's two groups
        batch = hub.take_batch(0, timeout_s=30)
        assert [(r.slot, r.group.gen_id) for r in batch] == [(0, 1), (1, 1)]
        gen.join(30)
        assert exit_code == [EXIT_DRAINED]
        assert "generator 1 drained" in caplog.text
        c = hub.stats().counters
        assert c["hub/generators_drained"] == 1 and c["hub/lost_prompts"] == 0
        assert c["cluster/generators"] == 0 and c["cluster/generators_target"] == 1
        assert c.get("hub/rejected/unknown_generator", 0) == 0
        assert wait_until(lambda: pub.counter_values().get("weights/left_channels") == 1, 10, 0.01)
        assert pub.channels == {} and "weights/dropped_channels" not in pub.counter_values()


def test_a_generator_declared_lost_while_it_runs_is_told_to_stop_and_exits_lost(tiny_model_dir, caplog):
    """The hub gives up on a live generator (here: its weight channel was reported failed): its weight channel is
    dropped at once, the groups it then delivers are refused (re-issued, never trained twice), and its next request
    gets Stop("lost: ..."), on which it exits EXIT_LOST, a failure the launcher restarts."""
    from common.runfiles import EXIT_LOST

    caplog.set_level(logging.INFO, logger="covrl.actor")
    wiring = lambda pub: Hooks(join=pub.join, lost=lambda gen_id, inc, *_: pub.drop(gen_id, inc))  # noqa: E731
    with _generator_and_hub(tiny_model_dir, lambda: 2, wiring) as (hub, pub, exit_code, gen):
        assert wait_until(lambda: 1 in pub.channels, 30, 0.01), "the generator never joined its weight channel"
        with hub.cv:
            incarnation = hub.gens[1].incarnation
        hub.lose(1, incarnation, "its weight channel failed (test)")
        gen.join(30)
        assert exit_code == [EXIT_LOST] and "the hub declared this incarnation lost: weight_channel" in caplog.text
        assert wait_until(lambda: 1 not in pub.channels, 10, 0.01)
        c = hub.stats().counters
        assert c["hub/generator_lost/weight_channel"] == 1 and c["hub/lost_prompts"] == 0
        assert pub.counter_values()["weights/dropped_channels"] == 1
