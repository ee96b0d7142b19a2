"""Pinned files: data that only the CPU studies and their tests read, kept in git history but out of the tip's
tracked tree.

Why: a command on the lent GPU machine carries the tracked work tree (not .git) beside the GPU kit, 60 MiB at most
with a spare kept free (hardware/kit.py), and every tracked byte the GPU proof never reads takes room from that
spare. A pinned file leaves the index (`git rm --cached`, then git-ignored; it stays on disk) and `assets/pinned.json`
records, per path, the git blob that holds its bytes, their sha256 and size, and the command that rebuilds the file
without git history. `restore` writes a missing file back from its blob (`git cat-file blob`) into a temp file
beside it, checks the sha256 and renames it into place, so no reader sees half a file; `make test`, `check`, `demo`
and `bench` run it once .venv is built. A file that is present with the pinned sha256 is not touched (so a second
restore costs one hash of each file), and one present with other bytes (a model rebuilt by hand, say) is never
overwritten silently: restore fails naming it, and `--force` puts the pinned bytes back.

The blobs stay in the clone as long as the commits that tracked the files do: a shallow clone lacks them (`git fetch
--unshallow`), and a copy without .git has none (each entry names its rebuild command for both cases).

    python -m common.pinned restore [--force]                  # every pinned file present, byte for byte
    python -m common.pinned check                              # exit 0 when all are, 1 when one is missing or differs
    python -m common.pinned pin PATH... --rebuild "COMMAND"    # tracked, committed files into the manifest

Exit status 2 on bad input (an unknown or untracked path, a malformed manifest), 1 when a file cannot be restored.
Standard library only: it runs before anything else is known to import, from the Makefile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "assets/pinned.json"
ABOUT = ("Files kept in git history but not in the tip's tracked tree: only CPU studies and their tests read them, "
         "and a command on the GPU machine carries the tracked tree (hardware/kit.py SPARE_BYTES). `python -m "
         "common.pinned restore` (run by make test, check, demo and bench) writes each back from its git blob, "
         "sha256-checked; `rebuild` makes it without git history. common/pinned.py says more.")
IGNORE_HEADER = f"# pinned files ({MANIFEST}): in git history, back with `python -m common.pinned restore`"
EXIT_FAILED, EXIT_USAGE = 1, 2


class PinError(RuntimeError):
    """A pinned file that cannot be restored or checked, said in one line with the way out."""


class BadInput(PinError):
    """The command's input is wrong (a path, the manifest): exit status 2."""


@dataclass(frozen=True)
class Entry:
    blob: str  # the git blob id (`git rev-parse HEAD:PATH` when it was pinned)
    sha256: str
    bytes: int
    rebuild: str  # the command that makes the file without git history


# ---- the manifest -----------------------------------------------------------------------------------------------

def load(repo: Path) -> dict[str, Entry]:
    """path (relative to the repo, POSIX) -> its entry; {} when there is no manifest."""
    path = repo / MANIFEST
    if not path.is_file():
        return {}
    try:
        files = json.loads(path.read_text())["files"]
        entries = {rel: Entry(**fields) for rel, fields in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path} is not a pinned-files manifest ({type(e).__name__}: {e}): take it back from git "
                       f"history (`git log -p -- {MANIFEST}`)") from e
    if outside := [rel for rel in entries if Path(rel).is_absolute() or ".." in Path(rel).parts]:
        raise BadInput(f"{path} names {', '.join(outside)}, outside the repository: pinned paths are relative to it")
    return entries


def save(repo: Path, entries: dict[str, Entry]) -> None:
    """Atomically, sorted by path."""
    data = {"_about": ABOUT, "files": {rel: asdict(entries[rel]) for rel in sorted(entries)}}
    path = repo / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def missing_hint(folder: str, repo: Path = REPO) -> str:
    """For an error about a model or data folder that lacks a file: how to get the pinned files of `folder` back, or
    "" when none of them is pinned there (or the manifest cannot be read: the error it belongs to says enough)."""
    try:
        entries = load(repo)
        inside = [rel for rel in entries if Path(os.path.abspath(repo / rel)).is_relative_to(os.path.abspath(folder))]
    except (PinError, OSError, ValueError):
        return ""
    if not inside:
        return ""
    return (f"; {', '.join(inside)} is pinned ({MANIFEST}): `python -m common.pinned restore` writes it back from git "
            f"history (make test and make demo do), or `{entries[inside[0]].rebuild}` rebuilds it")


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def state(repo: Path, rel: str, entry: Entry) -> str:
    """"ok" (the pinned bytes), "missing" or "differs" (anything else there: other bytes, a folder, a link)."""
    path = repo / rel
    if not path.exists() and not path.is_symlink():
        return "missing"
    if path.is_symlink() or not path.is_file() or path.stat().st_size != entry.bytes:
        return "differs"
    return "ok" if sha256_file(path) == entry.sha256 else "differs"


