"""Finding and verifying the checkpoints of a run (no torch: the launcher imports this).

learner/checkpoint.py writes them; see its docstring for the layout. Each checkpoint carries `manifest.json`,
written last, just before the rename that makes the checkpoint visible: every file's size and CRC-32. The rename
protects against a crash mid-write; the manifest against what happens to the files afterwards (a copy to shared
storage cut short, a disk error, a file lost). `verify` checks one checkpoint against its manifest (sizes always,
checksums unless told not to); `choose` picks the checkpoint a resume starts from: the newest that verifies, or one
named with `--from`. The launcher and the learner both go through `choose`.

A checkpoint written before manifests existed has none: it loads, reported as unverified. One a resume passed over
is never deleted: `set_aside` renames it `step_N.damaged` (or `.superseded`, for good ones a `--from` rewound past),
a name no resume takes, so a later resume cannot mistake it for the run's newest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field

from common.diskspace import tree_bytes

STATE_FILE = "covrl_state.json"  # the run's state: a directory without it is not a checkpoint
DS_TAG = "deepspeed"  # the engine state's subdirectory
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
LOAD_FAILED = "load_failed.json"  # RUN_DIR/: a learner that could not load its checkpoint says so (the summary reads it)
_PART = "manifest.rank_{}.json"  # one rank's share, merged into MANIFEST by rank 0 and removed
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SET_ASIDE = re.compile(r"^step_(\d+)\.(damaged|superseded)(?:\.\d+)?$")  # set_aside's names
# Files one rank writes alone, so that rank checksums them (in parallel with the others): DeepSpeed's per-rank
# shards (`[bf16_]zero_pp_rank_R_mp_rank_00_*.pt`) and our RNG states (`rng/rank_R.pt`). Anything else is rank 0's:
# the last rank checksums those under deepspeed/ and rng/ too (write_rank_part), rank 0 the export and the state.
_RANK_FILE = re.compile(r"(?:^|/)(?:bf16_)?(?:zero_pp_)?rank_(\d+)[_.]")
_CHUNK = 8 << 20

GOOD, UNVERIFIED, DAMAGED = "good", "unverified", "damaged"


class CheckpointError(ValueError):
    """No checkpoint a resume can start from (or the one asked for is damaged or absent): a user error."""


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first: cheap (no file is read). `.tmp` directories (a write
    that never finished), set-aside ones and directories without the state file are not checkpoints."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)) and os.path.isdir(os.path.join(path, DS_TAG)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def remove_rolling(run_dir: str, before: int) -> list[int]:
    """Delete the complete checkpoints older than step `before` that were written only because run.checkpoint_every_s
    passed (`"rolling": true` in their state file): a newer checkpoint supersedes them. Returns their steps."""
    gone = []
    for step, path in complete_checkpoints(run_dir):
        if step >= before:
            continue
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                rolling = json.load(f).get("rolling", False)
        except (OSError, ValueError):  # unreadable: not ours to judge, kept
            continue
        if rolling is True:
            shutil.rmtree(path)
            gone.append(step)
    return gone


def checkpoint_bytes(path: str) -> int:
    """A checkpoint's size: its manifest's total (what the next one of the run needs on disk, about), or the bytes
    of its files where it has no readable manifest."""
    try:
        manifest = read_manifest(path)
    except ValueError:
        manifest = None
    if manifest is not None:
        return sum(e["bytes"] for e in manifest["files"].values())
    return tree_bytes(path)


def step_dirs(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `step_N` directory, oldest first, whatever it holds: each was renamed into place only
    once complete, so one that lacks a file now was damaged since (`verify` says which)."""
    root = os.path.join(run_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((int(m.group(1)), os.path.join(root, n)) for n in names if (m := _STEP_DIR.match(n)))


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint directory's name: `step_N`, or one a resume set aside (`step_N.damaged[.K]`,
    `step_N.superseded[.K]`); None for any other name (`step_N.tmp` included: never a checkpoint)."""
    m = _STEP_DIR.match(name) or _SET_ASIDE.match(name)
    return int(m.group(1)) if m else None


def latest_checkpoint(run_dir: str) -> tuple[int, str] | None:
    """The newest complete checkpoint, unverified (`choose` is what a resume uses)."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


# ---- writing the manifest (learner/checkpoint.py calls these inside the checkpoint's .tmp directory)


def crc32_of(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(root: str) -> list[str]:
    """Every file under `root` as a relative path with '/' separators, the manifest and its parts left out."""
    out = []
    for here, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(here, name), root).replace(os.sep, "/")
            if rel != MANIFEST and not (rel.startswith("manifest.rank_") and rel.endswith(".json")):
                out.append(rel)
    return sorted(out)


