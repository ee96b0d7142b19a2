"""The hub against a scripted generator on loopback: handshake, hostile input, admission, re-issue, scaling."""

import contextlib
import logging
import time

import numpy as np
import pytest
import zmq

from common import messages
from common.config import load_config
from common.data import PromptSource
from common.transport import GeneratorSocket
from broker.hub import Hub
from broker.rules import GroupRules
from tests.helpers.groups import rollout_group, sample
from tests.helpers.hooks import Hooks

KEY = b"k" * 32
# The `hub` fixture's config (tests/unit/conftest.py).
HUB_SETTINGS = ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                "rollout.max_staleness_steps=0", "transport.generator_timeout_s=1.5", "learner.filter.dynamic_sampling=false"]


def _hello(sock, gen_id=0, version=messages.PROTOCOL_VERSION, run_id="run1", inc="a"):
    sock.send(messages.Hello(protocol_version=version, run_id=run_id, gen_id=gen_id, incarnation=inc, pid=1))
    return sock.recv(5.0)


def _result(item: messages.WorkItem, gen_id=0, inc="a", version=0, n=2):
    s = sample([3, 4], logprobs=[-0.1, -0.2], versions=version)
    return rollout_group([s] * n, item=item, gen_id=gen_id, incarnation=inc, gen_time_s=0.1)


def test_wrong_protocol_version_and_garbage_are_rejected_and_hub_survives(hub, caplog):
    caplog.set_level(logging.WARNING, logger="covrl.hub")
    gen = GeneratorSocket(hub.sock.address, KEY)
    reply = _hello(gen, version=messages.PROTOCOL_VERSION + 1)
    assert isinstance(reply, messages.Refused) and "protocol version" in reply.reason
    assert "protocol version" in caplog.text  # logged with its reason
    assert isinstance(_hello(gen, run_id="other"), messages.Refused)
    # Raw hostile frames: bad MAC, wrong frame count, valid MAC over a body that is not a message.
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(f"tcp://{hub.sock.address}")
    raw.send_multipart([b"x" * 32, b"garbage"])
    raw.send_multipart([b"only-one-frame"])
    gen.sock.send_multipart(gen._frames(messages.Stop(reason="a hub never accepts this type")))
    import hashlib, hmac
    body = b"\x93\xa5hello\x01\x02"  # msgpack-ish but not a Hello
    raw.send_multipart([hmac.new(KEY, body, hashlib.sha256).digest(), body])
    time.sleep(0.5)
    c = hub.stats().counters
    assert c["hub/rejected/auth"] >= 1 and c["hub/rejected/frames"] >= 1 and c["hub/rejected/malformed"] >= 2
    assert c["hub/rejected/handshake"] == 2
    # ... and the hub still serves a well-behaved generator.
    assert isinstance(_hello(gen), messages.Welcome)
    gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    work = gen.recv(5.0)
    assert isinstance(work, messages.Work) and len(work.items) == 2  # staleness 0: one step's worth only
    raw.close(0)
    gen.close()


def _until_counter(hub, key, value, timeout_s=5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while hub.stats().counters.get(key) != value:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_admission_control_and_staleness_zero_batches(hub):
    gen = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(gen), messages.Welcome)
    gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    work = gen.recv(5.0)
    assert [it.ticket for it in work.items] == [0, 1]
    gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    assert gen.recv(0.5) is None  # admission: slots 2.. wait for version 1
    for it in work.items:
        gen.send(_result(it))
    batch = hub.take_batch(0, timeout_s=5)
    assert [r.slot for r in batch] == [0, 1]
    # Each group comes with the rewards the rules shaped (the learner never shapes them again).
    shaped = GroupRules.of(hub.cfg).rewards([r.group for r in batch])
    assert all(np.array_equal(r.rewards, row) for r, row in zip(batch, shaped, strict=True))
    assert hub.stats().gen_busy_s == pytest.approx(0.2)  # each valid group's gen_time_s (timing_s/gen_idle)
    assert {k: v for k, v in hub.stats().counters.items() if "weight_lag" in k} == {
        "perf/weight_lag/gen0": 0.0, "perf/weight_lag/max": 0.0}
    hub.set_version(1)
    more = gen.recv(5.0)  # the pending request is served once the version moves
    assert isinstance(more, messages.Work) and more.policy_version == 1 and len(more.items) == 2
    # The weight lag: versions behind the learner by the generator's last heartbeat.
    assert hub.stats().counters["perf/weight_lag/max"] == 1.0
    gen.send(messages.Heartbeat(gen_id=0, incarnation="a", policy_version=1))
    assert _until_counter(hub, "perf/weight_lag/gen0", 0.0)
    # A result for an unknown ticket, or with a version from the future, is rejected, not trained.
    gen.send(_result(messages.WorkItem(ticket=999, prompt_id=0, epoch=0, prompt_ids=more.items[0].prompt_ids, answer="",
                                data_source="", seed=0)))
    gen.send(_result(more.items[0], version=5))
    time.sleep(0.3)
    c = hub.stats().counters
    assert c["hub/rejected/unknown_ticket"] == 1 and c["hub/rejected/version"] == 1
    gen.close()


