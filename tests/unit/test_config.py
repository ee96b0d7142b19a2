import tomllib

import pytest

from common.config import Config, ConfigError, from_dict, load_config, to_toml


def test_defaults_roundtrip_through_toml(tmp_path):
    cfg = load_config(None, ["rollout.group_size=4", "learner.lr=1e-4", "learner.loss.dual_clip_c=0",
                             "learner.adam_betas=[0.9, 0.95]", "learner.adam_eps=1e-6"])
    assert cfg.rollout.group_size == 4 and cfg.learner.lr == 1e-4 and cfg.learner.loss.dual_clip_c == 0
    assert cfg.learner.adam_betas == (0.9, 0.95) and cfg.learner.adam_eps == 1e-6
    assert Config().learner.adam_betas == (0.9, 0.999) and Config().learner.adam_eps == 1e-8  # torch's AdamW defaults
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(str(path)) == cfg
    assert from_dict(tomllib.loads(to_toml(Config()))) == Config()


@pytest.mark.parametrize("override, needle", [
    ("rollout.group_sizee=4", "rollout.group_sizee is not a config key; did you mean rollout.group_size?"),
    ("learner.loss.type='klcov'", 'learner.loss.type = \'klcov\' is not one of "ppo", "clip_cov", "kl_cov"'),
    ("learner.loss.kl_fraction=0.1", 'learner.loss.kl_fraction is not a field of learner.loss.type = "ppo"; it belongs '
                                     'to type = "kl_cov"'),
    ("learner.advantage='grp'", '"grpo"'),
    ("nosuch.key=1", "nosuch is not a config key; its fields are run, model, data"),
    ("rollout.group_size=1", "at `rollout.group_size`"),
    ("rollout.top_p=1.5", "at `rollout.top_p`"),
    ("rollout.top_p=0.9", "rollout.top_p=0.9: generators report each token's logprob under the top-p nucleus"),
    ("learner.loss.dual_clip_c=0.5", "dual_clip_c"),
    ("learner.mini_batches=3", "must divide rollout.groups_per_step"),
    ("rollout", "expected key.path=value"),
    ("learner.zero_stage=4", "at `learner.zero_stage`"),
    ("learner.adam_betas=[0.9, 1.0]", "at `learner.adam_betas[1]`"),
    ("learner.adam_betas=[0.9]", "at `learner.adam_betas`"),
    ("learner.adam_eps=0", "at `learner.adam_eps`"),
    ("data.task=files", "needs data.train_files"),
    ("data.train_files=['x.jsonl']", "set data.task = \"files\""),
    ("data.eval_files=['/no/such/file.jsonl']", "does not exist"),
    ("learner.importance.geo_lo=1.5", "geo_lo (1.5) below geo_hi"),
    ("transport.learner_timeout_s=600", "transport.learner_timeout_s = 600 must exceed batch_timeout_s + "
                                        "weight_send_timeout_s (600 + 60)"),
    ("transport.generator_progress_timeout_s=-1", "at `transport.generator_progress_timeout_s`"),
])
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_top_p_below_one_is_refused_for_training_only():
    """The learner scores the full tempered softmax, so a training nucleus would bias every
    importance weight by its mass; evaluation never reaches the learner and may sample a nucleus."""
    with pytest.raises(ConfigError, match="Train with rollout.top_p = 1 .*eval.top_p may be < 1"):
        load_config(None, ["rollout.top_p=0.95"])
    assert load_config(None, ["eval.top_p=0.9"]).eval.top_p == 0.9


def test_nccl_finish_updates_that_would_hold_the_learner_are_refused():
    """With NCCL a generator receives only once paused; "finish" pauses after every in-flight
    request ends, so without the deterministic barrier (nothing in flight at a publish) the learner would wait for
    the longest response at every step."""
    nccl = ["generator.weight_transport=nccl", "run.deterministic=false"]
    with pytest.raises(ConfigError, match="would wait for the longest response in flight at every publish. Use "
                                          "weight_update = \"keep\""):
        load_config(None, nccl)
    assert load_config(None, [*nccl, "generator.weight_update=keep"]).generator.weight_update == "keep"
    assert load_config(None, ["generator.weight_transport=nccl"]).run.deterministic  # the barrier: nothing in flight
    assert load_config(None, ["run.deterministic=false"]).generator.weight_transport == "rpc"


