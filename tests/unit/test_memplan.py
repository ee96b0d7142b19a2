"""The memory plan (common/memplan.py, launch/plan.py): its formulas on hand-worked configurations, its activation count
against what autograd actually saves, the choices it makes on a stated GPU size, `covrl plan`'s output and refusal,
and `covrl run` refused at the door with nothing started."""

import os
import subprocess
import sys

import pytest

from common import memplan as M
from common.config import load_config
from tests.helpers.paths import REPO

# A shape small enough to count by hand: 2 layers, hidden 8, MLP 16, 2 heads of 4, 1 KV head, vocabulary 10.
TINY = M.Shape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, tied=False,
               qkv_bias=True)
PSI = 1384  # embedding 80 + head 80 + 2 x (q 64 + k 32 + v 32 + o 64 + biases 16 + MLP 384 + norms 16) + final norm 8


def _cfg(*sets):
    return load_config(None, ["model.dtype=\"bfloat16\"", *sets], validate=False)


def _terms(terms):
    return {t.name: t.bytes for t in terms}


def test_parameters_counted_from_the_shape():
    assert TINY.params == PSI
    # The published sizes of Qwen2.5 (their model cards: 0.49 B, 1.54 B, 7.61 B, 32.8 B parameters).
    assert M.KNOWN["qwen2.5-0.5b"].params == 494_032_768
    assert M.KNOWN["qwen2.5-7b"].params == 7_615_616_512
    assert round(M.KNOWN["qwen2.5-1.5b"].params / 1e9, 2) == 1.54
    assert round(M.KNOWN["qwen2.5-32b"].params / 1e9, 1) == 32.8
    assert M.shape_of(os.path.join(REPO, "assets", "arith-base")) == M.shape_of("")  # '' is the built-in model


@pytest.mark.parametrize("stage, params, grads, opt, fp32_grads, buckets", [
    (0, 2 * PSI, 2 * PSI, 12 * PSI, 4 * PSI, None),  # nothing partitioned
    (1, 2 * PSI, 2 * PSI, 12 * PSI / 4, 4 * PSI / 4, 2 * PSI * 2),  # optimizer states over 4 ranks
    (2, 2 * PSI, 2 * PSI / 4, 12 * PSI / 4, 4 * PSI / 4, 2 * PSI * 2),  # and gradients
    (3, 2 * PSI / 4, 2 * PSI / 4, 12 * PSI / 4, None, None),  # and parameters
])
def test_model_states_by_zero_stage_in_bf16(stage, params, grads, opt, fp32_grads, buckets):
    t = _terms(M.model_states(_cfg(f"learner.zero_stage={stage}"), TINY, ranks=4))
    assert t["parameters"] == params and t["gradients"] == grads and t["optimizer states"] == opt
    assert t.get("fp32 gradient accumulation") == fp32_grads
    assert t.get("ZeRO communication buckets") == buckets  # 2 buckets of min(5e8, PSI) bf16 elements
    if stage == 3:  # the larger of two layers (2 x 608) and the embedding (80), in bf16
        assert t["ZeRO-3 gathered parameters"] == 2 * 608 * 2


def test_offload_moves_the_optimizer_states_to_the_host_and_fp32_has_no_master_copy():
    off = _cfg("learner.zero_stage=2", "learner.offload_optimizer=true")
    assert "optimizer states" not in _terms(M.model_states(off, TINY, ranks=4))
    host = _terms(M.learner_host(off, TINY, ranks=4, rank=1, gloo_peer=False))
    assert host["learner 1: offloaded optimizer states"] == 12 * PSI / 4
    fp32 = _terms(M.model_states(load_config(None, ["learner.zero_stage=0", 'model.dtype="float32"'], validate=False),
                                 TINY, ranks=1))
    assert fp32["optimizer states"] == 8 * PSI and fp32["parameters"] == 4 * PSI  # momentum + variance; fp32 params
    assert "fp32 gradient accumulation" not in fp32


