"""The GPU kit on CPU: fatbin pruning on a synthetic ELF (hardware/fatbin.py), the travel budget and its spare,
unpacking, `_C`'s entries travelling decompressed (hollow / restore, with zlib standing in for nvcc's zstd: the
mechanics are the codec's business only), and the build's pieces (vLLM's Python tree, the binaries, archives of
several xz streams, reuse of archives, wheel selection) on a synthetic wheel.

The synthetic `.so` is built here byte by byte: an ELF64 header, a `.text` section, a `.nv_fatbin` section of
four containers (with 8 bytes of padding between two of them, as a linker may leave), a `.shstrtab` and the
section header table. Entries carry distinct random payloads, so "kept" is checked by content, not only by count.
No network, no real wheel: the real kit's sizes come from hardware/kit_sizes.json (written by `make gpu-kit`).
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import tarfile
import zipfile
import zlib

import pytest

from hardware import fatbin
from hardware import kit as gpu_kit

SASS, PTX = fatbin.KIND_SASS, fatbin.KIND_PTX
SM90A = 0x108011  # nvcc's flags on an sm_90a entry (0x8011 on the others)


def entry(kind: int, arch: int, rng: random.Random, flags: int = 0x8011) -> bytes:
    """One fatbin entry: a 64-byte header (kind, version 0x101, header size, payload size, arch at +28, flags at
    +40) and a random payload whose size is a multiple of 8."""
    payload = rng.randbytes(8 * rng.randint(2, 40))
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    struct.pack_into("<Q", header, 40, flags)
    return bytes(header) + payload


def container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(sections: list[tuple[str, bytes]]) -> bytes:
    """A minimal little-endian ELF64 file holding the given sections (8-byte aligned) and a section name table."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    out, headers, name_at = bytearray(64), [bytes(64)], 1
    for name, data in [*sections, (".shstrtab", names)]:
        out += bytes(-len(out) % 8)
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 2, 0, len(out), len(data), 0, 0, 8, 0))
        out += data
        name_at += len(name) + 1
    out += bytes(-len(out) % 8)
    shoff = len(out)
    out += b"".join(headers)
    out[:16] = b"\x7fELF\x02\x01\x01" + bytes(9)
    struct.pack_into("<HHIQQQIHHHHHH", out, 16, 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1)
    return bytes(out)


# (container, entries as (kind, arch, flags)): the mix vLLM's _C holds, plus one container nothing of which runs on
# sm_90 and one with no sm_90 SASS but PTX for it.
LAYOUT = [
    [(SASS, 75, 0x8011), (SASS, 80, 0x8011), (SASS, 86, 0x8011), (SASS, 89, 0x8011), (SASS, 90, 0x8011),
     (SASS, 90, SM90A), (SASS, 100, 0x8011), (SASS, 120, 0x8011)],
    [(PTX, 80, 0x8011), (PTX, 90, 0x8011), (SASS, 80, 0x8011), (SASS, 90, 0x8011), (SASS, 120, 0x8011)],
    [(PTX, 80, 0x8011), (PTX, 89, 0x8011), (SASS, 80, 0x8011), (SASS, 120, 0x8011)],  # no sm_90 SASS
    [(SASS, 75, 0x8011), (SASS, 100, 0x8011), (PTX, 100, 0x8011)],  # nothing for sm_90
]
KEPT = {  # per policy, per container: the labels that survive
    "sm90": [["sass_sm_90", "sass_sm_90a"], ["sass_sm_90"], ["ptx_sm_80", "ptx_sm_89"], []],
    "ptx": [["sass_sm_90", "sass_sm_90a"], ["ptx_sm_90", "sass_sm_90"], ["ptx_sm_89"], []],
}


@pytest.fixture
def so() -> bytes:
    rng = random.Random(0)
    blobs = [container([entry(k, a, rng, f) for k, a, f in c]) for c in LAYOUT]
    section = blobs[0] + blobs[1] + bytes(8) + blobs[2] + blobs[3]  # 8 bytes of padding before container 3
    return elf([(".text", rng.randbytes(200)), (".nv_fatbin", section), (".rodata", rng.randbytes(136))])


