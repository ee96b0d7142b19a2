"""CUDA fatbin pruning in place: keep only the code a Hopper GPU (sm_90) runs, so vLLM's kernels travel small.

A CUDA `.so` keeps its device code in the ELF section `.nv_fatbin`: a run of fatbin *containers*, one per
compilation unit, each registered at load time by the address of its start (host code holds that pointer). A
container is a 16-byte header (u32 magic 0xBA55ED50, u16 version 1, u16 header size, u64 payload size) followed
by *entries*, each with its own header: u16 kind (1 PTX, 2 SASS/ELF), u16, u32 header size, u64 payload size,
..., u32 architecture at +28, u64 flags at +40 (0x100000 marks the arch-specific sm_90a), then its payload
(already compressed by nvcc, so xz gains little on it).

Pruning rewrites each container where it stands: the kept entries are copied to the front of its payload, the
header's payload size shrinks, and the freed tail is zeroed. Container start addresses never move, and no byte
outside `.nv_fatbin` changes, so the ELF layout, symbols and relocations stay valid and the file size is the same;
xz then compresses the zeroed tails to nothing. Policies:

  sm90  SASS for sm_90 / sm_90a; PTX <= 90 only in a container that has no sm_90 SASS (a JIT path for kernels
        built only for older GPUs).
  ptx   SASS for sm_90 / sm_90a and, in every container, its newest PTX <= 90 (the conservative fallback: the
        driver can JIT every kernel that was built with PTX if it refuses the SASS). Older PTX beside it is
        dropped: on sm_90 the driver JITs the newest compatible PTX, so the rest is never read (and keeping it
        costs vLLM 0.26's `_C` 5.5 MB of xz, more than the travel budget has).

A container left with no entry (code for other GPUs only) stays in place with a zero payload: cuobjdump reads
such a file, and whether the driver accepts it is what the first GPU run shows. `keep_one=True` keeps each such
container's smallest entry instead (no container is ever empty), at 4.7 MB of xz for vLLM 0.26's `_C`.
Standard library only (the GPU machine runs it before anything is unpacked); it does not depend on readelf.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
CONTAINER_VERSION = 1
KIND_PTX, KIND_SASS = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000  # sm_90a (cuobjdump's listing agrees: 24 such entries in vLLM 0.26's _C)
HOPPER = 90
_CONTAINER = struct.Struct("<IHHQ")
_ENTRY = struct.Struct("<HHIQ")
_ENTRY_MIN_HEADER = 48  # through the u64 flags at +40


class FatbinError(ValueError):
    """The bytes are not a fatbin this pruner understands; nothing was written."""


@dataclass(frozen=True)
class Entry:
    offset: int  # file offset of the entry header
    kind: int
    arch: int
    flags: int
    header_bytes: int
    payload_bytes: int

    @property
    def size(self) -> int:
        return self.header_bytes + self.payload_bytes

    @property
    def label(self) -> str:
        """cuobjdump's name for the code: sass_sm_90a, ptx_sm_80."""
        suffix = "a" if self.flags & FLAG_ARCH_SPECIFIC else ""
        return f"{'ptx' if self.kind == KIND_PTX else 'sass'}_sm_{self.arch}{suffix}"


@dataclass(frozen=True)
class Container:
    offset: int  # file offset of the container header: host code points here, so it never moves
    version: int
    header_bytes: int
    payload_bytes: int
    entries: tuple[Entry, ...]


Policy = Callable[[tuple[Entry, ...]], list[Entry]]


def keep_sm90(entries: tuple[Entry, ...]) -> list[Entry]:
    """sm_90/sm_90a SASS; PTX <= 90 only where a container has no sm_90 SASS."""
    sass = [e for e in entries if e.kind == KIND_SASS and e.arch == HOPPER]
    return sass or [e for e in entries if e.kind == KIND_PTX and e.arch <= HOPPER]


def keep_sm90_ptx(entries: tuple[Entry, ...]) -> list[Entry]:
    """sm_90/sm_90a SASS and the newest PTX <= 90 (the PTX a Hopper driver would JIT if it refused the SASS)."""
    newest = max((e.arch for e in entries if e.kind == KIND_PTX and e.arch <= HOPPER), default=None)
    return [e for e in entries
            if (e.kind == KIND_SASS and e.arch == HOPPER) or (e.kind == KIND_PTX and e.arch == newest)]


POLICIES: dict[str, Policy] = {"sm90": keep_sm90, "ptx": keep_sm90_ptx}


