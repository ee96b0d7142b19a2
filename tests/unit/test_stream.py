"""A generator that keeps its engine full (actors/actor.py, actors/continuous.py, broker/hub.py).

The torch engine's continuous batch against its static `generate` (the same samples, whenever a group joins), groups
leaving in the order they finish, weights swapped mid-stream stamping the new version; the hub's side of the protocol:
a generator's room honoured with groups still on the wire, kept open across versions (several Works in flight),
shared between generators, and a request from a generator that holds work not counting as progress; and a real
generator (`run_actor`) against a real hub whose admission opens step by step."""

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from actors.continuous import StreamingTorchEngine
from common import messages
from common.messages import SamplingParams
from common.transport import GeneratorSocket
from tests.helpers.groups import rollout_group, sample

KEY = b"s" * 32
# The `hub` fixture's config (tests/unit/conftest.py): 2 groups of 2 a step, on-policy, a short progress limit.
HUB_SETTINGS = ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                "rollout.max_staleness_steps=0", "transport.generator_timeout_s=1.5",
                "learner.filter.dynamic_sampling=false", "transport.generator_progress_timeout_s=3"]


def _hello(sock, gen_id=0, inc="a"):
    sock.send(messages.Hello(protocol_version=messages.PROTOCOL_VERSION, run_id="run1", gen_id=gen_id,
                             incarnation=inc, pid=1))
    return sock.recv(5.0)


def _result(item: messages.WorkItem, gen_id=0, inc="a"):
    s = sample([3, 4], logprobs=[-0.1, -0.2], versions=0)
    return rollout_group([s] * 2, item=item, gen_id=gen_id, incarnation=inc, gen_time_s=0.1)

SP = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _engine(tiny_model_dir, tok, rows):
    return StreamingTorchEngine(tiny_model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_num_seqs=rows)


def _prompts(tok, n):
    return [list(tok(f"What is {i} + {3 * i + 1}?")["input_ids"]) for i in range(n)]


def _drain(engine, hook=lambda: None, each=None):
    got, order = {}, []
    while engine.in_flight:
        for key, comps in engine.collect(0.01, hook):
            got[key] = comps
            order.append(key)
        if each is not None:
            each()
    return got, order


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-4)
        assert x.finish_reason == y.finish_reason and x.entropy == pytest.approx(y.entropy, abs=1e-3)
        np.testing.assert_array_equal(x.versions, y.versions)


@pytest.mark.parametrize("sampling", [SP, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=40,
                                                          forced_length_median=12, forced_length_sigma=0.9)])
def test_the_continuous_batch_draws_the_samples_of_the_static_batch_with_groups_joining_as_rows_free(
        tiny_model_dir, tok, sampling):
    """7 groups of 4 through 12 rows: at most 3 groups run at once, the rest join as earlier ones leave; every
    sample equals what `generate` draws for the same prompt and seed in one static batch."""
    engine = _engine(tiny_model_dir, tok, rows=12)
    prompts = _prompts(tok, 7)
    ref = engine.generate(prompts, 4, sampling, list(range(7)))
    most = []
    for i, p in enumerate(prompts):
        engine.submit(i, p, 4, sampling, i)
    got, order = _drain(engine, each=lambda: most.append(len(engine._stream.owner)))
    assert sorted(order) == list(range(7)) and max(most) <= 12
    assert order != list(range(7)) or sampling.forced_length_median == 0  # forced lengths differ: order changes
    for i in range(7):
        _same(ref[i], got[i])


def test_attention_buckets_cover_the_rows_in_order_and_bound_what_each_row_reads():
    from actors.continuous import _BUCKET_FIXED, attention_buckets

    # One straggler among short rows: it gets its own bucket; the short rows are not padded to it.
    assert attention_buckets(np.array([1200] + [150] * 127)) == [(0, 1, 1200), (1, 128, 150)]
    # Rows of similar lengths (within a factor 2): one bucket over the longest.
    assert attention_buckets(np.array([300, 290, 200, 160])) == [(0, 4, 300)]
    # A split that saves less than a bucket's fixed cost is not made.
    assert attention_buckets(np.array([40, 10, 10])) == [(0, 3, 40)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        ends = np.sort(rng.lognormal(5, 1, rng.integers(1, 200)).astype(int) + 1)[::-1]
        ends[rng.random(len(ends)) < 0.1] += 7  # admission order is almost, not exactly, by length
        b = attention_buckets(ends)
        assert b[0][0] == 0 and b[-1][1] == len(ends) and all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert all(e == ends[i:j].max() for i, j, e in b)  # each bucket reads its longest row's entries
        read = sum((j - i) * e for i, j, e in b)
        assert read <= 2 * ends.sum() + 8 + _BUCKET_FIXED * len(b)  # within 2x plus the joins' allowance


def test_the_continuous_batch_in_several_attention_buckets_draws_the_static_batchs_samples(
        tiny_model_dir, tok, monkeypatch):
    """Heavy-tailed lengths with buckets free to split (no fixed cost): rows of different lengths attend in
    different buckets, finished rows leave holes that rows from the ends of the buckets fill, and every sample still
    equals the static batch's."""
    import actors.continuous as C

    monkeypatch.setattr(C, "_BUCKET_FIXED", 0)
    seen = []
    real = C.attention_buckets
    monkeypatch.setattr(C, "attention_buckets", lambda ends: seen.append(real(ends)) or seen[-1])
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=80, forced_length_median=10,
                        forced_length_sigma=1.0)
    engine = _engine(tiny_model_dir, tok, rows=16)
    prompts = _prompts(tok, 9)
    ref = engine.generate(prompts, 4, sp, list(range(9)))
    for i, p in enumerate(prompts):
        engine.submit(i, p, 4, sp, i)
    got, _ = _drain(engine)
    assert max(len(b) for b in seen) >= 2
    for i in range(9):
        _same(ref[i], got[i])


