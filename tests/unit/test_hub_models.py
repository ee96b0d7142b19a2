"""model.path as a Hugging Face Hub id, resolved through a Hub cache built here in the Hub's layout (offline)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.paths import BASE_MODEL, HUB_OLD as OLD, HUB_SHA as SHA, REPO


def resolve(cache, path, offline=True, endpoint=None):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "PYTHONPATH": REPO}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    code = ("import sys\nfrom common.config import ConfigError\nfrom common.data import resolve_model\n"
            f"try:\n    print(*resolve_model({path!r}), sep='\\n')\n"
            "except ConfigError as e:\n    print(e, file=sys.stderr); sys.exit(2)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    p = resolve(hub_cache, "acme/arith-base")
    assert p.returncode == 0, p.stderr
    local, source = p.stdout.split()
    assert local == str(hub_cache / "models--acme--arith-base" / "snapshots" / SHA)
    assert source == f"acme/arith-base@{SHA}"
    p = resolve(hub_cache, f"acme/arith-base@{OLD}")  # a pinned revision
    assert p.returncode == 0 and p.stdout.split()[0].endswith(OLD), p.stderr


def test_a_missing_model_says_how_to_fetch_it(hub_cache):
    p = resolve(hub_cache, "acme/other-model")
    assert p.returncode == 2
    assert p.stderr.strip() == ("model.path 'acme/other-model' is not in the Hugging Face cache and HF_HUB_OFFLINE=1; "
                                "fetch it on a machine with network (`hf download acme/other-model`, into the same "
                                "Hugging Face cache), or point model.path at a local model directory (there is no "
                                "local directory 'acme/other-model')")


def test_without_a_network_the_cache_still_serves_and_a_miss_says_so(hub_cache):
    nowhere = "http://127.0.0.1:9"  # nothing listens: the Hub cannot be reached
    p = resolve(hub_cache, "acme/arith-base", offline=False, endpoint=nowhere)
    assert p.returncode == 0 and p.stdout.split()[0].endswith(SHA), p.stderr
    p = resolve(hub_cache, "acme/other-model", offline=False, endpoint=nowhere)
    assert p.returncode == 2 and "is not in the Hugging Face cache and the Hub cannot be reached" in p.stderr, p.stderr


def test_local_directories_and_relative_paths_stay_paths(tmp_path):
    from common.config import is_hub_id, load_config, with_absolute_paths
    from common.data import resolve_model

    assert resolve_model(BASE_MODEL) == (BASE_MODEL, None)
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("Qwen/Qwen2.5-0.5B@main") and not is_hub_id("./models/x")
    cfg = with_absolute_paths(load_config(None, ['model.path="Qwen/Qwen2.5-0.5B@v1"']), str(tmp_path))
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B@v1"  # not made into <cwd>/Qwen/Qwen2.5-0.5B@v1
    (tmp_path / "org" / "name").mkdir(parents=True)  # a local directory of that shape wins
    cfg = with_absolute_paths(load_config(None, ['model.path="org/name"']), str(tmp_path))
    assert cfg.model.path == str(tmp_path / "org" / "name")