def test_activations_with_and_without_checkpointing_and_by_attention():
    per_layer = 2 * (4 * 8 + 2 * 8) + (2 * 2 * 8 + 3 * 2 * 4 + 2 * 8 + 4 * 2) + 4 * 2 * 16  # norms, attention, MLP
    assert M.layer_activation_bytes(TINY, 2) == per_layer == 304
    base = ["learner.micro_batch_tokens=100", "learner.logprob_chunk_tokens=50"]
    full = _terms(M.activations(_cfg(*base, "learner.attn_implementation=\"varlen\""), TINY, cuda=True))
    assert full["activations"] == 100 * 2 * 304 and "dense attention masks" not in full
    assert full["LM head chunk"] == 50 * 10 * (2 + 4 * 2)  # fused on CUDA: bf16 logits + 2 fp32 copies
    ckpt = _terms(M.activations(_cfg(*base, "learner.gradient_checkpointing=true", "learner.attn_implementation=\"varlen\""),
                                TINY, cuda=True))
    assert ckpt["activations (checkpointed)"] == 100 * (2 * 2 * 8 + 304)  # each layer's input, one layer's full set
    sdpa = _terms(M.activations(_cfg(*base, "learner.attn_implementation=\"sdpa\""), TINY, cuda=True))
    assert sdpa["dense attention masks"] == 100 * 100 * (1 + 2 * 2 * 2)
    eager = _terms(M.activations(_cfg(*base, "learner.attn_implementation=\"eager\""), TINY, cuda=True))
    assert eager["attention scores"] == 2 * 2 * 100 * 100 * 2 * 2
    cpu = _terms(M.activations(_cfg(*base, "learner.logprob_head=\"auto\""), TINY, cuda=False))
    assert cpu["LM head chunk"] == 50 * 10 * (2 + 4 * 3)  # chunked off CUDA: 3 fp32 copies


