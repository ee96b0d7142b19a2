"""The ipc weight transport (common/ipc_weights.py, learner/ipc.py) between two real processes: this test is learner
rank 0 (its TCPStore, its end of the gloo pair channel, an `IpcSender`), tests/helpers/ipc_generator.py the
generator and its worker. On the CPU the slots are shared-memory files (the `shm` backend), with the same
ordering and acknowledgement code as CUDA IPC; the `gpu` test runs the CUDA backend."""

from __future__ import annotations

import datetime
import inspect
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from common import ipc_weights
from common import weights
from common.ipc_weights import IpcError
from common.transport import free_port
from learner.ipc import IpcPlacementError, IpcSender
from learner.nccl import wait_until
from tests.helpers.host_copies import record_host_copies
from tests.helpers.ipc_generator import digest
from tests.helpers.paths import REPO

HOST, PREFIX = "127.0.0.1", weights.pair_prefix(0, "ipc")
# Seven parameters cut at 1,200 elements: five buckets; the first (one 2,500-element parameter) sets the slot size.
LAYOUT = weights.Layout(("embed", "w1", "b1", "w2", "norm", "up", "head"),
                        ((50, 50), (64, 33), (33,), (128, 9), (300,), (40, 25), (7, 3)))
BOUND = 1200
PLAN = weights.bucket_plan(LAYOUT, BOUND)


def _pieces(lay: weights.Layout, bound: int):
    """The publisher's wire order (`weights.wire_plan`): the plan's buckets, a parameter larger than the bound cut
    into pieces of at most `bound` elements -> (first, end, start, stop, offset into the bucket, last piece)."""
    for first, end, start, stop in weights.bucket_plan(lay, bound):
        for at in range(start, stop, bound):
            yield first, end, at, min(at + bound, stop), at - start, at + bound >= stop


def _version(v: int) -> torch.Tensor:
    """The learner's fp32 parameters at version v (distinct in every bucket and every version)."""
    return torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(v))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Learner:
    """Learner rank 0's end of one generator channel over ipc, and the generator process it talks to."""

    def __init__(self, tmp_path, dtype: str = "bfloat16", timeout_s: float = 30, device: str = "cpu",
                 layout: weights.Layout = LAYOUT, bound: int = BOUND, slots: int = 2, **behaviour):
        self.layout, self.bound, self.out = layout, bound, str(tmp_path / "generator.pt")
        port = free_port()
        self.store = dist.TCPStore(HOST, port, None, is_master=True, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)
        job = {"port": port, "prefix": PREFIX, "names": list(layout.names), "shapes": [list(s) for s in layout.shapes],
               "dtype": dtype, "timeout_s": 30, "out": self.out, "device": device, **behaviour}
        (tmp_path / "job.json").write_text(json.dumps(job))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.ipc_generator", str(tmp_path / "job.json")],
                                     cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            self.ch = weights.WeightChannel(HOST, port, weights.LEARNER_RANK, weights.PAIR_WORLD, 30, prefix=PREFIX,
                                            store=self.store)
            self.pair = dist.PrefixStore(PREFIX, self.store)
            self.sender = IpcSender(self.pair, self.ch, layout, device, timeout_s, setup_timeout_s=30, slots=slots,
                                    bucket_numel=bound)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def publish(self, version: int, flat: torch.Tensor, cancelled=None, after_each=None, pieces=True) -> float:
        """The publisher's order: the header over gloo, then every bucket of the plan, a large parameter in pieces
        (`pieces`) or whole. Returns its seconds."""
        t0 = time.monotonic()
        self.ch.start_header(version, self.layout, weights.FLAG_DIRECT).wait()
        plan = _pieces(self.layout, self.bound) if pieces else ((*b, 0, True) for b in PLAN)
        for first, end, start, stop, offset, last in plan:
            self.sender.send_bucket(self.layout, first, end, flat[start:stop], self.sender.dtype, cancelled,
                                    offset=offset, last=last)
            if after_each is not None:
                after_each()
        return time.monotonic() - t0

    def received(self) -> dict:
        self.ch.stop()
        assert self.proc.stdout.readline().strip() == "stopped"
        return torch.load(self.out)

    def slot_files(self) -> list[str]:
        return [h["path"] for h in json.loads(ipc_weights.read_slots(self.pair, 5))["slots"]]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.sender.close()


