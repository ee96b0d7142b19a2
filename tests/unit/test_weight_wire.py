"""The weight wire in the model's dtype, bounded buckets, and a host copy only when a late joiner can need it
(issue 47; common/weights.py, learner/params.py, learner/publisher.py).

The model throughout: Linear(4, 8) + Linear(8, 3), parameters of 32, 8, 24 and 3 elements (67). With a bucket bound
of 16 elements the load plan (`bucket_plan`) is [32], [8], [24], [3] (no two neighbours fit in 16, and the 32 and the
24 are alone) and the wire plan cuts the two large ones: [0:16] [16:32] | [32:40] | [40:56] [56:64] | [64:67].
"""

import contextlib
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from common import vllm_weights
from common import weights
from common.transport import free_port
from learner.nccl import wait_until
from tests.helpers.host_copies import record_host_copies
from tests.helpers.weight_channel import receive

BOUND = 16  # elements per bucket in these tests (weights.BUCKET_NUMEL is 32M)


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)).to(dtype)


def _flat(model):
    """The parameters in layout order, in their own dtype (weights.flatten is the fp32 reference)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _bits(t):
    """The raw bits, so equal means equal to the bit (NaN-safe, no promotion between dtypes)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture
def bound(monkeypatch):
    monkeypatch.setattr(weights, "BUCKET_NUMEL", BOUND)
    return BOUND


# ---- the plans ------------------------------------------------------------------------------------------------------


def test_the_wire_plan_splits_what_exceeds_the_bound_and_covers_every_element_once_in_layout_order():
    lay = weights.Layout(("a", "b", "c", "d"), ((3, 2), (5,), (20,), (4,)))  # 6, 5, 20, 4 elements
    plan = weights.wire_plan(lay, 8)
    # a+b = 11 > 8, so each alone; c (20) in pieces of 8, 8, 4; d whole
    assert [(b.first, b.end, b.start, b.stop, b.offset, b.last) for b in plan] == [
        (0, 1, 0, 6, 0, True), (1, 2, 6, 11, 0, True),
        (2, 3, 11, 19, 0, False), (2, 3, 19, 27, 8, False), (2, 3, 27, 31, 16, True),
        (3, 4, 31, 35, 0, True)]
    assert [b.whole for b in plan] == [True, True, False, False, False, True]
    for limit in (1, 3, 5, 6, 7, 12, 20, 1000):
        plan = weights.wire_plan(lay, limit)
        assert [b.start for b in plan] == [0] + [b.stop for b in plan[:-1]] and plan[-1].stop == lay.numel
        assert all(0 < b.stop - b.start <= limit for b in plan)
        # grouped by load-plan bucket, the wire plan is the load plan
        groups = weights.load_groups(plan)
        assert [(g[0].first, g[-1].end, g[0].start, g[-1].stop) for g in groups] == weights.bucket_plan(lay, limit)
        for g in groups:  # pieces: one parameter, offsets inside it, consecutive
            assert all(b.first == g[0].first and b.end == g[0].end for b in g)
            assert [b.offset for b in g] == [b.start - g[0].start for b in g]
    assert weights.wire_plan(lay, 1000) == [weights.WireBucket(0, 4, 0, 35)]  # nothing to split: the load plan


def test_the_checksum_does_not_move_with_the_split_nor_with_the_wire_dtype(monkeypatch):
    """The fp32 values are what the checksum gave before bounded buckets and 16-bit wires (the old definition is
    written out below: the load plan's buckets, each summed once), and a bf16 vector has the checksum of its fp32
    upcast: the same values, the same fp64 sum."""
    monkeypatch.setattr(weights, "CHECKSUM_SAMPLES", 7)  # stride 9 on 67 elements: samples cross piece edges
    model = _model()
    lay, flat = weights.layout(model), weights.flatten(model)

    def before(flat, limit):  # common/weights.py's Checksum before issue 47, fed by the load plan
        stride, total = max(1, flat.numel() // 7), 0.0
        for _, _, start, end in weights.bucket_plan(lay, limit):
            bucket, first = flat[start:end], -start % stride
            sample, s0 = bucket[first::stride], (start + first) // stride
            w = torch.arange(s0 + 1, s0 + 1 + sample.numel(), dtype=torch.float64).remainder_(1013.0).add_(1.0)
            total += float((sample.double() * w).sum())
        return total

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 1 << 20)
    whole = weights.checksum(flat, lay)
    assert whole == before(flat, 1 << 20)
    monkeypatch.setattr(weights, "BUCKET_NUMEL", 5)  # every large parameter in pieces
    assert len(weights.wire_plan(lay)) > len(weights.bucket_plan(lay))
    assert weights.checksum(flat, lay) == before(flat, 5)
    half = flat.to(torch.bfloat16)
    assert weights.checksum(half, lay) == weights.checksum(half.float(), lay) == before(half.float(), 5)
    assert weights.checksum(half, lay) != weights.checksum(flat, lay)  # rounding shows