def test_dead_generator_work_is_reissued_with_same_slot(hub):
    a = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(a, gen_id=0, inc="a"), messages.Welcome)
    a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
    lost = a.recv(5.0)
    a.close()  # dies holding both prompts; no heartbeats follow
    b = GeneratorSocket(hub.sock.address, KEY)
    assert isinstance(_hello(b, gen_id=1, inc="b"), messages.Welcome)
    deadline = time.time() + 10
    got = None
    while got is None and time.time() < deadline:
        b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
        b.send(messages.Heartbeat(gen_id=1, incarnation="b", policy_version=0))
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
def _eval_hub(tiny_model_dir, *extra, target=lambda: 1, on_leave=None):
    """A hub with two small eval sets, and a generator (id 0) it has welcomed; both closed on exit."""
    from transformers import AutoTokenizer

    from common.data import Prompt

    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             "rollout.max_staleness_steps=1", "run.steps=3", "eval.every_steps=2", "eval.k=2",
                             "eval.temperature=0.6", "eval.temperatures.greedy_set=0",
                             "learner.filter.dynamic_sampling=false", *extra])
    prompts = {"sampled_set": [Prompt(f"Question: {i} + 1?", str(i + 1), "sampled_set", (5, 6, i)) for i in range(3)],
               "greedy_set": [Prompt("Question: 2 + 2?", "4", "greedy_set", (5, 7))]}
    h = Hub(cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)),
            eval_prompts=prompts, weight_addr="127.0.0.1:1", generators=target, hooks=Hooks(leave=on_leave), target_poll_s=0.05)
    h.start()
    gen = GeneratorSocket(h.sock.address, KEY)
    try:
        assert isinstance(_hello(gen), messages.Welcome)
        yield h, gen
    finally:
        gen.close()
        h.stop()


def _eval_result(item, k, rewards, version=0, inc="a", texts=()):
    return messages.EvalResult(gen_id=0, incarnation=inc, ticket=item.ticket, policy_version=version, rewards=rewards,
                        lengths=[5] * k, score_status=["ok"] * k, texts=list(texts))


