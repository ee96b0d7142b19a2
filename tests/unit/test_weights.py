import threading

import pytest
import torch
from torch.testing import assert_close

from common import weights as W
from common.transport import free_port


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def test_flatten_roundtrip_and_checksum_sensitivity():
    a, b = _model(0), _model(1)
    flat = W.flatten(a)
    W.load_flat(b, flat)
    assert_close(W.flatten(b), flat)
    swapped = flat.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert W.checksum(swapped) != W.checksum(flat)  # order-sensitive


def test_bucket_plan_cuts_at_parameter_boundaries():
    lay = W.Layout(("a", "b", "c", "d"), ((3, 2), (5,), (20,), (4,)))  # 6, 5, 20, 4 elements
    assert W.bucket_plan(lay, 12) == [(0, 2, 0, 11), (2, 3, 11, 31), (3, 4, 31, 35)]  # c alone exceeds 12
    assert W.bucket_plan(lay, 1000) == [(0, 4, 0, 35)]
    assert [(s, e) for _, _, s, e in W.bucket_plan(lay, 1)] == [(0, 6), (6, 11), (11, 31), (31, 35)]


def test_checksum_is_the_same_whole_or_by_buckets(monkeypatch):
    monkeypatch.setattr(W, "CHECKSUM_SAMPLES", 7)  # stride > 1, crossing bucket edges at odd offsets
    monkeypatch.setattr(W, "BUCKET_NUMEL", 16)
    src = _model(0)
    lay, flat = W.layout(src), W.flatten(src)
    one = W.Checksum(flat.numel())
    one.add(flat, 0)
    strided = flat[:: max(1, flat.numel() // 7)].double()
    expected = float((strided * (torch.arange(1, strided.numel() + 1, dtype=torch.float64) % 1013 + 1)).sum())
    assert one.total == pytest.approx(expected, rel=1e-12)
    assert W.checksum(flat, lay) == pytest.approx(one.total, rel=1e-12)


def test_broadcast_to_two_receivers_then_stop(monkeypatch):
    monkeypatch.setattr(W, "BUCKET_NUMEL", 16)  # force several buckets
    port = free_port()
    src = _model(0)
    lay = W.layout(src)
    got = {1: [], 2: []}

    reused = []

    def receiver(rank):
        ch = W.WeightChannel("127.0.0.1", port, rank, 3, 30)
        buf = None  # rank 2 receives each version into the previous one's vector, as the actor does once applied
        while (r := ch.receive(lay, out=buf)) is not None:
            got[rank].append((r[0], r[1].clone(), r[2]))
            if rank == 2:
                reused.append(buf is not None and r[1].data_ptr() == buf.data_ptr())
                buf = r[1]

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    root = W.WeightChannel("127.0.0.1", port, 0, 3, 30)
    sent, sums = [], []
    for v in (1, 2):
        with torch.no_grad():
            for p in src.parameters():
                p.add_(0.5)
        flat = W.flatten(src)
        sent.append(flat.clone())
        buckets = [flat[s:e] for _, _, s, e in W.bucket_plan(lay)]
        assert len(buckets) > 2
        seconds, nbytes, total = root.publish(v, lay, iter(buckets))
        assert nbytes == lay.numel * 4 and seconds >= 0
        sums.append(total)
    root.stop()
    for t in threads:
        t.join(10)
    assert reused == [False, True]
    for rank in (1, 2):
        assert [v for v, _, _ in got[rank]] == [1, 2]
        for (_, flat, total), ref, sent_sum in zip(got[rank], sent, sums):
            assert torch.equal(flat, ref) and total == sent_sum == W.checksum(ref, lay)  # to the bit


def test_publish_refuses_a_bucket_off_the_plan():
    root = W.WeightChannel("127.0.0.1", free_port(), 0, 1, 30)  # no receivers: only the check runs
    with pytest.raises(ValueError, match="the plan says"):
        root.publish(1, W.layout(_model(0)), iter([torch.zeros(3)]))


def test_layout_mismatch_is_a_clear_error():
    port = free_port()
    errors = []

    def receiver():
        ch = W.WeightChannel("127.0.0.1", port, 1, 2, 30)
        try:
            ch.receive(W.layout(torch.nn.Linear(4, 4)))
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=receiver)
    t.start()
    root = W.WeightChannel("127.0.0.1", port, 0, 2, 30)
    lay = W.layout(_model(0))  # 4*8+8 + 8*3+3 = 67 parameters; the receiver holds 20
    root._bcast(torch.tensor([1, lay.numel, lay.digest, 0]))  # the header alone: the receiver must refuse it
    t.join(10)
    assert errors and "sends a model of 67 parameters" in errors[0]
    assert "start generators from the learner's model" in errors[0]


def test_param_buckets_into_one_scratch_buffer_equal_fresh_buckets(monkeypatch):
    from learner.params import param_buckets, scratch_for

    monkeypatch.setattr(W, "BUCKET_NUMEL", 16)  # several buckets of different sizes
    model = _model(3)
    lay = W.layout(model)
    scratch = scratch_for(lay)
    fresh = [b.clone() for b in param_buckets(model, lay, False)]
    pointers = set()
    for want, got in zip(fresh, param_buckets(model, lay, False, scratch), strict=True):
        assert torch.equal(got, want)
        pointers.add(got.data_ptr())
    assert pointers == {scratch.data_ptr()} and len(fresh) > 2
    assert torch.equal(torch.cat(fresh), W.flatten(model))
