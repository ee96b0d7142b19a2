"""A CUDA learner's publish, on a real GPU. Buckets are assembled on the GPU (`scratch_for` follows
the parameters), copied into the publisher's pinned host vector, and sent over gloo to a generator that receives
the same bytes (checksums equal to the bit), bf16 and fp32, with and without one reused scratch buffer."""

from __future__ import annotations

import threading

import pytest
import torch

from common import weights
from common.transport import free_port
from learner.nccl import wait_until
from learner.params import param_buckets, scratch_for
from learner.publisher import WeightPublisher
from tests.helpers.weight_channel import receive

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_learner_publishes_what_the_generator_receives(monkeypatch, dtype):
    monkeypatch.setattr(weights, "BUCKET_NUMEL", 1 << 12)  # several buckets, one scratch reused for all of them
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)).to("cuda", dtype)
    lay = weights.layout(model)
    port = free_port()
    pub = WeightPublisher("127.0.0.1", port, 60, device="cuda")
    got = []

    def generator():
        ch = weights.WeightChannel("127.0.0.1", port, 1, 2, 60, prefix=weights.pair_prefix(0, "g"))
        while (v := receive(ch, lay)) is not None:
            got.append(v)

    t = threading.Thread(target=generator, daemon=True)
    t.start()
    pub.join(0, "g")
    assert wait_until(lambda: pub.channels, 60, 0.01)
    scratch = scratch_for(model, lay)
    assert scratch.is_cuda and pub.latest is None
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        _, _, total = pub.publish(version, lay, param_buckets(model, lay, False, scratch))
        expected = weights.flatten(model).cpu()
        assert wait_until(lambda: len(got) >= version, 60, 0.01)
        v, flat, received = got[-1]
        assert v == version and torch.equal(flat, expected) and received == total == weights.checksum(expected, lay)
    assert pub.latest.flat.is_pinned()
    pub.stop()
    t.join(30)
