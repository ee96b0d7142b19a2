import threading
import time

import pytest
import torch
from torch.testing import assert_close

from common import weights
from common.transport import free_port
from learner.nccl import wait_until
from tests.helpers.paths import REPO
from tests.helpers.weight_channel import receive


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def test_flatten_roundtrip_and_checksum_sensitivity():
    a, b = _model(0), _model(1)
    flat = weights.flatten(a)
    weights.load_flat(b, flat)
    assert_close(weights.flatten(b), flat)
    swapped = flat.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert weights.checksum(swapped) != weights.checksum(flat)  # order-sensitive


def test_bucket_plan_cuts_at_parameter_boundaries():
    lay = weights.Layout(("a", "b", "c", "d"), ((3, 2), (5,), (20,), (4,)))  # 6, 5, 20, 4 elements
    assert weights.bucket_plan(lay, 12) == [(0, 2, 0, 11), (2, 3, 11, 31), (3, 4, 31, 35)]  # c alone exceeds 12
    assert weights.bucket_plan(lay, 1000) == [(0, 4, 0, 35)]
    assert [(s, e) for _, _, s, e in weights.bucket_plan(lay, 1)] == [(0, 6), (6, 11), (11, 31), (31, 35)]


def test_checksum_is_the_same_whole_or_by_buckets(monkeypatch):
    monkeypatch.setattr(weights, "CHECKSUM_SAMPLES", 7)  # stride > 1, crossing bucket edges at odd offsets
    monkeypatch.setattr(weights, "BUCKET_NUMEL", 16)
    src = _model(0)
    lay, flat = weights.layout(src), weights.flatten(src)
    one = weights.Checksum(flat.numel())
    one.add(flat, 0)
    strided = flat[:: max(1, flat.numel() // 7)].double()
    expected = float((strided * (torch.arange(1, strided.numel() + 1, dtype=torch.float64) % 1013 + 1)).sum())
    assert one.total == pytest.approx(expected, rel=1e-12)
    assert weights.checksum(flat, lay) == pytest.approx(one.total, rel=1e-12)


def test_publisher_broadcasts_to_two_generators_then_stops(monkeypatch):
    """Each generator has its own pair channel; every version reaches both, bucket by bucket, with the sender's
    checksum; a receiver may take each version into the vector of the one before."""
    from learner.publisher import WeightPublisher

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 16)  # force several buckets
    port = free_port()
    src = _model(0)
    lay = weights.layout(src)
    pub = WeightPublisher("127.0.0.1", port, 30)
    got = {0: [], 1: []}
    reused = []

    def receiver(gen_id):
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(gen_id, "x"))
        buf = None  # generator 1 receives each version into the previous one's vector, as the actor does once applied
        while (r := receive(ch, lay, out=buf)) is not None:
            got[gen_id].append((r[0], r[1].clone(), r[2]))
            if gen_id == 1:
                reused.append(buf is not None and r[1].data_ptr() == buf.data_ptr())
                buf = r[1]

    threads = [threading.Thread(target=receiver, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for g in (0, 1):
        pub.join(g, "x")
    assert wait_until(lambda: len(pub.channels) == 2, 30, 0.01)
    sent, sums = [], []
    for v in (1, 2):
        with torch.no_grad():
            for p in src.parameters():
                p.add_(0.5)
        flat = weights.flatten(src)
        sent.append(flat.clone())
        buckets = [flat[b.start:b.stop] for b in weights.wire_plan(lay)]
        assert len(buckets) > 2
        seconds, nbytes, total = pub.publish(v, lay, iter(buckets))
        assert nbytes == lay.numel * 4 and 0 < seconds < 30  # timed, and not stuck on a receiver
        sums.append(total)
    pub.stop()
    for t in threads:
        t.join(10)
    assert reused == [False, True]
    for gen_id in (0, 1):
        assert [v for v, _, _ in got[gen_id]] == [1, 2]
        for (_, flat, total), ref, sent_sum in zip(got[gen_id], sent, sums):
            assert torch.equal(flat, ref) and total == sent_sum == weights.checksum(ref, lay)  # to the bit


def test_leave_closes_a_drained_generators_channel_without_counting_a_failure():
    """The hub drained generator 1: its receiver is told to stop, its channel goes, the count is `left` (not
    `dropped`), and the next version reaches only generator 0."""
    from learner.publisher import WeightPublisher

    port = free_port()
    src = _model(0)
    lay = weights.layout(src)
    pub = WeightPublisher("127.0.0.1", port, 30)
    got = {0: [], 1: []}

    def receiver(gen_id, inc):
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(gen_id, inc))
        while (r := receive(ch, lay)) is not None:
            got[gen_id].append(r[0])

    incarnations = {0: "x", 1: "y"}
    threads = {g: threading.Thread(target=receiver, args=(g, inc)) for g, inc in incarnations.items()}
    for g, t in threads.items():
        t.start()
        pub.join(g, incarnations[g])
    assert wait_until(lambda: len(pub.channels) == 2, 30, 0.01)
    flat = weights.flatten(src)
    pub.publish(1, lay, iter([flat[b.start:b.stop] for b in weights.wire_plan(lay)]))
    pub.leave(1, "y")
    threads[1].join(10)
    assert not threads[1].is_alive()  # its receiver got the stop header: it ends cleanly, as a drained generator does
    assert wait_until(lambda: 1 not in pub.channels, 10, 0.01)
    pub.publish(2, lay, iter([flat[b.start:b.stop] for b in weights.wire_plan(lay)]))
    pub.leave(0, "stale")  # another incarnation of generator 0 than the one connected: nothing to close
    pub.stop()
    threads[0].join(10)
    assert got == {0: [1, 2], 1: [1]}
    c = pub.counter_values()
    assert c["weights/left_channels"] == 1 and c["weights/joins"] == 2 and "weights/dropped_channels" not in c


def test_a_generator_drained_before_its_rendezvous_is_never_admitted():
    """`leave` before the join thread's rendezvous completes: the channel is built, told to stop at once, and never
    enters the broadcast list; it counts as left, not as a join failure."""
    from learner.publisher import WeightPublisher

    port = free_port()
    lay = weights.layout(_model(0))
    pub = WeightPublisher("127.0.0.1", port, 30)
    got = []
    pub.join(0, "z")
    pub.leave(0, "z")  # the mark is taken before this returns, so the join thread cannot miss it

    def receiver():  # the generator reaches the rendezvous only now
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(0, "z"))
        got.append(receive(ch, lay))

    t = threading.Thread(target=receiver)
    t.start()
    t.join(30)
    assert got == [None] and pub.channels == {}
    assert wait_until(lambda: pub.counter_values().get("weights/left_channels") == 1, 10, 0.01)
    c = pub.counter_values()
    assert "weights/joins" not in c and "weights/join_failures" not in c
    pub.stop()


