"""Rollout groups (common/messages.py) as a generator sends them, built for tests: `sample` and `rollout_group`."""

from __future__ import annotations

import numpy as np

from common import messages


def sample(tokens, reward=1.0, logprobs=-0.5, versions=0, finish_reason="stop", score_status="ok") -> messages.Sample:
    """One scored response of token ids `tokens`. `logprobs` and `versions` are one value for every token or one per
    token, taken as given (a hostile-input test sends lengths that disagree with the tokens')."""
    def per_token(v):
        return np.full(len(tokens), v) if np.ndim(v) == 0 else v

    return messages.Sample(token_ids=messages.to_bytes(tokens, messages.TOKEN_DTYPE),
                           logprobs=messages.to_bytes(per_token(logprobs), messages.LOGPROB_DTYPE),
                           versions=messages.to_bytes(per_token(versions), messages.VERSION_DTYPE),
                           reward=float(reward), finish_reason=finish_reason, score_status=score_status)


def rollout_group(samples: list[messages.Sample], *, item: messages.WorkItem | None = None, prompt=(1, 2),
                  gen_id: int = 0, incarnation: str = "x", ticket: int = 0, prompt_id: int = 0, epoch: int = 0,
                  gen_time_s: float = 0.0) -> messages.RolloutGroup:
    """A generator's group of `samples`: its answer to the hub's work `item` (whose ticket, prompt id, epoch and
    prompt tokens it carries), or without one a group for the prompt token ids `prompt` with the ids given."""
    if item is not None:
        ticket, prompt_id, epoch, prompt_ids = item.ticket, item.prompt_id, item.epoch, item.prompt_ids
    else:
        prompt_ids = messages.to_bytes(prompt, messages.TOKEN_DTYPE)
    return messages.RolloutGroup(gen_id=gen_id, incarnation=incarnation, ticket=ticket, prompt_id=prompt_id,
                                 epoch=epoch, prompt_ids=prompt_ids, samples=samples, gen_time_s=gen_time_s)
