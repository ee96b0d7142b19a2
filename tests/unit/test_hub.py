"""The hub against a scripted generator on loopback: handshake, hostile input, admission, re-issue."""

import contextlib
import logging
import time

import numpy as np
import pytest
import zmq

from common import messages as M
from common.config import load_config
from common.data import PromptSource
from common.transport import GeneratorSocket
from broker.hub import Hub

KEY = b"k" * 32


@pytest.fixture
def hub(tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             "rollout.max_staleness_steps=0", "transport.generator_timeout_s=1.5",
                             "learner.filter.dynamic_sampling=false"])
    h = Hub(cfg, run_id="run1", key=KEY, port=0, source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)),
            weight_addr="127.0.0.1:1", n_generators=2)
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
    c = hub.stats().counters
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
    c = hub.stats().counters
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
    assert hub.stats().counters["hub/reissued_prompts"] == 2
    b.close()


@contextlib.contextmanager
def _eval_hub(tiny_model_dir, *extra):
    """A hub with two small eval sets, and a generator it has welcomed; both closed on exit."""
    from transformers import AutoTokenizer

    from common.data import Prompt

    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             "rollout.max_staleness_steps=1", "run.steps=3", "eval.every_steps=2", "eval.k=2",
                             "eval.temperature=0.6", "eval.temperatures.greedy_set=0",
                             "learner.filter.dynamic_sampling=false", *extra])
    prompts = {"sampled_set": [Prompt(f"Question: {i} + 1?", str(i + 1), "sampled_set", (5, 6, i)) for i in range(3)],
               "greedy_set": [Prompt("Question: 2 + 2?", "4", "greedy_set", (5, 7))]}
    h = Hub(cfg, run_id="run1", key=KEY, port=0, source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)),
            eval_prompts=prompts, weight_addr="127.0.0.1:1", n_generators=1)
    h.start()
    gen = GeneratorSocket(h.sock.address, KEY)
    try:
        assert isinstance(_hello(gen), M.Welcome)
        yield h, gen
    finally:
        gen.close()
        h.stop()


def _eval_result(item, k, rewards, version=0, inc="a"):
    return M.EvalResult(gen_id=0, incarnation=inc, ticket=item.ticket, weight_version=version, rewards=rewards,
                        lengths=[5] * k, score_status=["ok"] * k)


def test_eval_is_served_first_per_source_temperature_and_holds_the_next_version(tiny_model_dir):
    with _eval_hub(tiny_model_dir, "run.deterministic=false") as (hub, gen):
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        sampled = gen.recv(5.0)
        # Eval of the base model (version 0) goes out before any training work, one source per message.
        assert isinstance(sampled, M.EvalWork) and sampled.policy_version == 0
        assert sampled.k == 2 and sampled.sampling.temperature == 0.6 and len(sampled.items) == 3
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        greedy = gen.recv(5.0)
        assert isinstance(greedy, M.EvalWork) and greedy.k == 1 and greedy.sampling.temperature == 0.0
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        assert isinstance(gen.recv(5.0), M.Work)  # then training work
        with pytest.raises(TimeoutError, match="eval prompts"):
            hub.wait_version_done(0, timeout_s=0.3)  # version 1 may not be published yet
        # A malformed result (wrong k, wrong version) is rejected, counted and its prompt queued again.
        gen.send(_eval_result(sampled.items[0], 1, [1.0]))
        gen.send(_eval_result(sampled.items[1], 2, [1.0, 1.0], version=3))
        time.sleep(0.3)
        c = hub.stats().counters
        assert c["hub/rejected/eval_shape"] == 1 and c["hub/rejected/eval_version"] == 1
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        again = gen.recv(5.0)
        assert isinstance(again, M.EvalWork) and sorted(it.prompt_id for it in again.items) == [0, 1]
        assert {it.prompt_id: it.seed for it in again.items} == {it.prompt_id: it.seed for it in sampled.items[:2]}  # same samples
        gen.send(_eval_result(again.items[0], 2, [1.0, 0.0]))
        gen.send(_eval_result(again.items[1], 2, [0.0, 0.0]))
        gen.send(_eval_result(sampled.items[2], 2, [1.0, 1.0]))
        gen.send(_eval_result(greedy.items[0], 1, [1.0]))
        waited = hub.wait_version_done(0, timeout_s=5)  # every eval prompt of version 0 is scored: no TimeoutError
        assert waited < 5
        m = hub.take_eval(0)
        assert m["eval/sampled_set/acc"] == pytest.approx((0.5 + 0 + 1) / 3)  # avg@k
        assert m["eval/sampled_set/pass@k"] == pytest.approx(2 / 3)
        assert m["eval/greedy_set/acc"] == 1.0 and m["eval/sampled_set/response_length"] == 5.0
        assert hub.take_eval(1) == {}  # version 1 is not evaluated (every 2, and the last: 3)
        hub.set_version(1)
        hub.set_version(2)  # evaluated: queued again, for version 2
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        nxt = gen.recv(5.0)
        assert isinstance(nxt, M.EvalWork) and nxt.policy_version == 2


