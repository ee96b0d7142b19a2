"""The learner's GPU kernels on CUDA, bf16: torch's varlen attention against the dense-mask sdpa path on the same
packed rows (values and gradients), no sample attending to its neighbour, the fused head against an fp32 reference
from the same bf16 logits, and no device sync in the micro-batch's forward, loss and backward.

A random-init Qwen2 of a few layers with GQA (8 query heads, 2 KV heads), built offline. Skipped without CUDA, and
the varlen tests without torch's varlen kernels (torch < 2.10). The CPU versions of these checks are
tests/unit/test_attention.py and tests/unit/test_fused_head.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import messages
from learner import attention
from learner.batch import TrainSample, pack
from learner.fused_head import fused_logprobs_and_entropy
from learner.logprobs import install_token_forward
from learner.trainer import accumulate, micro_sums
from learner.tokens import Surveyed, Tokens, Choices

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_varlen = pytest.mark.skipif(attention.torch_varlen() is None, reason="this torch has no varlen attention")

VOCAB = 4096
ROW = [(40, 200), (17, 90), (64, 511), (5, 30)]  # (prompt, response) tokens of the packed samples


def tiny(attn: str, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=0, bos_token_id=None)
    cfg._attn_implementation = attention.resolve(attn, cuda=True, dtype=torch.bfloat16)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.config.use_cache = False
    return model


def samples(seed: int = 0, plant: tuple[int, int] | None = None) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(ROW):
        ids = rng.integers(1, VOCAB, p + r)
        if plant is not None and plant[0] == i:
            ids[plant[1]] = (ids[plant[1]] + 11) % VOCAB
        out.append(TrainSample(input_ids=messages.to_bytes(ids, messages.TOKEN_DTYPE), prompt_len=p,
                               behav_logprobs=messages.to_bytes(np.full(r, -np.log(VOCAB)), messages.LOGPROB_DTYPE),
                               versions=messages.to_bytes(np.zeros(r), messages.VERSION_DTYPE), advantage=1.0 - i % 2))
    return out


def forward(model, mb, head: str = "chunked"):
    install_token_forward(model, head=head)
    return model(input_ids=mb.input_ids, position_ids=mb.position_ids, targets=mb.targets, temperature=0.7,
                 chunk=256, **mb.attn_kwargs())


@needs_varlen
def test_varlen_equals_dense_sdpa_in_bf16():
    mb = pack(samples(), list(range(len(ROW))), pad_id=0).to(torch.device("cuda"))
    dense, varlen = tiny("sdpa"), tiny("varlen")
    (lp_d, ent_d), (lp_v, ent_v) = forward(dense, mb), forward(varlen, mb)
    valid = mb.mask > 0
    dlogp = (lp_v - lp_d)[valid].abs()
    assert float(dlogp.mean()) < 0.02 and float(dlogp.max()) < 0.25, (float(dlogp.mean()), float(dlogp.max()))
    assert float((ent_v - ent_d)[valid].abs().mean()) < 0.02
    for m, lp, ent in ((dense, lp_d, ent_d), (varlen, lp_v, ent_v)):
        ((lp + 0.01 * ent) * mb.mask).sum().backward()
    for (name, p), q in zip(dense.named_parameters(), varlen.parameters()):
        cos = torch.nn.functional.cosine_similarity(p.grad.float().flatten(), q.grad.float().flatten(), dim=0)
        assert float(cos) > 0.99, (name, float(cos))


@needs_varlen
def test_no_sample_attends_to_its_neighbour_on_cuda():
    model = tiny("varlen").eval()
    lens = [p + r for p, r in ROW]
    start = np.concatenate([[0], np.cumsum(lens)])
    with torch.no_grad():
        ref = forward(model, pack(samples(), [0, 1, 2, 3], 0).to(torch.device("cuda")))[0][0]
        moved = forward(model, pack(samples(plant=(1, 3)), [0, 1, 2, 3], 0).to(torch.device("cuda")))[0][0]
    others = torch.cat([ref[:start[1]] - moved[:start[1]], ref[start[2]:] - moved[start[2]:]])
    assert float(others.abs().max()) == 0.0  # samples 0, 2, 3: the same bits
    assert float((ref[start[1] + 3:start[2] - 1] - moved[start[1] + 3:start[2] - 1]).abs().max()) > 0


@pytest.mark.parametrize("kernels", ["fused", "triton", "inductor"])
def test_fused_head_equals_an_fp32_reference_from_the_same_bf16_logits(kernels):
    """Today's eager head and the Triton / compiled kernels of learner/head_kernels.py, at 152k, in bf16."""
    torch.manual_seed(0)
    n, h, v, temp = 3000, 512, 151_936, 0.7
    hidden = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    lp, ent = fused_logprobs_and_entropy(hidden, weight, None, targets, temperature=temp, chunk=1024,
                                         kernels=kernels)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    grads = hidden.grad.float(), weight.grad.float()
    h32, w32 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    z = (h32 @ w32.T).float() / temp  # bf16 logits (the rounding vLLM's logprobs share), then fp32
    logp_all = torch.log_softmax(z, -1)
    ref_lp = logp_all.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    torch.autograd.backward([ref_lp, ref_ent], [g_lp, g_ent])
    assert float((lp - ref_lp).abs().max()) < 1e-3 and float((ent - ref_ent).abs().max()) < 1e-3
    for got, want in zip(grads, (h32.grad.float(), w32.grad.float())):
        assert float((got - want).norm() / want.norm()) < 1e-2