def test_eval_is_served_first_per_source_temperature_and_holds_the_next_version(tiny_model_dir):
    with _eval_hub(tiny_model_dir, "run.deterministic=false") as (hub, gen):
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        sampled = gen.recv(5.0)
        # Eval of the base model (version 0) goes out before any training work, one source per message.
        assert isinstance(sampled, messages.EvalWork) and sampled.policy_version == 0
        assert sampled.k == 2 and sampled.sampling.temperature == 0.6 and len(sampled.items) == 3
        assert sampled.keep_texts == 2  # logging.eval_samples: the first 2 prompts' responses come back as text
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        greedy = gen.recv(5.0)
        assert isinstance(greedy, messages.EvalWork) and greedy.k == 1 and greedy.sampling.temperature == 0.0
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        assert isinstance(gen.recv(5.0), messages.Work)  # then training work
        with pytest.raises(TimeoutError, match="eval prompts"):
            hub.wait_version_done(0, timeout_s=0.3)  # version 1 may not be published yet
        # A malformed result (wrong k, wrong version) is rejected, counted and its prompt queued again.
        gen.send(_eval_result(sampled.items[0], 1, [1.0]))
        gen.send(_eval_result(sampled.items[1], 2, [1.0, 1.0], version=3))
        time.sleep(0.3)
        c = hub.stats().counters
        assert c["hub/rejected/eval_shape"] == 1 and c["hub/rejected/eval_version"] == 1
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        again = gen.recv(5.0)
        assert isinstance(again, messages.EvalWork) and sorted(it.prompt_id for it in again.items) == [0, 1]
        assert {it.prompt_id: it.seed for it in again.items} == {it.prompt_id: it.seed for it in sampled.items[:2]}  # same samples
        gen.send(_eval_result(again.items[0], 2, [1.0, 0.0], texts=["\\boxed{3}", "4"]))
        gen.send(_eval_result(again.items[1], 2, [0.0, 0.0], texts=["x"]))  # 1 text for k = 2: rejected, queued again
        time.sleep(0.3)
        assert hub.stats().counters["hub/rejected/eval_shape"] == 2
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        third = gen.recv(5.0)
        assert [it.prompt_id for it in third.items] == [again.items[1].prompt_id]
        gen.send(_eval_result(third.items[0], 2, [0.0, 0.0]))
        gen.send(_eval_result(sampled.items[2], 2, [1.0, 1.0]))
        gen.send(_eval_result(greedy.items[0], 1, [1.0]))
        waited = hub.wait_version_done(0, timeout_s=5)  # every eval prompt of version 0 is scored: no TimeoutError
        assert waited < 5
        m, texts = hub.take_eval(0)
        assert [(ds, i, r.texts) for ds, i, r in texts] == [("sampled_set", again.items[0].prompt_id, ["\\boxed{3}", "4"])]
        assert m["eval/sampled_set/acc"] == pytest.approx((0.5 + 0 + 1) / 3)  # avg@k
        assert m["eval/sampled_set/pass@k"] == pytest.approx(2 / 3)
        assert m["eval/greedy_set/acc"] == 1.0 and m["eval/sampled_set/response_length"] == 5.0
        assert hub.take_eval(1) == ({}, [])  # version 1 is not evaluated (every 2, and the last: 3)
        hub.set_version(1)
        hub.set_version(2)  # evaluated: queued again, for version 2
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
        nxt = gen.recv(5.0)
        assert isinstance(nxt, messages.EvalWork) and nxt.policy_version == 2


def test_deterministic_barrier_waits_for_all_training_work_of_the_version(tiny_model_dir):
    with _eval_hub(tiny_model_dir, "eval.every_steps=0") as (hub, gen):
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=3))
        first = gen.recv(5.0)
        assert isinstance(first, messages.Work) and len(first.items) == 3
        for it in first.items:
            gen.send(_result(it))
        batch = hub.take_batch(0, timeout_s=5)
        # Staleness 1: version 0 may issue 2 steps' worth (4 groups); one is not issued yet.
        with pytest.raises(TimeoutError):
            hub.wait_version_done(0, timeout_s=0.3)
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=3))
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
    assert isinstance(_hello(gen), messages.Welcome)
    gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
    first = gen.recv(5.0).items
    gen.send(_result(first[0]))  # slot 0 ready; slot 1 still in flight at the snapshot
    time.sleep(0.3)
    blob = hub.snapshot()
    gen.close()
    hub.stop()

    h = Hub(hub.cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, weight_addr="127.0.0.1:1", generators=lambda: 2,
            source=PromptSource(hub.cfg, AutoTokenizer.from_pretrained(tiny_model_dir)))
    h.restore(blob)
    h.start()
    g = GeneratorSocket(h.sock.address, KEY)
    try:
        assert isinstance(_hello(g), messages.Welcome)
        g.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
        again = g.recv(5.0).items
        assert [(it.prompt_id, it.seed) for it in again] == [(first[1].prompt_id, first[1].seed)]  # only the lost one
        g.send(_result(again[0]))
        batch = h.take_batch(0, timeout_s=5)
        assert [r.slot for r in batch] == [0, 1] and batch[0].group.prompt_id == first[0].prompt_id
        assert h.stats().counters["hub/reissued_prompts"] == 1 and h.stats().counters["hub/lost_prompts"] == 0
        h.set_version(1)
        g.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
        nxt = g.recv(5.0).items
        assert [it.prompt_id for it in nxt] == [h.source.order(0)[2], h.source.order(0)[3]]  # the stream goes on
    finally:
        g.close()
        h.stop()