def test_a_group_leaves_the_moment_its_samples_end_and_a_late_one_joins_running_rows(tiny_model_dir, tok):
    """A long group submitted first and a short one after it started: the short one comes back first, while the long
    one is still running, and both equal their static-batch samples."""
    engine = _engine(tiny_model_dir, tok, rows=16)
    long_sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=60, forced_length_median=60,
                             forced_length_sigma=0.0)
    short_sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=60, forced_length_median=5,
                              forced_length_sigma=0.0)
    p_long, p_short = _prompts(tok, 2)
    engine.submit("long", p_long, 4, long_sp, 1)
    assert engine.collect(0.0, lambda: None) == [] and len(engine._stream.owner) == 4  # one iteration: it runs
    engine.submit("joins", p_short, 4, long_sp, 2)  # the same sampling: admitted beside the running rows
    assert engine.collect(0.0, lambda: None) == [] and len(engine._stream.owner) == 8
    got, _ = _drain(engine)
    _same(engine.generate([p_short], 4, long_sp, [2])[0], got["joins"])
    engine.submit("long", p_long, 4, long_sp, 1)
    engine.collect(0.0, lambda: None)
    # A different sampling (a shorter forced length) waits for the running rows: it cannot overtake them.
    engine.submit("short", p_short, 4, short_sp, 2)
    _, order = _drain(engine)
    assert order == ["long", "short"]
    # With the same sampling, lengths decide: forced lengths drawn per row, the shortest group first.
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=64, forced_length_median=16,
                        forced_length_sigma=1.0)
    prompts = _prompts(tok, 6)
    for i, p in enumerate(prompts):
        engine.submit(i, p, 2, sp, 100 + i)
    got, order = _drain(engine)
    longest = {k: max(len(c.token_ids) for c in comps) for k, comps in got.items()}
    assert order == sorted(order, key=lambda k: longest[k])
    assert len(set(longest.values())) > 1  # the workload is not trivially ordered


def test_weights_swapped_mid_stream_stamp_the_new_version_on_later_tokens_only(tiny_model_dir, tok):
    engine = _engine(tiny_model_dir, tok, rows=8)
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=30, forced_length_median=30, forced_length_sigma=0.0)
    prompts = _prompts(tok, 2)
    engine.submit(0, prompts[0], 4, sp, 0)
    calls = []
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}

    def hook():
        calls.append(1)
        if len(calls) == 10:
            engine.model.load_state_dict(new)
            engine.version = 5
            engine.submit(1, prompts[1], 4, sp, 1)  # joins after the swap: all of it is version 5

    got, _ = _drain(engine, hook)
    for c in got[0]:
        assert list(c.versions[:9]) == [0] * 9 and set(c.versions[9:]) == {5}
    assert all(set(c.versions) == {5} for c in got[1])


# ---- the hub's side: a generator's room ----


@contextlib.contextmanager
def _generator(hub, gen_id=0, inc="a"):
    sock = GeneratorSocket(hub.sock.address, KEY)
    try:
        assert isinstance(_hello(sock, gen_id=gen_id, inc=inc), messages.Welcome)
        yield sock
    finally:
        sock.close()


def _want(sock, room, received, gen_id=0, inc="a", capacity=8):
    sock.send(messages.WorkRequest(gen_id=gen_id, incarnation=inc, max_groups=room, received_groups=received,
                                   capacity=capacity))


