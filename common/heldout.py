"""Evaluation work and metrics, shared by the hub (in-training) and `launch/evaluate.py` (standalone).

Both cut each held-out set into the same chunks, give each prompt the same seed and sampling
parameters, and compute the metrics with the same function, so the two report the same numbers for
the same model, data and seed (tests/integration/test_files_and_evaluate.py).

Per data source: temperature `eval.temperatures[source]` or `eval.temperature`; k samples per prompt
(one when greedy). Metrics: `eval/<source>/acc` = avg@k (share of correct samples, averaged over
prompts), `pass@k` = share of prompts with a correct sample, `response_length` (mean tokens),
`score_failures` (samples whose scoring timed out or failed, scored 0 and counted).
"""

from __future__ import annotations

import numpy as np

from common import messages
from common.config import Config, eval_sampling
from common.data import Prompt
from common.seeds import eval_seed


def eval_params(cfg: Config, data_source: str) -> tuple[messages.SamplingParams, int]:
    """(sampling parameters, samples per prompt) of one eval set."""
    t, k = eval_sampling(cfg, data_source)
    return messages.SamplingParams(temperature=t, top_p=cfg.eval.top_p,
                            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens), k


# The training groups an EvalWork is sized for when the generator did not say its capacity (a hand-written client).
UNKNOWN_CAPACITY_GROUPS = 4


def batch_groups(cfg: Config, capacity: int) -> int:
    """Groups per Work of the batch loop (`generator.loop`, a deterministic run's): rollout.groups_per_request when
    set, else one step's groups (rollout.groups_per_step), at most the engine's `capacity` in groups. The same
    number sizes its evaluation chunks (`eval_room`), so a standalone evaluation (actors/eval_model.py) batches
    the held-out prompts as the run did."""
    return max(1, min(cfg.rollout.groups_per_request or cfg.rollout.groups_per_step, capacity))


def eval_room(cfg: Config, k: int, capacity: int = 0) -> int:
    """Eval prompts per EvalWork: as many sequences as the generator keeps in flight for training (`capacity`
    groups, its request says; else UNKNOWN_CAPACITY_GROUPS)."""
    return max(1, (capacity or UNKNOWN_CAPACITY_GROUPS) * cfg.rollout.group_size // k)


def eval_item(cfg: Config, ticket: int, data_source: str, index: int, prompt: Prompt,
              prompt_ids: bytes) -> messages.WorkItem:
    return messages.WorkItem(ticket=ticket, prompt_id=index, epoch=0, prompt_ids=prompt_ids, answer=prompt.answer,
                      data_source=data_source, seed=eval_seed(cfg.run.seed, data_source, index))


def correct(reward: float) -> bool:
    """A sample counts as solved at full reward (a format-only reward does not)."""
    return reward >= 1.0


def eval_metrics(results: dict[str, list[messages.EvalResult]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ds, res in sorted(results.items()):
        if not res:
            continue
        solved = [[correct(r) for r in x.rewards] for x in res]
        out[f"eval/{ds}/acc"] = float(np.mean([np.mean(s) for s in solved]))
        out[f"eval/{ds}/pass@k"] = float(np.mean([any(s) for s in solved]))
        out[f"eval/{ds}/response_length"] = float(np.mean([np.mean(x.lengths) for x in res]))
        out[f"eval/{ds}/score_failures"] = float(sum(st != "ok" for x in res for st in x.score_status))
        measured = [x for x in res if x.entropies]
        if measured and len(measured) == len(res):  # on-policy entropy: every sample's, under its own version
            tokens = sum(sum(x.lengths) for x in res)
            out[f"eval/{ds}/entropy"] = sum(sum(x.entropies) for x in res) / max(tokens, 1)
            out[f"eval/{ds}/entropy_per_response"] = float(np.mean([e for x in res for e in x.entropies]))
    return out