def test_forced_lengths_need_the_torch_engine():
    with pytest.raises(ConfigError, match="implemented by the torch engine only"):
        load_config(None, ["rollout.forced_length_median=128", 'generator.engine="vllm"'])
    assert load_config(None, ["rollout.forced_length_median=128", 'generator.engine="torch"']).rollout.forced_length_median == 128


def test_ipc_is_refused_where_it_cannot_serve_in_one_line():
    """ipc waits for the generator's drain as nccl does (the same rule); the torch engine has no vLLM worker to map
    the slots into; and it serves the one generator on learner rank 0's GPU, so autoscaling past one is refused."""
    ipc = ["generator.weight_transport=ipc"]
    cases = [
        (["run.deterministic=false"], "generator.weight_transport = \"ipc\" with weight_update = \"finish\" and "
                                      "run.deterministic = false"),
        (['generator.engine="torch"'], "generator.engine = \"torch\" has no such worker"),
        (["cluster.autoscale.min=1", "cluster.autoscale.max=2"], "cluster.autoscale.max = 2 would start more"),
    ]
    for extra, needle in cases:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*ipc, *extra])
        assert needle in str(e.value) and "\n" not in str(e.value)
        assert "weight_transport = \"rpc\"" in str(e.value)  # the fallback, named
    assert load_config(None, ipc).generator.weight_transport == "ipc"  # deterministic by default: nothing in flight
    keep = load_config(None, [*ipc, "run.deterministic=false", "generator.weight_update=keep"])
    assert keep.generator.weight_update == "keep"


@pytest.mark.parametrize("choice, capability, dtype", [
    ("auto", None, "float32"),  # the CPU: every recorded CPU run is fp32
    ("auto", (8, 0), "bfloat16"),  # A100
    ("auto", (9, 0), "bfloat16"),  # H100, H200
    ("auto", (8, 9), "bfloat16"),  # L4, L40
    ("auto", (7, 5), "float32"),  # T4: no bf16 tensor cores
    ("auto", (7, 0), "float32"),  # V100
    ("float32", (9, 0), "float32"),  # a named dtype passes through, whatever the device
    ("bfloat16", None, "bfloat16"),
    ("bfloat16", (7, 5), "bfloat16"),
])
def test_model_dtype_auto_resolves_by_the_learners_device(choice, capability, dtype):
    from common.config import resolve_dtype

    assert resolve_dtype(choice, capability) == dtype


def test_model_dtype_defaults_to_auto_and_a_bad_value_is_one_line_naming_the_choices():
    from common.config import resolve_dtype

    assert Config().model.dtype == "auto" and load_config(None, []).model.dtype == "auto"
    with pytest.raises(ConfigError) as e:
        load_config(None, ['model.dtype="float16"'])
    assert str(e.value) == 'invalid config: model.dtype = \'float16\' is not one of "auto", "bfloat16", "float32"'
    with pytest.raises(ConfigError) as e:
        resolve_dtype("fp32", None)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        'model.dtype = \'fp32\' is not one of "auto", "bfloat16", "float32"')


def test_a_role_outside_a_run_resolves_auto_on_its_own_device_and_probes_cuda_only_for_auto(monkeypatch):
    """`dtype_on`: what the learner and the torch engine run when their config still says "auto" (tests, covrl
    evaluate); a run's config.toml names the launcher's dtype, which passes through without looking at CUDA."""
    import torch

    from common.config import dtype_on, with_dtype

    assert dtype_on("auto", "cpu") == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert dtype_on("auto", "cuda") == "bfloat16" and dtype_on("auto", "cpu") == "float32"
    capability[0] = (7, 5)
    assert dtype_on("auto", "cuda:0") == "float32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("probed for a named dtype"))
    assert dtype_on("bfloat16", "cuda") == "bfloat16" and dtype_on("float32", "cuda") == "float32"
    cfg = Config()
    assert with_dtype(cfg, "auto") is cfg and with_dtype(cfg, "float32").model.dtype == "float32"
    assert with_dtype(cfg, "float32").model.path == cfg.model.path
