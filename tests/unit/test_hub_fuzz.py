"""Hostile input at the hub: 10,000 fuzzed frames; the hub survives, rejects each one with a counted
reason, and then trains on a well-behaved generator's groups as if nothing had happened."""

import random
import time

import msgspec
import numpy as np
import zmq

from common import messages
from common.transport import GeneratorSocket, _mac
from tests.helpers.groups import rollout_group, sample

KEY = b"s" * 32
N_FRAMES = 10_000
# The `hub` fixture's config (tests/unit/conftest.py).
HUB_SETTINGS = ["data.train_size=64", "rollout.groups_per_step=2", "rollout.group_size=2",
                "rollout.max_staleness_steps=0", "learner.filter.dynamic_sampling=false", "rollout.max_new_tokens=8",
                "eval.every_steps=0"]


def _group(item, n=2, tokens=(3, 4), logprobs=(-0.1, -0.2), versions=(0, 0), inc="a"):
    s = sample(list(tokens), logprobs=list(logprobs), versions=list(versions))
    return rollout_group([s] * n, item=item, incarnation=inc, gen_time_s=0.1)


def _wait(hub, expected: dict[str, int], timeout_s=60.0) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        c = hub.stats().counters
        if all(c.get(k, 0) >= v for k, v in expected.items()):
            return c
        time.sleep(0.2)
    return hub.stats().counters


def test_ten_thousand_hostile_frames(hub):
    rng = random.Random(1234)
    gen = GeneratorSocket(hub.sock.address, KEY)
    gen.send(messages.Hello(protocol_version=messages.PROTOCOL_VERSION, run_id="run1", gen_id=0, incarnation="a", pid=1))
    assert isinstance(gen.recv(5), messages.Welcome)
    insider = GeneratorSocket(hub.sock.address, KEY)  # holds the key, speaks garbage
    outsider = zmq.Context.instance().socket(zmq.DEALER)  # no key at all
    outsider.setsockopt(zmq.LINGER, 0)
    outsider.connect(f"tcp://{hub.sock.address}")
    enc = msgspec.msgpack.Encoder()
    signed = lambda body: insider.sock.send_multipart([_mac(KEY, body), body])  # noqa: E731
    fake_item = messages.WorkItem(ticket=10**6, prompt_id=0, epoch=0, prompt_ids=messages.to_bytes([1, 2], messages.TOKEN_DTYPE),
                           answer="", data_source="", seed=0)
    kinds = ["random", "truncated", "bad_mac", "garbage_body", "wrong_tag", "old_protocol", "future_protocol",
             "stranger", "unknown_ticket"]
    sent = dict.fromkeys(kinds, 0)
    for _ in range(N_FRAMES):
        kind = rng.choice(kinds)
        sent[kind] += 1
        blob = rng.randbytes(rng.randint(0, 300))
        if kind == "random":  # two frames of noise
            outsider.send_multipart([blob, rng.randbytes(rng.randint(1, 64))])
        elif kind == "truncated":  # a multipart message cut short or padded
            outsider.send_multipart([blob] * rng.choice([1, 3, 4]))
        elif kind == "bad_mac":  # a real message under the wrong key
            outsider.send_multipart([_mac(b"x" * 32, b"hi"), enc.encode(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=9))])
        elif kind == "garbage_body":
            signed(blob)
        elif kind == "wrong_tag":  # a message the hub never receives (hub -> generator types)
            signed(enc.encode(rng.choice([messages.Stop(reason="x"), messages.Refused(reason="y")])))
        elif kind in ("old_protocol", "future_protocol"):
            v = messages.PROTOCOL_VERSION + (-1 if kind == "old_protocol" else rng.randint(1, 10**6))
            signed(enc.encode(messages.Hello(protocol_version=v, run_id="run1", gen_id=1, incarnation="z", pid=2)))
        elif kind == "stranger":  # a generator that never said hello
            signed(enc.encode(messages.Heartbeat(gen_id=1, incarnation="nobody", policy_version=-5)))
        elif kind == "unknown_ticket":  # right generator, a ticket the hub never issued
            signed(enc.encode(_group(fake_item)))
    expected = {"hub/rejected/frames": sent["truncated"], "hub/rejected/auth": sent["random"] + sent["bad_mac"],
                "hub/rejected/malformed": sent["garbage_body"] + sent["wrong_tag"],
                "hub/rejected/handshake": sent["old_protocol"] + sent["future_protocol"],
                "hub/rejected/unknown_generator": sent["stranger"], "hub/rejected/unknown_ticket": sent["unknown_ticket"]}
    c = _wait(hub, expected)
    for key, n in expected.items():  # every frame rejected once, for its own reason
        assert c.get(key, 0) == n, (key, c.get(key), n)
    assert hub.error is None and all(n > 900 for n in sent.values())

    # Well-formed groups for real tickets with broken contents: each rejected with its reason, its prompt re-issued.
    defects = {"length_mismatch": dict(logprobs=(-0.1,)), "version": dict(versions=(0, -3)),
               "token_ids": dict(tokens=tuple(range(3, 12)), logprobs=(-0.1,) * 9, versions=(0,) * 9),
               "logprobs": dict(logprobs=(-0.1, float("nan"))), "group_size": dict(n=3)}
    for reason, bad in defects.items():
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=1))
        work = gen.recv(5)
        assert isinstance(work, messages.Work), reason
        gen.send(_group(work.items[0], **bad))
        assert _wait(hub, {f"hub/rejected/{reason}": 1}, 10).get(f"hub/rejected/{reason}") == 1, reason
    gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=1))
    future = gen.recv(5)
    gen.send(_group(future.items[0], versions=(0, 7)))  # a version the learner has not published
    assert _wait(hub, {"hub/rejected/version": 2}, 10)["hub/rejected/version"] == 2

    # ...and training is unaffected: the two slots of step 1 arrive, in order, from the honest generator.
    got = []
    deadline = time.time() + 20
    while len(got) < 2 and time.time() < deadline:
        gen.send(messages.WorkRequest(gen_id=0, incarnation="a", max_groups=2))
        w = gen.recv(2)
        if isinstance(w, messages.Work):
            for it in w.items:
                gen.send(_group(it))
                got.append(it)
    batch = hub.take_batch(0, timeout_s=10)
    assert [r.slot for r in batch] == [0, 1] and hub.error is None
    assert all(np.array_equal(messages.as_array(s.token_ids, messages.TOKEN_DTYPE), [3, 4]) for r in batch for s in r.group.samples)
    outsider.close(0)
    insider.close()
    gen.close()
