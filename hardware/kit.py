"""The GPU kit: everything an offline Hopper machine lacks to run covrl with vLLM 0.26.0, small enough to travel
with every command beside the tracked tree (under 60 MiB in all, with SPARE_BYTES of it kept free).

    python3 -m hardware.kit build  --out .kit [--wheel-cache DIR ...] [--with-transformers] [--no-hollow]  # here
    python3 -m hardware.kit unpack --kit .kit --target /tmp/site                               # there
    python3 -m hardware.kit check  --kit .kit [--tree-bytes N]                                 # the budget

The GPU machine: Python 3.12, torch 2.11.0+cu130 (vLLM 0.26.0 pins exactly that torch), transformers 5.17,
x86-64, no registry. The kit (git-ignored, rebuilt by `make gpu-kit`):

  common/vllm-py.tar.xz    vLLM's Python tree and its dist-info (RECORD dropped): no .so, no vllm-rs, no bundled
                           CUDA headers, no web assets. The dist-info must travel: without its METADATA,
                           vllm/triton_utils/importing.py disables Triton and vLLM silently falls back to its slow
                           V1 model runner.
  common/site312.tar.xz    one `pip install --target` tree for CPython 3.12 manylinux: the 18 packages vLLM
                           imports at engine start that the machine lacks, covrl's own (deepspeed, math-verify,
                           ...), one version each, and backports.zstd for `unpack` (KIT_TOOLS).
  bin-sm90/vllm-bin.tar.xz the primary binaries: `_C_stable_libtorch` pruned to sm_90 (hardware/fatbin.py, policy
                           sm90, keep_one: a container with no Hopper code keeps its smallest entry, so none is
                           empty), FA3 (`_vllm_fa3_C`, sm_90a only already) and `cumem_allocator`.
  bin-ptx/vllm-bin.tar.xz  the fallback, if the driver refuses the primary's `_C`: the same with policy ptx (each
                           container also keeps its newest PTX <= 90, for the driver to JIT if it refuses the SASS).
  manifest.json            every file's bytes and sha256, versions, what the pruning kept and dropped, travel
                           bytes. `hardware/kit_sizes.json` (tracked) repeats the sizes, so the CPU test of the
                           travel budget knows them without building the kit.

A command carries `.kit/common`, ONE of `.kit/bin-sm90` / `.kit/bin-ptx` (`unpack` refuses both or neither) and
`.kit/manifest.json` if it can (then `unpack` checks every archive's sha256, so a truncated copy fails in one line).

How the bytes travel, all lossless (`unpack` writes every binary bit for bit as pruned, checked by sha256):
- `_C` hollowed: nvcc stored each fatbin entry as a zstd frame (level 19), which xz cannot shrink; the kit carries
  `_C` with those payloads zeroed in place, plus the entries decompressed (`.cuda-raw`: PTX, then SASS) and their
  index (`.cuda-raw.json`). xz packs the raw code a third smaller than nvcc's frames, and `unpack` compresses them
  back with the kit's own zstd 1.5.7, which re-creates every frame byte for byte (`build` checks each entry and
  leaves any other one as it is; measured 2026-11-28: all 94 of the fallback's, all 117 of the primary's). The
  price: ~190 s of CPU at unpack, over the machine's cores, at least the ~20 s its largest entry (a 34 MB PTX)
  takes alone. `--no-hollow` builds without it (about 6.5 MB more per variant).
- filter chains per stretch of bytes (`chains`, one xz stream each): BCJ x86 before LZMA2 on machine code,
  16-byte LZMA alignment on SASS; the streams concatenate into one .xz that tarfile reads as usual.
Together, 2026-11-28: the fallback's bin 28.1 -> 20.5 MB, the primary's 27.4 -> 20.9 MB, common 16.0 -> 15.9 MB
(with backports.zstd added).

Left out, by measurement (the manifest's `measured`):
- transformers 5.20.2 (covrl pins >=5.20,<5.21; the machine has 5.17): 3.5 MB of xz. covrl runs on 5.17 (its unit
  tests and the rehearsed runs pass there); `--with-transformers` carries it.
- huggingface-hub: the machine has 1.33.0 already, which transformers 5.20 accepts.
- PTX older than a container's newest PTX <= 90, in the fallback: on sm_90 the driver JITs the newest compatible
  PTX, so the rest is never read (keeping it cost 5.6 MB of nvcc-compressed xz).

Standard library only and no torch import: `unpack` runs on the GPU machine before anything is unpacked (it loads
backports.zstd from the unpacked common archive, `import_zstd`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import inspect
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hardware import fatbin

REPO = Path(__file__).resolve().parent.parent
SIZES_FILE = REPO / "hardware" / "kit_sizes.json"
BUDGET_BYTES = 60 * 2**20  # the device tool carries at most 64 MiB per command; 4 MiB stay for what is untracked
# Kept free under the budget by the tracked tree + the larger kit (tests/unit/test_gpu_kit.py). The rule that keeps
# it: data only the CPU studies and their tests read is pinned (common/pinned.py): it stays in git history, leaves
# the tracked tree (so it does not travel) and `make test`/`check`/`demo`/`bench` restore it from history. The GPU
# proof reads assets/arith-base only; the chain and grid base models are pinned (assets/pinned.json). (8 MiB until
# 2026-12-07, then 3 MiB for a day's commits once the grid study's base model took the rest, until those two were
# pinned.)
SPARE_BYTES = 8 * 2**20
FORMAT = 2  # bump when the kit's layout or contents change, so `build` redoes every archive
XZ_PRESET = 9 | lzma.PRESET_EXTREME
MTIME = 1_767_225_600  # 2026-01-01: every member gets it, so equal inputs give equal archives

VLLM = "vllm==0.26.0"
VLLM_DIST_INFO = "vllm-0.26.0.dist-info"
# What vLLM 0.26 imports at engine start and the machine lacks (shared/notes/vllm-0.26.md, section 2). Pins: what
# pip resolved for vllm==0.26.0 on the machine's image (xgrammar 0.2.8 would need tvm-ffi >= 0.1.11; vLLM pins
# 0.1.10).
VLLM_DEPS = ("msgspec==0.22.0", "pyzmq==27.3.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
             "typing-inspection==0.4.5", "cachetools==8.0.2", "cbor2==6.3.0", "pybase64==1.5.1", "openai==3.57.0",
             "httpx2==2.16.2", "sniffio==1.3.1", "openai-harmony==0.0.8", "fastapi==0.136.3", "starlette==1.10.0",
             "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10", "llguidance==1.7.6")
# covrl's own (pyproject) beyond the machine's image: math-verify and its parser, tomli_w, DeepSpeed and hjson,
# typing-extensions >= 4.16 for pydantic 2.14. msgspec, pyzmq and pydantic are in VLLM_DEPS already.
COVRL_DEPS = ("math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2",
              "tomli_w==1.2.0", "typing-extensions==4.16.0", "hjson==3.1.0", "deepspeed==0.19.8")
TRANSFORMERS = "transformers==5.20.2"
BUILT_FROM_SDIST = {"deepspeed"}  # sdist only on the registry: `pip wheel --no-deps` once, then the cached wheel
PIP_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
              "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",  # llguidance: 2_31 only
              "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any")

PY_TREE_DROPPED = (re.compile(r"\.(so|js|css|map)$"), re.compile(r"^vllm/vllm-rs$"),
                   re.compile(r"^vllm/third_party/(deep_gemm/include|fmha_sm100/cutlass)/"),
                   re.compile(rf"^{re.escape(VLLM_DIST_INFO)}/RECORD$"))
C_LIB = "vllm/_C_stable_libtorch.abi3.so"
BIN_UNCHANGED = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/cumem_allocator.abi3.so")
# `_C`'s fatbin entries are zstd frames (nvcc's level 19); zstd 1.5.7 at level 19 re-creates every one vLLM 0.26's
# `_C` keeps byte for byte, so they travel decompressed (xz packs the raw SASS and PTX far smaller) and `unpack`
# compresses them back into place. backports.zstd bundles zstd 1.5.7 (its own copy, no system library) and travels
# in common/site312 for that; `build` installs it for its own Python too.
ZSTD_TOOL = "backports.zstd==1.8.0"
ZSTD_LEVEL = 19
FLAG_ZSTD = 0x8000  # in a fatbin entry's flags: nvcc compressed the payload with zstd
RAW_SUFFIX = ".cuda-raw"  # beside a hollowed binary: its decompressed entries, and (+ ".json") where they go back
KIT_TOOLS = (ZSTD_TOOL,)  # what `unpack` itself needs beyond the standard library (in common/site312)
# name: (folder, pruning policy, keep_one). The primary never leaves a container empty (an empty fatbin container is
# the one shape the original file never had; 4.7 MB of xz buys that certainty); the fallback keeps PTX to JIT from
# instead, and cannot afford both within the budget.
VARIANTS = {"primary": ("bin-sm90", "sm90", True), "fallback": ("bin-ptx", "ptx", False)}


class KitError(RuntimeError):
    """A one-line reason the kit cannot be built, checked or unpacked, with what to do."""


# ---- wheels -----------------------------------------------------------------------------------------------------

def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_fits(filename: str) -> bool:
    """Whether a wheel installs on the GPU machine: CPython 3.12, x86-64, manylinux up to glibc 2.31 (its glibc is
    newer; llguidance needs 2.31)."""
    parts = filename[:-len(".whl")].split("-")
    py, abi, plat = parts[-3:]
    plat_ok = any(p == "any" or re.fullmatch(r"manylinux(1|2010|2014)_x86_64", p)
                  or (m := re.fullmatch(r"manylinux_2_(\d+)_x86_64", p)) and int(m.group(1)) <= 31
                  for p in plat.split("."))
    py_ok = any(t in ("py3", "cp312") or abi == "abi3" and re.fullmatch(r"cp3\d+", t) and int(t[3:]) <= 12
                for t in py.split("."))
    return plat_ok and py_ok and abi in ("none", "abi3", "cp312")


def find_wheel(requirement: str, dirs: list[Path]) -> Path | None:
    """A wheel for `name==version` that fits the GPU machine, in the first directory holding one."""
    name, version = requirement.split("==")
    for d in dirs:
        for path in sorted(d.glob("*.whl")) if d.is_dir() else []:
            parts = path.name.split("-")
            if normalize(parts[0]) == normalize(name) and parts[1] == version and wheel_fits(path.name):
                return path
    return None


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise KitError(f"`{' '.join(cmd[:6])} ...` failed ({done.returncode}): {tail}")


def acquire_wheels(requirements: list[str], cache: Path, extra_dirs: list[Path]) -> dict[str, Path]:
    """Each requirement's wheel: reused from extra_dirs or the cache, else downloaded (or built, for an sdist-only
    package) into the cache. A second build finds them all and never calls pip."""
    dirs = [*extra_dirs, cache]
    cache.mkdir(parents=True, exist_ok=True)
    missing = [r for r in requirements if find_wheel(r, dirs) is None]
    built = [r for r in missing if normalize(r.split("==")[0]) in BUILT_FROM_SDIST]
    fetched = [r for r in missing if r not in built]
    if fetched:
        print(f"gpu_kit: downloading {len(fetched)} wheel(s): {' '.join(fetched)}", flush=True)
        pip("download", "-q", "--no-deps", *PIP_TARGET, "-d", str(cache), *fetched)
    for r in built:
        print(f"gpu_kit: building a wheel for {r} (sdist only on the registry)", flush=True)
        pip("wheel", "-q", "--no-deps", "-w", str(cache), r)
    found = {r: find_wheel(r, dirs) for r in requirements}
    lost = [r for r, p in found.items() if p is None]
    if lost:
        raise KitError(f"no wheel for {', '.join(lost)} fits CPython 3.12 manylinux x86-64 after pip ran: check the "
                       f"pins in hardware/kit.py against the registry")
    return {r: into_cache(p, cache) for r, p in found.items()}


def into_cache(wheel: Path, cache: Path) -> Path:
    """The wheel's copy in the cache (a hard link where possible), so the next build needs no --wheel-cache."""
    kept = cache / wheel.name
    if not kept.exists():
        try:
            os.link(wheel, kept)
        except OSError:
            shutil.copyfile(wheel, kept)
    return kept