# ---- elastic generators: the target is read again while the hub runs ------------------------------------------

@contextlib.contextmanager
def _elastic_hub(tiny_model_dir, target: list[int], *extra):
    """A hub whose generator target is `target[0]`, read every 50 ms; yields (hub, the on_leave calls)."""
    from transformers import AutoTokenizer

    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             "rollout.max_staleness_steps=2", "learner.filter.dynamic_sampling=false",
                             "eval.every_steps=0", *extra])
    left = []
    h = Hub(cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, weight_addr="127.0.0.1:1",
            source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)),
            generators=lambda: target[0], hooks=Hooks(leave=lambda *gen: left.append(gen)), target_poll_s=0.05)
    h.start()
    try:
        yield h, left
    finally:
        h.stop()


def _until(hub, **gauges) -> dict:
    """Wait (at most 5 s) until the hub's counters hold these values ("cluster__generators" for cluster/generators)."""
    want = {k.replace("__", "/"): v for k, v in gauges.items()}
    deadline = time.time() + 5
    while time.time() < deadline:
        c = hub.stats().counters
        if all(c.get(k) == v for k, v in want.items()):
            return c
        time.sleep(0.02)
    raise AssertionError(f"counters never reached {want}: {hub.stats().counters}")


def test_scale_down_drains_a_generator_after_its_groups_are_in_and_trains_them_once(tiny_model_dir):
    target = [2]
    with _elastic_hub(tiny_model_dir, target, "transport.generator_timeout_s=30") as (hub, left):
        a, b = GeneratorSocket(hub.sock.address, KEY), GeneratorSocket(hub.sock.address, KEY)
        try:
            assert isinstance(_hello(a, gen_id=0, inc="a"), messages.Welcome)
            assert isinstance(_hello(b, gen_id=1, inc="b"), messages.Welcome)
            _until(hub, cluster__generators=2.0, cluster__generators_target=2.0)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
            held = b.recv(5.0).items  # slots 0, 1
            a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
            first = a.recv(5.0).items  # slots 2, 3
            target[0] = 1  # covrl scale RUN_DIR --gens 1: generator 1 drains
            _until(hub, cluster__generators=1.0, cluster__generators_target=1.0)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
            assert b.recv(0.5) is None  # no new work for a draining generator, and no Stop while it holds two groups
            a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
            second = a.recv(5.0).items  # ... though there was work: admission (staleness 2) allows slots 4, 5
            assert len(second) == 2
            b.send(_result(held[0], gen_id=1, inc="b"))
            assert b.recv(0.5) is None and left == []  # still holds one
            b.send(_result(held[1], gen_id=1, inc="b"))
            stop = b.recv(5.0)
            assert isinstance(stop, messages.Stop) and stop.reason == "drained"
            assert left == [(1, "b")]
            c = _until(hub, cluster__generators=1.0)
            assert c["hub/generators_drained"] == 1
            # Its late frames are expected, not hostile: a request is answered with Stop again, a heartbeat ignored.
            b.send(messages.Heartbeat(gen_id=1, incarnation="b", policy_version=0))
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
            assert isinstance(b.recv(5.0), messages.Stop)
            for it in [*first, *second]:
                a.send(_result(it))
            trained = []
            for v in range(3):
                batch = hub.take_batch(v, timeout_s=5)
                trained += [(r.slot, r.group.gen_id, r.group.ticket) for r in batch]
                hub.set_version(v + 1)
            assert [s for s, _, _ in trained] == [0, 1, 2, 3, 4, 5]  # every slot once, the drained one's included
            assert [(g, t) for _, g, t in trained[:2]] == [(1, held[0].ticket), (1, held[1].ticket)]
            c = hub.stats().counters
            assert c["hub/lost_prompts"] == 0 and c["hub/duplicate_trained_prompts"] == 0
            assert c.get("hub/rejected/unknown_generator", 0) == 0 and c.get("hub/reissued_prompts", 0) == 0
            # It may not come back while the target excludes it; the reason says how to allow it.
            refused = _hello(b, gen_id=1, inc="b2")
            assert isinstance(refused, messages.Refused)
            assert "target is 1" in refused.reason and "covrl scale RUN_DIR --gens 2" in refused.reason
        finally:
            a.close()
            b.close()


