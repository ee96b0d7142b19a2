"""A real generator (`run_actor`, torch engine on the tiny model, real reward pool) against a real hub and weight
publisher on loopback: scaled away while it runs, its groups are trained, it exits EXIT_DRAINED saying it was
drained, and its weight channel is closed as a leave, not a failure; declared lost while it runs, it is told to stop
and exits EXIT_LOST, its channel dropped."""

import contextlib
import logging
import threading

from actors.actor import run_actor
from actors.engine import TorchEngine
from broker.hub import Hub
from common.runfiles import EXIT_DRAINED
from common.config import load_config
from common.data import PromptSource
from common.transport import free_port
from learner.nccl import wait_until
from learner.publisher import WeightPublisher
from tests.helpers.hooks import Hooks

KEY = b"d" * 32


def _config():
    return load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                              "rollout.max_new_tokens=8", "rollout.max_staleness_steps=0", "eval.every_steps=0",
                              "learner.filter.dynamic_sampling=false", "transport.recv_timeout_s=1",
                              "transport.heartbeat_s=0.5", "transport.weight_sync_timeout_s=30"])


@contextlib.contextmanager
def _generator_and_hub(tiny_model_dir, generators, wiring):
    """A real hub and weight publisher on loopback, and generator 1 (`run_actor`, torch engine, real reward pool) in
    a thread. `wiring(pub)`: the hub's hooks into the publisher. Yields (hub, pub, the generator's exit codes,
    its thread)."""
    from transformers import AutoTokenizer

    # Staleness 0: version 0 issues exactly one step's groups.
    cfg = _config()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    wport = free_port()
    pub = WeightPublisher("127.0.0.1", wport, 30)
    hub = Hub(cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, source=PromptSource(cfg, tok),
              weight_addr=f"127.0.0.1:{wport}", generators=generators, target_poll_s=0.05, hooks=wiring(pub))
    hub.start()
    engine = TorchEngine(tiny_model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    exit_code = []
    gen = threading.Thread(target=lambda: exit_code.append(run_actor(
        cfg, engine=engine, tokenizer=tok, hub_addr=hub.sock.address, key=KEY, run_id="run1", gen_id=1,
        run_dir=None)))
    try:
        gen.start()
        yield hub, pub, exit_code, gen
    finally:
        hub.stop()
        pub.stop()
        gen.join(10)


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
