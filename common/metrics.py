"""Per-step metrics: one JSON object per learner step in metrics.jsonl, same tags in TensorBoard.

The names are the contract of docs/DESIGN.md section 6. Each row is appended with
one write(2) and a row cut short is truncated away, so a watcher (the launcher's
progress line, a user's `tail -f`) never sees half a line. A full disk stops the
learner with one line (common/diskspace.py) naming the file and the free space.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import math
import os

import numpy as np

from common.diskspace import naming_full_disk

CLOCK_KEYS = ("timing_s/", "perf/")  # the machine's wall clock: the only keys two runs of one seed may differ in
PROGRESS_KEYS = ("critic/score/mean", "actor/entropy", "perf/gen_tokens_per_s", "staleness/mean", "staleness/max",
                 "timing_s/step", "cluster/generators", "cluster/generators_target")


def newest_evals(rows: list[dict]) -> dict[str, float]:
    """eval/<ds>/acc of the newest row that has any, by data source."""
    for row in reversed(rows):
        accs = {k.split("/")[1]: v for k, v in row.items()
                if k.startswith("eval/") and k.endswith("/acc") and isinstance(v, float) and math.isfinite(v)}
        if accs:
            return accs
    return {}


def read_progress(run_dir: str) -> dict | None:
    """progress.json (see MetricsWriter.progress), or None before the learner's first write."""
    try:
        with open(os.path.join(run_dir, "progress.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class MetricsWriter:
    def __init__(self, run_dir: str, tensorboard: bool = True, purge_step: int | None = None, wandb=None):
        """`purge_step` (a resumed run): TensorBoard hides the events of steps >= it that the dead run wrote.
        `wandb`: a W&B run (`common.wandb_log.open_wandb`) that gets the same tags, or None."""
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb_dir = os.path.join(run_dir, "tb")
        self.evals = newest_evals(read_metrics(run_dir))  # for progress.json; a resumed run starts from its file's
        with naming_full_disk(self.path, run_dir):
            # Unbuffered: nothing is left in a buffer to fail again at close once the disk is full.
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.wandb = wandb
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            with naming_full_disk(self.tb_dir, run_dir):
                self.tb = SummaryWriter(self.tb_dir, purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in sorted(metrics.items())}}
        self.evals = newest_evals([row]) or self.evals
        # JSON has no NaN: write null so every reader can parse the line.
        line = json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()})
        with naming_full_disk(self.path, self.run_dir):
            self._append((line + "\n").encode())
        if self.tb is not None:
            with naming_full_disk(self.tb_dir, self.run_dir):  # its writer thread's ENOSPC surfaces at flush
                self._scalars(row, step)
        if self.wandb is not None:
            # The x axis is the `step` key (open_wandb defines it), not W&B's own counter: a held evaluation row
            # or a text may be logged after a later step's, and W&B drops what goes back on its counter.
            self.wandb.log({k: v for k, v in row.items() if k == "step" or math.isfinite(v)})

    def _scalars(self, row: dict[str, float], step: int) -> None:
        for k, v in row.items():
            if k != "step" and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def _append(self, data: bytes) -> None:
        """One row at the end of metrics.jsonl; a row cut short (the disk filled) is truncated away."""
        size = os.fstat(self.fd).st_size
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            os.ftruncate(self.fd, size)
            raise

    def histogram(self, tag: str, values, step: int) -> None:
        """A distribution under `tag` (TensorBoard's histograms tab; W&B's histogram). Not in metrics.jsonl."""
        if len(values) == 0:
            return
        if self.tb is not None:
            with naming_full_disk(self.tb_dir, self.run_dir):
                self.tb.add_histogram(tag, np.asarray(values), step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({"step": step, tag: wandb.Histogram(np.asarray(values))})

    def text(self, tag: str, text: str, step: int) -> None:
        """A markdown text under `tag` (TensorBoard's text tab; a one-cell table in W&B)."""
        if self.tb is not None:
            with naming_full_disk(self.tb_dir, self.run_dir):
                self.tb.add_text(tag, text, step)
                self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({"step": step, tag: wandb.Table(columns=["text"], data=[[text]])})

    def progress(self, step: int, row: dict[str, float], evaluating: list[int], note: str = "") -> None:
        """RUN_DIR/progress.json (atomic): the last trained step, a few of its metrics, the policy versions whose
        evaluation is still running (their rows wait in the learner) and the newest held-out accuracies, for the
        launcher's progress line; `note`: the autoscale policy's last decision, in a few words."""
        keep = {k: float(v) for k, v in row.items() if k in PROGRESS_KEYS and math.isfinite(v)}
        path = os.path.join(self.run_dir, "progress.json")
        data = json.dumps({"step": step, "evaluating": evaluating, "evals": self.evals, **keep,
                           **({"autoscale": note} if note else {})})
        with naming_full_disk(path, self.run_dir):
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(data)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path + ".tmp")  # half a file, never renamed into place
                raise
        os.replace(path + ".tmp", path)

    def close(self) -> None:
        os.close(self.fd)
        if self.tb is not None:
            with naming_full_disk(self.tb_dir, self.run_dir):
                self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_metrics(run_dir: str, keep) -> int:
    """Rewrite metrics.jsonl with only the rows whose step satisfies `keep(step)` (and no torn last
    line); atomic. Returns the rows kept. Used on resume: rows written after the checkpoint go."""
    rows = [r for r in read_metrics(run_dir) if keep(r["step"])]
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)
    return len(rows)


def read_metrics(run_dir: str) -> list[dict]:
    """A run's metrics rows: `metrics.jsonl`, or `metrics.jsonl.xz` where a finished run was archived compressed
    (the studies under docs/); [] when neither exists."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path) and os.path.exists(path + ".xz"):
        with lzma.open(path + ".xz", "rt") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]