# ---- archives ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Member:
    """One file of an archive. `regions`: (start, end, chain) spans of its bytes that compress better with another
    xz filter chain (CHAINS); None: an ELF file's code goes to "x86" and its CUDA SASS to "sass", the rest "text"."""
    arcname: str
    data: bytes | Path
    mode: int = 0o644
    regions: tuple[tuple[int, int, str], ...] | None = None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def chains(preset: int) -> dict[str, list[dict]]:
    """xz filter chains by kind of bytes. All lossless and all read by tarfile (liblzma decodes any chain): x86
    machine code packs ~30 % smaller after the BCJ x86 filter; CUDA SASS (16-byte instructions) ~4 % smaller with
    LZMA's position bits at 16 bytes."""
    lzma2 = {"id": lzma.FILTER_LZMA2, "preset": preset}
    return {"text": [lzma2], "x86": [{"id": lzma.FILTER_X86}, lzma2], "sass": [{**lzma2, "lc": 0, "lp": 4, "pb": 4}]}


MIN_STREAM_BYTES = 1 << 20  # a shorter run of another chain stays with its neighbour (each stream starts afresh)


def auto_regions(data: bytes) -> tuple[tuple[int, int, str], ...]:
    """An ELF file: all "x86" but its CUDA device code ("sass"); anything else: "text"."""
    if data[:4] != b"\x7fELF":
        return ((0, len(data), "text"),)
    try:
        start, size = fatbin.elf_section(data, ".nv_fatbin")
    except fatbin.FatbinError:
        return ((0, len(data), "x86"),)
    return (0, start, "x86"), (start, start + size, "sass"), (start + size, len(data), "x86")