def payloads(data: bytes, c: fatbin.Container) -> list[tuple[str, bytes]]:
    return [(e.label, data[e.offset:e.offset + e.size]) for e in c.entries]


@pytest.mark.parametrize("policy", ["sm90", "ptx"])
def test_prune_keeps_exactly_the_policy_entries_in_place(so, policy):
    off, size = fatbin.elf_section(so, ".nv_fatbin")
    before = fatbin.parse_containers(so, off, size)
    assert [[e.label for e in c.entries] for c in before][1] == [
        "ptx_sm_80", "ptx_sm_90", "sass_sm_80", "sass_sm_90", "sass_sm_120"]
    out, stats = fatbin.prune_elf(so, policy)
    after = fatbin.parse_containers(out, off, size)

    assert len(out) == len(so) and out[:off] == so[:off] and out[off + size:] == so[off + size:]
    assert [c.offset for c in after] == [c.offset for c in before]  # registered addresses never move
    for b, a, labels in zip(before, after, KEPT[policy]):
        assert [e.label for e in a.entries] == labels
        kept = [p for p in payloads(so, b) if p[0] in labels]
        assert payloads(out, a) == kept  # the same bytes, in the original order
        assert a.payload_bytes == sum(len(p) for _, p in kept) < b.payload_bytes
        tail = out[a.offset + a.header_bytes + a.payload_bytes:b.offset + b.header_bytes + b.payload_bytes]
        assert tail == bytes(len(tail))  # the freed tail is zeroed
    total = sum(len(c.entries) for c in before)
    assert sum(r["entries"] for r in stats["kept"].values()) + sum(
        r["entries"] for r in stats["dropped"].values()) == total
    assert stats["emptied"] == 1 and stats["placeholders"] == 0
    assert stats["payload_bytes_after"] == sum(c.payload_bytes for c in after)


def test_prune_is_idempotent_and_keep_one_never_empties_a_container(so):
    once, _ = fatbin.prune_elf(so, "sm90")
    twice, _ = fatbin.prune_elf(once, "sm90")
    assert twice == once
    data = bytearray(so)
    off, size = fatbin.elf_section(so, ".nv_fatbin")
    stats = fatbin.prune_fatbin_section(data, off, size, fatbin.keep_sm90, keep_one=True)
    last = fatbin.parse_containers(bytes(data), off, size)[-1]
    smallest = min(fatbin.parse_containers(so, off, size)[-1].entries, key=lambda e: e.size)
    assert [e.label for e in last.entries] == [smallest.label] and stats["placeholders"] == 1


def test_malformed_fatbin_is_refused_and_left_unchanged(so):
    off, size = fatbin.elf_section(so, ".nv_fatbin")
    first = fatbin.parse_containers(so, off, size)[0].entries[0]
    bad = bytearray(so)
    struct.pack_into("<Q", bad, first.offset + 8, 10**6)  # an entry that runs past its container
    copy = bytes(bad)
    with pytest.raises(fatbin.FatbinError, match="past its container's end"):
        fatbin.prune_fatbin_section(bad, off, size, fatbin.keep_sm90)
    assert bytes(bad) == copy
    bad = bytearray(so)
    bad[off:off + 4] = b"\x01\x02\x03\x04"
    with pytest.raises(fatbin.FatbinError, match="no fatbin container at"):
        fatbin.prune_elf(bytes(bad), "sm90")
    with pytest.raises(fatbin.FatbinError, match="no .nv_fatbin section"):
        fatbin.prune_elf(elf([(".text", b"x" * 16)]), "sm90")
    with pytest.raises(fatbin.FatbinError, match="not a little-endian 64-bit ELF"):
        fatbin.elf_section(b"MZ" + bytes(100), ".nv_fatbin")


# ---- the travel budget ------------------------------------------------------------------------------------------