@needs_varlen
@pytest.mark.parametrize("head", ["fused", "triton"])
def test_no_device_sync_in_the_micro_batch_forward_loss_and_backward(head):
    """What the trainer runs per micro-batch, short of DeepSpeed's own backward: the varlen forward, the fused head,
    the objective, autograd's backward, and the step sums. A sync raises under sync debug mode "error"."""
    from common.config import load_config
    from learner.objective import Objective

    cfg = load_config(None, [])
    model = tiny("varlen")
    objective = Objective(cfg.learner, cfg.rollout.max_new_tokens)
    mb = pack(samples(), [0, 1, 2, 3], pad_id=0).to(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    totals: dict = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            logp, ent = forward(model, mb, head=head)
            start = Surveyed.of(mb, logp.detach(), ent.detach(), version=0)
            t = Tokens.of(start, logp, ent, start.old, Choices())
            loss, met = objective(t, global_tokens=1000.0, global_seqs=4.0, par_lambda=1.0, generator=gen)
            loss.backward()
            with torch.no_grad():
                accumulate(totals, micro_sums(t, met, start.entropy, mb.row_tokens, mb.num_seqs))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert totals["tokens"].device.type == "cuda" and float(totals["tokens"]) == 2 * float(mb.mask.sum())


@needs_varlen
def test_compiled_layers_reuse_their_graphs_across_packings_on_cuda():
    """The varlen path under `learner.compile_layers` (traced with the eager backend): rows of other lengths and
    packings reuse the first graphs (boundaries as tensors, the longest sample a dynamic int), same numbers."""
    import torch._dynamo

    from learner.trainer import compile_layers

    torch._dynamo.reset()
    plain, compiled = tiny("varlen").eval(), tiny("varlen").eval()
    compile_layers(compiled, backend="eager")
    rows = [pack(samples(), idx, 0).to(torch.device("cuda")) for idx in ([0, 1, 2, 3], [1, 3], [2])]
    with torch.no_grad():
        for i, mb in enumerate(rows):
            got, want = forward(compiled, mb)[0], forward(plain, mb)[0]
            assert float((got - want).abs().max()) < 1e-2
            if i == 0:
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, dict(torch._dynamo.utils.counters["stats"])
    torch._dynamo.reset()


@needs_varlen
def test_the_train_steps_micro_batch_loop_does_not_sync_on_the_new_path():
    """Real train steps (DeepSpeed ZeRO-1, bf16, the built-in model) under CUDA's sync debug mode, by
    tests/integration/learner_step_check.py --cuda: the varlen + fused path's forward, loss, backward and step sums
    cause no sync of covrl's (DeepSpeed's own are counted apart); today's path shows its one per forward
    (transformers' packed-row check), so the watch can see one; both train to the same numbers within bf16."""
    import json
    import os
    import subprocess
    import sys

    from common.transport import free_port

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "tests.integration.learner_step_check", "--cuda"], env=env, cwd=repo,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    old, new = got["sdpa+chunked"], got["varlen+fused"]
    assert new["device_syncs"] == [] and new["loop_reads"] == [] and new["sum_reads"] == [], new
    assert len(old["device_syncs"]) >= old["micro_batches"], old["device_syncs"]
    for a, b in zip(old["metrics"], new["metrics"]):
        for key in ("actor/grad_norm", "actor/entropy", "actor/pg_loss"):
            assert abs(a[key] - b[key]) <= 0.03 * abs(a[key]) + 1e-4, (key, a[key], b[key])