def test_deterministic_barrier_waits_for_all_training_work_of_the_version(tiny_model_dir):
    with _eval_hub(tiny_model_dir, "eval.every_steps=0") as (hub, gen):
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=3))
        first = gen.recv(5.0)
        assert isinstance(first, M.Work) and len(first.items) == 3
        for it in first.items:
            gen.send(_result(it))
        batch = hub.take_batch(0, timeout_s=5)
        # Staleness 1: version 0 may issue 2 steps' worth (4 groups); one is not issued yet.
        with pytest.raises(TimeoutError):
            hub.wait_version_done(0, timeout_s=0.3)
        gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=3))
        last = gen.recv(5.0)
        assert len(last.items) == 1 and last.policy_version == 0
        with pytest.raises(TimeoutError):
            hub.wait_version_done(0, timeout_s=0.3)  # issued, not yet back
        gen.send(_result(last.items[0]))
        hub.wait_version_done(0, timeout_s=5)
        assert [r.slot for r in batch] == [0, 1]


def test_snapshot_and_restore_keep_the_ledger_and_the_stream(hub, tiny_model_dir):
    """Resume: a restored hub trains the saved rollouts, re-issues what was in flight with the
    same slots and seeds, and continues the prompt stream where it stopped."""
    from transformers import AutoTokenizer

    gen = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(gen), M.Welcome)
    gen.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    first = gen.recv(5.0).items
    gen.send(_result(first[0]))  # slot 0 ready; slot 1 still in flight at the snapshot
    time.sleep(0.3)
    blob = hub.snapshot()
    gen.close()
    hub.stop()

    h = Hub(hub.cfg, run_id="run1", key=KEY, port=0, weight_addr="127.0.0.1:1", n_generators=2,
            source=PromptSource(hub.cfg, AutoTokenizer.from_pretrained(tiny_model_dir)))
    h.restore(blob)
    h.start()
    g = GeneratorSocket(h.sock.address, KEY)
    try:
        assert isinstance(_hello(g), M.Welcome)
        g.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
        again = g.recv(5.0).items
        assert [(it.prompt_id, it.seed) for it in again] == [(first[1].prompt_id, first[1].seed)]  # only the lost one
        g.send(_result(again[0]))
        batch = h.take_batch(0, timeout_s=5)
        assert [r.slot for r in batch] == [0, 1] and batch[0].group.prompt_id == first[0].prompt_id
        assert h.stats().counters["hub/reissued_prompts"] == 1 and h.stats().counters["hub/lost_prompts"] == 0
        h.set_version(1)
        g.send(M.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
        nxt = g.recv(5.0).items
        assert [it.prompt_id for it in nxt] == [h.source.order(0)[2], h.source.order(0)[3]]  # the stream goes on
    finally:
        g.close()
        h.stop()