# ---- the learner's buckets ------------------------------------------------------------------------------------------


def test_param_buckets_stay_in_the_models_dtype_bounded_and_gather_a_split_parameter_once(monkeypatch, bound):
    """ZeRO-3's path with a stand-in for DeepSpeed's GatheredParameters (a real ZeRO-3 engine takes a process of its
    own and a GPU for bf16): every bucket is bf16 (no `.float()` anywhere), at most the bound, in one scratch buffer
    of at most the bound; each load-plan bucket is gathered once, a split parameter's gather held across its pieces;
    and the checkpoint's state dict puts the split parameters back together, bit for bit."""
    from learner import params

    model = _model(torch.bfloat16)
    lay = weights.layout(model)
    events = []

    @contextlib.contextmanager
    def gathered(group, zero3):
        assert zero3
        events.append(("gather", sum(p.numel() for p in group)))
        yield
        events.append(("release",))

    def no_float(self, *a, **k):
        raise AssertionError("param_buckets upcast a tensor with .float()")

    monkeypatch.setattr(params, "_gathered", gathered)
    monkeypatch.setattr(torch.Tensor, "float", no_float)
    scratch = params.scratch_for(model, lay)
    assert scratch.dtype == torch.bfloat16 and scratch.numel() == bound  # not 32, the largest parameter
    got = []
    for bucket in params.param_buckets(model, lay, True, scratch):
        assert bucket.dtype == torch.bfloat16 and bucket.data_ptr() == scratch.data_ptr()
        events.append(("bucket", bucket.numel()))
        got.append(bucket.clone())
    assert events == [("gather", 32), ("bucket", 16), ("bucket", 16), ("release",),
                      ("gather", 8), ("release",), ("bucket", 8),
                      ("gather", 24), ("bucket", 16), ("bucket", 8), ("release",),
                      ("gather", 3), ("release",), ("bucket", 3)]
    assert torch.equal(_bits(torch.cat(got)), _bits(_flat(model)))
    fresh = list(params.param_buckets(model, lay, True))  # without a scratch: copies, in bf16
    assert [b.dtype for b in fresh] == [torch.bfloat16] * 6
    assert torch.equal(_bits(torch.cat(fresh)), _bits(_flat(model)))
    state = params.full_state_dict(model, lay, True)
    assert list(state) == list(lay.names)
    for name, p in model.named_parameters():
        assert state[name].dtype == torch.bfloat16 and torch.equal(_bits(state[name]), _bits(p.detach()))


def test_a_mixed_dtype_model_goes_as_fp32_and_a_uniform_one_in_its_own_dtype():
    model = _model(torch.bfloat16)
    assert weights.wire_dtype(model.parameters()) == torch.bfloat16
    assert weights.wire_dtype(_model(torch.float16).parameters()) == torch.float16
    model[1].float()
    assert weights.wire_dtype(model.parameters()) == torch.float32  # exact for both


