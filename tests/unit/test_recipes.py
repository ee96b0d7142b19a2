"""Every recipe in launch/recipes loads and holds the paper's values (ALGORITHMS.md "Paper recipes")."""

import glob
import os

import pytest

from common import config
from tests.helpers.paths import REPO

RECIPES = os.path.join(REPO, "launch", "recipes")
PAPER = sorted(glob.glob(os.path.join(RECIPES, "qwen2.5-[0-9]*b-*.toml")))
PAPER = [p for p in PAPER if "1gpu" not in p]


def _load(name):
    # validate=False: the values, without the cross-field checks that need the data files (test below).
    return config.load_config(os.path.join(RECIPES, name), validate=False)


def test_the_eight_paper_recipes_exist():
    names = sorted(os.path.basename(p) for p in PAPER)
    assert names == sorted(f"qwen2.5-{s}-{m}.toml" for s in ("7b", "32b") for m in ("grpo", "clip-higher", "clip-cov", "kl-cov"))


@pytest.mark.parametrize("path", PAPER, ids=os.path.basename)
def test_paper_recipe_shared_values(path):
    cfg = config.load_config(path, validate=False)
    size = "7b" if "-7b-" in path else "32b"
    assert cfg.model.path.endswith("Qwen2.5-7B" if size == "7b" else "Qwen2.5-32B") and cfg.model.dtype == "bfloat16"
    r, lr = cfg.rollout, cfg.learner
    assert (r.groups_per_step, r.group_size, lr.mini_batches) == (256, 8, 8)  # 256 x 8, mini-batch 32 prompts
    assert lr.lr == (5e-7 if size == "7b" else 1e-6) and lr.weight_decay == 0 and lr.grad_clip == 1.0
    assert r.max_new_tokens == 8192 and cfg.data.max_prompt_tokens == 2048
    assert r.temperature == 1.0 and r.top_p == 1.0
    assert lr.agg == "token-mean" and lr.advantage == "grpo"
    assert lr.filter.dynamic_sampling and lr.filter.max_filtered_batches == 10
    assert lr.kl.coef == 0 and lr.entropy_coef == 0
    assert cfg.data.train_files == ("data/dapo-math-17k.parquet",)
    # Validation: greedy, except AIME, AIME25 and AMC at 0.6 with avg@32.
    assert cfg.eval.temperature == 0 and cfg.eval.k == 32
    assert cfg.eval.temperatures == {"aime-2024": 0.6, "aime-2025": 0.6, "amc": 0.6}
    assert config.eval_sampling(cfg, "math500") == (0.0, 1) and config.eval_sampling(cfg, "aime-2025") == (0.6, 32)


@pytest.mark.parametrize("size", ["7b", "32b"])
def test_paper_recipe_loss_values(size):
    grpo, higher = _load(f"qwen2.5-{size}-grpo.toml").learner.loss, _load(f"qwen2.5-{size}-clip-higher.toml").learner.loss
    assert isinstance(grpo, config.PPOLoss) and (grpo.clip_low, grpo.clip_high) == (0.2, 0.2)
    assert isinstance(higher, config.PPOLoss) and (higher.clip_low, higher.clip_high) == (0.2, 0.28)
    cc = _load(f"qwen2.5-{size}-clip-cov.toml").learner.loss
    assert isinstance(cc, config.ClipCovLoss)
    assert (cc.cov_fraction, cc.cov_lb, cc.cov_ub, cc.clip_low, cc.clip_high) == (2e-4, 1.0, 5.0, 1.0, 1.0)
    kc = _load(f"qwen2.5-{size}-kl-cov.toml").learner.loss
    assert isinstance(kc, config.KLCovLoss) and kc.kl_coef == 1.0
    assert kc.kl_fraction == (2e-3 if size == "7b" else 2e-4)


def test_small_gpu_recipe():
    cfg = _load("qwen2.5-1.5b-1gpu-kl-cov.toml")
    assert cfg.model.path.endswith("Qwen2.5-1.5B") and isinstance(cfg.learner.loss, config.KLCovLoss)
    assert cfg.learner.loss.kl_fraction == 2e-3 and cfg.rollout.groups_per_step % cfg.learner.mini_batches == 0


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(RECIPES, "*.toml"))), ids=os.path.basename)
def test_recipe_passes_every_check_once_its_data_exists(path, tmp_path, monkeypatch):
    cfg = config.load_config(path, validate=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.check(cfg)  # the data files are named, and missing here
    for f in cfg.data.train_files + cfg.data.eval_files:
        os.makedirs(os.path.dirname(f), exist_ok=True)
        open(f, "w").close()
    config.check(cfg)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(RECIPES, "*.toml"))), ids=os.path.basename)
def test_recipe_weight_path_is_one_vllm_026_accepts(path):
    """Every recipe runs as written on vLLM 0.26 (the version run on GPUs so far): its transport and update pass the
    config's rule (common/config.py check_weight_transport: nccl or ipc with "finish" is refused in a run that is not
    deterministic) and its placement's, launched as its comment says (common/runfiles.py check_colocation: no nccl
    between colocated roles, ipc only beside learner rank 0), and it does not ask for "keep", which vLLM 0.26 refuses
    at start (actors/vllm_engine.py: no per-token version labels). The recipe's own comment says why."""
    import re

    from common.runfiles import check_colocation, place_gpus

    cfg = config.load_config(path, validate=False)
    config.check_weight_transport(cfg)
    assert cfg.generator.weight_update == "finish", "vLLM 0.26 refuses weight_update = \"keep\""
    text = open(path).read()
    flags = dict(re.findall(r"--(gens|learners|tp|gpus) (\d+)", re.search(r"#\s+covrl run (.*)", text).group(1)))
    gens, learners, tp = int(flags["gens"]), int(flags["learners"]), int(flags.get("tp", 1))
    check_colocation(place_gpus(int(flags.get("gpus", 8)), learners, gens, tp), cfg.generator)  # paper recipes: 8 GPUs
    assert f'weight_transport = "{cfg.generator.weight_transport}"' in text and "vLLM 0.26" in text