def pinnable(tracked: dict[str, int], count: int = 5) -> list[tuple[str, int]]:
    """The largest tracked files hardware/ never reads, largest first: what to pin (common/pinned.py) when the tree
    outgrows the spare. The rule: every file under assets/ but the GPU proof's model (assets/arith-base) and the
    manifest of pinned files, and every study's archived runs (docs/**/runs.tar.xz)."""
    def never_on_gpu(path: str) -> bool:
        gpu_asset = path.startswith("assets/arith-base/") or path == "assets/pinned.json"
        return path.startswith("assets/") and not gpu_asset or path.startswith("docs/") and path.endswith("/runs.tar.xz")

    return sorted(((p, n) for p, n in tracked.items() if never_on_gpu(p)), key=lambda pn: (-pn[1], pn[0]))[:count]


def test_pinnable_names_the_largest_files_the_gpu_proof_never_reads():
    tracked = {"assets/arith-base/model.safetensors": 9000, "assets/chain-base/train.jsonl": 400,
               "assets/grid-base/model.safetensors": 4000, "assets/pinned.json": 5000, "docs/study-x/runs.tar.xz": 700,
               "docs/study-x/README.md": 800, "hardware/proof.py": 1000, "docs/study-y/pilots/a/runs.tar.xz": 300}
    assert pinnable(tracked, 3) == [("assets/grid-base/model.safetensors", 4000), ("docs/study-x/runs.tar.xz", 700),
                                    ("assets/chain-base/train.jsonl", 400)]


