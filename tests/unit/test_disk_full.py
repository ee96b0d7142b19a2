"""A full disk is said in one line (common/diskspace.py): the checkpoint on a real 1 MiB tmpfs (torch's serializer
hides the errno there), metrics.jsonl and progress.json, and the rule that decides what counts as a full disk."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from common.checkpoint_dirs import GOOD, checkpoint_bytes, complete_checkpoints, verify
from common.diskspace import (DiskFullError, disk_full_error, free_bytes, full_disk_in_chain, is_disk_full,
                              resume_advice, size_text)
from common.metrics import MetricsWriter, read_metrics
from common.transport import free_port
from learner.checkpoint import disk_full, save_checkpoint

MiB = 2**20
TORCH_TEXT = "[enforce fail at inline_container.cc:672] . unexpected pos 13440 vs 13334"  # seen in issue 49


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs, unmounted afterwards; skipped where this process may not mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no `mount` command: the disk-full tests fill a real 1 MiB tmpfs")
    if got.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({got.stderr.strip()}): the disk-full tests need root "
                    "with CAP_SYS_ADMIN")
    try:
        yield disk
    finally:
        gc.collect()  # a failed test's traceback may hold torch's open file on the disk
        if subprocess.run(["umount", str(disk)], timeout=30).returncode != 0:
            subprocess.run(["umount", "--lazy", str(disk)], check=True, timeout=30)  # detached; freed once closed


def fill(disk, leave_bytes: int = 0) -> None:
    """Take the disk's free space down to about `leave_bytes` with a filler file."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while free_bytes(str(disk)) > leave_bytes:
                f.write(b"\0" * min(16384, max(4096, free_bytes(str(disk)) - leave_bytes)))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


# ---- the rule and the message, alone


def test_an_enospc_anywhere_in_the_chain_is_a_full_disk_whatever_the_free_space():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            raise RuntimeError("wrapped by a library") from e
    except RuntimeError as e:
        wrapped = e
    assert full_disk_in_chain(wrapped) and is_disk_full(wrapped, free=10 * 2**30, need_bytes=MiB)
    quota = RuntimeError("while saving")
    quota.__context__ = OSError(errno.EDQUOT, "quota")  # implicit chaining counts too
    assert is_disk_full(quota, free=10 * 2**30)
    # safetensors keeps only the text: "Error while serializing: I/O error: No space left on device (os error 28)"
    assert is_disk_full(RuntimeError("I/O error: No space left on device (os error 28)"), free=10 * 2**30)


def test_torchs_error_counts_only_when_the_disk_lacks_the_space_and_an_unrelated_error_never():
    assert is_disk_full(RuntimeError(TORCH_TEXT), free=MiB, need_bytes=5 * MiB)  # errno hidden; the disk says it
    assert not is_disk_full(RuntimeError(TORCH_TEXT), free=10 * 2**30, need_bytes=5 * MiB)  # room: not a full disk
    assert not is_disk_full(KeyError("optimizer"), free=10 * 2**30, need_bytes=5 * MiB)
    # A peer that died or froze during the write fails this rank's barrier: never a full disk, however little is free.
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 35000ms "
                        "for recv operation to complete")
    assert not is_disk_full(gloo, free=MiB, need_bytes=5 * MiB)
    import torch.distributed as dist

    assert not is_disk_full(dist.DistBackendError("NCCL communicator was aborted"), free=MiB, need_bytes=5 * MiB)
    err = disk_full_error("/r/checkpoints/step_6", MiB, resume_advice("/r", "the previous checkpoint is intact"),
                          need_bytes=5 * MiB + MiB // 2)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err) == ("no space left on device while writing /r/checkpoints/step_6 (needs about 5.5 MiB, 1.0 MiB "
                        "free): free space or point the run at a larger disk, then covrl resume /r; the previous "
                        "checkpoint is intact")


