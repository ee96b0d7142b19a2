"""The processes of a run, whatever starts them: learner ranks and generators as `RoleSpec`s.

A role is `python -m learner` or `python -m actors` with its arguments and its own environment variables. Where it
runs is a backend's business (`launch/local.py`: this machine; `launch/ray_backend.py`: a Ray cluster); what the
launcher does with it (start, restart, drain, stop) is the same for both (`launch/supervisor.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from common.runfiles import ClusterInfo

# Ray restarts a generator's actor this many times when its node is lost (Ray's own restarts; the launcher's are
# judged over a window, cluster.generator_max_failures).
GEN_MAX_RESTARTS = 3


@dataclass
class RoleSpec:
    name: str
    module: str  # "learner" or "actors"
    args: list[str]
    env: dict[str, str]  # this role's own variables, on top of `base_env`
    gen_id: int | None = None  # None: a learner rank
    devices: list[int] = field(default_factory=list)  # local GPU indices (the local backend; Ray assigns its own)
    # Start only once the learner ranks are built (RUN_DIR/learners.ready): a generator that shares a GPU with a
    # learner rank. vLLM measures the GPU's free memory as it starts and fails if another process frees some
    # meanwhile, which a learner does while it loads the model and builds its DeepSpeed engine.
    after_learners: bool = False
    failures: list[float] = field(default_factory=list)  # monotonic times of its failures within the window
    set_aside: int = 0  # times this generator slot was set aside
    set_aside_until: float = 0.0  # monotonic time its slot is tried again; 0: not set aside
    next_start: float = 0.0
    running: bool = False
    done: bool = False

    @property
    def is_generator(self) -> bool:
        return self.gen_id is not None


def base_env(cfg, environ=os.environ) -> dict[str, str]:
    """What every role's environment holds besides its own variables: the caller's, covrl importable, the
    run's thread count, and no network access for model files."""
    from common.data import REPO_ROOT

    return {**environ, "PYTHONPATH": REPO_ROOT + os.pathsep + environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": str(cfg.run.torch_threads), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def learner_specs(run_dir: str, info: ClusterInfo, master: tuple[str, int], resume: bool,
                  devices: list[list[int]] | None = None, extra_env: dict[str, str] | None = None,
                  local_rank: bool = True) -> list[RoleSpec]:
    """Every learner rank of one torch.distributed world rooted at `master` (rank 0's host, a free port there).
    `local_rank`: LOCAL_RANK = RANK (one node, every GPU visible); False: 0 (each rank sees only its own GPU)."""
    return [RoleSpec(f"learner{r}", "learner", ["--run-dir", run_dir, *(["--resume"] if resume else [])],
                     {"RANK": str(r), "LOCAL_RANK": str(r if local_rank else 0), "WORLD_SIZE": str(info.learners),
                      "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), **(extra_env or {})},
                     devices=devices[r] if devices else [])
            for r in range(info.learners)]


def generator_spec(run_dir: str, gen_id: int, devices: list[int] | None = None, extra_env: dict[str, str] | None = None,
                   after_learners: bool = False) -> RoleSpec:
    """Generator `gen_id`. One that dies is restarted (one that keeps failing is set aside, `launch/supervisor.py`):
    it rejoins with a weight channel of its own and is sent the latest version before it generates; the hub
    re-issues the prompts it held."""
    return RoleSpec(f"gen{gen_id}", "actors", ["--run-dir", run_dir, "--gen-id", str(gen_id)], dict(extra_env or {}),
                    gen_id=gen_id, devices=devices or [], after_learners=after_learners)
