import numpy as np
import torch
from torch.testing import assert_close

from broker.rules import scores
from common import messages
from learner import advantages
from learner import batch
from tests.helpers.groups import rollout_group, sample


def _group(prompt, responses, rewards, version=0):
    return rollout_group([sample(r, w, versions=version) for r, w in zip(responses, rewards)], prompt=prompt)


def test_grpo_advantages_hand_computed():
    # rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.866025
    adv = advantages.grpo(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    np.testing.assert_allclose(adv[0], [0.866025, -0.866025, -0.866025, 0.866025], rtol=1e-5)
    np.testing.assert_allclose(adv[1], [0.0, 0.0, 0.0, 0.0])  # no spread, no signal


def test_plan_balances_tokens_and_aligns_micro_batch_counts():
    rng = np.random.default_rng(0)
    groups = [_group([1, 2, 3], [list(rng.integers(3, 50, size=rng.integers(1, 40))) for _ in range(4)], [1, 0, 1, 0])
              for _ in range(6)]
    b = batch.build_step_batch(groups, scores(groups), version=3, ranks=4, mini_batches=2, micro_batch_tokens=64)
    assert len(b.plan) == 2 and all(len(per_rank) == 4 for per_rank in b.plan)
    for per_rank in b.plan:
        assert len({len(micro) for micro in per_rank}) == 1  # same depth on every rank
        seen = sorted(i for micro in per_rank for mb in micro for i in mb)
        assert len(seen) == len(set(seen)) == 12  # 3 groups x 4 samples per mini-batch, each once
    lengths = [len(s.input_ids) // 4 for s in b.samples]
    loads = [sum(lengths[i] for mb in micro for i in mb) for micro in b.plan[0]]
    assert max(loads) - min(loads) <= max(lengths)  # LPT greedy bound
    for micro in b.plan[0]:
        for mb in micro:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 64
    assert b.mini_tokens[0] == sum(len(b.samples[i].versions) // 4 for micro in b.plan[0] for mb in micro for i in mb)
    assert batch.decode(batch.encode(b)) == b


def test_pack_aligns_targets_with_response_tokens(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    groups = [_group([5, 6, 7], [[8, 9], [10, 11, 12]], [1, 0]), _group([13, 14], [[15, 16, 17, 18], [19]], [0, 1])]
    b = batch.build_step_batch(groups, scores(groups), version=0, ranks=1, mini_batches=1, micro_batch_tokens=1000)
    mb = batch.pack(b.samples, [0, 1, 2, 3], pad_id=0)
    assert mb.mask.sum().item() == 2 + 3 + 4 + 1
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits[:, :-1]
        packed = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None])[..., 0][mb.mask > 0]
        # The same log-probs one sequence at a time, unpacked:
        ref = []
        for s in b.samples:
            ids = torch.from_numpy(messages.as_array(s.input_ids, messages.TOKEN_DTYPE).astype(np.int64))[None]
            lp = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[0, :, 0]
            ref.append(lp[s.prompt_len - 1 :])
    assert_close(packed, torch.cat(ref), rtol=1e-5, atol=1e-5)
    adv = mb.adv[mb.mask > 0]
    assert_close(adv[:2], torch.full((2,), 0.7071057))  # group 0: rewards [1, 0] -> +-1/sqrt(2)
    empty = batch.pack(b.samples, [], pad_id=0)
    assert empty.mask.numel() == 0 and empty.input_ids.shape == (1, 1) and empty.num_seqs == 0