def test_a_draining_generator_that_dies_has_its_work_reissued_and_is_not_drained(tiny_model_dir):
    target = [2]
    # Staleness 0: the two prompts the dying generator holds are all version 0 may issue.
    with _elastic_hub(tiny_model_dir, target, "transport.generator_timeout_s=1.5",
                      "rollout.max_staleness_steps=0") as (hub, left):
        a, b = GeneratorSocket(hub.sock.address, KEY), GeneratorSocket(hub.sock.address, KEY)
        try:
            assert isinstance(_hello(a, gen_id=0, inc="a"), messages.Welcome)
            assert isinstance(_hello(b, gen_id=1, inc="b"), messages.Welcome)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
            lost = b.recv(5.0).items
            target[0] = 1
            _until(hub, cluster__generators=1.0, cluster__generators_target=1.0)
            b.close()  # dies while draining, holding two groups
            got, deadline = [], time.time() + 10
            while len(got) < 2 and time.time() < deadline:
                a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
                a.send(messages.Heartbeat(gen_id=0, incarnation="a", policy_version=0))
                if (w := a.recv(0.5)) is not None:
                    got += w.items
            assert [it.prompt_id for it in got] == [it.prompt_id for it in lost]  # re-issued, same prompts
            for it in got:
                a.send(_result(it))
            assert [r.slot for r in hub.take_batch(0, timeout_s=5)] == [0, 1]
            c = hub.stats().counters
            assert c["hub/generator_lost/timeout"] == 1 and c["hub/reissued_prompts"] == 2
            assert "hub/generators_drained" not in c and left == []  # a death, not a drain: the publisher finds out
            assert c["hub/lost_prompts"] == 0
        finally:
            a.close()


def test_scale_up_welcomes_new_ids_and_a_draining_generator_stays_if_the_target_rises_again(tiny_model_dir):
    target = [1]
    with _elastic_hub(tiny_model_dir, target, "transport.generator_timeout_s=30") as (hub, left):
        a, b = GeneratorSocket(hub.sock.address, KEY), GeneratorSocket(hub.sock.address, KEY)
        try:
            assert isinstance(_hello(a, gen_id=0, inc="a"), messages.Welcome)
            refused = _hello(b, gen_id=1, inc="b")
            assert isinstance(refused, messages.Refused) and "outside 0..0" in refused.reason
            assert "covrl scale RUN_DIR --gens 2" in refused.reason
            assert _until(hub, cluster__generators=1.0, cluster__generators_target=1.0)["hub/rejected/handshake"] == 1
            target[0] = 3
            _until(hub, cluster__generators_target=3.0)
            assert isinstance(_hello(b, gen_id=1, inc="b"), messages.Welcome)
            _until(hub, cluster__generators=2.0)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=1))
            held = b.recv(5.0).items
            assert len(held) == 1
            target[0] = 1  # generator 1 starts draining ...
            _until(hub, cluster__generators=1.0, cluster__generators_target=1.0)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=1))
            assert b.recv(0.5) is None
            target[0] = 2  # ... and is wanted again before it is done: its pending request is served
            more = b.recv(5.0)
            assert isinstance(more, messages.Work) and len(more.items) == 1
            b.send(_result(held[0], gen_id=1, inc="b"))
            b.send(_result(more.items[0], gen_id=1, inc="b"))
            assert b.recv(0.5) is None and left == []
            c = _until(hub, cluster__generators=2.0, cluster__generators_target=2.0)
            assert "hub/generators_drained" not in c
        finally:
            a.close()
            b.close()