def test_the_hub_fills_a_generators_room_across_versions_without_counting_a_group_twice(hub):
    """Staleness 0, 2 groups a step: a room of 3 gets the 2 admissible groups, then (no new request) the 3rd once
    version 1 opens admission; a request that crossed a Work on the wire (received_groups behind) gets nothing more
    than the room; the generator holds Works of two versions at once."""
    with _generator(hub) as gen:
        _want(gen, 3, 0)
        first = gen.recv(5.0)
        assert isinstance(first, messages.Work) and len(first.items) == 2 and first.policy_version == 0
        _want(gen, 3, 0)  # sent before it saw `first`: 2 groups are on the wire, so the room is 1
        for it in first.items:
            gen.send(_result(it))
        hub.take_batch(0, timeout_s=5)
        hub.set_version(1)
        second = gen.recv(5.0)
        assert isinstance(second, messages.Work) and second.policy_version == 1 and len(second.items) == 1
        assert gen.recv(0.3) is None  # room filled: nothing more until it asks
        _want(gen, 2, 3)  # it holds 1 of 3: room 2
        third = gen.recv(5.0)
        assert isinstance(third, messages.Work) and len(third.items) == 1  # admission: 2 a step, 1 given
        assert {it.ticket for it in second.items}.isdisjoint(it.ticket for it in third.items)


def test_a_streaming_generator_that_dies_holding_several_works_loses_nothing(hub):
    """Generator a holds two Works of version 1 (one group each, asked for as its room freed) and dies without a
    word; b gets both groups again (same slots, prompts and seeds), the step trains them once, and the ledger
    shows nothing lost or trained twice."""
    with _generator(hub) as a:
        _want(a, 3, 0)
        first = a.recv(5.0)
        for it in first.items:
            a.send(_result(it))
        hub.take_batch(0, timeout_s=5)
        hub.set_version(1)
        second = a.recv(5.0)  # the room left open: 1 group
        _want(a, 2, 3)
        third = a.recv(5.0)
        held = [*second.items, *third.items]
        assert isinstance(third, messages.Work) and len(second.items) == len(third.items) == 1
    # a is gone, holding both Works (no heartbeat follows); b asks until they are re-issued to it
    with _generator(hub, 1, "b") as b:
        got, deadline = [], time.monotonic() + 15
        while len(got) < 2 and time.monotonic() < deadline:
            _want(b, 4, len(got), gen_id=1, inc="b")
            b.send(messages.Heartbeat(gen_id=1, incarnation="b", policy_version=1))
            w = b.recv(0.5)
            if isinstance(w, messages.Work):
                got += w.items
        key = lambda it: (it.prompt_id, it.epoch, it.seed)
        assert sorted(map(key, got)) == sorted(map(key, held)), "the dead generator's groups were not re-issued"
        s = sample([3, 4], logprobs=[-0.1, -0.2], versions=1)  # generated at version 1: inside the bound
        for it in got:
            b.send(rollout_group([s] * 2, item=it, gen_id=1, incarnation="b", gen_time_s=0.1))
        assert sorted(r.slot for r in hub.take_batch(1, timeout_s=10)) == [2, 3]
        c = hub.stats().counters
        assert c["hub/reissued_prompts"] == 2 and c["hub/lost_prompts"] == 0
        assert c.get("hub/duplicate_trained_prompts", 0) == 0


def test_generators_waiting_together_share_what_admission_allows(hub):
    """Generator a takes the first step's 2 groups and keeps room for 6 more; b asks for 8 while admission is closed.
    When version 1 opens 2 more slots, each gets one: the first to ask does not take them all."""
    with _generator(hub, 0, "a") as a, _generator(hub, 1, "b") as b:
        _want(a, 8, 0)
        first = a.recv(5.0)
        assert isinstance(first, messages.Work) and len(first.items) == 2
        _want(b, 8, 0, gen_id=1, inc="b")
        assert b.recv(0.3) is None  # admission: closed until version 1
        for it in first.items:
            a.send(_result(it))
        hub.take_batch(0, timeout_s=5)
        hub.set_version(1)
        wa, wb = a.recv(5.0), b.recv(5.0)
        assert isinstance(wa, messages.Work) and isinstance(wb, messages.Work)
        assert len(wa.items) == len(wb.items) == 1


def test_requests_from_a_generator_that_holds_work_are_not_progress(hub):
    """Its engine wedged with groups in flight, a streaming generator's main loop may still ask for its free room:
    the hub declares it stuck all the same."""
    with _generator(hub) as gen:
        _want(gen, 8, 0)
        assert isinstance(gen.recv(5.0), messages.Work)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and hub.stats().counters.get("hub/generator_lost/stuck", 0) == 0:
            gen.send(messages.Heartbeat(gen_id=0, incarnation="a", policy_version=0))
            _want(gen, 6, 2)
            time.sleep(0.2)
        assert hub.stats().counters.get("hub/generator_lost/stuck") == 1