# ---- the gloo wire --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gloo_publish_delivers_the_models_own_bits_in_its_dtype(bound, dtype):
    """The one publish path over a real pair channel: the generator receives a host vector in the model's dtype,
    bit for bit, with the learner's checksum; half the bytes for bf16; the host copy (a gloo peer exists) is in that
    dtype too, and a receiver's vector is reused for the next version."""
    from learner.publisher import ModelPublisher, WeightPublisher

    model = _model(dtype)
    lay = weights.layout(model)
    port = free_port()
    pub = ModelPublisher(model, zero3=False, channel=WeightPublisher("127.0.0.1", port, 30))
    assert pub.scratch.dtype == dtype and pub.scratch.numel() == bound
    got, reused = [], []

    def generator():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(0, "w"))
        buf = None
        while (r := receive(ch, lay, out=buf)) is not None:
            reused.append(buf is not None and r[1].data_ptr() == buf.data_ptr())
            got.append((r[0], r[1].clone(), r[2]))
            buf = r[1]

    t = threading.Thread(target=generator, daemon=True)
    t.start()
    pub.channel.join(0, "w")
    assert wait_until(lambda: pub.channel.channels, 30, 0.01)
    sent = []
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01).add_(0.003)  # new values, most of them not exact in bf16 arithmetic
        _, nbytes, total = pub.publish(version)
        sent.append((_flat(model).clone(), total))
        assert nbytes == lay.numel * dtype.itemsize
    host = pub.channel.latest
    assert host.flat.dtype == dtype and host.flat.numel() == lay.numel and host.version == 2
    pub.stop()
    t.join(30)
    assert [v for v, _, _ in got] == [1, 2] and reused == [False, True]
    for (_, flat, received_sum), (expected, sent_sum) in zip(got, sent):
        assert flat.dtype == dtype and torch.equal(_bits(flat), _bits(expected))
        assert received_sum == sent_sum == weights.checksum(expected, lay) == weights.checksum(expected.double(), lay)


def _header_receiver(port, lay, errors):
    def run():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30)
        try:
            errors.append(ch.receive_header(lay))
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("case", ["older_generator", "unknown_flags", "mislabelled"])
def test_a_header_for_another_wire_dtype_is_refused_clearly(case):
    """The dtype is in the flags and, for a 16-bit wire, in the digest: a generator that would read a bf16 wire as
    fp32 (one from before 16-bit wires checks the plain layout digest) sees another model's digest; flags it does not
    know and a digest that does not match the dtype named are refused with the fix."""
    lay = weights.layout(_model())
    assert weights.wire_digest(lay, torch.float32) == lay.digest  # the fp32 header is what it always was
    assert len({weights.wire_digest(lay, d) for d in weights.WIRE_DTYPES}) == 3
    header = {"older_generator": [1, lay.numel, weights.wire_digest(lay, torch.bfloat16), 0],
              "unknown_flags": [1, lay.numel, lay.digest, 1 << 5],
              "mislabelled": [1, lay.numel, lay.digest, weights.dtype_flags(torch.bfloat16)]}[case]
    port, errors = free_port(), []
    t = _header_receiver(port, lay, errors)
    root = weights.WeightChannel("127.0.0.1", port, 0, 2, 30)
    root._bcast(torch.tensor(header))
    t.join(10)
    (error,) = errors
    if case == "unknown_flags":
        assert "another covrl version" in error and "same checkout" in error
    elif case == "mislabelled":
        assert "as bfloat16" in error and "same covrl checkout" in error
    else:  # what an fp32-only receiver compares: the plain layout digest, which the bf16 header does not carry
        assert "sends a model of 67 parameters as float32" in error and f"layout {lay.digest:x}" in error


def test_a_header_names_its_dtype_and_the_receiver_takes_it():
    lay = weights.layout(_model())
    port, got = free_port(), []
    t = _header_receiver(port, lay, got)
    root = weights.WeightChannel("127.0.0.1", port, 0, 2, 30)
    root.start_header(7, lay, weights.FLAG_DIRECT, torch.bfloat16).wait()
    t.join(10)
    assert got == [(7, weights.FLAG_DIRECT | weights.dtype_flags(torch.bfloat16))]
    assert weights.flags_dtype(got[0][1]) == torch.bfloat16
    assert weights.flags_dtype(weights.FLAG_DIRECT) == torch.float32  # no dtype bits: fp32, as headers always were


# ---- the host copy --------------------------------------------------------------------------------------------------


