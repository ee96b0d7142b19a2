"""A real generator (`run_actor`, the streaming torch engine, a real reward pool) in a thread, against a real hub and
weight publisher on loopback: what the unit tests of the generator's life (tests/unit/test_actor_drain.py,
tests/unit/test_stream.py) drive."""

from __future__ import annotations

import contextlib
import threading

from actors.actor import run_actor
from actors.continuous import StreamingTorchEngine
from broker.hub import Hub
from common.config import load_config
from common.data import PromptSource
from common.transport import free_port
from learner.publisher import WeightPublisher

KEY = b"d" * 32
# 2 groups of 2 a step, 8 tokens, on-policy (version 0 issues exactly one step's groups), no evaluation.
SETTINGS = ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "rollout.max_staleness_steps=0", "eval.every_steps=0", "learner.filter.dynamic_sampling=false",
            "transport.recv_timeout_s=1", "transport.heartbeat_s=0.5", "transport.weight_sync_timeout_s=30"]


@contextlib.contextmanager
def generator_and_hub(tiny_model_dir, generators, wiring, settings: tuple[str, ...] = ()):
    """A real hub and weight publisher on loopback, and generator 1 in a thread. `wiring(pub)`: the hub's hooks into
    the publisher; `settings`: overrides on top of SETTINGS. Yields (hub, pub, the generator's exit codes, its
    thread)."""
    from transformers import AutoTokenizer

    cfg = load_config(None, [*SETTINGS, *settings])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    wport = free_port()
    pub = WeightPublisher("127.0.0.1", wport, 30)
    hub = Hub(cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, source=PromptSource(cfg, tok),
              weight_addr=f"127.0.0.1:{wport}", generators=generators, target_poll_s=0.05, hooks=wiring(pub))
    hub.start()
    engine = StreamingTorchEngine(tiny_model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  max_num_seqs=cfg.generator.max_num_seqs)
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