def xz_streams(raw: bytes, spans: list[tuple[int, int, str]], preset: int) -> list[bytes]:
    """`raw` cut into one xz stream per run of one chain (short runs join their neighbour), compressed in parallel;
    their concatenation is one valid .xz file."""
    runs: list[list] = []
    for start, end, chain in spans:
        if runs and (runs[-1][2] == chain or end - start < MIN_STREAM_BYTES):
            runs[-1][1] = end
        elif runs and runs[-1][1] - runs[-1][0] < MIN_STREAM_BYTES:
            runs[-1][1:] = [end, chain]
        else:
            runs.append([start, end, chain])
    filters = chains(preset)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # lzma frees the GIL
        return list(pool.map(lambda r: lzma.compress(raw[r[0]:r[1]], lzma.FORMAT_XZ, filters=filters[r[2]]), runs))


def write_tar_xz(path: Path, members: list[Member], preset: int = XZ_PRESET) -> dict:
    """A deterministic tar.xz (members sorted by name, ELF files last, fixed mtime, owner root; preset 9e unless
    told), each member's bytes under its filter chain, written atomically; its size, sha256, member count and raw
    bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf, spans, raw = io.BytesIO(), [], 0
    loaded = [(m, m.data if isinstance(m.data, bytes) else m.data.read_bytes()) for m in members]
    loaded.sort(key=lambda md: (md[1][:4] == b"\x7fELF", md[0].arcname))
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m, data in loaded:
            info = tarfile.TarInfo(m.arcname)
            info.size, info.mode, info.mtime = len(data), m.mode, MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            before = tar.offset
            tar.addfile(info, io.BytesIO(data))
            at = tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # where the data begins
            spans.append((before, at, "text"))
            spans += [(at + a, at + b, chain) for a, b, chain in (m.regions or auto_regions(data)) if b > a]
            spans.append((at + len(data), tar.offset, "text"))
            raw += len(data)
    tarred = buf.getvalue()
    spans.append((spans[-1][1] if spans else 0, len(tarred), "text"))  # the end-of-archive blocks
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(xz_streams(tarred, [s for s in spans if s[1] > s[0]], preset))
    os.replace(tmp, path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path), "members": len(members), "raw_bytes": raw}


def py_tree_members(wheel: Path) -> list[Member]:
    """vLLM's Python tree from the wheel, without what PY_TREE_DROPPED names."""
    members = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or any(p.search(info.filename) for p in PY_TREE_DROPPED):
                continue
            mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
            members.append(Member(info.filename, z.read(info), mode))
    if not any(m.arcname == f"{VLLM_DIST_INFO}/METADATA" for m in members):
        raise KitError(f"{wheel.name} has no {VLLM_DIST_INFO}/METADATA; without it vLLM disables Triton")
    return members


