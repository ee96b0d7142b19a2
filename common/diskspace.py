"""A full disk, said in one line: what was being written, the space it needs, the space free, the way out.

Writers of the run directory (the checkpoint, metrics.jsonl, progress.json, TensorBoard) raise `DiskFullError`
instead of what their library made of ENOSPC: torch's serializer turns it into "[enforce fail at
inline_container.cc:672] . unexpected pos 13440 vs 13334" and safetensors into a SafetensorError, neither of which
keeps the errno. So a failure counts as a full disk when an ENOSPC or EDQUOT OSError is anywhere in its chain, when
its text is the system's own message for either, or when the disk now has less free space than the write needed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = tuple(os.strerror(n) for n in FULL_ERRNOS)  # "No space left on device", "Disk quota exceeded"


class DiskFullError(OSError):
    """The run's disk (or quota) is full. Its text is one line; `errno` is ENOSPC, for callers that test it."""

    def __init__(self, message: str):
        super().__init__(message)  # one argument: str() is the message, not "[Errno 28] ..."
        self.errno = errno.ENOSPC


def full_disk_in_chain(exc: BaseException) -> bool:
    """An ENOSPC/EDQUOT OSError, or the system's text for one, anywhere in `exc`'s causes and contexts."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in _FULL_TEXTS):  # safetensors: "... No space left on device (os error 28)"
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str) -> int:
    """Free space for this user on the filesystem that holds `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def tree_bytes(path: str) -> int:
    """The bytes of every file under `path` (0 when it does not exist)."""
    total = 0
    for here, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # a file another rank removes meanwhile
                total += os.path.getsize(os.path.join(here, name))
    return total


# Failures of a collective (a peer that died or froze, a deadline): never the disk, however little is free.
_NOT_THE_DISK = ("gloo", "nccl", "timed out", "timeout", "connection", "broken pipe", "collective")


def is_disk_full(exc: BaseException, free: int, need_bytes: int = 0) -> bool:
    """Whether `exc`, raised while writing something of which about `need_bytes` was still to be written, came from
    a full disk: the errno or its text in the chain; else, for an error of a local write (not a collective's, nor a
    distributed error), free space below what remained to write."""
    if full_disk_in_chain(exc):
        return True
    text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}".lower()
    return free < need_bytes and "distributed" not in text and not any(t in text for t in _NOT_THE_DISK)


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 10 * 2**30 else f"{n / 2**20:.1f} MiB"


def disk_full_error(path: str, free: int, advice: str, need_bytes: int = 0, note: str = "") -> DiskFullError:
    """The one-line error: `path` was being written; `advice` says what to do; `note` adds a clause."""
    need = f"needs about {size_text(need_bytes)}, " if need_bytes else ""
    text = f"no space left on device while writing {path} ({need}{size_text(free)} free{note}): {advice}"
    return DiskFullError(" ".join(text.split()))


def resume_advice(run_dir: str, intact: str) -> str:
    """The way out of a full disk for a run: `intact` names what the resume starts from."""
    return f"free space or point the run at a larger disk, then covrl resume {run_dir}; {intact}"


@contextlib.contextmanager
def naming_full_disk(path: str, run_dir: str):
    """Around a small write to the run directory (metrics, progress): a full disk becomes one `DiskFullError` line
    naming `path` and the free space; any other error passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # re-raised as it was unless the disk is full
        if not full_disk_in_chain(e):
            raise
        advice = resume_advice(run_dir, "it starts from the newest checkpoint and rewrites the rows after it")
        raise disk_full_error(path, free_bytes(path), advice) from e