@pytest.fixture
def learners():
    made = []
    yield lambda *a, **kw: made.append(Learner(*a, **kw)) or made[-1]
    for learner in made:
        learner.close()


@pytest.mark.parametrize("dtype, slots", [("bfloat16", 2), ("float32", 3)])
def test_a_publish_through_shared_slots_delivers_bit_identical_weights(tmp_path, learners, dtype, slots):
    """Three versions of five buckets through two (three) slots, the two parameters larger than the bound in pieces,
    as the publisher sends them: the generator holds exactly the learner's parameters cast to its dtype, every
    version."""
    assert len(PLAN) == 5 and max(stop - start for *_, start, stop in PLAN) == 2500 > BOUND
    assert [(p[4], p[5]) for p in _pieces(LAYOUT, BOUND)][:5] == [(0, False), (1200, False), (2400, True),
                                                                   (0, False), (1200, True)]
    learner = learners(tmp_path, dtype, slots=slots)
    sent = {v: _version(v) for v in (1, 2, 3)}
    for v, flat in sent.items():
        learner.publish(v, flat)
    got = learner.received()["versions"]
    assert sorted(got) == [1, 2, 3]
    for v, flat in sent.items():
        expected = flat.to(getattr(torch, dtype))
        assert got[v].dtype == expected.dtype and torch.equal(_bits(got[v]), _bits(expected)), f"version {v} differs"


def test_slots_are_never_overwritten_before_their_acknowledgement_and_are_mapped_once(tmp_path, learners):
    """A generator that sleeps 0.1 s before reading each slot: were a slot overwritten before its bucket was
    acknowledged, it would load a later bucket's values. It loads every version exactly; the learner never has more
    buckets in flight than slots, and each publish returns only once its last bucket is loaded. One mapping serves
    every version (same slot addresses). After the stop header the learner keeps its slots while the generator still
    maps them, and frees them as soon as it says it unmapped them (while it is still alive)."""
    learner = learners(tmp_path, "bfloat16", slow_s=0.1, hold_s=1.5, linger_s=30)
    sender, in_flight = learner.sender, []
    sent = {v: _version(10 + v) for v in (1, 2, 3)}
    for v, flat in sent.items():
        took = learner.publish(v, flat, after_each=lambda: in_flight.append(sender.seq - sender.acked), pieces=False)
        assert took >= len(PLAN) * 0.1 and sender.acked == sender.seq == v * len(PLAN)
    assert max(in_flight) == sender.count == 2 and in_flight[-1] == 0
    got = learner.received()
    for v, flat in sent.items():
        assert torch.equal(_bits(got["versions"][v]), _bits(flat.to(torch.bfloat16))), f"version {v} was torn"
    assert got["maps"] == {"shm": 1} and len({tuple(p) for p in got["ptrs"]}) == 1
    files = learner.slot_files()
    assert sender.close() is False and all(os.path.exists(f) for f in files)  # still mapped: kept
    assert learner.proc.stdout.readline().strip() == "unmapped"
    assert sender.released.wait(10) and not any(os.path.exists(f) for f in files)
    assert learner.proc.poll() is None  # freed because it unmapped, not because it died