@pytest.mark.parametrize("dtype, tolerance", [("float32", 0.01), ("bfloat16", 0.05)])
def test_the_activation_count_matches_what_autograd_saves_in_a_decoder_layer(dtype, tolerance):
    """One decoder layer of the built-in model, 64 and 128 tokens: the bytes of every tensor saved for the backward
    (parameters and the input excluded), per token, against `layer_activation_bytes`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = os.path.join(REPO, "assets", "arith-base")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    shape = M.shape_of(path)
    layer, owned = model.model.layers[0], {p.untyped_storage().data_ptr() for p in model.parameters()}
    for T in (64, 128):
        h = torch.randn(1, T, shape.hidden, dtype=getattr(torch, dtype), requires_grad=True)
        pos = torch.arange(T)[None]
        saved = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in owned and ptr != h.untyped_storage().data_ptr():
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(h, position_embeddings=model.model.rotary_emb(h, pos), attention_mask=None, position_ids=pos)
        per_token = sum(saved.values()) / T
        planned = M.layer_activation_bytes(shape, M.dtype_bytes(dtype))
        assert abs(per_token - planned) <= tolerance * planned, (T, per_token, planned)


def test_reference_model_publisher_and_host_copy():
    cfg = _cfg("learner.kl.coef=0.1")
    rank0 = _terms(M.learner_gpu(cfg, TINY, ranks=2, rank=0))
    rank1 = _terms(M.learner_gpu(cfg, TINY, ranks=2, rank=1))
    assert rank0["reference model"] == rank1["reference model"] == 2 * PSI  # unsharded, bf16, on every rank
    assert rank0["weight publisher buckets"] == PSI * 2 and "weight publisher buckets" not in rank1
    ipc = _terms(M.learner_gpu(_cfg("generator.weight_transport=\"ipc\""), TINY, ranks=1, rank=0))
    assert ipc["weight publisher buckets"] == 3 * PSI * 2  # + two staging slots (a bucket: the model, when smaller)
    host = _terms(M.learner_host(cfg, TINY, ranks=2, rank=0, gloo_peer=True))
    assert host["learner 0: host copy of the weights"] == 2 * PSI
    assert "learner 0: host copy of the weights" not in _terms(M.learner_host(cfg, TINY, ranks=2, rank=0, gloo_peer=False))


def test_the_constants_agree_with_the_code_they_describe():
    from common import weights

    assert M.BUCKET_NUMEL == weights.BUCKET_NUMEL


def test_zero3_start_up_peak_is_the_whole_model_on_each_gpu():
    cfg = _cfg("learner.zero_stage=3", "learner.offload_optimizer=true", "learner.gradient_checkpointing=true",
               "learner.micro_batch_tokens=2048")
    p = M.plan(cfg, M.KNOWN["qwen2.5-32b"], 8, 0, 1, M.Machine(8, 40 * M.GiB, None))  # the step: about 20 GiB
    learner = p.devices[0]
    assert learner.peaks[0].bytes == M.KNOWN["qwen2.5-32b"].params * 2 + M.CUDA_RUNTIME_BYTES
    assert learner.total == max(learner.step_total, learner.peaks[0].bytes) and not learner.fits
    assert "start-up" in M.refusal(p)  # 61 GiB of weights on a 40 GiB GPU: the start-up is what does not fit


def test_vllm_kv_cache_and_the_sequences_it_holds():
    cfg = _cfg("generator.gpu_memory_utilization=0.5", "generator.max_num_seqs=64", "rollout.max_new_tokens=1000",
               "data.max_prompt_tokens=24", "generator.enforce_eager=true")
    shape = M.KNOWN["qwen2.5-0.5b"]
    terms, notes = M.vllm_gpu(cfg, shape, tp=1, gpu_bytes=80 * M.GiB)
    t = _terms(terms)
    weights = shape.params * 2
    work = M.VLLM_WORKSPACE_BYTES + 64 * shape.vocab * 4
    kv = 40 * M.GiB - weights - work - M.CUDA_RUNTIME_BYTES
    assert t["vLLM weights"] == weights and t["vLLM KV cache"] == kv
    per_token = 2 * 24 * 2 * 64 * 2  # K and V x layers x KV heads x head dim x bf16
    assert M.kv_bytes_per_token(shape, 2, 1) == per_token
    assert f"holds {kv / (per_token * 1024):.0f} sequences of 1024 tokens" in notes[-1]


def test_placement_colocates_generators_without_gpus_of_their_own_and_the_refusal_names_the_largest_term():
    cfg = _cfg("learner.micro_batch_tokens=4096")
    shape = M.KNOWN["qwen2.5-7b"]
    p = M.plan(cfg, shape, 1, 1, 1, M.Machine(1, 80 * M.GiB, None))
    assert len(p.devices) == 2 and "colocated" in p.devices[0].name  # the learner's GPU and the host
    line = M.refusal(p)
    assert line is not None and "\n" not in line
    assert line.startswith("the run does not fit GPU 0:") and "optimizer states" in line
    assert "change learner.offload_optimizer" in line  # ZeRO-1 over one rank partitions nothing: offload is the knob


def test_the_plan_chooses_the_largest_micro_batch_that_fits_a_stated_gpu():
    from launch import plan

    recipe = os.path.join(REPO, "launch", "recipes", "qwen2.5-7b-kl-cov.toml")
    cfg = load_config(recipe, ["learner.gradient_checkpointing=false"], validate=False)
    shape, m80 = M.KNOWN["qwen2.5-7b"], M.Machine(8, 80 * M.GiB, None)
    got = plan.choose(cfg, shape, 4, 4, 1, m80, explicit=set())
    assert got == {"learner.micro_batch_tokens": 32768, "learner.gradient_checkpointing": True}, got
    assert plan.shown(got) == "learner.micro_batch_tokens=32768, learner.gradient_checkpointing=true"
    assert plan.applied(cfg, got).learner.micro_batch_tokens == 32768 and plan.applied(cfg, got).learner.gradient_checkpointing
    # 32768 (the largest choice) fits with checkpointing; without it even 8192 does not.
    for tokens, ckpt, fits in ((32768, True, True), (8192, False, False)):
        assert M.plan(plan._with(cfg, tokens, ckpt), shape, 4, 4, 1, m80).fits is fits
    # An explicit setting wins: only the other one is chosen; both given: nothing.
    assert plan.choose(cfg, shape, 4, 4, 1, m80, explicit={"learner.micro_batch_tokens"}) == \
        {"learner.gradient_checkpointing": True}
    assert plan.choose(cfg, shape, 4, 4, 1, m80, explicit=set(plan.CHOSEN)) == {}
    # On a 141 GB GPU 8k tokens fit without checkpointing; on the CPU nothing is chosen.
    assert plan.choose(cfg, shape, 4, 4, 1, M.Machine(8, 141 * M.GiB, None), explicit=set()) == \
        {"learner.micro_batch_tokens": 8192, "learner.gradient_checkpointing": False}
    assert plan.choose(cfg, shape, 4, 4, 1, M.Machine(0, None, None), explicit=set()) == {}
    assert plan.explicit_keys(recipe, ["learner.lr=1e-6"]) >= {"learner.micro_batch_tokens", "learner.lr",
                                                               "rollout.group_size"}


@pytest.mark.parametrize("recipe, flags", [("qwen2.5-7b-kl-cov", ["--gens", "4", "--learners", "4"]),
                                           ("qwen2.5-32b-kl-cov", ["--gens", "2", "--tp", "2", "--learners", "4"])])
def test_covrl_plan_shows_a_recipe_that_fits_80gb(recipe, flags):
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "plan", "--config",
                        os.path.join(REPO, "launch", "recipes", f"{recipe}.toml"), *flags, "--gpus", "8",
                        "--gpu-memory", "80GB", "--host-memory", "1TB"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "DOES NOT FIT" not in p.stdout and "GPU 0 learner 0:" in p.stdout and "host:" in p.stdout
    assert "activations (checkpointed)" in p.stdout and "vLLM KV cache" in p.stdout and "sources: (1)" in p.stdout


def test_covrl_plan_refuses_in_one_line_what_does_not_fit():
    recipe = os.path.join(REPO, "launch", "recipes", "qwen2.5-7b-kl-cov.toml")
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "plan", "--config", recipe, "--set",
                        "learner.gradient_checkpointing=false", "--gens", "4", "--learners", "4", "--gpus", "8",
                        "--gpu-memory", "80GB"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and "DOES NOT FIT" in p.stdout
    line, = p.stderr.strip().splitlines()
    assert line.startswith("error: the run does not fit GPU 0:") and "change learner.gradient_checkpointing" in line
    bad = subprocess.run([sys.executable, "-m", "launch.covrl", "plan", "--gpus", "2"], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert bad.returncode == 2 and "--gpu-memory" in bad.stderr


def test_covrl_plan_refuses_a_model_config_without_a_shape_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 8}')
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "plan", "--set", f'model.path="{tmp_path}"'], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    line, = p.stderr.strip().splitlines()
    assert "does not give a decoder's shape" in line and "num_hidden_layers" in line


def test_covrl_run_is_refused_at_the_door_with_nothing_started(tmp_path):
    """The torch generator's KV cache for a million rows cannot fit this host: exit 2, one line naming it and its
    knob, no run directory, no process."""
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run_dir),
                        "--steps", "1", "--quiet", "--set", "generator.max_num_seqs=100000000"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    line, = p.stderr.strip().splitlines()
    assert line.startswith("error: the run does not fit host:") and "torch generator KV cache" in line
    assert "change generator.max_num_seqs" in line
    assert not run_dir.exists()


def test_a_triton_head_on_the_cpu_is_refused_at_the_door_with_nothing_started(tmp_path):
    """learner.logprob_head = "triton" with no GPU and no Triton interpreter: one line before anything starts, not a
    learner rank failing at its start."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run_dir),
                        "--steps", "1", "--quiet", "--set", 'learner.logprob_head="triton"'],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr
    line, = p.stderr.strip().splitlines()
    assert "learner.logprob_head" in line and "need CUDA" in line and "use \"chunked\" or \"fused\"" in line
    assert not run_dir.exists()


