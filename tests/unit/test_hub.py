"""The hub against a scripted generator on loopback: handshake, hostile input, admission, re-issue."""

import logging
import time

import numpy as np
import pytest
import zmq

from common import messages as M
from common.config import load_config
from common.data import PromptSource
from common.transport import GeneratorSocket
from learner.hub import Hub

KEY = b"k" * 32


@pytest.fixture
def hub(tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             "rollout.max_staleness_steps=0", "transport.generator_timeout_s=1.5",
                             "learner.filter.dynamic_sampling=false"])
    h = Hub(cfg, run_id="run1", key=KEY, port=0, source=PromptSource(cfg),
            tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), weight_addr="127.0.0.1:1", n_generators=2)
    h.start()
    yield h
    h.stop()


def _hello(sock, gen_id=0, version=M.PROTOCOL_VERSION, run_id="run1", inc="a"):
    sock.send(M.Hello(protocol_version=version, run_id=run_id, gen_id=gen_id, incarnation=inc, pid=1))
    return sock.recv(5.0)


def _result(item: M.WorkItem, gen_id=0, inc="a", version=0, n=2):
    s = M.Sample(token_ids=M.to_bytes([3, 4], M.TOKEN_DTYPE), logprobs=M.to_bytes([-0.1, -0.2], M.LOGPROB_DTYPE),
                 versions=M.to_bytes([version, version], M.VERSION_DTYPE), reward=1.0, finish_reason="stop", score_status="ok")
    return M.RolloutGroup(gen_id=gen_id, incarnation=inc, ticket=item.ticket, prompt_id=item.prompt_id, epoch=item.epoch,
                          prompt_ids=item.prompt_ids, samples=[s] * n, gen_time_s=0.1)


def test_wrong_protocol_version_and_garbage_are_rejected_and_hub_survives(hub, caplog):
    caplog.set_level(logging.WARNING, logger="covrl.hub")
    gen = GeneratorSocket(hub.sock.address, KEY)
    reply = _hello(gen, version=M.PROTOCOL_VERSION + 1)
    assert isinstance(reply, M.Refused) and "protocol version" in reply.reason
    assert "protocol version" in caplog.text  # logged with its reason
    assert isinstance(_hello(gen, run_id="other"), M.Refused)
    # Raw hostile frames: bad MAC, wrong frame count, valid MAC over a body that is not a message.
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(f"tcp://{hub.sock.address}")
    raw.send_multipart([b"x" * 32, b"garbage"])
    raw.send_multipart([b"only-one-frame"])
    gen.sock.send_multipart(gen._frames(M.Stop(reason="a hub never accepts this type")))
    import hashlib, hmac
    body = b"\x93\xa5hello\x01\x02"  # msgpack-ish but not a Hello
    raw.send_multipart([hmac.new(KEY, body, hashlib.sha256).digest(), body])
    time.sleep(0.5)
    c = hub.counters()
    assert c["hub/rejected/auth"] >= 1 and c["hub/rejected/frames"] >= 1 and c["hub/rejected/malformed"] >= 2
    assert c["hub/rejected/handshake"] == 2
    # ... and the hub still serves a well-behaved generator.
    assert isinstance(_hello(gen), M.Welcome)
    gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    work = gen.recv(5.0)
    assert isinstance(work, M.Work) and len(work.items) == 2  # staleness 0: one step's worth only
    raw.close(0)
    gen.close()


def test_admission_control_and_staleness_zero_batches(hub):
    gen = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(gen), M.Welcome)
    gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    work = gen.recv(5.0)
    assert [it.ticket for it in work.items] == [0, 1]
    gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    assert gen.recv(0.5) is None  # admission: slots 2.. wait for version 1
    for it in work.items:
        gen.send(_result(it))
    batch = hub.take_batch(0, timeout_s=5)
    assert [r.slot for r in batch] == [0, 1]
    hub.set_version(1)
    more = gen.recv(5.0)  # the pending request is served once the version moves
    assert isinstance(more, M.Work) and more.policy_version == 1 and len(more.items) == 2
    # A result for an unknown ticket, or with a version from the future, is rejected, not trained.
    gen.send(_result(M.WorkItem(ticket=999, prompt_id=0, epoch=0, prompt_ids=more.items[0].prompt_ids, answer="",
                                data_source="", seed=0)))
    gen.send(_result(more.items[0], version=5))
    time.sleep(0.3)
    c = hub.counters()
    assert c["hub/rejected/unknown_ticket"] == 1 and c["hub/rejected/version"] == 1
    gen.close()


def test_dead_generator_work_is_reissued_with_same_slot(hub):
    a = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(a, gen_id=0, inc="a"), M.Welcome)
    a.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
    lost = a.recv(5.0)
    a.close()  # dies holding both prompts; no heartbeats follow
    b = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(b, gen_id=1, inc="b"), M.Welcome)
    deadline = time.time() + 10
    got = None
    while got is None and time.time() < deadline:
        b.send(M.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
        b.send(M.Heartbeat(gen_id=1, incarnation="b", weight_version=0))
        got = b.recv(0.5)
    assert got is not None, "the dead generator's prompts were never re-issued"
    assert sorted(it.prompt_id for it in got.items) == sorted(it.prompt_id for it in lost.items)
    for it in got.items:
        b.send(_result(it, gen_id=1, inc="b"))
    batch = hub.take_batch(0, timeout_s=5)
    assert [r.slot for r in batch] == [0, 1]
    assert hub.counters()["hub/reissued_prompts"] == 2
    b.close()