def test_tracked_tree_and_kit_fit_the_travel_budget_with_the_spare():
    """Fails when the tracked tree (docs and study data included) grows into the SPARE_BYTES kept free under the
    budget with the larger kit. The rule that keeps the spare: data only the CPU studies read is pinned (it stays in
    git history and `make` restores it: common/pinned.py), so the message names the largest such files; or shrink
    the kit (hardware/kit.py) and rerun `make gpu-kit`; lower the spare only with a reason in hardware/kit.py."""
    sizes = json.loads(gpu_kit.SIZES_FILE.read_text())
    assert set(sizes["travel_bytes"]) == set(gpu_kit.VARIANTS)
    if not (gpu_kit.REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked tree cannot be measured")
    files = gpu_kit.tracked_file_bytes()
    tree = sum(files.values())  # gpu_kit.tracked_tree_bytes()
    rows = gpu_kit.budget_rows(tree, sizes["travel_bytes"])
    mib = 2**20
    short = [f"{name}: {left / mib:.2f} MiB left" for name, _, left in rows if left < gpu_kit.SPARE_BYTES]
    movable = ", ".join(f"{p} ({n / 1e6:.2f} MB)" for p, n in pinnable(files))
    assert not short, (
        f"tracked tree {tree:,} B ({tree / mib:.2f} MiB) + the GPU kit leave less than the "
        f"{gpu_kit.SPARE_BYTES / mib:.0f} MiB spare under the {gpu_kit.BUDGET_BYTES / mib:.0f} MiB travel budget "
        f"({'; '.join(short)}). Pin what hardware/ never reads, largest first: {movable or 'none left'}, with "
        f"`python -m common.pinned pin PATH --rebuild COMMAND` (common/pinned.py: it stays in git history and make "
        f"restores it), then commit; or shrink the kit in hardware/kit.py and rerun `make gpu-kit`")


def test_budget_arithmetic_catches_an_oversize_tree_and_a_thin_spare(tmp_path, capsys):
    kit = {"primary": 40 * 2**20, "fallback": 45 * 2**20}
    room = gpu_kit.BUDGET_BYTES - kit["fallback"]  # the tree that leaves the fallback nothing
    assert gpu_kit.budget_rows(room - 1, kit) == [("primary", room - 1 + kit["primary"], 5 * 2**20 + 1),
                                                  ("fallback", gpu_kit.BUDGET_BYTES - 1, 1)]
    assert [left > 0 for _, _, left in gpu_kit.budget_rows(room, kit)] == [True, False]
    (tmp_path / "manifest.json").write_text(json.dumps({"travel_bytes": kit}))
    spare = room - gpu_kit.SPARE_BYTES
    assert gpu_kit.check(tmp_path, spare) is True
    assert "LOW" not in capsys.readouterr().out
    assert gpu_kit.check(tmp_path, spare + 1) is True  # travels, but under the spare: said, and the test above fails
    assert capsys.readouterr().out.count("LOW SPARE") == 1  # the fallback's; the primary keeps 5 MiB above the spare
    assert gpu_kit.check(tmp_path, room + 2**20) is False
    assert "OVER" in capsys.readouterr().out
    assert gpu_kit.main(["check", "--kit", str(tmp_path), "--tree-bytes", str(room)]) == 1


# ---- archives and unpacking -------------------------------------------------------------------------------------

def tiny_kit(root, bins=("bin-sm90",)):
    gpu_kit.write_tar_xz(root / "common" / "vllm-py.tar.xz",
                   [gpu_kit.Member("pkg/__init__.py", b"X = 1\n"), gpu_kit.Member("pkg-1.0.dist-info/METADATA", b"Name: pkg\n")],
                   preset=1)
    for folder in bins:
        gpu_kit.write_tar_xz(root / folder / "vllm-bin.tar.xz", [gpu_kit.Member("pkg/_C.so", folder.encode(), 0o755)], preset=1)
    return root


def test_unpack_extracts_common_and_the_one_bin_variant(tmp_path):
    kit = tiny_kit(tmp_path / "kit", bins=("bin-ptx",))
    lines = gpu_kit.unpack(kit, tmp_path / "site")
    assert (tmp_path / "site" / "pkg" / "__init__.py").read_text() == "X = 1\n"
    assert (tmp_path / "site" / "pkg" / "_C.so").read_bytes() == b"bin-ptx"
    assert json.loads((tmp_path / "site" / "_covrl_kit.json").read_text())["variant"] == "fallback"
    assert "bin-ptx (fallback)" in lines[0]


def test_unpack_without_vllm_extracts_the_site_tree_alone(tmp_path, capsys):
    """`make gpu-first-lease` runs no vLLM: --no-vllm extracts common/site312 only, needs no bin variant (the command
    carries neither), and says in one line when the site tree was not carried."""
    kit = tiny_kit(tmp_path / "kit", bins=())
    gpu_kit.write_tar_xz(kit / gpu_kit.SITE_ARCHIVE, [gpu_kit.Member("deepspeed/__init__.py", b"V = 1\n")], preset=1)
    lines = gpu_kit.unpack(kit, tmp_path / "site", no_vllm=True)
    assert (tmp_path / "site" / "deepspeed" / "__init__.py").read_bytes() == b"V = 1\n"
    assert not (tmp_path / "site" / "pkg").exists()  # vLLM's Python tree stays packed
    assert "binaries: none (no-vllm)" in lines[0]
    assert json.loads((tmp_path / "site" / "_covrl_kit.json").read_text())["variant"] == "no-vllm"
    (kit / gpu_kit.SITE_ARCHIVE).unlink()
    assert gpu_kit.main(["unpack", "--no-vllm", "--kit", str(kit), "--target", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "site312.tar.xz is missing" in err


@pytest.mark.parametrize("bins", [("bin-sm90", "bin-ptx"), ()])
def test_unpack_refuses_both_or_neither_variant_in_one_line(tmp_path, capsys, bins):
    kit = tiny_kit(tmp_path / "kit", bins=bins)
    assert gpu_kit.main(["unpack", "--kit", str(kit), "--target", str(tmp_path / "site")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exactly one of bin-sm90 / bin-ptx" in err
    assert not (tmp_path / "site").exists()


def test_unpack_refuses_an_archive_that_differs_from_the_manifest(tmp_path):
    kit = tiny_kit(tmp_path / "kit")
    good = {"bin-sm90/vllm-bin.tar.xz": {"sha256": gpu_kit.sha256_file(kit / "bin-sm90" / "vllm-bin.tar.xz")}}
    (kit / "manifest.json").write_text(json.dumps({"files": {**good, "common/vllm-py.tar.xz": {"sha256": "0" * 64}}}))
    with pytest.raises(gpu_kit.KitError, match="differs from manifest.json"):
        gpu_kit.unpack(kit, tmp_path / "site")
    # an archive the manifest does not know (another build's) is refused before anything is extracted
    (kit / "manifest.json").write_text(json.dumps({"files": good}))
    with pytest.raises(gpu_kit.KitError, match=r"common/vllm-py\.tar\.xz not in .*manifest\.json"):
        gpu_kit.unpack(kit, tmp_path / "site")
    assert not (tmp_path / "site" / "pkg").exists()


def test_unpack_refuses_a_truncated_archive_in_one_line(tmp_path):
    kit = tiny_kit(tmp_path / "kit")
    path = kit / "common" / "vllm-py.tar.xz"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(gpu_kit.KitError, match="vllm-py.tar.xz is not a complete .tar.xz"):
        gpu_kit.unpack(kit, tmp_path / "site")


def test_unpack_refuses_a_member_outside_the_target(tmp_path):
    kit = tiny_kit(tmp_path / "kit")
    gpu_kit.write_tar_xz(kit / "common" / "evil.tar.xz", [gpu_kit.Member("../escaped.txt", b"x")], preset=1)
    with pytest.raises(tarfile.OutsideDestinationError):
        gpu_kit.unpack(kit, tmp_path / "site")
    assert not (tmp_path / "escaped.txt").exists()


def test_archives_are_deterministic(tmp_path):
    members = [gpu_kit.Member("b.txt", b"two"), gpu_kit.Member("a/x.py", b"one", 0o755)]
    first = gpu_kit.write_tar_xz(tmp_path / "1.tar.xz", members, preset=1)
    second = gpu_kit.write_tar_xz(tmp_path / "2.tar.xz", list(reversed(members)), preset=1)
    assert first["sha256"] == second["sha256"] and first["members"] == 2 and first["raw_bytes"] == 6
    with tarfile.open(tmp_path / "1.tar.xz") as tar:
        assert [(m.name, m.mode, m.mtime, m.uid) for m in tar] == [("a/x.py", 0o755, gpu_kit.MTIME, 0),
                                                                   ("b.txt", 0o644, gpu_kit.MTIME, 0)]


def test_an_archive_of_several_xz_streams_reads_back_exactly(tmp_path, so, monkeypatch):
    """Each run of one filter chain is its own xz stream (an ELF file's code under BCJ x86, its fatbin under the
    SASS chain, text under plain LZMA2); tarfile reads the concatenation as one archive."""
    monkeypatch.setattr(gpu_kit, "MIN_STREAM_BYTES", 1)  # the synthetic files are small: every run its own stream
    text = b"".join(b"line %d\n" % i for i in range(2000))
    members = [gpu_kit.Member("vllm/_C.so", so, 0o755), gpu_kit.Member("a.py", text),
               gpu_kit.Member("blob", bytes(range(256)) * 40, regions=((0, 4096, "text"), (4096, 10240, "sass")))]
    rec = gpu_kit.write_tar_xz(tmp_path / "a.tar.xz", members, preset=1)
    assert (tmp_path / "a.tar.xz").read_bytes().count(b"\xfd7zXZ\x00") >= 6  # ELF: x86, sass, x86; blob: 2; text
    with tarfile.open(tmp_path / "a.tar.xz", "r:xz") as tar:
        assert tar.getnames() == ["a.py", "blob", "vllm/_C.so"]  # by name, ELF files last
        assert [tar.extractfile(n).read() for n in tar.getnames()] == [text, members[2].data, so]
    assert rec["raw_bytes"] == len(so) + len(text) + 10240
    monkeypatch.setattr(gpu_kit, "MIN_STREAM_BYTES", 1 << 20)  # the default: short runs join their neighbour
    gpu_kit.write_tar_xz(tmp_path / "b.tar.xz", members, preset=1)
    assert (tmp_path / "b.tar.xz").read_bytes().count(b"\xfd7zXZ\x00") == 1


# ---- _C's entries travel decompressed ---------------------------------------------------------------------------

def zlib_codec() -> gpu_kit.Codec:
    """zlib level 9 in the role of nvcc's zstd level 19: one stream, zero padding after it."""
    def unpack(payload: bytes) -> bytes | None:
        d = zlib.decompressobj()
        try:
            raw = d.decompress(payload)
        except zlib.error:
            return None
        return raw if d.eof and not any(d.unused_data) else None

    return gpu_kit.Codec("zlib 9", lambda raw: zlib.compress(raw, 9), unpack)


def packed_entry(kind: int, arch: int, raw: bytes, flags: int = 0x8011, pack=lambda r: zlib.compress(r, 9)) -> bytes:
    """A fatbin entry whose payload is `raw` compressed, zero-padded to a multiple of 8 bytes."""
    payload = pack(raw)
    payload += bytes(-len(payload) % 8)
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    struct.pack_into("<Q", header, 40, flags)
    return bytes(header) + payload


@pytest.fixture
def packed_so() -> bytes:
    """Two containers: PTX and SASS compressed as nvcc would (flag 0x8000), an entry packed otherwise (level 1 with
    a small window: the codec decompresses it but does not re-create it, so it stays) and one stored plain (FA3's
    kind, no 0x8000: left alone)."""
    rng = random.Random(1)
    words = [rng.choice([b"ld.global", b"st.shared", b"mma.sync", b"bar.sync", b"add.f32"]) for _ in range(3000)]
    ptx = b" ".join(words)
    sass = rng.randbytes(64) * 50
    odd = zlib.compressobj(1, wbits=9)
    section = (container([packed_entry(PTX, 90, ptx), packed_entry(SASS, 90, sass),
                          packed_entry(SASS, 90, b"odd" * 300, pack=lambda r: odd.compress(r) + odd.flush())])
               + container([entry(SASS, 90, rng, 0x100011), packed_entry(SASS, 90, sass[::-1], SM90A)]))
    return elf([(".text", rng.randbytes(200)), (".nv_fatbin", section)])


def test_hollow_zeroes_what_the_codec_recreates_and_restore_puts_it_back(tmp_path, packed_so):
    hollowed, raw, index = gpu_kit.hollow(packed_so, zlib_codec())
    entries = [e for c in fatbin.parse_containers(packed_so, *fatbin.elf_section(packed_so, ".nv_fatbin"))
               for e in c.entries]
    payload = {e.offset: packed_so[e.offset + e.header_bytes:e.offset + e.size] for e in entries}
    kept_as_is = [e for e in entries if hollowed[e.offset:e.offset + e.size] == packed_so[e.offset:e.offset + e.size]]
    assert len(hollowed) == len(packed_so) and [e.label for e in kept_as_is] == ["sass_sm_90", "sass_sm_90a"]
    assert [e.offset + e.header_bytes for e in entries if e not in kept_as_is] == sorted(
        at for at, _, _ in index["entries"])
    assert all(not any(hollowed[at:at + n]) for at, n, _ in index["entries"])  # zeroed in place
    # the blob: PTX first, then SASS, each entry decompressed
    assert raw[:index["sass_from"]] == zlib.decompress(payload[entries[0].offset]) and index["sass_from"] < len(raw)
    assert index["codec"] == "zlib 9" and index["sha256"] == hashlib.sha256(packed_so).hexdigest()
    target = tmp_path / "site"
    for m in [gpu_kit.Member("vllm/_C.so", hollowed, 0o755), *gpu_kit.raw_members("vllm/_C.so", raw, index)]:
        (target / m.arcname).parent.mkdir(parents=True, exist_ok=True)
        (target / m.arcname).write_bytes(m.data)
    (target / "vllm/_C.so").chmod(0o755)
    assert gpu_kit.restore(target, "vllm/_C.so", zlib_codec()) == 3
    assert (target / "vllm/_C.so").read_bytes() == packed_so and (target / "vllm/_C.so").stat().st_mode & 0o111
    assert sorted(p.name for p in (target / "vllm").iterdir()) == ["_C.so"]  # the sidecars are gone


def test_restore_refuses_another_codec_and_other_bytes_in_one_line(tmp_path, packed_so):
    hollowed, raw, index = gpu_kit.hollow(packed_so, zlib_codec())

    def lay_out(blob: bytes):
        target = tmp_path / "site"
        (target / "vllm").mkdir(parents=True, exist_ok=True)
        (target / "vllm/_C.so").write_bytes(hollowed)
        for m in gpu_kit.raw_members("vllm/_C.so", blob, index):
            (target / m.arcname).write_bytes(m.data)
        return target

    other = gpu_kit.Codec("zstd 1.5.6 level 19", zlib_codec().pack, zlib_codec().unpack)
    with pytest.raises(gpu_kit.KitError, match="hollowed with zlib 9 but this kit's .* is zstd 1.5.6"):
        gpu_kit.restore(lay_out(raw), "vllm/_C.so", other)
    for flipped in (len(raw) - 1, 0):  # a byte the entry compresses to its old size, or to more
        with pytest.raises(gpu_kit.KitError, match=r"(differs from the build's \(sha256\)|more than its \d+ B): "
                                                   r"this zlib 9 does not re-create nvcc's entries.*--no-hollow"):
            gpu_kit.restore(lay_out(raw[:flipped] + bytes([raw[flipped] ^ 1]) + raw[flipped + 1:]), "vllm/_C.so",
                            zlib_codec())
    assert (tmp_path / "site/vllm/_C.so").read_bytes() == hollowed  # nothing written


def test_unpack_restores_a_hollowed_binary_with_the_kits_own_zstd(tmp_path, packed_so, monkeypatch):
    hollowed, raw, index = gpu_kit.hollow(packed_so, zlib_codec())
    kit = tiny_kit(tmp_path / "kit", bins=())
    gpu_kit.write_tar_xz(kit / "bin-ptx" / "vllm-bin.tar.xz",
                         [gpu_kit.Member("vllm/_C.so", hollowed, 0o755), *gpu_kit.raw_members("vllm/_C.so", raw, index)],
                         preset=1)
    seen = []
    monkeypatch.setattr(gpu_kit, "import_zstd", lambda site: seen.append(site) or "zstd from the site")
    monkeypatch.setattr(gpu_kit, "zstd_codec", lambda module: zlib_codec())
    lines = gpu_kit.unpack(kit, tmp_path / "site")
    assert seen == [tmp_path / "site"] and "restored 3 CUDA entries of vllm/_C.so (zlib 9, sha256 checked)" in lines[-1]
    assert (tmp_path / "site" / "vllm" / "_C.so").read_bytes() == packed_so
    assert not (tmp_path / "site" / "vllm" / ("_C.so" + gpu_kit.RAW_SUFFIX)).exists()


def test_import_zstd_says_what_to_carry_when_the_kit_has_none(tmp_path):
    with pytest.raises(gpu_kit.KitError, match=r"backports/zstd/__init__\.py is missing: .*carry the kit's common"):
        gpu_kit.import_zstd(tmp_path)


# ---- wheels -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, fits", [
    ("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", True),
    ("llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl", True),
    ("msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl", True),
    ("deepspeed-0.19.8-py3-none-any.whl", True),
    ("msgspec-0.22.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),  # another Python
    ("foo-1.0-cp312-cp312-manylinux_2_34_x86_64.whl", False),  # newer glibc than the kit promises
    ("foo-1.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),
    ("foo-1.0-cp313-abi3-manylinux_2_28_x86_64.whl", False),  # abi3 from 3.13 on
])
def test_wheel_fits_the_gpu_machine(name, fits):
    assert gpu_kit.wheel_fits(name) is fits


def test_find_wheel_normalizes_names_and_skips_other_platforms(tmp_path):
    for n in ("typing_inspection-0.4.5-py3-none-any.whl", "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl",
              "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (tmp_path / n).write_bytes(b"")
    assert gpu_kit.find_wheel("typing-inspection==0.4.5", [tmp_path]).name.startswith("typing_inspection-0.4.5")
    assert "cp312" in gpu_kit.find_wheel("pydantic-core==2.50.5", [tmp_path]).name
    assert gpu_kit.find_wheel("typing-inspection==0.4.6", [tmp_path]) is None


def test_pins_name_each_package_once():
    names = [gpu_kit.normalize(r.split("==")[0]) for r in (gpu_kit.VLLM, *gpu_kit.VLLM_DEPS, *gpu_kit.COVRL_DEPS, gpu_kit.TRANSFORMERS)]
    assert len(names) == len(set(names)) and len(gpu_kit.VLLM_DEPS) == 18


# ---- the build's pieces, on a synthetic wheel -------------------------------------------------------------------

def fake_vllm_wheel(path, so: bytes, with_metadata: bool = True):
    files = {"vllm/__init__.py": b"", "vllm/v1/engine/async_llm.py": b"x = 1\n", gpu_kit.C_LIB: so,
             "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3", "vllm/cumem_allocator.abi3.so": b"cumem",
             "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2", "vllm/vllm-rs": b"rust",
             "vllm/third_party/deep_gemm/include/a.hpp": b"h", "vllm/entrypoints/serve/static/app.js": b"js",
             f"{gpu_kit.VLLM_DIST_INFO}/RECORD": b"r", f"{gpu_kit.VLLM_DIST_INFO}/WHEEL": b"w"}
    if with_metadata:
        files[f"{gpu_kit.VLLM_DIST_INFO}/METADATA"] = b"Name: vllm\nVersion: 0.26.0\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_py_tree_drops_binaries_and_web_assets_and_keeps_the_dist_info(tmp_path, so):
    names = {m.arcname for m in gpu_kit.py_tree_members(fake_vllm_wheel(tmp_path / "v.whl", so))}
    assert names == {"vllm/__init__.py", "vllm/v1/engine/async_llm.py", f"{gpu_kit.VLLM_DIST_INFO}/METADATA",
                     f"{gpu_kit.VLLM_DIST_INFO}/WHEEL"}
    with pytest.raises(gpu_kit.KitError, match="METADATA"):
        gpu_kit.py_tree_members(fake_vllm_wheel(tmp_path / "w.whl", so, with_metadata=False))


def test_bin_members_prune_c_and_carry_fa3_and_cumem_unchanged(tmp_path, so):
    members, stats = gpu_kit.bin_members(fake_vllm_wheel(tmp_path / "v.whl", so), "sm90", True, None)
    by_name = {m.arcname: m.data for m in members}
    assert by_name == {gpu_kit.C_LIB: fatbin.prune_elf(so, "sm90", True)[0], "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
                       "vllm/cumem_allocator.abi3.so": b"cumem"}
    assert fatbin.prune_elf(so, "sm90", True)[0] != fatbin.prune_elf(so, "sm90")[0]  # the fixture has a container to keep
    assert stats["policy"] == "sm90" and stats["keep_one"] and set(stats["files"]) == set(by_name)
    assert stats["kept"]["sass_sm_90a"] == {"entries": 1, "bytes": fatbin.parse_containers(
        so, *fatbin.elf_section(so, ".nv_fatbin"))[0].entries[5].size}


def test_bin_members_hollow_c_and_record_what_unpack_gives(tmp_path, packed_so):
    members, stats = gpu_kit.bin_members(fake_vllm_wheel(tmp_path / "v.whl", packed_so), "ptx", False, zlib_codec())
    names = [m.arcname for m in members]
    assert names[1:3] == list(gpu_kit.BIN_UNCHANGED) and names[3:] == [gpu_kit.C_LIB + gpu_kit.RAW_SUFFIX,
                                                                        gpu_kit.C_LIB + gpu_kit.RAW_SUFFIX + ".json"]
    pruned = fatbin.prune_elf(packed_so, "ptx")[0]
    assert members[0].data == gpu_kit.hollow(pruned, zlib_codec())[0] != pruned
    assert stats["files"][gpu_kit.C_LIB]["sha256"] == hashlib.sha256(pruned).hexdigest()  # what unpack restores
    assert stats["hollowed"]["entries"] == 3 and stats["hollowed"]["codec"] == "zlib 9"


def test_an_archive_is_reused_only_when_inputs_and_bytes_are_unchanged(tmp_path):
    path = tmp_path / "a.tar.xz"
    job = gpu_kit.Job("common/a.tar.xz", path, {"wheel": "x.whl"}, lambda: ([gpu_kit.Member("a", b"1")], {}))
    rec = {**gpu_kit.write_tar_xz(path, [gpu_kit.Member("a", b"1")], preset=1), "inputs": gpu_kit.fingerprint(job.inputs)}
    old = {"files": {job.key: rec}}
    assert gpu_kit.reusable(job, old) == rec
    assert gpu_kit.reusable(gpu_kit.Job(job.key, path, {"wheel": "y.whl"}, job.make), old) is None
    path.write_bytes(path.read_bytes()[:-1] + b"\0")  # same size, other bytes
    assert gpu_kit.reusable(job, old) is None
