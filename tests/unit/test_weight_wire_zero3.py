"""A real ZeRO-3 learner's publish in bf16, on the CPU: two learner ranks (gloo) whose tiny model DeepSpeed has
sharded (`deepspeed.zero.Init`, bf16, no optimizer: DeepSpeed's bf16 optimizer needs a GPU, partitioning does not)
walk `param_buckets` with a bucket bound of 16 elements; rank 0 publishes through the one publish path to a
generator's pair channel in the same process. Checked: every bucket bf16 and at most the bound, each load-plan bucket
gathered once (the 32- and 24-element parameters once for both their pieces), the generator's vector the model's
own bits in bf16 with the learner's checksum, and the checkpoint's state dict whole and bf16.

Each rank is this module run as a script (`python -m tests.unit.test_weight_wire_zero3 RANK ...`), since
torch.distributed is set up once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.transport import free_port
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow
BOUND = 16


def test_a_zero3_bf16_learner_publishes_bounded_bf16_buckets_gathering_each_parameter_once(tmp_path):
    dist_port, weight_port = free_port(), free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(dist_port), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": REPO}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.unit.test_weight_wire_zero3", str(weight_port),
                                       str(tmp_path / f"rank{rank}.json")], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["sharded"]  # each rank holds a shard, not the parameter: the gathers are real
        assert r["dtypes"] == ["torch.bfloat16"] and r["sizes"] == [16, 16, 8, 16, 8, 3] and r["scratch"] == BOUND
        assert r["gathers"] == [32, 8, 24, 3] * 2  # the publish, then the checkpoint: once per load-plan bucket
        assert r["buckets_equal"] and r["state_dict"] == {"0.weight": [8, 4], "0.bias": [8], "1.weight": [3, 8],
                                                          "1.bias": [3]}
    assert r0["received"] == {"version": 1, "dtype": "torch.bfloat16", "equal": True, "checksum": r0["published"]}
    assert r1["published"] is None  # only rank 0 sends


def _rank(weight_port: int, out: str) -> None:
    import datetime
    import math
    import threading

    import torch

    from common import weights
    from learner import params
    from learner.nccl import wait_until
    from learner.publisher import ModelPublisher, WeightPublisher
    from learner.trainer import _quiet_deepspeed
    from tests.helpers.weight_channel import receive

    deepspeed = _quiet_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=120))
    rank = int(os.environ["RANK"])
    weights.BUCKET_NUMEL = BOUND

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))

    reference = build().to(torch.bfloat16)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = build()
    gathers, real = [], params._gathered

    def counted(group, zero3):
        gathers.append(sum(math.prod(p.ds_shape) for p in group))
        return real(group, zero3)

    params._gathered = counted
    lay = weights.layout(model)
    result = {"sharded": all(p.numel() == 0 for p in model.parameters()), "received": None}
    seen = []
    real_buckets = params.param_buckets

    def recorded(*args):
        for b in real_buckets(*args):
            seen.append(b.clone())
            yield b

    import learner.publisher as publisher_module

    publisher_module.param_buckets = recorded
    channel = WeightPublisher("127.0.0.1", weight_port, 60) if rank == 0 else None
    pub = ModelPublisher(model, zero3=True, channel=channel)
    got = []
    if rank == 0:
        def generator():
            ch = weights.WeightChannel("127.0.0.1", weight_port, 1, 2, 60, prefix=weights.pair_prefix(0, "z3"))
            while (r := receive(ch, lay)) is not None:
                got.append(r)

        t = threading.Thread(target=generator, daemon=True)
        t.start()
        channel.join(0, "z3")
        assert wait_until(lambda: channel.channels, 60, 0.01)
    published = pub.publish(1)
    state = params.full_state_dict(model, lay, True)
    if rank == 0:
        pub.stop()
        t.join(60)
        (version, flat, received_sum), = got
        result["received"] = {"version": version, "dtype": str(flat.dtype), "checksum": received_sum,
                              "equal": torch.equal(flat.view(torch.int16), expected.view(torch.int16))}
    bits = [state[n].reshape(-1) for n in lay.names]
    result.update(
        published=None if published is None else published[2], gathers=gathers, scratch=pub.scratch.numel(),
        dtypes=sorted({str(b.dtype) for b in seen} | {str(v.dtype) for v in state.values()}),
        sizes=[b.numel() for b in seen], state_dict={n: list(v.shape) for n, v in state.items()},
        buckets_equal=torch.equal(torch.cat(seen).view(torch.int16), expected.view(torch.int16))
        and torch.equal(torch.cat(bits).view(torch.int16), expected.view(torch.int16)))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _rank(int(sys.argv[1]), sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # the result is written; gloo's threads (the pair channel, the store) may abort a normal shutdown