def bin_members(wheel: Path, policy: str, keep_one: bool, codec: Codec | None) -> tuple[list[Member], dict]:
    """The `_C` library pruned by `policy` and, given a codec, hollowed (`hollow`: its entries travel beside it),
    and the binaries that travel unchanged; the pruning's statistics, and per binary the bytes and sha256 that
    `unpack` gives."""
    with zipfile.ZipFile(wheel) as z:
        pruned, stats = fatbin.prune_elf(z.read(C_LIB), policy, keep_one)
        unchanged = [Member(n, z.read(n), 0o755) for n in BIN_UNCHANGED]
    stats["files"] = {m.arcname: {"bytes": len(m.data), "sha256": hashlib.sha256(m.data).hexdigest()}
                      for m in (Member(C_LIB, pruned), *unchanged)}
    if codec is None:
        return [Member(C_LIB, pruned, 0o755), *unchanged], stats
    hollowed, raw, index = hollow(pruned, codec)
    stats["hollowed"] = {"entries": len(index["entries"]), "raw_bytes": len(raw), "codec": index["codec"]}
    return [Member(C_LIB, hollowed, 0o755), *unchanged, *raw_members(C_LIB, raw, index)], stats


# ---- fatbin entries that travel decompressed --------------------------------------------------------------------

@dataclass(frozen=True)
class Codec:
    """How nvcc compressed a fatbin entry: `pack(unpack(payload))` must give the payload back (then zero padding)."""
    name: str  # recorded beside a hollowed binary; `restore` refuses a codec of another name
    pack: Callable[[bytes], bytes]
    unpack: Callable[[bytes], bytes | None]  # None: not one frame followed by zero padding


def zstd_codec(zstd: types.ModuleType) -> Codec:
    """nvcc's: one zstd frame at level ZSTD_LEVEL, zero-padded to the entry's size."""
    def unpack(payload: bytes) -> bytes | None:
        d = zstd.ZstdDecompressor()
        try:
            raw = d.decompress(payload)
        except zstd.ZstdError:
            return None
        return raw if d.eof and not any(d.unused_data) else None

    return Codec(f"zstd {zstd.zstd_version} level {ZSTD_LEVEL}", lambda raw: zstd.compress(raw, level=ZSTD_LEVEL),
                 unpack)