class _Sender:
    """Stands in for learner.nccl.NcclSender (NCCL needs GPUs): records what it was asked to broadcast."""

    built: list = []

    def __init__(self, host, port, world_size, device, timeout_s):
        self.sent = []
        type(self).built.append(self)

    def send_bucket(self, lay, first, end, bucket, dtype, cancelled=None):
        self.sent.append((first, end, bucket.to(dtype).clone()))
        return bucket.numel() * dtype.itemsize

    def close(self):
        pass


def _nccl_generator(port, gen_id, inc, lay, headers):
    """A vLLM generator with the nccl transport, as far as the pair channel sees it: it announces a receiver, joins,
    reads the NCCL address and takes every header."""
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=30))
    pair = dist.PrefixStore(weights.pair_prefix(gen_id, inc), store)
    vllm_weights.announce(pair, tp=1, dtype=torch.bfloat16)
    ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(gen_id, inc), store=store)
    vllm_weights.read_address(pair, 30)
    while (got := ch.receive_header(lay)) is not None:
        headers.append(got)


def _gloo_generator(port, gen_id, inc, lay, got):
    ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 30, prefix=weights.pair_prefix(gen_id, inc))
    while (r := receive(ch, lay)) is not None:
        got.append((r[0], r[1].clone()))


def _start(target, *args):
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def _publish(pub, model, version):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    from learner.params import param_buckets

    lay = weights.layout(model)
    pub.publish(version, lay, param_buckets(model, lay, False))
    return _flat(model).clone()


def test_the_host_copy_is_kept_only_while_a_late_joiner_can_need_it(monkeypatch, bound):
    """A resumed learner's first publish (nobody joined yet) keeps it; once every peer is an NCCL peer it is freed,
    and an NCCL joiner is not caught up (the publish that admits it sends it that version); a first gloo joiner then
    gets the next publish, from which on the copy is kept (bf16, the wire's), and a later gloo joiner is caught up
    from it at once. The NCCL peer gets each split parameter whole."""
    from learner import nccl
    from learner.publisher import WeightPublisher

    monkeypatch.setattr(nccl, "NcclSender", _Sender)
    _Sender.built = []
    model = _model(torch.bfloat16)
    lay = weights.layout(model)
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 30)
    _publish(pub, model, 1)  # before any generator joined: keep it, whoever comes must be caught up
    assert pub.latest.flat.dtype == torch.bfloat16 and pub.latest.version == 1
    headers, g1, g2 = [], [], []
    threads = [_start(_nccl_generator, port, 0, "n", lay, headers)]
    pub.join(0, "n")
    assert wait_until(lambda: pub.pending_direct, 30, 0.01)
    v2 = _publish(pub, model, 2)
    assert pub.latest is None  # every peer so far is an NCCL peer
    assert wait_until(lambda: headers, 30, 0.01)  # its weight thread takes the header in its own time
    assert headers == [(2, weights.FLAG_DIRECT | weights.dtype_flags(torch.bfloat16))]  # no catch-up of version 1
    (sender,) = _Sender.built
    assert [(f, e) for f, e, _ in sender.sent] == [(f, e) for f, e, _, _ in weights.bucket_plan(lay)]  # whole
    assert torch.equal(_bits(torch.cat([b for _, _, b in sender.sent])), _bits(v2))
    threads.append(_start(_gloo_generator, port, 1, "g1", lay, g1))
    pub.join(1, "g1")
    assert wait_until(lambda: 1 in pub.channels, 30, 0.01)
    assert pub.latest is None and g1 == []  # nothing to catch it up from: it waits for the next publish
    v3 = _publish(pub, model, 3)
    assert pub.latest.flat.dtype == torch.bfloat16 and pub.latest.version == 3
    threads.append(_start(_gloo_generator, port, 2, "g2", lay, g2))
    pub.join(2, "g2")
    assert wait_until(lambda: g2, 30, 0.01)  # caught up at once, before any further publish
    pub.stop()
    for t in threads:
        t.join(30)
    assert [v for v, _ in g1] == [3] and [v for v, _ in g2] == [3]
    assert all(f.dtype == torch.bfloat16 and torch.equal(_bits(f), _bits(v3)) for _, f in g1 + g2)
    assert headers[-1][0] == 3 and pub.counter_values()["weights/joins"] == 3