def test_publish_refuses_a_bucket_off_the_plan():
    from learner.publisher import WeightPublisher

    pub = WeightPublisher("127.0.0.1", free_port(), 30)  # no generators: only the check runs
    with pytest.raises(ValueError, match="the plan says"):
        pub.publish(1, weights.layout(_model(0)), iter([torch.zeros(3)]))


def test_layout_mismatch_is_a_clear_error():
    port = free_port()
    errors = []

    def receiver():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30)
        try:
            receive(ch, weights.layout(torch.nn.Linear(4, 4)))
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=receiver)
    t.start()
    root = weights.WeightChannel("127.0.0.1", port, 0, 2, 30)
    lay = weights.layout(_model(0))  # 4*8+8 + 8*3+3 = 67 parameters; the receiver holds 20
    root._bcast(torch.tensor([1, lay.numel, lay.digest, 0]))  # the header alone: the receiver must refuse it
    t.join(10)
    assert errors and "sends a model of 67 parameters" in errors[0]
    assert "start generators from the learner's model" in errors[0]


def test_param_buckets_into_one_scratch_buffer_equal_fresh_buckets(monkeypatch):
    from learner.params import param_buckets, scratch_for

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 16)  # several buckets of different sizes
    model = _model(3)
    lay = weights.layout(model)
    scratch = scratch_for(model, lay)
    fresh = [b.clone() for b in param_buckets(model, lay, False)]
    pointers = set()
    for want, got in zip(fresh, param_buckets(model, lay, False, scratch), strict=True):
        assert torch.equal(got, want)
        pointers.add(got.data_ptr())
    assert pointers == {scratch.data_ptr()} and len(fresh) > 2
    assert torch.equal(torch.cat(fresh), weights.flatten(model))


