"""Keep a finished study in the repository: each run's config and metrics in one solid archive, and the study's files.

    python -m study.archive STUDY_DIR DEST

Copies STUDY_DIR/study.json and, for every run it names that is complete (a metrics row at its last step),
RUN/config.toml and RUN/metrics.jsonl into DEST/runs.tar.xz, one xz-compressed tar for the whole study;
checkpoints, rollouts, logs and TensorBoard files stay behind. The archived metrics keep every key but the
machine's clocks (`timing_s/*`, `perf/*`: seconds and tokens/s of a shared 2-core machine running two studies'
runs at once, a fifth of the compressed bytes, and no study reads them; study.json keeps each run's wall clock),
every kept value exactly as logged. Run it again as runs finish: the runs already in DEST's archive stay, those
archived again are replaced. `covrl study --report-only --study-dir DEST` then rebuilds the report from DEST alone.

Why one archive per study, not one file per run: a study's runs share their keys and nearly all their config,
which one xz stream stores once (the 144 staleness runs: 4.5 MB as 288 files, 3.1 MB as two archives), and the
repository travels with every GPU command (hardware/kit.py, BUDGET_BYTES). One run's files, to read or to rerun:
`tar -xJf DEST/runs.tar.xz NAME/config.toml NAME/metrics.jsonl`.

The readers (`read_run`, `has_run`) take a run's directory as before: the directory itself when it exists (a study
in progress), else its member of the archive beside it.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import lzma
import os
import shutil
import sys
import tarfile

from common.metrics import CLOCK_KEYS, read_metrics

RUNS_FILE = "runs.tar.xz"
MTIME = 1_767_225_600  # 2026-01-01: every member gets it, so equal runs give an equal archive


def _split(run_dir: str) -> tuple[str, str]:
    """(study directory, run name) of a run directory STUDY/NAME."""
    return os.path.split(os.path.normpath(run_dir))


@functools.lru_cache(maxsize=4)
def _members(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    """Every file of an archive by name (cached by path and stat: a study's report reads each run once or twice)."""
    with tarfile.open(path, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def archived(study_dir: str) -> dict[str, bytes]:
    """The files of STUDY_DIR/runs.tar.xz by name (`NAME/config.toml`, `NAME/metrics.jsonl`); {} when absent."""
    path = os.path.join(study_dir, RUNS_FILE)
    if not os.path.isfile(path):
        return {}
    st = os.stat(path)
    return _members(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def has_run(run_dir: str) -> bool:
    """Whether the run exists: its directory, or its metrics in the study's archive."""
    study, name = _split(run_dir)
    return os.path.isdir(run_dir) or f"{name}/metrics.jsonl" in archived(study)


def read_run(run_dir: str) -> list[dict]:
    """A run's metrics rows: from its directory (common.metrics.read_metrics: metrics.jsonl or .xz) when it exists,
    else from the study's archive; [] when neither has it."""
    if os.path.isdir(run_dir):
        return read_metrics(run_dir)
    study, name = _split(run_dir)
    text = archived(study).get(f"{name}/metrics.jsonl")
    if text is None:
        return []
    return [json.loads(line) for line in text.decode().splitlines(keepends=True) if line.endswith("\n")]


def complete(run_dir: str, steps: int) -> bool:
    return any(r.get("step") == steps for r in read_run(run_dir))


def run_files(src: str) -> dict[str, bytes]:
    """A run's config.toml as it is and its metrics.jsonl without the CLOCK_KEYS, by archive name."""
    study, name = _split(src)
    if os.path.isdir(src):
        with open(os.path.join(src, "config.toml"), "rb") as f:
            config = f.read()
    else:
        config = archived(study)[f"{name}/config.toml"]
    lines = []
    for row in read_run(src):
        kept = {k: v for k, v in row.items() if not k.startswith(CLOCK_KEYS)}
        lines.append(json.dumps(kept, separators=(",", ":"), allow_nan=False) + "\n")
    return {f"{name}/config.toml": config, f"{name}/metrics.jsonl": "".join(lines).encode()}


def write_runs(dest: str, files: dict[str, bytes]) -> str:
    """DEST/runs.tar.xz holding `files`: sorted, fixed mtime and owner, xz preset 9e, written atomically."""
    os.makedirs(dest, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, MTIME
            tar.addfile(info, io.BytesIO(files[name]))
    path = os.path.join(dest, RUNS_FILE)
    with open(path + ".tmp", "wb") as f:
        f.write(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    os.replace(path + ".tmp", path)
    return path


def archive(study_dir: str, dest: str) -> list[str]:
    """Archive every complete run of the study (with the runs DEST's archive holds already); returns their names."""
    with open(os.path.join(study_dir, "study.json")) as f:
        meta = json.load(f)
    steps = meta.get("run_steps", {})  # every run any invocation asked for, with its length; else the study's
    names = list(steps) or meta.get("runs", meta.get("methods", []))
    done = [name for name in names if complete(os.path.join(study_dir, name), steps.get(name, meta["steps"]))]
    files = dict(archived(dest))
    for name in done:
        files.update(run_files(os.path.join(study_dir, name)))
    write_runs(dest, files)
    if os.path.abspath(study_dir) != os.path.abspath(dest):
        shutil.copyfile(os.path.join(study_dir, "study.json"), os.path.join(dest, "study.json"))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.archive", description=__doc__.split("\n")[0])
    ap.add_argument("study_dir")
    ap.add_argument("dest")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.study_dir, "study.json")):
        print(f"study.archive: error: {args.study_dir} has no study.json; pass a study directory (covrl study "
              f"--study-dir)", file=sys.stderr)
        return 2
    done = archive(args.study_dir, args.dest)
    print(f"study.archive: {len(done)} complete run(s) into {os.path.join(args.dest, RUNS_FILE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