def test_a_generator_that_dies_mid_version_fails_the_send_at_once_and_frees_the_slots(tmp_path, learners):
    """The generator exits while loading bucket 1: the learner's wait for that acknowledgement fails within
    milliseconds of the death (its socket closes), not at the 60 s deadline; the sender refuses further buckets, and
    close() frees the slots, since the process that mapped them is gone."""
    learner = learners(tmp_path, "bfloat16", timeout_s=60, die_at=1)
    files = learner.slot_files()
    t0 = time.monotonic()
    # Bucket 2's signal or bucket 1's acknowledgement, whichever was in flight when the connection closed.
    with pytest.raises(IpcError, match="(signal of bucket 2|acknowledgement of bucket 1) failed"):
        learner.publish(1, _version(1))
    assert time.monotonic() - t0 < 10
    with pytest.raises(IpcError, match="takes no more buckets: the .* of bucket [12] failed"):
        learner.sender.send_bucket(LAYOUT, *PLAN[0][:2], _version(2)[: PLAN[0][3]], torch.bfloat16)
    learner.proc.wait(10)
    assert learner.sender.close() is True and not any(os.path.exists(f) for f in files)


@pytest.mark.parametrize("verdict", [False, True])
def test_a_frozen_generator_fails_the_send_at_its_deadline_or_at_the_hubs_verdict(tmp_path, learners, verdict):
    """The generator stops itself (SIGSTOP) while loading bucket 1. Without a verdict the learner gives up at its 2 s
    deadline; with the hub's verdict half a second in (deadline 60 s), at once. Either way the slots stay allocated
    while the frozen process maps them, and are freed once it is killed."""
    learner = learners(tmp_path, "bfloat16", timeout_s=60 if verdict else 2, freeze_at=1)
    files = learner.slot_files()
    t0 = time.monotonic()
    cancelled = (lambda: time.monotonic() > t0 + 0.5) if verdict else None
    with pytest.raises(IpcError, match="declared the generator lost" if verdict else "did not complete within"):
        learner.publish(1, _version(1), cancelled=cancelled)
    took = time.monotonic() - t0
    assert (0.5 <= took < 3) if verdict else (2 <= took < 5), f"the publish gave up after {took:.1f}s"
    assert learner.sender.close() is False and all(os.path.exists(f) for f in files)
    learner.proc.kill()
    assert learner.sender.released.wait(10) and not any(os.path.exists(f) for f in files)


def test_gloos_own_timeout_reads_as_the_deadline_it_is_and_a_closed_peer_as_a_failure():
    """A signal's gloo deadline and the poll's are one deadline; gloo's timer may fire first (seen on a loaded 2-core
    machine: the frozen-generator test then read "failed: ... Timed out"). Either way the caller is told the
    deadline passed; a peer that closed its connection is a failure."""

    class Work:
        def __init__(self, why):
            self.why = why

        def is_completed(self):
            return True

        def wait(self, timeout=None):
            raise RuntimeError(self.why)

    timed_out = Work("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1999ms for recv operation to complete")
    with pytest.raises(IpcError, match=r"^the signal of bucket 1 did not complete within 2.0s \(.*Timed out waiting"):
        ipc_weights.settle(timed_out, 2.0, lambda: False, what="the signal of bucket 1")
    with pytest.raises(IpcError, match=r"^the signal of bucket 1 failed: Connection closed by peer"):
        ipc_weights.settle(Work("Connection closed by peer [127.0.0.1]:4242"), 2.0, what="the signal of bucket 1")