def test_a_draining_generator_finishes_its_eval_prompts_before_it_is_stopped(tiny_model_dir):
    target, left = [2], []
    with _eval_hub(tiny_model_dir, "run.deterministic=false", target=lambda: target[0],
                   on_leave=lambda *gen: left.append(gen)) as (hub, a):
        b = GeneratorSocket(hub.sock.address, KEY)
        try:
            assert isinstance(_hello(b, gen_id=1, inc="b"), messages.Welcome)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=4))
            sampled = b.recv(5.0)
            assert isinstance(sampled, messages.EvalWork) and sampled.policy_version == 0 and len(sampled.items) == 3
            target[0] = 1
            _until(hub, cluster__generators=1.0, cluster__generators_target=1.0)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=4))
            assert b.recv(0.5) is None  # the greedy set's eval is queued, but not for a draining generator
            a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=4))
            greedy = a.recv(5.0)
            assert isinstance(greedy, messages.EvalWork) and greedy.k == 1
            for it in sampled.items:
                b.send(messages.EvalResult(gen_id=1, incarnation="b", ticket=it.ticket, policy_version=0, rewards=[1.0, 0.0],
                                    lengths=[5, 5], score_status=["ok", "ok"]))
            stop = b.recv(5.0)
            assert isinstance(stop, messages.Stop) and stop.reason == "drained" and left == [(1, "b")]
            a.send(_eval_result(greedy.items[0], 1, [1.0]))
            hub.wait_version_done(0, timeout_s=5)
            m, _ = hub.take_eval(0)
            assert m["eval/sampled_set/acc"] == 0.5 and m["eval/greedy_set/acc"] == 1.0  # the drained one's results count
        finally:
            b.close()


def test_the_learners_target_reader_follows_generators_json_and_keeps_the_last_good_value(tmp_path, caplog):
    from common.runfiles import write_generator_target
    from learner.__main__ import GeneratorTargetReader

    read = GeneratorTargetReader(str(tmp_path), default=3)
    assert read() == 3  # no generators.json (a run from before it existed): cluster.json's count
    write_generator_target(str(tmp_path), 5)
    assert read() == 5
    (tmp_path / "generators.json").write_text('{"generators": 0}')  # by hand: not a target a run can have
    assert read() == 5 and "a run needs at least one" in caplog.text
    (tmp_path / "generators.json").write_text("{not json")
    assert read() == 5 and "covrl scale RUN_DIR --gens N" in caplog.text
    (tmp_path / "generators.json").write_text('{"generators": 2, "revision": 7}')
    assert read() == 2


@contextlib.contextmanager
def _verdict_hub(tiny_model_dir, *extra, exited=None):
    """A hub whose verdicts are recorded; yields (hub, the on_lost calls). `exited`: the hub's poll of the
    processes the launcher saw exit."""
    from transformers import AutoTokenizer

    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             "rollout.max_staleness_steps=2", "learner.filter.dynamic_sampling=false",
                             "eval.every_steps=0", "transport.generator_timeout_s=30", *extra])
    lost = []
    h = Hub(cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, weight_addr="127.0.0.1:1",
            source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)), generators=lambda: 2,
            hooks=Hooks(lost=lambda *v: lost.append(v)), target_poll_s=0.1, exited=exited)
    h.start()
    try:
        yield h, lost
    finally:
        h.stop()