def import_zstd(site: Path) -> types.ModuleType:
    """backports.zstd from `site` and nowhere else (it is a namespace package, so another `backports` on sys.path
    could shadow it); KitError when it is missing or does not load."""
    init = site / "backports" / "zstd" / "__init__.py"
    if not init.is_file():
        raise KitError(f"gpu_kit: {init} is missing: {ZSTD_TOOL} restores vLLM's _C; carry the kit's common "
                       f"folder whole (or rebuild with make gpu-kit)")
    loaded = sys.modules.get("backports.zstd")
    if loaded is not None and getattr(loaded, "__file__", None) == str(init):
        return loaded
    for name in [n for n in sys.modules if n == "backports.zstd" or n.startswith("backports.zstd.")]:
        del sys.modules[name]  # another copy's: its submodules would be reused
    if "backports" not in sys.modules:  # the parent must exist; backports.zstd's own path below finds the rest
        sys.modules["backports"] = types.ModuleType("backports")
        sys.modules["backports"].__path__ = []
    spec = importlib.util.spec_from_file_location("backports.zstd", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["backports.zstd"] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        del sys.modules["backports.zstd"]
        raise KitError(f"gpu_kit: {ZSTD_TOOL} from {site} does not load ({e}): the kit's copy is for CPython 3.12 "
                       f"x86-64; run `hardware.kit unpack` with that Python") from None
    return module


def build_codec(cache: Path) -> Codec:
    """The zstd codec for the building Python: ZSTD_TOOL installed once into the cache (pip, no dependencies)."""
    tools = cache / f"tools-cp{sys.version_info[0]}{sys.version_info[1]}"
    if not (tools / "backports" / "zstd" / "__init__.py").is_file():
        print(f"gpu_kit: installing {ZSTD_TOOL} for this Python into {tools}", flush=True)
        pip("install", "-q", "--no-deps", "--only-binary=:all:", "--target", str(tools), ZSTD_TOOL)
    return zstd_codec(import_zstd(tools))


def hollow(elf: bytes, codec: Codec) -> tuple[bytes, bytes, dict]:
    """`elf` with the payload of every zstd-compressed fatbin entry that `codec` re-creates byte for byte zeroed in
    place (same size, same layout), those payloads decompressed into one blob (PTX, then SASS: like with like for
    xz), and the index `restore` needs: where each goes, and the restored file's sha256. An entry the codec does
    not re-create exactly stays as it is."""
    off, size = fatbin.elf_section(elf, ".nv_fatbin")
    entries = [e for c in fatbin.parse_containers(elf, off, size) for e in c.entries if e.flags & FLAG_ZSTD]

    def decompressed(e: fatbin.Entry) -> bytes | None:
        payload = elf[e.offset + e.header_bytes:e.offset + e.size]
        raw = codec.unpack(payload)
        if raw is None:
            return None
        packed = codec.pack(raw)
        return raw if len(packed) <= len(payload) and payload == packed + bytes(len(payload) - len(packed)) else None

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # zstd frees the GIL
        raws = list(pool.map(decompressed, entries))
    done = sorted(((e, r) for e, r in zip(entries, raws) if r is not None), key=lambda er: (er[0].kind, er[0].offset))
    out = bytearray(elf)
    for e, _ in done:
        out[e.offset + e.header_bytes:e.offset + e.size] = bytes(e.payload_bytes)
    index = {"codec": codec.name, "bytes": len(elf), "sha256": hashlib.sha256(elf).hexdigest(),
             "sass_from": sum(len(r) for e, r in done if e.kind != fatbin.KIND_SASS),
             "entries": [[e.offset + e.header_bytes, e.payload_bytes, len(r)] for e, r in done]}
    return bytes(out), b"".join(r for _, r in done), index


def raw_members(arcname: str, raw: bytes, index: dict) -> list[Member]:
    """The sidecars of a hollowed binary: the blob (its SASS under the "sass" chain) and the index."""
    if not index["entries"]:
        return []
    regions = ((0, index["sass_from"], "text"), (index["sass_from"], len(raw), "sass"))
    return [Member(arcname + RAW_SUFFIX, raw, 0o644, regions),
            Member(arcname + RAW_SUFFIX + ".json", json.dumps(index, sort_keys=True).encode())]


def restore(target: Path, arcname: str, codec: Codec) -> int:
    """Compress a hollowed binary's entries back into place (in parallel), check the file against the index's
    sha256, replace it atomically and remove the sidecars; the entries restored. KitError when the bytes differ."""
    so, blob, meta = target / arcname, target / (arcname + RAW_SUFFIX), target / (arcname + RAW_SUFFIX + ".json")
    index = json.loads(meta.read_text())
    if index["codec"] != codec.name:
        raise KitError(f"gpu_kit unpack: {arcname} was hollowed with {index['codec']} but this kit's "
                       f"{ZSTD_TOOL} is {codec.name}: rebuild with make gpu-kit and carry it whole")
    data, raw, starts = bytearray(so.read_bytes()), blob.read_bytes(), [0]
    for _, _, n in index["entries"]:
        starts.append(starts[-1] + n)
    largest_first = sorted(range(len(index["entries"])), key=lambda i: starts[i] - starts[i + 1])  # the 34 MB PTX
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # entry takes ~20 s alone
        done = dict(zip(largest_first, pool.map(lambda i: codec.pack(raw[starts[i]:starts[i + 1]]), largest_first)))
    packed = [done[i] for i in range(len(index["entries"]))]
    remedy = (f"this {codec.name} does not re-create nvcc's entries here; rebuild with `make gpu-kit "
              f"GPU_KIT_ARGS=--no-hollow` (the entries travel as nvcc wrote them) and carry it whole")
    for (at, room, _), p in zip(index["entries"], packed):
        if len(p) > room:
            raise KitError(f"gpu_kit unpack: an entry of {arcname} at {at} compressed to {len(p)} B, more than its "
                           f"{room} B: {remedy}")
        data[at:at + len(p)] = p
    if len(data) != index["bytes"] or hashlib.sha256(data).hexdigest() != index["sha256"]:
        raise KitError(f"gpu_kit unpack: {arcname} restored differs from the build's (sha256): {remedy}")
    tmp = so.with_name(so.name + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(so.stat().st_mode)
    os.replace(tmp, so)
    blob.unlink()
    meta.unlink()
    return len(index["entries"])


def install_site(wheels: list[Path], target: Path) -> None:
    """One `pip install --target` tree for CPython 3.12 from the given wheels (no index, no dependencies)."""
    pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target), *PIP_TARGET,
        *map(str, wheels))


def site_members(site: Path, keep: Callable[[str], bool]) -> list[Member]:
    """The installed tree's files that `keep` accepts, without console scripts (their shebangs name this machine's
    Python), bytecode, or pip's direct_url.json (it names this machine's paths)."""
    members = []
    for path in sorted(site.rglob("*")):
        rel = path.relative_to(site).as_posix()
        if path.is_dir() or rel.startswith("bin/") or "__pycache__" in rel or rel.endswith(("direct_url.json", ".pyc")):
            continue
        if keep(rel):
            members.append(Member(rel, path, 0o755 if path.stat().st_mode & 0o111 else 0o644))
    return members


def is_transformers(rel: str) -> bool:
    top = rel.split("/", 1)[0]
    return top == "transformers" or top.startswith("transformers-")


# ---- build ------------------------------------------------------------------------------------------------------

@dataclass
class Job:
    """One archive (or one measurement, path None): rebuilt only when its inputs' fingerprint changed."""
    key: str
    path: Path | None
    inputs: dict
    make: Callable[[], tuple[list[Member], dict]]


def fingerprint(inputs: dict) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **inputs}, sort_keys=True).encode()).hexdigest()


def reusable(job: Job, old: dict) -> dict | None:
    """The old manifest's record of this job when its inputs are the same and its file is intact."""
    rec = old.get("files", {}).get(job.key) or old.get("measured", {}).get(job.key)
    if not rec or rec.get("inputs") != fingerprint(job.inputs):
        return None
    if job.path is not None and (not job.path.is_file() or job.path.stat().st_size != rec["bytes"]
                                 or sha256_file(job.path) != rec["sha256"]):
        return None
    return rec