# ---- git --------------------------------------------------------------------------------------------------------

def git(repo: Path, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], stdout=stdout, stderr=subprocess.PIPE)
    except FileNotFoundError as e:
        raise PinError("git is not installed: pinned files come from git history; install git, or rebuild them "
                       f"(the `rebuild` commands in {MANIFEST})") from e


def require_checkout(repo: Path, rel: str, entry: Entry) -> None:
    """PinError unless `repo` is the top of a git checkout that holds the entry's blob."""
    top = git(repo, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.decode().strip()).resolve() != repo.resolve():
        raise PinError(f"{repo} is not a git checkout, so {rel} (pinned: kept in git history only) cannot be "
                       f"restored: work in a clone of the repository, or rebuild it with `{entry.rebuild}`")
    if git(repo, "cat-file", "-e", f"{entry.blob}^{{blob}}").returncode != 0:
        shallow = git(repo, "rev-parse", "--is-shallow-repository").stdout.decode().strip() == "true"
        why = "this is a shallow clone: `git fetch --unshallow`" if shallow else "fetch the full history"
        raise PinError(f"{rel}: its blob {entry.blob} is not in this clone's history ({why}), or rebuild it with "
                       f"`{entry.rebuild}`")


def write_from_blob(repo: Path, rel: str, entry: Entry) -> None:
    """The blob's bytes at `rel`, through a temp file beside it renamed into place once its sha256 is checked."""
    require_checkout(repo, rel, entry)
    path = repo / rel
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".pinned-tmp")
    except OSError as e:
        raise PinError(f"{rel}: cannot write beside it ({e.strerror}): make {path.parent} writable") from e
    try:
        with os.fdopen(fd, "wb") as f:
            done = git(repo, "cat-file", "blob", entry.blob, stdout=f)
        if done.returncode != 0:
            raise PinError(f"{rel}: `git cat-file blob {entry.blob}` failed: {done.stderr.decode().strip()}")
        if (got := sha256_file(Path(tmp))) != entry.sha256:
            raise PinError(f"{rel}: blob {entry.blob} has sha256 {got}, {MANIFEST} says {entry.sha256}: the manifest "
                           f"is wrong; take it from the commit that pinned the file, or rebuild with `{entry.rebuild}`")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise PinError(f"{rel}: cannot put the pinned bytes in place ({e.strerror}); move what is there aside") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- the commands -----------------------------------------------------------------------------------------------

def check(repo: Path) -> dict[str, str]:
    """Every pinned path -> its state (`state`)."""
    return {rel: state(repo, rel, entry) for rel, entry in load(repo).items()}


def restore(repo: Path, force: bool = False) -> list[str]:
    """Write back every missing pinned file (and, with `force`, every differing one); the lines to print. A file
    already right is not touched. PinError after the rest are restored when one differs and `force` is off."""
    entries = load(repo)
    states = {rel: state(repo, rel, entry) for rel, entry in entries.items()}
    written = [rel for rel, s in states.items() if s == "missing" or s == "differs" and force]
    for rel in written:
        write_from_blob(repo, rel, entries[rel])
    differing = [rel for rel, s in states.items() if s == "differs" and not force]
    if differing:
        raise PinError(f"{', '.join(differing)}: present with bytes other than the pinned ones ({MANIFEST}; a "
                       f"rebuilt file?), left as it is: move your copy aside, or `python -m common.pinned restore "
                       f"--force` to overwrite it with the pinned bytes")
    lines = [f"pinned: restored {rel} from blob {entries[rel].blob[:12]} (sha256 checked)" for rel in written]
    return lines + [f"pinned: {len(entries)} file(s) present with their pinned sha256 ({MANIFEST})"]