def elf_section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the named section of a little-endian ELF64 file; FatbinError if absent."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a little-endian 64-bit ELF file (only x86-64 .so files are pruned)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        raise FatbinError("ELF section header table missing or past the end of the file")

    def header(i: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        base = shoff + i * shentsize
        return struct.unpack_from("<I", data, base)[0], *struct.unpack_from("<QQ", data, base + 0x18)

    names_at = header(shstrndx)[1]
    for i in range(shnum):
        name_off, offset, size = header(i)
        start = names_at + name_off
        if data[start:data.index(b"\0", start)].decode() == name:
            if offset + size > len(data):
                raise FatbinError(f"section {name} runs past the end of the file")
            return offset, size
    raise FatbinError(f"no {name} section: this ELF file holds no CUDA device code")


def parse_containers(data: bytes, offset: int, size: int) -> list[Container]:
    """Every container of a `.nv_fatbin` section; zero padding between containers is skipped (pruning makes it)."""
    containers, pos, end = [], offset, offset + size
    while pos + _CONTAINER.size <= end:
        if not any(data[pos:pos + 8]):  # padding, or a pruned container's zeroed tail
            pos += 8
            continue
        magic, version, header_bytes, payload_bytes = _CONTAINER.unpack_from(data, pos)
        if magic != FATBIN_MAGIC or version != CONTAINER_VERSION:
            raise FatbinError(f"no fatbin container at 0x{pos:x} (magic 0x{magic:08x}, version {version}; expected "
                              f"0x{FATBIN_MAGIC:08x}, {CONTAINER_VERSION}): not a layout this pruner knows, so the "
                              f"file is left as it is")
        if pos + header_bytes + payload_bytes > end:
            raise FatbinError(f"fatbin container at 0x{pos:x} declares {payload_bytes} bytes, past the section end "
                              f"0x{end:x}: the file is truncated or not a fatbin")
        containers.append(Container(pos, version, header_bytes, payload_bytes,
                                    _parse_entries(data, pos + header_bytes, pos + header_bytes + payload_bytes)))
        pos += header_bytes + payload_bytes
        pos += -(pos - offset) % 8  # containers start 8-byte aligned within the section
    return containers


def _parse_entries(data: bytes, start: int, end: int) -> tuple[Entry, ...]:
    """The entries between start and end, which they must fill exactly."""
    entries, pos = [], start
    while pos < end:
        kind, _, header_bytes, payload_bytes = _ENTRY.unpack_from(data, pos)
        if kind not in (KIND_PTX, KIND_SASS) or header_bytes < _ENTRY_MIN_HEADER:
            raise FatbinError(f"fatbin entry at 0x{pos:x} has kind {kind} and a {header_bytes}-byte header "
                              f"(expected kind 1 or 2 and at least {_ENTRY_MIN_HEADER} bytes): unknown entry layout")
        if pos + header_bytes + payload_bytes > end:
            raise FatbinError(f"fatbin entry at 0x{pos:x} runs to 0x{pos + header_bytes + payload_bytes:x}, past its "
                              f"container's end 0x{end:x}: the container is malformed")
        arch, = struct.unpack_from("<I", data, pos + 28)
        flags, = struct.unpack_from("<Q", data, pos + 40)
        entries.append(Entry(pos, kind, arch, flags, header_bytes, payload_bytes))
        pos += header_bytes + payload_bytes
    return tuple(entries)


def prune_fatbin_section(data: bytearray, offset: int, size: int, keep: Policy, keep_one: bool = False) -> dict:
    """Rewrite every container of the section in place to the entries `keep` chooses; returns what was kept and
    dropped (entries and bytes per label). The whole section is parsed first, so a malformed one changes nothing."""
    containers = parse_containers(data, offset, size)
    stats: dict = {"containers": len(containers), "placeholders": 0, "emptied": 0, "kept": {}, "dropped": {},
                   "payload_bytes_before": sum(c.payload_bytes for c in containers), "payload_bytes_after": 0}
    for c in containers:
        kept = keep(c.entries)
        if keep_one and not kept and c.entries:  # never leave a container empty (see the module docstring)
            kept = [min(c.entries, key=lambda e: e.size)]
            stats["placeholders"] += 1
        stats["emptied"] += not kept
        body = b"".join(bytes(data[e.offset:e.offset + e.size]) for e in kept)
        start = c.offset + c.header_bytes
        data[start:start + len(body)] = body
        data[start + len(body):start + c.payload_bytes] = bytes(c.payload_bytes - len(body))
        _CONTAINER.pack_into(data, c.offset, FATBIN_MAGIC, c.version, c.header_bytes, len(body))
        stats["payload_bytes_after"] += len(body)
        kept_at = {e.offset for e in kept}
        for e in c.entries:
            row = stats["kept" if e.offset in kept_at else "dropped"].setdefault(e.label, {"entries": 0, "bytes": 0})
            row["entries"] += 1
            row["bytes"] += e.size
    for side in ("kept", "dropped"):
        stats[side] = dict(sorted(stats[side].items()))
    return stats


def prune_elf(data: bytes, policy: str, keep_one: bool = False) -> tuple[bytes, dict]:
    """A copy of the ELF file with its `.nv_fatbin` pruned by the named policy, and the pruning's statistics."""
    out = bytearray(data)
    offset, size = elf_section(out, ".nv_fatbin")
    stats = prune_fatbin_section(out, offset, size, POLICIES[policy], keep_one)
    return bytes(out), {"policy": policy, "keep_one": keep_one, "section_offset": offset, "section_bytes": size,
                        **stats}
