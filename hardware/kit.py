"""The GPU kit: everything an offline Hopper machine lacks to run covrl with vLLM 0.26.0, small enough to travel
with every command beside the tracked tree (under 60 MiB in all).

    python3 -m hardware.kit build  --out .kit [--wheel-cache DIR ...] [--with-transformers]   # here (registry)
    python3 -m hardware.kit unpack --kit .kit --target /tmp/site                               # there
    python3 -m hardware.kit check  --kit .kit [--tree-bytes N]                                 # the budget

The GPU machine: Python 3.12, torch 2.11.0+cu130 (vLLM 0.26.0 pins exactly that torch), transformers 5.17,
x86-64, no registry. The kit (git-ignored, rebuilt by `make gpu-kit`):

  common/vllm-py.tar.xz    vLLM's Python tree and its dist-info (RECORD dropped): no .so, no vllm-rs, no bundled
                           CUDA headers, no web assets. The dist-info must travel: without its METADATA,
                           vllm/triton_utils/importing.py disables Triton and vLLM silently falls back to its slow
                           V1 model runner.
  common/site312.tar.xz    one `pip install --target` tree for CPython 3.12 manylinux: the 18 packages vLLM
                           imports at engine start that the machine lacks, and covrl's own (deepspeed, math-verify,
                           ...), one version each.
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

Left out, by measurement (the manifest's `measured`):
- transformers 5.20.2 (covrl pins >=5.20,<5.21; the machine has 5.17): 3.5 MB of xz. With it the fallback ends
  0.25 MiB under the budget, leaving no room for the tracked tree to grow. `--with-transformers` carries it.
- huggingface-hub: the machine has 1.33.0 already, which transformers 5.20 accepts.
- PTX older than a container's newest PTX <= 90, in the fallback: on sm_90 the driver JITs the newest compatible
  PTX, so the rest is never read, and keeping it (25.7 MB of xz for `_C` instead of 20.1) puts the fallback over
  60 MiB even without transformers.

Standard library only and no torch import: `unpack` runs on the GPU machine before anything is unpacked.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
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
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hardware import fatbin

REPO = Path(__file__).resolve().parent.parent
SIZES_FILE = REPO / "hardware" / "kit_sizes.json"
BUDGET_BYTES = 60 * 2**20  # the device tool carries at most 64 MiB per command; 4 MiB stay for what is untracked
FORMAT = 1  # bump when the kit's layout or contents change, so `build` redoes every archive
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
    arcname: str
    data: bytes | Path
    mode: int = 0o644


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_tar_xz(path: Path, members: list[Member], preset: int = XZ_PRESET) -> dict:
    """A deterministic tar.xz (sorted members, fixed mtime, owner root; preset 9e unless told), written atomically;
    its size, sha256, member count and raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    raw = 0
    with tarfile.open(tmp, "w:xz", preset=preset, format=tarfile.PAX_FORMAT) as tar:
        for m in sorted(members, key=lambda m: m.arcname):
            data = m.data if isinstance(m.data, bytes) else m.data.read_bytes()
            info = tarfile.TarInfo(m.arcname)
            info.size, info.mode, info.mtime = len(data), m.mode, MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
            raw += len(data)
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


def bin_members(wheel: Path, policy: str, keep_one: bool) -> tuple[list[Member], dict]:
    """The `_C` library pruned by `policy`, and the binaries that travel unchanged; the pruning's statistics."""
    with zipfile.ZipFile(wheel) as z:
        pruned, stats = fatbin.prune_elf(z.read(C_LIB), policy, keep_one)
        members = [Member(C_LIB, pruned, 0o755)] + [Member(n, z.read(n), 0o755) for n in BIN_UNCHANGED]
    stats["files"] = {m.arcname: {"bytes": len(m.data), "sha256": hashlib.sha256(m.data).hexdigest()}
                      for m in members}
    return members, stats


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


def plan_jobs(out: Path, wheels: dict[str, Path], site: Path, with_transformers: bool) -> list[Job]:
    """Every archive of the kit plus the transformers measurement, largest first (they compress in parallel). The
    site jobs read `site`, which `build` installs only when one of them must run."""
    vllm = wheels[VLLM]
    vllm_in = {"wheel": vllm.name, "sha256": sha256_file(vllm)}
    prune_code = inspect.getsource(fatbin)  # the whole module: any change to reading or pruning rebuilds
    prune_in = {"prune_code": hashlib.sha256(prune_code.encode()).hexdigest(), "binaries": [C_LIB, *BIN_UNCHANGED]}
    site_reqs = [r for r in wheels if r != VLLM and (with_transformers or r != TRANSFORMERS)]
    site_in = {"wheels": sorted(wheels[r].name for r in site_reqs)}
    jobs = [Job(f"{folder}/vllm-bin.tar.xz", out / folder / "vllm-bin.tar.xz",
                {**vllm_in, **prune_in, "policy": policy, "keep_one": one},
                lambda p=policy, k=one: bin_members(vllm, p, k))
            for folder, policy, one in VARIANTS.values()]
    jobs.append(Job("common/site312.tar.xz", out / "common" / "site312.tar.xz", site_in,
                    lambda: (site_members(site, lambda r: with_transformers or not is_transformers(r)), {})))
    jobs.append(Job("common/vllm-py.tar.xz", out / "common" / "vllm-py.tar.xz",
                    {**vllm_in, "dropped": [p.pattern for p in PY_TREE_DROPPED]}, lambda: (py_tree_members(vllm), {})))
    jobs.append(Job(TRANSFORMERS, None, {"wheel": wheels[TRANSFORMERS].name},
                    lambda: (site_members(site, is_transformers), {})))
    return jobs


