"""Weights & Biases as an optional second logger (`logging.wandb.project`; `pip install -e '.[wandb]'`).

Learner rank 0 opens one W&B run per covrl run: id = the run's id (cluster.json), so a resumed run continues
the same W&B run; name = `logging.wandb.name` or the run directory's name; files in RUN_DIR/wandb. Its config
is the resolved covrl config plus `covrl/git_revision` and `covrl/hardware` (CPU count, CUDA devices, torch,
platform). Every metrics.jsonl key is logged under the same tag as in TensorBoard, against the `step` key
(`define_metric`), and the rollout texts as one-cell tables. `mode = "offline"` writes only to RUN_DIR/wandb
(`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later).
"""

from __future__ import annotations

import os
import platform
import subprocess

import msgspec

from common.config import Config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() + ("+changes" if dirty else "")


def hardware() -> dict:
    import torch

    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpus": os.cpu_count(), "cuda_devices": cuda, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


FINISH_TIMEOUT_S = 120


def open_wandb(cfg: Config, run_dir: str, run_id: str):
    """The W&B run of this covrl run, or None when `logging.wandb.project` is empty."""
    w = cfg.logging.wandb
    if not w.project:
        return None
    import wandb  # installed: config.check refuses logging.wandb.project without it
    config = {**msgspec.to_builtins(cfg), "covrl": {"git_revision": git_revision(), "hardware": hardware()}}
    # finish() waits for the upload at most FINISH_TIMEOUT_S (W&B's default is for ever): what is not sent by then
    # stays in RUN_DIR/wandb for `wandb sync`.
    run = wandb.init(project=w.project, entity=w.entity or None, name=w.name or os.path.basename(run_dir.rstrip("/")),
                     id=run_id, resume="allow", dir=run_dir, mode=w.mode, config=config,
                     settings=wandb.Settings(finish_timeout=FINISH_TIMEOUT_S))
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run