def test_a_launch_on_gpus_runs_with_what_the_plan_chose(tmp_path, tiny_model_dir, monkeypatch):
    """`covrl run`'s door on a stated 80 GB GPU (this machine described as one): the settings the config leaves open
    are chosen and written into the run's config, the banner says so; a setting given with --set stays."""
    from launch import cluster, plan

    monkeypatch.setattr(plan, "this_machine", lambda gpus: M.Machine(gpus, 80 * M.GiB, 64 * M.GiB))

    def launch(name, *sets):
        args = cluster.parse_args(["--gens", "1", "--learners", "1", "--gpus", "1", "--run-dir", str(tmp_path / name),
                                   "--set", f'model.path="{tiny_model_dir}"', "--set",
                                   "generator.gpu_memory_utilization=0.3", "--set", "eval.every_steps=0", *sets])
        return cluster.prepare(args, gpus=1)

    # Both open: the tiny model fits the largest choice without checkpointing.
    run = launch("open")
    assert run.cfg.learner.micro_batch_tokens == plan.MICRO_BATCH_CHOICES[0]
    assert not run.cfg.learner.gradient_checkpointing
    assert any(n.startswith("chosen by the memory plan") for n in run.notes)
    assert any(n.startswith("memory plan: GPU 0") for n in run.notes)
    assert "micro_batch_tokens = 32768" in (tmp_path / "open" / "config.toml").read_text()
    # One given: it stays, and the other is still chosen (checkpointing off: 1024 tokens fit without it).
    given = launch("given", "--set", "learner.micro_batch_tokens=1024")
    assert given.cfg.learner.micro_batch_tokens == 1024 and not given.cfg.learner.gradient_checkpointing
    assert any("learner.gradient_checkpointing=false" in n for n in given.notes)
    both = launch("both", "--set", "learner.micro_batch_tokens=1024", "--set", "learner.gradient_checkpointing=true")
    assert both.cfg.learner.gradient_checkpointing and not any(n.startswith("chosen") for n in both.notes)