def test_a_learner_whose_every_peer_is_nccl_never_allocates_a_host_copy(monkeypatch, bound):
    from learner import nccl
    from learner import publisher

    monkeypatch.setattr(nccl, "NcclSender", _Sender)
    made = record_host_copies(monkeypatch)
    model = _model(torch.bfloat16)
    lay = weights.layout(model)
    port = free_port()
    pub = publisher.WeightPublisher("127.0.0.1", port, 30)
    headers = []
    t = _start(_nccl_generator, port, 0, "n", lay, headers)
    pub.join(0, "n")
    assert wait_until(lambda: pub.pending_direct, 30, 0.01)
    for version in (1, 2, 3):
        _publish(pub, model, version)
        assert pub.latest is None
    pub.stop()
    t.join(30)
    assert made == [] and [v for v, _ in headers] == [1, 2, 3]  # all taken before the stop header ended it


# ---- the generators' ends -------------------------------------------------------------------------------------------


def test_rpc_bytes_keep_a_bf16_wires_bits_and_round_fp32_once():
    from actors.vllm_engine import from_rpc_bytes, rpc_bytes

    x = torch.randn(37, generator=torch.Generator().manual_seed(0))
    half = x.to(torch.bfloat16)
    assert rpc_bytes(half, torch.bfloat16) == half.view(torch.uint8).numpy().tobytes()  # the bits as they came
    assert rpc_bytes(x, torch.bfloat16) == rpc_bytes(half, torch.bfloat16)  # fp32 rounds once, to the same bits
    assert torch.equal(_bits(from_rpc_bytes(rpc_bytes(half, torch.bfloat16), "bfloat16")), _bits(half))


def test_the_vllm_rpc_path_loads_a_split_parameter_whole_with_its_last_piece(monkeypatch, bound):
    """`VllmEngine.load_flat` sends one wire bucket per call (none over the bound); the worker extension puts a split
    parameter together and hands `load_weights` whole tensors, bf16 bits unchanged."""
    import asyncio

    from actors import vllm_engine

    loaded, calls = {}, []

    class Model:
        def load_weights(self, pairs):
            for name, t in pairs:
                loaded[name] = t.clone()

    class Worker(vllm_engine.CovrlWorkerExtension):
        device = torch.device("cpu")
        model_runner = type("Runner", (), {"get_model": staticmethod(lambda: MODEL)})

    MODEL, worker = Model(), Worker()

    class LLM:
        async def collective_rpc(self, method, args=()):
            calls.append(len(args[3]) // 2)  # elements in this call (bf16)
            return [getattr(worker, method)(*args)]

    model = _model(torch.bfloat16)
    lay = weights.layout(model)
    flat = _flat(model)

    async def label(version):
        pass

    fake = type("Engine", (), {})()
    fake.lay, fake.dtype, fake.llm, fake._label = lay, torch.bfloat16, LLM(), label
    fake._update = lambda version, load: asyncio.run(load())
    vllm_engine.VllmEngine.load_flat(fake, flat, 1)
    assert calls == [16, 16, 8, 16, 8, 3] and max(calls) <= bound
    assert list(loaded) == [vllm_weights.vllm_name(n) for n in lay.names]
    for name, p in model.named_parameters():
        assert loaded[name].shape == p.shape and torch.equal(_bits(loaded[name]), _bits(p.detach()))
    with pytest.raises(RuntimeError, match="must come in order"):
        piece = vllm_engine.rpc_bytes(flat[16:32], torch.bfloat16)
        worker.covrl_load_weights(["0.weight"], [[8, 4]], "bfloat16", piece, 16)


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
def test_the_torch_engine_loads_a_bf16_wire(tiny_model_dir, engine_dtype):
    """`TorchEngine.load_flat` takes the wire's dtype: copy_ casts (bf16 into bf16 or fp32 is exact)."""
    from actors.engine import TorchEngine

    engine = TorchEngine(tiny_model_dir, eos_token_id=0, pad_token_id=0, dtype=engine_dtype)
    flat = (weights.flatten(engine.model) + 0.01).to(torch.bfloat16)
    engine.load_flat(flat, 5)
    assert engine.version == 5 and torch.equal(weights.flatten(engine.model), flat.float())