def test_buckets_are_assembled_on_the_parameters_device(monkeypatch):
    """A CUDA learner's first publish once crashed: the scratch was on the CPU and `torch.cat(cuda_parts, out=)`
    cannot cross devices. The meta device stands in for CUDA here (the same cross-device rule): the scratch and
    every bucket must follow the parameters."""
    from learner.params import param_buckets, scratch_for

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 16)
    model = _model(3).to("meta")
    lay = weights.layout(model)
    scratch = scratch_for(model, lay)
    assert scratch.device.type == "meta" and scratch.numel() == max(b.stop - b.start for b in weights.wire_plan(lay))
    buckets = list(param_buckets(model, lay, False, scratch))
    assert len(buckets) > 2 and all(b.device.type == "meta" and b.dtype == torch.float32 for b in buckets)


def test_publisher_sends_its_own_host_copy_of_each_bucket():
    """The publisher stages every bucket into its host vector (`latest`) and sends that over gloo, so the caller's
    bucket may live on any device and may be overwritten as soon as the next one is asked for."""
    from learner.publisher import WeightPublisher

    model = _model(5)
    lay = weights.layout(model)
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 30)
    got = []

    def generator():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(0, "a"))
        got.append(receive(ch, lay))

    t = threading.Thread(target=generator)
    t.start()
    pub.join(0, "a")
    assert wait_until(lambda: pub.channels, 30, 0.01)
    flat = weights.flatten(model)
    scratch = torch.empty(flat.numel())

    def reused():  # one buffer for every bucket, poisoned as soon as the publisher moves on
        for b in weights.wire_plan(lay):
            scratch[: b.stop - b.start].copy_(flat[b.start:b.stop])
            yield scratch[: b.stop - b.start]
            scratch.fill_(float("nan"))

    _, _, total = pub.publish(1, lay, reused())
    t.join(30)
    pub.stop()
    version, received, received_sum = got[0]
    assert version == 1 and torch.equal(received, flat) and received_sum == total == weights.checksum(flat, lay)
    assert torch.equal(pub.latest.flat, flat)


class _RecordingSender:
    """Stands in for `learner.nccl.NcclSender` (NCCL needs GPUs): records where and how it was built and what it sent."""

    built: list = []

    def __init__(self, host, port, world_size, device, timeout_s, fail_after: int | None = None):
        self.device, self.thread, self.sent = device, threading.current_thread().name, []
        type(self).built.append(self)

    def send_bucket(self, lay, first, end, bucket, dtype, cancelled=None):
        if getattr(type(self), "fail", False):
            from learner.nccl import NcclTimeout

            raise NcclTimeout("stand-in: the generator died mid-transfer")
        self.sent.append((first, end, bucket.clone(), dtype))
        return bucket.numel() * 2

    def close(self):
        self.closed = True


def test_nccl_groups_are_built_by_the_publishing_thread_on_the_learners_device(monkeypatch):
    """The join thread only records an NCCL receiver; the trainer thread builds its group at the next publish, on
    the device the learner gave the publisher (a join thread's current device would be cuda:0), and a sender
    that times out mid-transfer drops that generator instead of hanging the publish."""
    from common import vllm_weights
    from learner import nccl
    from learner.publisher import WeightPublisher

    monkeypatch.setattr(nccl, "NcclSender", _RecordingSender)
    _RecordingSender.built = []
    model = _model(7)
    lay = weights.layout(model)
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 30, device="meta")  # any device the learner names
    headers = []

    def generator():
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=30))
        pair = dist.PrefixStore(weights.pair_prefix(0, "d"), store)
        vllm_weights.announce(pair, tp=1, dtype=torch.bfloat16)
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(0, "d"), store=store)
        headers.append(vllm_weights.read_address(pair, 30))
        try:
            while (got := ch.receive_header(lay)) is not None:
                headers.append(got)
        except RuntimeError:  # the learner dropped this channel (the stand-in timed out)
            headers.append("dropped")

    t = threading.Thread(target=generator, daemon=True)
    t.start()
    pub.join(0, "d")
    assert wait_until(lambda: pub.pending_direct, 30, 0.01)
    assert not pub.channels and not _RecordingSender.built  # nothing NCCL in the join thread
    flat = weights.flatten(model)
    pub.publish(1, lay, (flat[b.start:b.stop] for b in weights.wire_plan(lay)))
    (sender,) = _RecordingSender.built
    assert sender.thread == threading.current_thread().name and sender.device == torch.device("meta")
    assert torch.equal(torch.cat([b for _, _, b, _ in sender.sent]), flat)
    assert {d for _, _, _, d in sender.sent} == {torch.bfloat16}  # sent in the dtype the generator announced
    _RecordingSender.fail = True
    try:
        pub.publish(2, lay, (flat[b.start:b.stop] for b in weights.wire_plan(lay)))
    finally:
        _RecordingSender.fail = False
    assert not pub.channels and pub.counter_values()["weights/dropped_channels"] == 1
    assert getattr(sender, "closed", False)  # the dropped generator's communicator is destroyed, not leaked
    pub.stop()
    assert headers[0]["world_size"] == 2 and headers[1] == (1, weights.FLAG_DIRECT) and headers[2] == (2, weights.FLAG_DIRECT)
    t.join(30)