def run_job(job: Job, scratch: Path) -> dict:
    """Build the job's archive (a measurement writes into scratch and keeps only the numbers)."""
    t0 = time.time()
    members, extra = job.make()
    path = job.path or scratch / (job.key.replace("/", "_") + ".tar.xz")
    rec = write_tar_xz(path, members)
    if job.path is None:
        path.unlink()
        rec.pop("sha256")
    print(f"gpu_kit: {job.key}: {rec['bytes']:,} B xz from {rec['raw_bytes']:,} B in {time.time() - t0:.0f} s",
          flush=True)
    return {**rec, **extra, "inputs": fingerprint(job.inputs)}


def plan_jobs(out: Path, wheels: dict[str, Path], site: Path, with_transformers: bool, hollowing: str,
              codec: Callable[[], Codec | None]) -> list[Job]:
    """Every archive of the kit plus the transformers measurement, largest first (they compress in parallel). The
    site jobs read `site`, which `build` installs only when one of them must run; the bin jobs hollow `_C` with
    `codec()` (`hollowing` names it), or not when it gives None."""
    vllm = wheels[VLLM]
    vllm_in = {"wheel": vllm.name, "sha256": sha256_file(vllm)}
    prune_code = inspect.getsource(fatbin)  # the whole module: any change to reading or pruning rebuilds
    prune_in = {"prune_code": hashlib.sha256(prune_code.encode()).hexdigest(), "binaries": [C_LIB, *BIN_UNCHANGED]}
    xz_in = {"chains": repr(chains(XZ_PRESET))}
    site_reqs = [r for r in wheels if r != VLLM and (with_transformers or r != TRANSFORMERS)]
    site_in = {"wheels": sorted(wheels[r].name for r in site_reqs), **xz_in}
    jobs = [Job(f"{folder}/vllm-bin.tar.xz", out / folder / "vllm-bin.tar.xz",
                {**vllm_in, **prune_in, **xz_in, "policy": policy, "keep_one": one,
                 "hollow": hollowing},
                lambda p=policy, k=one: bin_members(vllm, p, k, codec()))
            for folder, policy, one in VARIANTS.values()]
    jobs.append(Job("common/site312.tar.xz", out / "common" / "site312.tar.xz", site_in,
                    lambda: (site_members(site, lambda r: with_transformers or not is_transformers(r)), {})))
    jobs.append(Job("common/vllm-py.tar.xz", out / "common" / "vllm-py.tar.xz",
                    {**vllm_in, **xz_in, "dropped": [p.pattern for p in PY_TREE_DROPPED]},
                    lambda: (py_tree_members(vllm), {})))
    jobs.append(Job(TRANSFORMERS, None, {"wheel": wheels[TRANSFORMERS].name, **xz_in},
                    lambda: (site_members(site, is_transformers), {})))
    return jobs


def build(out: Path, wheel_dirs: list[Path], with_transformers: bool, hollow_entries: bool = True) -> dict:
    """Build (or reuse) every archive, then write the manifest and the tracked sizes file."""
    t0 = time.time()
    requirements = [VLLM, *VLLM_DEPS, *COVRL_DEPS, *KIT_TOOLS, TRANSFORMERS]
    if len({normalize(r.split("==")[0]) for r in requirements}) != len(requirements):
        raise KitError("a package is pinned twice in hardware/kit.py (VLLM_DEPS, COVRL_DEPS, KIT_TOOLS): keep one "
                       "version")
    wheels = acquire_wheels(requirements, out / "cache", wheel_dirs)
    old = load_json(out / "manifest.json")
    lock, made = threading.Lock(), []

    def codec() -> Codec | None:
        """zstd from ZSTD_TOOL, set up once for both bin jobs; None with --no-hollow."""
        with lock:
            if not made:
                made.append(build_codec(out / "cache") if hollow_entries else None)
            return made[0]

    hollowing = f"{ZSTD_TOOL} level {ZSTD_LEVEL}" if hollow_entries else "no"
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as scratch:
        site = Path(scratch) / "site"
        jobs = plan_jobs(out, wheels, site, with_transformers, hollowing, codec)
        records = {j.key: r for j in jobs if (r := reusable(j, old))}
        if records:
            print(f"gpu_kit: reusing {', '.join(sorted(records))}", flush=True)
        todo = [j for j in jobs if j.key not in records]
        if any(j.key in ("common/site312.tar.xz", TRANSFORMERS) for j in todo):  # they read the installed tree
            install_site([wheels[r] for r in requirements if r != VLLM], site)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {j.key: pool.submit(run_job, j, Path(scratch)) for j in todo}
            records.update({k: f.result() for k, f in futures.items()})
    manifest = assemble_manifest(wheels, records, with_transformers, time.time() - t0)
    write_json(out / "manifest.json", manifest)
    write_json(SIZES_FILE, sizes_summary(manifest))
    return manifest