class Module(torch.nn.Module):
    """The policy's part save_checkpoint uses: parameters and save_pretrained (safetensors + config.json)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))

    def save_pretrained(self, path, safe_serialization=True, state_dict=None):
        from safetensors.torch import save_file

        save_file(state_dict or self.state_dict(), os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"n": self.w.numel()}, f)


class Engine:
    """DeepSpeed's engine as save_checkpoint uses it: its state under `tag`, written by torch.save (parameters
    and AdamW's two moments, as DeepSpeed's shards hold them)."""

    def __init__(self, n: int):
        self.module = Module(n)

    def save_checkpoint(self, path, tag, save_latest):
        os.makedirs(os.path.join(path, tag))
        w = self.module.w.detach()
        torch.save({"module": {"w": w}}, os.path.join(path, tag, "mp_rank_00_model_states.pt"))
        torch.save({"exp_avg": w * 0.1, "exp_avg_sq": w * w},
                   os.path.join(path, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


class Tokenizer:
    def save_pretrained(self, path):
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")


@pytest.fixture
def one_rank():
    """A gloo world of one rank, for save_checkpoint's barriers."""
    assert not dist.is_initialized(), "a process group is left over from another test"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_unrelated_failure_mid_checkpoint_passes_unchanged_and_keeps_the_tmp(tmp_path):
    tmp = tmp_path / "checkpoints" / "step_6.tmp"
    tmp.mkdir(parents=True)
    final = str(tmp_path / "checkpoints" / "step_6")
    assert disk_full(KeyError("optimizer"), str(tmp_path), final, Engine(1000)) is None  # a disk with room
    assert tmp.is_dir()  # only a full disk removes the partial directory


# ---- on a real full disk


def test_a_checkpoint_on_a_full_disk_says_so_in_one_line_and_leaves_the_previous_one_to_resume(tiny_disk,
                                                                                                one_rank):
    run = tiny_disk / "run"
    engine = Engine(24_000)  # 96 kB of fp32 parameters: about 400 kB a checkpoint (export, states, two moments)
    save = dict(engine=engine, rank=0, tokenizer=Tokenizer(), state={"learners": 1}, hub_state=b"hub")
    step_2 = save_checkpoint(str(run), 2, **save)
    need = checkpoint_bytes(step_2)
    assert 300_000 < need < 500_000
    fill(tiny_disk, leave_bytes=150_000)  # the next one starts, and the disk fills in torch.save's shards
    with pytest.raises(DiskFullError) as got:
        save_checkpoint(str(run), 4, **save)
    text = str(got.value)
    free = free_bytes(str(run))
    assert "\n" not in text and text == (
        f"no space left on device while writing {run}/checkpoints/step_4 (needs about {size_text(need)}, "
        f"{size_text(free)} free; its partial step_4.tmp was removed): free space or point the run at a larger "
        f"disk, then covrl resume {run}; the previous checkpoint, step_2, is intact")
    assert isinstance(got.value.__cause__, RuntimeError)  # torch's "[enforce fail at inline_container.cc ...]"
    assert not full_disk_in_chain(got.value.__cause__), "torch kept the errno: the free-space rule was not needed"
    assert complete_checkpoints(str(run)) == [(2, step_2)] and verify(step_2).state == GOOD
    assert sorted(os.listdir(run / "checkpoints")) == ["step_2"]  # the partial .tmp is gone, nothing else touched


def test_metrics_and_progress_on_a_full_disk_say_so_in_one_line(tiny_disk):
    run = tiny_disk / "run"
    run.mkdir()
    sink = MetricsWriter(str(run), tensorboard=False)
    sink.write(1, {"critic/score/mean": 0.5})
    fill(tiny_disk)
    with pytest.raises(DiskFullError) as got:
        sink.write(2, {"critic/score/mean": 0.6, "pad": 1.0} | {f"x/{i}": float(i) for i in range(500)})
    assert str(got.value) == (f"no space left on device while writing {run}/metrics.jsonl (0.0 MiB free): free space "
                              f"or point the run at a larger disk, then covrl resume {run}; it starts from the newest "
                              "checkpoint and rewrites the rows after it")
    assert [r["step"] for r in read_metrics(str(run))] == [1]
    assert (run / "metrics.jsonl").read_bytes().endswith(b"\n")  # the row cut short was truncated away
    with pytest.raises(DiskFullError, match=rf"^no space left on device while writing {run}/progress\.json \(0\.0 "
                                            r"MiB free\): free space .*covrl resume"):
        sink.progress(2, {"critic/score/mean": 0.6}, [])
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]  # no half progress.json.tmp left
    sink.close()