class _Heartbeat:
    """A generator's heartbeat thread on its own socket, reporting `version` as received: alive whatever its main
    loop does."""

    def __init__(self, address, gen_id=0, inc="a"):
        import threading

        self.version, self.stop = 0, threading.Event()
        self.sock = GeneratorSocket(address, KEY)
        self.thread = threading.Thread(target=self._run, args=(gen_id, inc), daemon=True)
        self.thread.start()

    def _run(self, gen_id, inc):
        while not self.stop.wait(0.1):
            self.sock.send(messages.Heartbeat(gen_id=gen_id, incarnation=inc, policy_version=self.version))

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _wait_lost(lost, n, timeout_s) -> float:
    t0 = time.monotonic()
    while len(lost) < n and time.monotonic() - t0 < timeout_s:
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_generator_holding_work_that_returns_nothing_is_stuck_whatever_its_heartbeat(tiny_model_dir):
    """Its heartbeat lives, its main loop sends nothing: lost as `stuck` once the progress limit passes, not before,
    and not while its heartbeat says it still waits for the weights its work names (the learner's delay, not its
    fault). Its work is re-issued with the same slots, and when it comes back it is told to stop."""
    with _verdict_hub(tiny_model_dir, "transport.generator_progress_timeout_s=1") as (hub, lost):
        a = GeneratorSocket(hub.sock.address, KEY)
        beat = _Heartbeat(hub.sock.address)
        try:
            assert isinstance(_hello(a), messages.Welcome)
            hub.set_version(1)  # the learner moved on: work is now issued at version 1
            a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
            held = a.recv(5.0)
            assert [it.ticket for it in held.items] == [0, 1] and held.policy_version == 1
            time.sleep(2.5)  # 2.5 x the limit, but its heartbeat says it has version 0 only: waiting for weights
            assert lost == [], "a generator waiting for the weights its work needs was declared stuck"
            beat.version = 1  # the weights arrived; from here its silence is its own
            waited = _wait_lost(lost, 1, 10)
            # The clock restarts at the last check that saw it waiting (every 0.25 s), before its heartbeat said
            # otherwise: so 0.75 s at the earliest.
            assert len(lost) == 1 and 0.7 <= waited < 2.5, f"declared after {waited:.2f}s with a 1 s limit"
            gen_id, inc, pid, why, detail = lost[0]
            assert (gen_id, inc, pid, why) == (0, "a", 1, "stuck") and "held 2 groups (slots 0..1)" in detail
            c = hub.stats().counters
            assert c["hub/generator_lost/stuck"] == 1 and c["hub/reissued_prompts"] == 2
            a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))  # unwedged: it must not go on
            stop = a.recv(5.0)
            assert isinstance(stop, messages.Stop) and stop.reason == "lost: stuck"
            b = GeneratorSocket(hub.sock.address, KEY)
            assert isinstance(_hello(b, gen_id=1, inc="b"), messages.Welcome)
            b.send(messages.WorkRequest(gen_id=1, incarnation="b", max_groups=2))
            again = b.recv(5.0)
            assert sorted(it.prompt_id for it in again.items) == sorted(it.prompt_id for it in held.items)
            for it in held.items:  # the lost incarnation's late results are refused, never trained
                a.send(_result(it, version=1))
            for it in again.items:
                b.send(_result(it, gen_id=1, inc="b", version=1))
            batch = hub.take_batch(1, timeout_s=5)
            assert [r.slot for r in batch] == [0, 1] and all(r.group.gen_id == 1 for r in batch)
            c = hub.stats().counters
            assert c["hub/lost_prompts"] == 0 and c.get("hub/duplicate_trained_prompts", 0) == 0
            assert c["hub/rejected/unknown_generator"] >= 2
            b.close()
        finally:
            beat.close()
            a.close()


def test_the_derived_progress_limit_follows_the_slowest_reply_above_its_floor(tiny_model_dir):
    with _verdict_hub(tiny_model_dir, "transport.generator_progress_floor_s=0.5",
                      "transport.generator_progress_factor=4") as (hub, lost):
        assert hub.progress_limit_s() == 0.5  # nothing measured yet: the floor
        a = GeneratorSocket(hub.sock.address, KEY)
        assert isinstance(_hello(a), messages.Welcome)
        a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
        work = a.recv(5.0)
        time.sleep(0.3)
        for it in work.items:
            a.send(_result(it))
        hub.take_batch(0, timeout_s=5)
        assert 4 * 0.3 <= hub.progress_limit_s() < 4 * 0.3 + 1.0 and lost == []
        a.close()


def test_a_failed_weight_channel_is_the_hubs_verdict_and_a_stale_report_is_ignored(tiny_model_dir):
    with _verdict_hub(tiny_model_dir) as (hub, lost):
        a = GeneratorSocket(hub.sock.address, KEY)
        assert isinstance(_hello(a), messages.Welcome)
        a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
        assert isinstance(a.recv(5.0), messages.Work)
        hub.lose(0, "older", "a report about an incarnation already replaced")
        assert lost == []
        hub.lose(0, "a", "a weight send was not taken within 60s")
        assert [(v[0], v[1], v[3]) for v in lost] == [(0, "a", "weight_channel")]
        hub.lose(0, "a", "the same channel again")  # decided once
        c = hub.stats().counters
        assert len(lost) == 1 and c["hub/generator_lost/weight_channel"] == 1 and c["hub/reissued_prompts"] == 2
        a.close()