def assemble_manifest(wheels: dict[str, Path], records: dict, with_transformers: bool, seconds: float) -> dict:
    files = {k: v for k, v in records.items() if k != TRANSFORMERS}
    common = sum(v["bytes"] for k, v in files.items() if k.startswith("common/"))
    variants = {name: {"folder": folder, "policy": policy, "bin_bytes": files[f"{folder}/vllm-bin.tar.xz"]["bytes"],
                       "travel_bytes": common + files[f"{folder}/vllm-bin.tar.xz"]["bytes"]}
                for name, (folder, policy, _) in VARIANTS.items()}
    carried = [r for r in wheels if r != VLLM and (with_transformers or r != TRANSFORMERS)]
    return {
        "format": FORMAT, "vllm": VLLM.split("==")[1], "python": "3.12",
        "packages": {r.split("==")[0]: r.split("==")[1] for r in sorted(carried)},
        "wheels": {r: p.name for r, p in sorted(wheels.items())},
        "transformers_included": with_transformers,
        "files": files, "common_bytes": common, "variants": variants,
        "travel_bytes": {name: v["travel_bytes"] for name, v in variants.items()},
        "measured": {TRANSFORMERS: records[TRANSFORMERS]},
        "build_seconds": round(seconds, 1),
    }


def sizes_summary(manifest: dict) -> dict:
    """What the tracked sizes file holds: bytes only (no dates), so an unchanged kit leaves it unchanged."""
    return {
        "_about": "Written by `python3 -m hardware.kit build` (make gpu-kit); read by tests/unit/test_gpu_kit.py "
                  "to check the travel budget without building the kit.",
        "vllm": manifest["vllm"], "transformers_included": manifest["transformers_included"],
        "common_bytes": manifest["common_bytes"],
        "bin_bytes": {n: v["bin_bytes"] for n, v in manifest["variants"].items()},
        "travel_bytes": manifest["travel_bytes"],
        "transformers_xz_bytes": manifest["measured"][TRANSFORMERS]["bytes"],
    }


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def write_json(path: Path, data: dict) -> None:
    """Atomically, and only when the content changes (the sizes file is tracked)."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- budget -----------------------------------------------------------------------------------------------------

def tracked_file_bytes(repo: Path = REPO) -> dict[str, int]:
    """path -> bytes of every tracked file present in the work tree (what the device tool copies, untracked files
    aside)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True)
    paths = (p for p in done.stdout.decode().split("\0") if p)
    return {p: (repo / p).stat().st_size for p in paths if (repo / p).is_file() and not (repo / p).is_symlink()}


def tracked_tree_bytes(repo: Path = REPO) -> int:
    """Bytes of every tracked file present in the work tree (what the device tool copies, untracked files aside)."""
    return sum(tracked_file_bytes(repo).values())


def budget_rows(tree_bytes: int, travel_bytes: dict[str, int]) -> list[tuple[str, int, int]]:
    """(variant, tree + kit bytes, bytes left under BUDGET_BYTES) per variant, primary first. Within the budget:
    left > 0; with the spare the tests require: left >= SPARE_BYTES."""
    names = [n for n in VARIANTS if n in travel_bytes] + sorted(set(travel_bytes) - set(VARIANTS))
    return [(n, tree_bytes + travel_bytes[n], BUDGET_BYTES - tree_bytes - travel_bytes[n]) for n in names]


def kit_travel_bytes(kit: Path) -> tuple[dict[str, int], str]:
    """Per variant, the kit's bytes in one command: from the built kit's manifest, else the tracked sizes file."""
    for path in (kit / "manifest.json", SIZES_FILE):
        if path.is_file():
            return load_json(path)["travel_bytes"], str(path)
    raise KitError(f"neither {kit}/manifest.json nor {SIZES_FILE} exists: run `make gpu-kit`")


def check(kit: Path, tree_bytes: int | None) -> bool:
    """Print tree + kit per variant against the budget; False when one is over it. Under it but with less than
    SPARE_BYTES left prints LOW SPARE (the CPU test fails then; a command still travels)."""
    tree = tracked_tree_bytes() if tree_bytes is None else tree_bytes
    travel, source = kit_travel_bytes(kit)
    mib = 2**20
    print(f"travel budget {BUDGET_BYTES / mib:.0f} MiB per command, {SPARE_BYTES / mib:.0f} MiB of it kept spare; "
          f"tracked tree {tree:,} B ({tree / mib:.2f} MiB); kit sizes from {source}")
    ok = True
    for name, total, left in budget_rows(tree, travel):
        folder = VARIANTS[name][0]
        verdict = "OVER" if left <= 0 else "LOW SPARE" if left < SPARE_BYTES else "ok"
        print(f"  {name:8} tree + common + {folder}: {total:,} B = {total / mib:.2f} MiB  {verdict} "
              f"({left / mib:+.2f} MiB left)")
        ok &= left > 0
    return ok


# ---- unpack -----------------------------------------------------------------------------------------------------

def bin_variant(kit: Path) -> str:
    """The one bin folder present in the kit, else KitError: the two variants travel alternately, never together."""
    present = [folder for folder, _, _ in VARIANTS.values() if any((kit / folder).glob("*.tar.xz"))]
    if len(present) != 1:
        both = " and ".join(present) if present else "none"
        raise KitError(f"gpu_kit unpack: {kit} must hold exactly one of bin-sm90 / bin-ptx (found {both}): carry "
                       f"{kit}/common with {kit}/bin-sm90, or with {kit}/bin-ptx if the sm90 binaries fail to load")
    return present[0]


SITE_ARCHIVE = "common/site312.tar.xz"  # covrl's dependencies (DeepSpeed, msgspec, math-verify, ...) and the kit's tools