def test_wait_until_gives_up_at_its_deadline():
    t0 = time.monotonic()
    assert not wait_until(lambda: False, 0.05) and time.monotonic() - t0 >= 0.05
    flips = iter([False, False, True])
    assert wait_until(lambda: next(flips), 1.0)


def test_model_publisher_on_rank_0_sends_the_module_through_its_channel(monkeypatch):
    """Rank 0's one publish path: its module's buckets (assembled in one scratch buffer) go through the channel,
    and the caller gets (seconds, bytes sent to each generator, checksum) with the receiver's checksum."""
    from learner.publisher import ModelPublisher, WeightPublisher

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 16)  # several buckets through the one scratch buffer
    model = _model(9)
    port = free_port()
    pub = ModelPublisher(model, zero3=False, channel=WeightPublisher("127.0.0.1", port, 30))
    lay = weights.layout(model)
    assert pub.layout == lay and pub.scratch.numel() == max(b.stop - b.start for b in weights.wire_plan(lay))
    got = []

    def generator():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(0, "m"))
        while (r := receive(ch, lay)) is not None:
            got.append(r)

    t = threading.Thread(target=generator, daemon=True)
    t.start()
    pub.channel.join(0, "m")
    assert wait_until(lambda: pub.channel.channels, 30, 0.01)
    seconds, nbytes, total = pub.publish(3)
    assert 0 <= seconds < 30 and nbytes == lay.numel * 4 and total == weights.checksum(weights.flatten(model), lay)
    assert pub.counter_values()["weights/joins"] == 1
    pub.stop()
    t.join(30)
    ((version, flat, received_sum),) = got
    assert version == 3 and torch.equal(flat, weights.flatten(model)) and received_sum == total


@pytest.mark.parametrize("zero3, walked", [(False, 0), (True, 6)])
def test_model_publisher_elsewhere_sends_nothing_and_gathers_only_under_zero3(monkeypatch, zero3, walked):
    """A rank without a channel returns None; under ZeRO-3 it still walks every bucket (each gather is a collective
    rank 0 waits in), and without ZeRO-3 it reads no parameter at all."""
    from learner import publisher

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 16)
    model = _model(9)
    # 32, 8, 24, 3 elements: no two neighbours fit in 16, and the 32 and the 24 are split in two pieces each
    assert len(weights.wire_plan(weights.layout(model))) == 6
    seen = []

    def recording(module, lay, zero3_arg, scratch):
        assert module is model and zero3_arg == zero3 and scratch is pub.scratch
        for b in weights.wire_plan(lay):
            seen.append(b.start)
            yield scratch[: b.stop - b.start]

    monkeypatch.setattr(publisher, "param_buckets", recording)
    pub = publisher.ModelPublisher(model, zero3=zero3, channel=None)
    assert pub.publish(1) is None and len(seen) == walked


def test_the_gpu_checks_learner_role_publishes_a_model_directory_through_the_publish_path(tiny_model_dir, tmp_path):
    """`python -m hardware.check_learner` (hardware/check.py's learner role; on the CPU here, the gloo path) hosts the
    store, publishes the directory's weights to generator 0's pair channel, reports what the publish returned,
    and stops the channel once the generator's report exists."""
    import datetime
    import json
    import os
    import subprocess
    import sys

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port = free_port()
    out, until = str(tmp_path / "learner.json"), str(tmp_path / "generator.json")
    proc = subprocess.Popen([sys.executable, "-m", "hardware.check_learner", "--model", tiny_model_dir, "--weights",
                             f"127.0.0.1:{port}", "--out", out, "--until", until, "--incarnation", "t",
                             "--timeout-s", "60"], cwd=repo, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        lay, flat = weights.layout(model), weights.flatten(model)
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=60))
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 60, prefix=weights.pair_prefix(0, "t"), store=store)
        version, received, received_sum = receive(ch, lay)
        assert version == 1 and torch.equal(received, flat)
        assert wait_until(lambda: os.path.exists(out), 60, 0.05)
        with open(out) as f:
            published = json.load(f)
        assert published["checksum"] == received_sum == weights.checksum(flat, lay)
        assert published["bytes_sent"] == lay.numel * 4 and published["weight_sync_s"] > 0
        assert proc.poll() is None  # the channel stays open until the generator has reported
        open(until, "w").close()
        assert receive(ch, lay) is None  # then the learner stops it
        assert proc.wait(60) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A generator whose weight thread stops reading: it joins its channel, then freezes itself (SIGSTOP), as a process