def build(out: Path, wheel_dirs: list[Path], with_transformers: bool) -> dict:
    """Build (or reuse) every archive, then write the manifest and the tracked sizes file."""
    t0 = time.time()
    requirements = [VLLM, *VLLM_DEPS, *COVRL_DEPS, TRANSFORMERS]
    if len({normalize(r.split("==")[0]) for r in requirements}) != len(requirements):
        raise KitError("a package is pinned twice in hardware/kit.py (VLLM_DEPS, COVRL_DEPS): keep one version")
    wheels = acquire_wheels(requirements, out / "cache", wheel_dirs)
    old = load_json(out / "manifest.json")
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as scratch:
        site = Path(scratch) / "site"
        jobs = plan_jobs(out, wheels, site, with_transformers)
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

def tracked_tree_bytes(repo: Path = REPO) -> int:
    """Bytes of every tracked file present in the work tree (what the device tool copies, untracked files aside)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True)
    paths = (repo / p for p in done.stdout.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def budget_rows(tree_bytes: int, travel_bytes: dict[str, int]) -> list[tuple[str, int, bool]]:
    """(variant, tree + kit bytes, within budget) per variant, primary first."""
    names = [n for n in VARIANTS if n in travel_bytes] + sorted(set(travel_bytes) - set(VARIANTS))
    return [(n, tree_bytes + travel_bytes[n], tree_bytes + travel_bytes[n] < BUDGET_BYTES) for n in names]


def kit_travel_bytes(kit: Path) -> tuple[dict[str, int], str]:
    """Per variant, the kit's bytes in one command: from the built kit's manifest, else the tracked sizes file."""
    for path in (kit / "manifest.json", SIZES_FILE):
        if path.is_file():
            return load_json(path)["travel_bytes"], str(path)
    raise KitError(f"neither {kit}/manifest.json nor {SIZES_FILE} exists: run `make gpu-kit`")


def check(kit: Path, tree_bytes: int | None) -> bool:
    tree = tracked_tree_bytes() if tree_bytes is None else tree_bytes
    travel, source = kit_travel_bytes(kit)
    mib = 2**20
    print(f"travel budget {BUDGET_BYTES / mib:.0f} MiB per command; tracked tree {tree:,} B ({tree / mib:.2f} MiB); "
          f"kit sizes from {source}")
    ok = True
    for name, total, fits in budget_rows(tree, travel):
        folder = VARIANTS[name][0]
        print(f"  {name:8} tree + common + {folder}: {total:,} B = {total / mib:.2f} MiB  "
              f"{'ok' if fits else 'OVER'} ({(BUDGET_BYTES - total) / mib:+.2f} MiB left)")
        ok &= fits
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


def unpack(kit: Path, target: Path) -> list[str]:
    """Extract common and the one bin variant into target (safe 'data' filter, in parallel); the lines to print."""
    t0 = time.time()
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
        return f"  {rel}: {len(names)} files"

    # common's archives share no folder, so they extract in parallel; the bin archive writes into vllm/ too, and two
    # threads creating the same folder race (tarfile's makedirs), so it goes after them.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(archives)) as pool:
        lines = list(pool.map(extract, [a for a in archives if a.parent.name == "common"]))
    lines += [extract(a) for a in archives if a.parent.name != "common"]
    variant = next(n for n, (f, _, _) in VARIANTS.items() if f == folder)
    (target / "_covrl_kit.json").write_text(json.dumps({"variant": variant, "folder": folder,
                                                        "archives": [a.relative_to(kit).as_posix() for a in archives]}))
    checked = "sha256 checked against manifest.json" if known is not None else "no manifest.json: sha256 not checked"
    return [f"gpu_kit: unpacked {kit} into {target} in {time.time() - t0:.1f} s; binaries: {folder} ({variant}); "
            f"{checked}", *lines]


# ---- command line -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_kit", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download and build the kit (needs a registry)")
    b.add_argument("--out", type=Path, default=Path(".kit"))
    b.add_argument("--wheel-cache", type=Path, action="append", default=[],
                   help="a folder searched for wheels before OUT/cache and the registry (repeatable)")
    b.add_argument("--with-transformers", action="store_true", help=f"carry {TRANSFORMERS} (see the docstring)")
    u = sub.add_parser("unpack", help="extract the kit into a site folder (on the GPU machine)")
    u.add_argument("--kit", type=Path, default=Path(".kit"))
    u.add_argument("--target", type=Path, required=True)
    c = sub.add_parser("check", help="tracked tree + kit against the 60 MiB travel budget")
    c.add_argument("--kit", type=Path, default=Path(".kit"))
    c.add_argument("--tree-bytes", type=int, default=None, help="instead of summing `git ls-files`")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            m = build(args.out, args.wheel_cache, args.with_transformers)
            print(f"gpu_kit: built {args.out} in {m['build_seconds']:.0f} s")
            return 0 if check(args.out, None) else 1
        if args.cmd == "unpack":
            print("\n".join(unpack(args.kit, args.target)))
            return 0
        return 0 if check(args.kit, args.tree_bytes) else 1
    except KitError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