def test_another_gpu_is_refused_before_anything_is_allocated():
    """The generator announces a GPU other than the learner's: the sender refuses with both UUIDs and the fix, and
    never offers slots."""
    port = free_port()
    store = dist.TCPStore(HOST, port, None, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    ipc_weights.announce_ipc(store, "GPU-0000-elsewhere", torch.bfloat16, backend="cuda")
    with pytest.raises(IpcPlacementError, match=r"GPU-0000-elsewhere.*weight_transport = \"rpc\" or \"nccl\""):
        IpcSender(store, None, LAYOUT, "cpu", 5)
    assert not store.check([ipc_weights.SLOTS_KEY])


def test_the_placement_refusal_names_both_gpus_and_the_fix():
    a, b = "GPU-8c9d2f4e-1b2a-4c3d-9e8f-0123456789ab", "GPU-11111111-2222-3333-4444-555555555555"
    refusal = ipc_weights.same_gpu(a, b)
    assert a in refusal and b in refusal and "\n" not in refusal
    assert "generator.weight_transport = \"rpc\" or \"nccl\"" in refusal and "one GPU" in refusal
    assert ipc_weights.same_gpu(a, a) is None
    assert ipc_weights.same_gpu(a, a.removeprefix("GPU-").upper()) is None  # torch prints it without the prefix
    assert ipc_weights.same_gpu("", "") is not None  # an unknown GPU is never taken for the learner's


def test_cuda_handles_travel_as_plain_fields_onto_the_importers_index_of_the_gpu():
    """reduce_tensor's arguments (torch 2.x) round-trip through JSON, bytes and all; the importer's device index
    replaces the exporter's (the same physical GPU may be cuda:3 there and cuda:0 here)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (torch.Tensor, torch.Size([2500]), (1,), 0, torch.storage.TypedStorage, torch.bfloat16, 3,
            b"\x01\x00handle", 8192, 512, False, b"/torch_123_456", 7, b"\x02event", True)
    fields = json.loads(json.dumps(ipc_weights.encode_cuda_args(args)))
    back = ipc_weights.decode_cuda_args(fields, device_index=0)
    assert back == args[:6] + (0,) + args[7:]
    assert len(back) == len(inspect.signature(rebuild_cuda_tensor).parameters)


def test_a_slot_is_staged_in_the_generators_dtype_and_never_pickled(tmp_path):
    """The offer names the backend, dtype, slot size and bucket bound in JSON, and the slots hold the cast bucket."""
    export = ipc_weights.exporter("cpu", "shm", 2, 10, torch.bfloat16)
    try:
        info = json.loads(ipc_weights.slot_handles(export, BOUND))
        assert (info["backend"], info["dtype"], info["numel"], info["bucket_numel"]) == ("shm", "bfloat16", 10, BOUND)
        bucket = torch.linspace(-1, 1, 7)
        assert export.stage(1, bucket)()
        mapped = ipc_weights.map_slots(ipc_weights.slot_handles(export, BOUND))
        assert torch.equal(mapped.slots[1][:7], bucket.to(torch.bfloat16))
    finally:
        export.release(consumer_gone=False)
    assert not any(os.path.exists(h["path"]) for h in info["slots"])
    with pytest.raises(ValueError, match="learner rank 0 is on cpu"):
        ipc_weights.exporter("cpu", "cuda", 2, 10, torch.bfloat16)


# ---- wired in: the publisher's IpcPeer, and the vLLM engine's ipc layer over a stand-in AsyncLLM ------------------


def test_an_ipc_header_is_flagged_direct_and_ipc_and_a_receiver_without_it_refuses_one():
    """FLAG_IPC (16) sits above the dtype bits; an ipc header carries FLAG_DIRECT too, so every receiver without a
    direct path refuses it as before (`refuse_direct`), and says which kind it got."""
    flags = weights.FLAG_DIRECT | weights.FLAG_IPC | weights.dtype_flags(torch.bfloat16)
    assert weights.FLAG_IPC == 16 and weights.KNOWN_FLAGS & weights.FLAG_IPC
    assert weights.flags_dtype(flags) == torch.bfloat16
    with pytest.raises(RuntimeError, match="sent through CUDA IPC slots into vLLM workers, but the torch engine "
                                           "announced no ipc receiver"):
        weights.refuse_direct(flags, "the torch engine")
    with pytest.raises(RuntimeError, match="header flags 0x20"):
        weights.flags_dtype(32)  # still refused: a bit this side does not know


def _generator_process(tmp_path, port: int, prefix: str, dtype: str, **behaviour) -> subprocess.Popen:
    """tests/helpers/ipc_generator.py as a generator of a real `WeightPublisher` (learner rank 0 in this process)."""
    job = {"port": port, "prefix": prefix, "names": list(LAYOUT.names), "shapes": [list(s) for s in LAYOUT.shapes],
           "dtype": dtype, "timeout_s": 30, "out": str(tmp_path / "generator.pt"), "device": "cpu", **behaviour}
    (tmp_path / "job.json").write_text(json.dumps(job))
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.ipc_generator", str(tmp_path / "job.json")],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)


def _wire(flat: torch.Tensor, lay: weights.Layout = LAYOUT):
    return (flat[b.start:b.stop] for b in weights.wire_plan(lay))


def test_a_publisher_with_an_ipc_peer_delivers_bit_identical_weights_and_keeps_no_host_copy(tmp_path, monkeypatch):
    """Learner rank 0's real publish path (`WeightPublisher`: join thread, `_connect_direct`, `IpcPeer`) to the
    generator process of tests/helpers/ipc_generator.py over the shm backend, the bound cut to 1,200 elements so
    the plan has five buckets and two parameters go in pieces: every version arrives bit-identical, cast once from
    the fp32 wire to the generator's bf16; the run never allocates the host copy (its only peer is direct); and
    after the stop header the slots stay until the generator says it unmapped them."""
    from learner import publisher

    monkeypatch.setattr(weights, "BUCKET_NUMEL", BOUND)
    made = record_host_copies(monkeypatch)
    port = free_port()
    pub = publisher.WeightPublisher(HOST, port, 30, send_timeout_s=30)
    proc = _generator_process(tmp_path, port, weights.pair_prefix(0, "ipc"), "bfloat16", hold_s=3.0, linger_s=30)
    try:
        pub.join(0, "ipc")
        assert wait_until(lambda: pub.pending_direct, 30, 0.01)
        assert pub.pending_direct[0].announced == "ipc" and not pub.channels  # built by the next publish
        sent = {v: _version(v) for v in (1, 2, 3)}
        for v, flat in sent.items():
            _, nbytes, _ = pub.publish(v, LAYOUT, _wire(flat))
            assert pub.latest is None and nbytes == LAYOUT.numel * 4
        (peer,) = pub.channels.values()
        assert isinstance(peer, publisher.IpcPeer) and peer.flags == weights.FLAG_DIRECT | weights.FLAG_IPC
        assert peer.sender.acked == peer.sender.seq == 3 * len(PLAN)  # each publish returned with every bucket loaded
        counters = pub.counter_values()
        assert counters["weights/direct_channels"] == counters["weights/joins"] == 1
        files = [h["path"] for h in json.loads(ipc_weights.read_slots(peer.sender.store, 5))["slots"]]
        pub.stop()
        assert proc.stdout.readline().strip() == "stopped"
        got = torch.load(tmp_path / "generator.pt")
        for v, flat in sent.items():
            assert torch.equal(_bits(got["versions"][v]), _bits(flat.to(torch.bfloat16))), f"version {v} differs"
        assert made == []  # an ipc-only run never allocates the model-sized host copy
        assert all(os.path.exists(f) for f in files) and not peer.sender.released.is_set()  # still mapped: kept
        assert proc.stdout.readline().strip() == "unmapped"
        assert peer.sender.released.wait(10) and not any(os.path.exists(f) for f in files)
    finally:
        proc.kill()
        proc.wait()


def test_a_generator_on_another_gpu_is_refused_at_the_publish_and_reported(tmp_path):
    """A generator that announces another GPU: the publish that would build its slots refuses it before allocating
    anything, counts a join failure and reports it to the hub with both GPUs and the fix; the publish goes on."""
    from learner import publisher

    port = free_port()
    pub = publisher.WeightPublisher(HOST, port, 30, send_timeout_s=30)
    reports = []
    pub.report = lambda *a: reports.append(a)
    proc = _generator_process(tmp_path, port, weights.pair_prefix(0, "far"), "bfloat16", uuid="GPU-0000-elsewhere")
    try:
        pub.join(0, "far")
        assert wait_until(lambda: pub.pending_direct, 30, 0.01)
        pub.publish(1, LAYOUT, _wire(_version(1)))
        assert not pub.channels and pub.counter_values()["weights/join_failures"] == 1
        ((gen_id, incarnation, why),) = reports
        assert (gen_id, incarnation) == (0, "far") and why.startswith("its ipc rendezvous failed: ")
        assert "GPU-0000-elsewhere" in why and "weight_transport = \"rpc\" or \"nccl\"" in why
    finally:
        proc.kill()
        proc.wait()


class _Worker:
    """What `CovrlWorkerExtension` sees of a vLLM worker on the CPU: its device and the model's load_weights."""

    def __init__(self):
        from actors.vllm_engine import CovrlWorkerExtension

        self.ext = type("Worker", (CovrlWorkerExtension,), {})()
        self.ext.device, self.ext.rank, self.loaded = torch.device("cpu"), 0, {}
        self.ext.model_runner = type("Runner", (), {"get_model": staticmethod(
            lambda: type("Model", (), {"load_weights": staticmethod(self._load)})())})()

    def _load(self, pairs):
        for name, t in pairs:
            self.loaded[name] = t.clone()  # vLLM copies out of the slot the same way


class _LLM:
    """vLLM's AsyncLLM as the ipc path uses it: collective_rpc into one worker, pause, resume, the version label."""

    def __init__(self, worker: _Worker):
        self.worker, self.calls = worker, []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return [getattr(self.worker.ext, method)(*args, **(kwargs or {}))]

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def update_weight_version(self, version):
        self.calls.append(f"label {version}")


_API = type("Api", (), {"version_spans": True, "engine_versions": True, "native_nccl": False, "version": "fake"})


def test_the_vllm_engines_ipc_layer_loads_every_version_from_the_slots_and_unmaps_on_close(tiny_model_dir,
                                                                                         monkeypatch):
    """`VllmEngine` with weight_transport = "ipc" over a stand-in AsyncLLM whose one worker is on the CPU (shm
    slots), against a real `WeightPublisher`, all in this process: the rendezvous hooks announce the worker and map
    the slots once; each version flagged FLAG_IPC is loaded under a pause, bucket by bucket out of the slots, a
    split parameter whole (bf16 bits as the learner sent them), and labelled; close() unmaps, says so, and the
    learner frees its slots. What this cannot show: CUDA IPC itself and vLLM's own load_weights (GPU only)."""
    from actors.vllm_engine import VllmEngine, VllmSettings
    from common.vllm_weights import vllm_name
    from learner.publisher import IpcPeer, WeightPublisher

    monkeypatch.setattr(weights, "BUCKET_NUMEL", 4096)  # the tiny model's 10,240-element embedding in 3 pieces
    worker = _Worker()
    llm = _LLM(worker)
    eng = VllmEngine(tiny_model_dir, stop_ids=[0], llm=llm, api=_API(), settings=VllmSettings(transport="ipc"))
    lay = eng.lay
    assert eng.receives_weights_directly and any(b.offset for b in weights.wire_plan(lay))
    port = free_port()
    pub = WeightPublisher(HOST, port, 30, send_timeout_s=30)
    received, errors = [], []

    def weight_thread():  # as actors/weight_receiver.py drives the engine
        try:
            ch = eng.join_weights(f"{HOST}:{port}", weights.pair_prefix(0, "vllm"), 30)
            while (got := ch.receive_header(lay)) is not None:
                received.append((got, eng.receive_weights(ch, lay, *got), eng.version))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=weight_thread, daemon=True)
    t.start()
    try:
        pub.join(0, "vllm")
        assert wait_until(lambda: pub.pending_direct, 30, 0.01)
        assert llm.calls == ["label 0", "covrl_ipc_identity"]  # announced before the rendezvous
        versions = {v: torch.randn(lay.numel, generator=torch.Generator().manual_seed(v)).to(torch.bfloat16)
                    for v in (1, 2)}
        for v, flat in versions.items():
            pub.publish(v, lay, _wire(flat, lay))
            assert wait_until(lambda: len(received) == v or errors, 30, 0.01) and not errors, errors
            assert eng.version == v
            for name, view in weights.bucket_views(lay, 0, len(lay.names), flat):
                got = worker.loaded[vllm_name(name)]
                assert got.shape == view.shape and torch.equal(_bits(got), _bits(view)), f"{name} at version {v}"
        flags = weights.FLAG_DIRECT | weights.FLAG_IPC | weights.dtype_flags(torch.bfloat16)
        assert [r[0] for r in received] == [(1, flags), (2, flags)] and [r[1:] for r in received] == [(None, 1),
                                                                                                       (None, 2)]
        loads = len(weights.bucket_plan(lay))
        assert llm.calls.count("covrl_map_ipc") == 1 and llm.calls.count("covrl_load_ipc") == 2 * loads
        assert llm.calls[-3:] == ["covrl_load_ipc", "label 2", "resume"]  # loaded and labelled while paused
        (peer,) = pub.channels.values()
        assert isinstance(peer, IpcPeer)
        pub.stop()
        t.join(30)
        assert not errors and not peer.sender.released.is_set()  # the worker still maps the slots
        eng.close()
        assert "covrl_unmap_ipc" in llm.calls and peer.sender.released.wait(10)
    finally:
        pub.stop()
        eng.close()
    assert not errors