# swapped out, a stalled node or a wedged receiver would look to the learner. A real process, a real gloo pair.
_FROZEN_PEER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from common import weights
ch = weights.WeightChannel("127.0.0.1", {port}, 1, 2, 60, prefix=weights.pair_prefix(1, "frozen"))
print("joined", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""
BIG = weights.Layout(("w",), ((8 << 20,),))  # 32 MiB of fp32 per version: more than loopback's socket buffers hold


def _healthy_and_frozen(port: int, got: list):
    """Generator 0 in a thread, receiving every version; generator 1 a process that joins and freezes."""
    import subprocess
    import sys

    def receiver():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 60, prefix=weights.pair_prefix(0, "ok"))
        while (r := receive(ch, BIG)) is not None:
            got.append((r[0], r[2]))

    t = threading.Thread(target=receiver, daemon=True)
    t.start()
    frozen = subprocess.Popen([sys.executable, "-c", _FROZEN_PEER.format(repo=REPO, port=port)],
                              stdout=subprocess.PIPE, text=True)
    return t, frozen


def _frozen_setup(send_timeout_s: float):
    from learner.publisher import WeightPublisher

    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 600, send_timeout_s=send_timeout_s)
    reports = []
    pub.report = lambda *a: reports.append(a)
    got = []
    t, frozen = _healthy_and_frozen(port, got)
    pub.join(0, "ok")
    pub.join(1, "frozen")
    assert frozen.stdout.readline().strip() == "joined"
    assert wait_until(lambda: len(pub.channels) == 2, 30, 0.01)
    flat = torch.arange(BIG.numel, dtype=torch.float32)
    return pub, reports, got, t, frozen, flat


def test_a_weight_send_to_a_peer_that_stops_reading_returns_within_its_deadline():
    """Generator 1 stops reading (frozen): the publish gives up on it at `send_timeout_s`, not the 600 s of the
    channel's sync timeout, reports it to whoever decides (the hub), and the healthy generator gets every version
    with the learner's checksum, including the next one, which no longer waits for the frozen peer."""
    pub, reports, got, t, frozen, flat = _frozen_setup(send_timeout_s=3)
    try:
        t0 = time.monotonic()
        _, _, sum1 = pub.publish(1, BIG, iter([flat]))
        took = time.monotonic() - t0
        assert 3 <= took < 3 + 5, f"the publish took {took:.1f}s with a 3 s send deadline"
        assert 1 not in pub.channels and pub.counter_values()["weights/dropped_channels"] == 1
        assert [(g, inc) for g, inc, _ in reports] == [(1, "frozen")] and "weight_send_timeout_s" in reports[0][2]
        t0 = time.monotonic()
        _, _, sum2 = pub.publish(2, BIG, iter([flat + 1]))
        assert time.monotonic() - t0 < 2.5  # the frozen peer is gone from the broadcast list
        pub.stop()
        t.join(30)
        assert got == [(1, sum1), (2, sum2)] and sum1 == weights.checksum(flat, BIG)
    finally:
        frozen.kill()
        frozen.wait()


def test_the_hubs_verdict_cuts_a_publish_short_and_is_not_reported_back():
    """The hub declares the frozen generator lost (`drop`) one second into a publish whose send deadline is 60 s:
    the publish stops waiting for it at once and finishes for the healthy generator; the publisher does not report
    the hub's own decision back to it."""
    pub, reports, got, t, frozen, flat = _frozen_setup(send_timeout_s=60)
    try:
        threading.Timer(1.0, pub.drop, args=(1, "frozen")).start()
        t0 = time.monotonic()
        _, _, total = pub.publish(1, BIG, iter([flat]))
        assert time.monotonic() - t0 < 1.0 + 3
        assert 1 not in pub.channels and reports == []
        assert pub.counter_values()["weights/dropped_channels"] == 1
        pub.stop()
        t.join(30)
        assert got == [(1, total)]
    finally:
        frozen.kill()
        frozen.wait()