def test_model_dtype_auto_is_planned_as_the_machine_resolves_it():
    """"auto" (the default) plans bf16 model states on GPUs of compute capability 8.0 or more, and on GPUs described
    without one (sm80+ assumed), fp32 on older GPUs and on the CPU; the parts never see "auto" itself."""
    cfg = load_config(None, ["learner.zero_stage=0"], validate=False)
    assert cfg.model.dtype == "auto"

    def parameters(machine):
        terms = {t.name.removeprefix("learner 0: "): t.bytes for d in M.plan(cfg, TINY, 1, 1, 1, machine).devices
                 for t in d.terms}
        return terms["parameters"]

    assert parameters(M.Machine(1, 80 * M.GiB, None)) == 2 * PSI  # described: sm80+ assumed
    assert parameters(M.Machine(1, 80 * M.GiB, None, (9, 0))) == 2 * PSI
    assert parameters(M.Machine(1, 16 * M.GiB, None, (7, 5))) == 4 * PSI  # a T4: fp32
    assert parameters(M.Machine(0, None, None)) == 4 * PSI  # the CPU: fp32
    with pytest.raises(ValueError, match="resolves model.dtype"):
        M.dtype_bytes("auto")


@pytest.mark.parametrize("gpus, said", [
    (["--gpus", "8", "--gpu-memory", "80GB"], 'model.dtype "auto": bfloat16 (GPUs described: sm80+ assumed'),
    (["--gpus", "0"], 'model.dtype "auto": float32 (the learner ranks run on the CPU)'),
])
def test_covrl_plan_says_what_auto_is_on_the_machine_described(gpus, said):
    p = subprocess.run([sys.executable, "-m", "launch.covrl", "plan", *gpus], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr
    assert said in p.stdout.splitlines()[0]