# ---- a real generator against a real hub ----


def test_a_real_generator_takes_work_of_new_versions_while_it_holds_older_and_labels_every_token(tiny_model_dir):
    """Staleness 1, in-flight updates: the generator (`run_actor`, streaming) takes version 0's four groups, then,
    with no request of its own in between, each version's new groups as admission opens, while older ones may still
    run; every slot is trained once, in order, no token is older than the bound, and the groups issued at a version
    carry no token older than it."""
    from transformers import AutoModelForCausalLM

    from learner.publisher import ModelPublisher
    from tests.helpers.actor_hub import generator_and_hub
    from tests.helpers.hooks import Hooks

    settings = ("rollout.max_staleness_steps=1", "run.deterministic=false", "rollout.max_new_tokens=24",
                'generator.loop="stream"')
    with generator_and_hub(tiny_model_dir, lambda: 2, lambda pub: Hooks(join=pub.join), settings) as (hub, pub, _, _):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        publisher = ModelPublisher(model, zero3=False, channel=pub)
        batches = [hub.take_batch(0, timeout_s=60)]
        torch.manual_seed(0)
        for v in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            hub.set_version(v)
            publisher.publish(v)
            batches.append(hub.take_batch(v, timeout_s=60))
        slots = [[r.slot for r in b] for b in batches]
        assert slots == [[0, 1], [2, 3], [4, 5], [6, 7]]
        for v, batch in enumerate(batches):
            for r in batch:
                issued_at = r.slot // 2 - 1  # admission: slots of step s+1 open at version s - 1 (staleness 1)
                versions = np.concatenate([messages.as_array(s.versions, messages.VERSION_DTYPE) for s in r.group.samples])
                assert versions.min() >= max(0, issued_at) and versions.min() >= v - 1 and versions.max() <= v
        with hub.cv:
            assert hub.gens[1].issued == hub.slots >= 8
        c = hub.stats().counters
        assert c["hub/lost_prompts"] == 0 and c.get("hub/duplicate_trained_prompts", 0) == 0
        assert c.get("hub/rejected/unknown_ticket", 0) == 0


def test_a_generator_whose_whole_room_came_back_at_once_asks_again_at_once(tiny_model_dir):
    """Room 2 (rollout.groups_per_request), filled by one Work and emptied in one turn: the hub closed that room
    when it filled it, so the generator must ask again as soon as its groups are out, not after
    transport.recv_timeout_s (30 s here)."""
    from transformers import AutoModelForCausalLM

    from learner.publisher import ModelPublisher
    from tests.helpers.actor_hub import generator_and_hub
    from tests.helpers.hooks import Hooks

    settings = ("rollout.groups_per_request=2", "transport.recv_timeout_s=30", "run.deterministic=false",
                'generator.loop="stream"')
    with generator_and_hub(tiny_model_dir, lambda: 2, lambda pub: Hooks(join=pub.join), settings) as (hub, pub, _, _):
        publisher = ModelPublisher(AutoModelForCausalLM.from_pretrained(tiny_model_dir), zero3=False, channel=pub)
        hub.take_batch(0, timeout_s=60)
        for v in (1, 2):
            hub.set_version(v)
            publisher.publish(v)
            t0 = time.monotonic()
            assert [r.slot for r in hub.take_batch(v, timeout_s=60)] == [2 * v, 2 * v + 1]
            assert time.monotonic() - t0 < 15, "the generator waited for its poll instead of asking"


def test_a_deterministic_run_keeps_one_static_batch_per_work_sized_to_a_step():
    """generator.loop "auto": a continuous batch's last bits depend on timing, so a deterministic run (the default,
    or a forced lag) takes the batch loop, one step's groups per Work unless groups_per_request says otherwise."""
    from common.config import generator_loop, load_config
    from common.heldout import batch_groups

    assert generator_loop(load_config(None, []), on_cpu=False) == "batch"
    assert generator_loop(load_config(None, ["run.deterministic=false"]), on_cpu=False) == "stream"
    assert generator_loop(load_config(None, ["run.deterministic=false"]), on_cpu=True) == "batch"  # CPU decode
    assert generator_loop(load_config(None, ["run.deterministic=false", "rollout.forced_lag=1"]), on_cpu=False) == "batch"
    assert generator_loop(load_config(None, ["generator.loop=\"stream\""]), on_cpu=True) == "stream"
    cfg = load_config(None, ["rollout.groups_per_step=16"])
    assert batch_groups(cfg, 32) == 16 and batch_groups(cfg, 8) == 8
    assert batch_groups(load_config(None, ["rollout.groups_per_request=4"]), 32) == 4