def _entry(root: str, rel: str) -> dict:
    path = os.path.join(root, rel)
    return {"bytes": os.path.getsize(path), "crc32": crc32_of(path)}


def owner(rel: str) -> int:
    """The learner rank that writes `rel` alone (and checksums it); 0 for everything else."""
    m = _RANK_FILE.search(rel)
    return int(m.group(1)) if m else 0


def write_synced(path: str, data: bytes) -> None:
    """`data` in `path`, on the disk before this returns (every file of a checkpoint is written this way)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json_synced(path: str, obj) -> None:
    write_synced(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def write_rank_part(tmp: str, rank: int, world: int) -> None:
    """Learner rank `rank` > 0, once every rank's engine state is on disk and while rank 0 writes the model export:
    the sizes and checksums of its own files; the last rank also takes rank 0's share of them (the module's states,
    under ZeRO-1/2 the whole model), which leaves rank 0 only the export and the run state."""
    take = {rank, 0} if rank == world - 1 else {rank}
    ours = [rel for rel in _files(tmp) if rel.startswith((DS_TAG + "/", "rng/")) and owner(rel) in take]
    _write_json_synced(os.path.join(tmp, _PART.format(rank)), {rel: _entry(tmp, rel) for rel in ours})


def write_manifest(tmp: str, world: int) -> dict:
    """Rank 0, after every other file of the checkpoint is written and the other ranks' parts are in: the
    manifest of every file (the parts merged, the rest checksummed here). The parts are removed."""
    files: dict[str, dict] = {}
    for r in range(1, world):
        part = os.path.join(tmp, _PART.format(r))
        if os.path.exists(part):  # absent only if that rank wrote nothing of its own; its files are hashed below
            with open(part) as f:
                files.update(json.load(f))
            os.remove(part)
    for rel in _files(tmp):
        if rel not in files:
            files[rel] = _entry(tmp, rel)
    manifest = {"format": MANIFEST_FORMAT, "learners": world, "files": files}
    _write_json_synced(os.path.join(tmp, MANIFEST), manifest)
    return manifest


# ---- verifying


@dataclass
class Check:
    """One checkpoint's state: good (every file as its manifest says), unverified (no manifest: written before
    covrl wrote them) or damaged (`problems` says which file and how)."""
    step: int
    path: str
    state: str
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    checksummed: bool = False
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def why(self) -> str:
        """The first problem and how many more, as one clause."""
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return self.problems[0] + more if self.problems else ""

    def summary(self) -> str:
        if self.state == DAMAGED:
            return f"damaged: {self.why()}"
        if self.state == UNVERIFIED:
            return "unverified: no manifest.json (written before covrl verified its checkpoints)"
        what = "sizes and checksums match" if self.checksummed else "sizes match (checksums not read: --fast)"
        return f"good: {self.files} files, {_size(self.bytes)}, {what}"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def read_manifest(path: str) -> dict | None:
    """The checkpoint's manifest, or None when it has none; ValueError when it cannot be read as one."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not all(
                isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), str) for e in files.values()):
            raise ValueError(f"format {manifest.get('format')!r}, this covrl reads {MANIFEST_FORMAT}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{MANIFEST} cannot be read ({type(e).__name__}: {e})") from None
    return manifest


def _file_problem(path: str, rel: str, want: dict, checksums: bool) -> str | None:
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"{rel} is missing"
    size = os.path.getsize(full)
    if size != want["bytes"]:
        return f"{rel} is {size:,} bytes, expected {want['bytes']:,}"
    if checksums and (crc := crc32_of(full)) != want["crc32"]:
        return f"{rel} has CRC-32 {crc}, expected {want['crc32']} (its bytes changed after it was written)"
    return None


def verify(path: str, checksums: bool = True, step: int | None = None) -> Check:
    """One checkpoint against its manifest: every file present at its size and, with `checksums`, its CRC-32."""
    t0 = time.monotonic()
    if step is None:
        step = checkpoint_step(os.path.basename(os.path.normpath(path)))
        step = -1 if step is None else step
    check = Check(step, path, GOOD, checksummed=checksums)
    try:
        manifest = read_manifest(path)
    except ValueError as e:
        check.state, check.problems = DAMAGED, [str(e)]
        return check
    if manifest is None:  # written before manifests: what every checkpoint has, or it is damaged
        check.problems = [f"{need} is missing" for need in (STATE_FILE, DS_TAG + "/")
                          if not os.path.exists(os.path.join(path, need))]
        check.state = DAMAGED if check.problems else UNVERIFIED
        return check
    for rel, want in sorted(manifest["files"].items()):
        if (problem := _file_problem(path, rel, want, checksums)) is not None:
            check.problems.append(problem)
        check.files, check.bytes = check.files + 1, check.bytes + want["bytes"]
    check.state = DAMAGED if check.problems else GOOD
    check.seconds = time.monotonic() - t0
    return check


