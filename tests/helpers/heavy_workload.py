"""The generation-heavy benchmark workload: a model with room for 2048-token responses, settings imposing lengths."""

from __future__ import annotations

import json
import os
import shutil

from tests.helpers.paths import REPO
from tests.helpers.pipeline_clock import SETTINGS

MEDIAN, SIGMA, CAP = 128, 0.9, 2048  # each response's length: lognormal(median, sigma) tokens, capped


def heavy_model(dst: str) -> str:
    """assets/arith-base with room for 2048-token responses (max_position_embeddings 4096)."""
    shutil.copytree(os.path.join(REPO, "assets", "arith-base"), dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 4096
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return dst


def workload(model: str) -> list[str]:
    """The `--set` overrides of the workload on `model` (a `heavy_model` copy)."""
    return [*SETTINGS, f'model.path="{model}"', f"rollout.forced_length_median={MEDIAN}",
            f"rollout.forced_length_sigma={SIGMA}", f"rollout.max_new_tokens={CAP}"]