def repo_path(repo: Path, given: str) -> str:
    """`given` (relative to the working directory, or absolute) as a POSIX path relative to `repo`."""
    path = Path(given).absolute()
    path = path.parent.resolve() / path.name  # the folders' links resolved, not a link the file itself may be
    try:
        return path.relative_to(repo.resolve()).as_posix()
    except ValueError:
        raise BadInput(f"{given} is not inside the repository {repo}: pin only files of this checkout") from None


def tracked(repo: Path, rel: str) -> bool:
    return git(repo, "ls-files", "--error-unmatch", "--", rel).returncode == 0


def committed_entry(repo: Path, rel: str, rebuild: str) -> Entry:
    """The entry for a tracked file whose bytes on disk are exactly its blob at HEAD (so history keeps them)."""
    if not tracked(repo, rel):
        raise BadInput(f"{rel} is not tracked by git, so no commit holds its bytes: commit it first, then pin it")
    head = git(repo, "rev-parse", "--verify", "--quiet", f"HEAD:{rel}")
    if head.returncode != 0:
        raise BadInput(f"{rel} is staged but not committed: commit it first (pin keeps the committed bytes)")
    blob = head.stdout.decode().strip()
    path = repo / rel
    content = git(repo, "cat-file", "blob", blob).stdout
    if not path.is_file() or hashlib.sha256(content).hexdigest() != sha256_file(path):
        raise BadInput(f"{rel} on disk differs from its blob at HEAD ({blob[:12]}): commit it (or `git restore "
                       f"{rel}`) first, so the pinned bytes are the ones history keeps")
    return Entry(blob=blob, sha256=hashlib.sha256(content).hexdigest(), bytes=len(content), rebuild=rebuild)


def ignore(repo: Path, rel: str) -> None:
    """`/rel` appended to the repo's .gitignore (under IGNORE_HEADER) unless the line is there already."""
    path, line = repo / ".gitignore", f"/{rel}"
    lines = path.read_text().splitlines() if path.is_file() else []
    if line not in lines:
        path.write_text("\n".join(lines + [IGNORE_HEADER] * (IGNORE_HEADER not in lines) + [line]) + "\n")


def pin(repo: Path, paths: list[str], rebuild: str) -> list[str]:
    """Move tracked, committed files into the manifest: entry recorded, git-ignored, out of the index (left on
    disk). Every path is checked before anything changes; the lines to print."""
    if not rebuild.strip():
        raise BadInput("pin needs --rebuild COMMAND: how to make the files without git history (e.g. `covrl "
                       "warmstart --task grid`)")
    rels = [repo_path(repo, p) for p in paths]
    entries = load(repo)
    if already := [rel for rel in rels if rel in entries and not tracked(repo, rel)]:
        raise BadInput(f"{', '.join(already)}: pinned already ({MANIFEST}); `python -m common.pinned restore` "
                       f"brings a missing one back")
    new = {rel: committed_entry(repo, rel, rebuild) for rel in rels}
    save(repo, {**entries, **new})
    for rel in rels:
        ignore(repo, rel)
        done = git(repo, "rm", "--cached", "--quiet", "--", rel)
        if done.returncode != 0:
            raise PinError(f"`git rm --cached {rel}` failed: {done.stderr.decode().strip()}")
    lines = [f"pinned: {rel} ({e.bytes:,} B, blob {e.blob[:12]}) left the index, git-ignored" for rel, e in new.items()]
    return lines + [f"pinned: now commit {MANIFEST}, .gitignore and the removal(s) together"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.pinned", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout (default: the one holding this module)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restore", help="write back every missing pinned file from git history")
    r.add_argument("--force", action="store_true", help="also overwrite pinned files present with other bytes")
    sub.add_parser("check", help="exit 0 when every pinned file is present with its sha256, else 1")
    p = sub.add_parser("pin", help="move tracked, committed files out of the tree into the manifest")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--rebuild", required=True, help="the command that makes the file(s) without git history")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            states = check(args.repo)
            print("\n".join(f"{s:8} {rel}" for rel, s in states.items()) or f"no files pinned ({MANIFEST})")
            return 0 if all(s == "ok" for s in states.values()) else EXIT_FAILED
        lines = restore(args.repo, args.force) if args.cmd == "restore" else pin(args.repo, args.paths, args.rebuild)
        print("\n".join(lines))
        return 0
    except PinError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, BadInput) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