def test_the_vllm_engine_refuses_ipc_with_tensor_parallel_workers_and_a_mismatched_header(tiny_model_dir):
    from actors.vllm_engine import VllmEngine, VllmSettings

    with pytest.raises(ValueError, match=r"runs 2 tensor-parallel workers: use --tp 1 .*weight_transport = \"rpc\""):
        VllmEngine(tiny_model_dir, stop_ids=[0], llm=_LLM(_Worker()), api=_API(),
                   settings=VllmSettings(transport="ipc", tensor_parallel_size=2))
    eng = VllmEngine(tiny_model_dir, stop_ids=[0], llm=_LLM(_Worker()), api=_API(),
                     settings=VllmSettings(transport="nccl"))
    try:
        with pytest.raises(RuntimeError, match="sent version 3 over ipc, but this generator announced an nccl"):
            eng.receive_weights(None, eng.lay, 3, weights.FLAG_DIRECT | weights.FLAG_IPC)
    finally:
        eng.close()


@pytest.mark.gpu
def test_cuda_ipc_publishes_a_half_billion_parameter_layout_in_under_a_fifth_of_a_second(tmp_path, learners):
    """Two processes on one GPU, CUDA backend, a Qwen2-0.5B-shaped layout (the embedding alone sets the slot): every
    version arrives bit-identical in bf16, and a publish takes at most 0.2 s once warm."""
    names = ["embed"] + [f"layer{i}.{p}" for i in range(24) for p in ("attn", "mlp")]
    shapes = [(151936, 896)] + [s for _ in range(24) for s in ((896, 1152), (896, 4864 * 3))]
    lay = weights.Layout(tuple(names), tuple(shapes))
    learner = learners(tmp_path, "bfloat16", device="cuda:0", layout=lay, bound=weights.BUCKET_NUMEL, keep=False)
    sent, took = {}, []
    for v in (1, 2, 3):
        flat = torch.randn(lay.numel, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(v))
        sent[v] = digest(flat.to(torch.bfloat16))
        torch.cuda.synchronize()
        took.append(learner.publish(v, flat))
    got = learner.received()
    assert got["digests"] == sent, "a version differs"
    assert min(took[1:]) <= 0.2, f"publishes took {took} s; the generator's loads {got['load_s']} s"