def test_a_generator_the_launcher_saw_exit_is_lost_at_once_and_a_report_on_another_pid_is_ignored(tiny_model_dir):
    """Without the launcher's word, a dead generator's work waits for its silence's timeout (30 s here) or its
    replacement's hello, and a generator set aside has no replacement. With it, within a poll."""
    reports = [[(0, 777, "exited with code -9")]]  # another process under id 0: an incarnation already gone

    def exited():
        return reports.pop(0) if reports else []

    with _verdict_hub(tiny_model_dir, exited=exited) as (hub, lost):
        a = GeneratorSocket(hub.sock.address, KEY)
        assert isinstance(_hello(a), messages.Welcome)  # pid 1
        a.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
        assert isinstance(a.recv(5.0), messages.Work)
        time.sleep(0.5)
        assert lost == [], "a report about another pid stopped a live generator"
        reports.append([(0, 1, "exited with code 1")])
        waited = _wait_lost(lost, 1, 5)
        assert waited < 1.0 and [(v[0], v[1], v[2], v[3]) for v in lost] == [(0, "a", 1, "exited")]
        assert "the launcher saw its process exited with code 1" in lost[0][4]
        c = hub.stats().counters
        assert c["hub/generator_lost/exited"] == 1 and c["hub/reissued_prompts"] == 2
        a.close()


def test_free_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice():
    """A port the launcher chooses is bound seconds later by another process (the hub, the weight store, the
    learners' rendezvous): from the kernel's ephemeral range an outgoing connection could take it meanwhile."""
    from common import transport

    ports = [transport.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    low = transport._ephemeral_low()
    if low > 2048:  # Linux: the range is readable
        assert all(max(1024, low - 16384) <= p < low for p in ports), (low, min(ports), max(ports))
    for p in ports[:5]:
        assert transport.port_in_use("127.0.0.1", p) is None


def _scored(item: messages.WorkItem, version: int, spread: bool) -> messages.RolloutGroup:
    """A group of two one-token responses sampled at `version`: rewards 1 and 0 (`spread`), else both 1 (a group
    dynamic sampling drops)."""
    samples = [sample([3], reward, logprobs=-0.1, versions=version) for reward in ((1.0, 0.0) if spread else (1.0, 1.0))]
    return rollout_group(samples, item=item, incarnation="a", gen_time_s=0.1)


def test_a_forced_lag_trains_every_token_exactly_that_many_versions_old(tiny_model_dir):
    """rollout.forced_lag = 3: the batch of the step starting at version v is exactly the generation issued at
    max(0, v - 3), whatever the generator's pace, with every third group dropped by dynamic sampling and refilled."""
    from transformers import AutoTokenizer

    k, steps = 3, 9
    cfg = load_config(None, ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                             f"rollout.max_staleness_steps={k + 1}", f"rollout.forced_lag={k}", f"run.steps={steps}",
                             "eval.every_steps=0"])
    hub = Hub(cfg, run_id="run1", key=KEY, host="127.0.0.1", port=0, weight_addr="127.0.0.1:1", generators=lambda: 1,
              source=PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)))
    hub.start()
    gen = GeneratorSocket(hub.sock.address, KEY)
    answered = 0
    try:
        assert isinstance(_hello(gen), messages.Welcome)
        for v in range(steps):
            while True:  # the generator takes all the work it is given, at once (much faster than the learner)
                gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=8))
                work = gen.recv(0.3)
                if work is None:
                    break
                if v == 5:  # the publish of v + 1 waits for the work issued at v, even with v's batch long ready
                    with pytest.raises(TimeoutError):
                        hub.wait_version_done(v, timeout_s=0.2)
                for item in work.items:
                    answered += 1
                    gen.send(_scored(item, work.policy_version, spread=answered % 3 != 0))
            batch = hub.take_batch(v, timeout_s=5)
            lags = {v - int(messages.as_array(s.versions, messages.VERSION_DTYPE)[0]) for r in batch
                    for s in r.group.samples}
            assert len(batch) == 2 and lags == {min(v, k)}, (v, lags)
            hub.wait_version_done(v, timeout_s=5)
            hub.set_version(v + 1)
        assert hub.stats().counters["hub/filtered_groups"] >= 4  # the refills were exercised
    finally:
        gen.close()
        hub.stop()