def unpack(kit: Path, target: Path, no_vllm: bool = False) -> list[str]:
    """Extract common and the one bin variant into target (safe 'data' filter, in parallel); the lines to print.
    `no_vllm`: only the site tree (SITE_ARCHIVE), for commands that run no vLLM (the GPU proof's learner and
    torch-side tests: `make gpu-first-lease`): vLLM's Python tree and binaries need not travel, and nothing is
    restored (seconds instead of ~20 s or more); `import vllm` then fails there, and its tests skip."""
    t0 = time.time()
    if no_vllm:
        folder, archives = None, [kit / SITE_ARCHIVE]
        if not archives[0].is_file():
            raise KitError(f"gpu_kit unpack --no-vllm: {kit / SITE_ARCHIVE} is missing: carry it (and "
                           f"{kit}/manifest.json), or build the kit with make gpu-kit")
    else:
        folder = bin_variant(kit)
        archives = sorted((kit / "common").glob("*.tar.xz")) + sorted((kit / folder).glob("*.tar.xz"))
    if not any(a.parent.name == "common" for a in archives):
        raise KitError(f"gpu_kit unpack: {kit}/common holds no .tar.xz: carry {kit}/common with the bin variant")
    manifest = kit / "manifest.json"
    known = load_json(manifest).get("files", {}) if manifest.is_file() else None
    if known is not None and (unknown := [a.relative_to(kit).as_posix() for a in archives
                                          if a.relative_to(kit).as_posix() not in known]):
        raise KitError(f"gpu_kit unpack: {', '.join(unknown)} not in {manifest}: a kit of another build? rebuild with "
                       f"make gpu-kit and carry it whole")
    target.mkdir(parents=True, exist_ok=True)

    def extract(archive: Path) -> str:
        rel = archive.relative_to(kit).as_posix()
        if known is not None and sha256_file(archive) != known[rel]["sha256"]:
            raise KitError(f"gpu_kit unpack: {archive} differs from manifest.json (sha256): an incomplete copy? "
                           f"rebuild with make gpu-kit and carry it again")
        try:
            with tarfile.open(archive, "r:xz") as tar:
                names = tar.getnames()
                tar.extractall(target, filter="data")
        except (tarfile.ReadError, EOFError, lzma.LZMAError) as e:  # not OutsideDestinationError: that one is raised
            raise KitError(f"gpu_kit unpack: {archive} is not a complete .tar.xz ({e}): an incomplete copy? rebuild "
                           f"with make gpu-kit and carry it again") from None
        hollowed = [n[:-len(RAW_SUFFIX + ".json")] for n in names if n.endswith(RAW_SUFFIX + ".json")]
        return f"  {rel}: {len(names)} files", hollowed

    # common's archives share no folder, so they extract in parallel; the bin archive writes into vllm/ too, and two
    # threads creating the same folder race (tarfile's makedirs), so it goes after them.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(archives)) as pool:
        done = list(pool.map(extract, [a for a in archives if a.parent.name == "common"]))
    done += [extract(a) for a in archives if a.parent.name != "common"]
    lines, hollowed = [line for line, _ in done], [n for _, names in done for n in names]
    if hollowed:  # common is in place, so the kit's own zstd is there
        t1, codec = time.time(), zstd_codec(import_zstd(target))
        restored = sum(restore(target, n, codec) for n in hollowed)
        lines.append(f"  restored {restored} CUDA entries of {', '.join(hollowed)} ({codec.name}, sha256 checked) "
                     f"in {time.time() - t1:.1f} s")
    variant = next((n for n, (f, _, _) in VARIANTS.items() if f == folder), "no-vllm")
    (target / "_covrl_kit.json").write_text(json.dumps({"variant": variant, "folder": folder,
                                                        "archives": [a.relative_to(kit).as_posix() for a in archives]}))
    checked = "sha256 checked against manifest.json" if known is not None else "no manifest.json: sha256 not checked"
    return [f"gpu_kit: unpacked {kit} into {target} in {time.time() - t0:.1f} s; binaries: {folder or 'none'} "
            f"({variant}); {checked}", *lines]


# ---- command line -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_kit", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download and build the kit (needs a registry)")
    b.add_argument("--out", type=Path, default=Path(".kit"))
    b.add_argument("--wheel-cache", type=Path, action="append", default=[],
                   help="a folder searched for wheels before OUT/cache and the registry (repeatable)")
    b.add_argument("--with-transformers", action="store_true", help=f"carry {TRANSFORMERS} (see the docstring)")
    b.add_argument("--no-hollow", action="store_true",
                   help="carry _C's CUDA entries as nvcc compressed them (MBs more; if unpack cannot restore them)")
    u = sub.add_parser("unpack", help="extract the kit into a site folder (on the GPU machine)")
    u.add_argument("--kit", type=Path, default=Path(".kit"))
    u.add_argument("--target", type=Path, required=True)
    u.add_argument("--no-vllm", action="store_true",
                   help=f"only {SITE_ARCHIVE}: for commands that run no vLLM (make gpu-first-lease)")
    c = sub.add_parser("check", help=f"tracked tree + kit against the {BUDGET_BYTES >> 20} MiB travel budget and its "
                                     f"{SPARE_BYTES >> 20} MiB spare")
    c.add_argument("--kit", type=Path, default=Path(".kit"))
    c.add_argument("--tree-bytes", type=int, default=None, help="instead of summing `git ls-files`")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            m = build(args.out, args.wheel_cache, args.with_transformers, not args.no_hollow)
            print(f"gpu_kit: built {args.out} in {m['build_seconds']:.0f} s")
            return 0 if check(args.out, None) else 1
        if args.cmd == "unpack":
            print("\n".join(unpack(args.kit, args.target, no_vllm=args.no_vllm)))
            return 0
        return 0 if check(args.kit, args.tree_bytes) else 1
    except KitError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