# ---- choosing the checkpoint a resume starts from


@dataclass
class Choice:
    """The checkpoint a resume starts from, and the newer ones it passed over (damaged, newest first)."""
    check: Check
    skipped: list[Check]

    @property
    def step(self) -> int:
        return self.check.step

    @property
    def path(self) -> str:
        return self.check.path


def step_name(text: str) -> int:
    """`--from` takes `step_N` or `N`."""
    m = re.fullmatch(r"(?:step_)?(\d+)", text.strip())
    if m is None:
        raise CheckpointError(f"--from {text!r}: name a checkpoint as step_N (or N), e.g. --from step_4")
    return int(m.group(1))


def choose(run_dir: str, checksums: bool = True, from_step: int | None = None) -> Choice | None:
    """The checkpoint a resume of `run_dir` starts from: `from_step`'s, or the newest that verifies. None when the
    run has no checkpoint at all (it starts from step 0). CheckpointError, in one line, when none can be used."""
    found = step_dirs(run_dir)
    if from_step is not None:
        return _chosen(run_dir, found, from_step, checksums)
    skipped = []
    for step, path in reversed(found):
        check = verify(path, checksums, step)
        if check.state != DAMAGED:
            return Choice(check, skipped)
        skipped.append(check)
    if not skipped:
        return None
    damage = "; ".join(f"{c.name}: {c.why()}" for c in skipped)
    raise CheckpointError(f"{run_dir}: no checkpoint verifies ({damage}); restore the files from a copy and check "
                          f"them with `covrl verify {run_dir}`, or start a new run from its config: covrl run "
                          f"--config {os.path.join(run_dir, 'config.toml')} with the --learners and --gens of "
                          f"{os.path.join(run_dir, 'cluster.json')}")


def _chosen(run_dir: str, found: list[tuple[int, str]], step: int, checksums: bool) -> Choice:
    paths = dict(found)
    if step not in paths:
        have = ", ".join(f"step_{s}" for s, _ in found) or "none"
        raise CheckpointError(f"--from step_{step}: {run_dir}/checkpoints has no step_{step} (it has: {have}; one a "
                              f"resume set aside, step_{step}.superseded, is taken again once renamed step_{step})")
    check = verify(paths[step], checksums, step)
    if check.state == DAMAGED:
        earlier = earlier_usable(run_dir, step)
        hint = f"; pick an earlier one (--from step_{earlier})" if earlier is not None else ""
        raise CheckpointError(f"--from step_{step}: it is damaged: {check.why()}{hint}; `covrl verify {run_dir}` "
                              f"lists every checkpoint's state")
    return Choice(check, [])


def earlier_usable(run_dir: str, step: int) -> int | None:
    """The newest checkpoint before `step` whose files have their manifest's sizes: what `--from` can name."""
    for s, path in reversed(step_dirs(run_dir)):
        if s < step and verify(path, checksums=False, step=s).state != DAMAGED:
            return s
    return None


def read_load_failure(run_dir: str) -> dict:
    """RUN_DIR/load_failed.json: {"checkpoint": "step_N", "rank", "error"} from a learner rank that could not load
    the checkpoint it resumed from; {} when none failed. One that cannot be read still says a load failed."""
    try:
        with open(os.path.join(run_dir, LOAD_FAILED)) as f:
            got = json.load(f)
        return got if isinstance(got, dict) and isinstance(got.get("checkpoint"), str) else {"checkpoint": "?"}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {"checkpoint": "?", "error": f"{LOAD_FAILED} cannot be read"}


def set_aside(path: str, why: str) -> str:
    """Rename a checkpoint a resume passed over to `step_N.<why>` (`.2`, `.3` if taken): kept, never taken."""
    dest, n = f"{path}.{why}", 2
    while os.path.exists(dest):
        dest, n = f"{path}.{why}.{n}", n + 1
    os.rename(path, dest)
    return dest


def set_aside_dirs(run_dir: str) -> list[str]:
    """The checkpoints earlier resumes set aside (`step_N.damaged`, `step_N.superseded`), oldest step first."""
    root = os.path.join(run_dir, "checkpoints")
    names = [n for n in os.listdir(root) if _SET_ASIDE.match(n)] if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: (checkpoint_step(n), n))]
