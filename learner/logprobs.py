"""Token log-probabilities and full-vocabulary entropy without materialising [tokens x vocab] logits.

A 152k vocabulary makes the logits of 8k tokens 5 GB in fp32, and softmax
intermediates several times that. We run the LM head over `chunk` tokens at a
time under activation checkpointing: the forward keeps only the per-token
outputs ([N] logp, [N] entropy), and the backward recomputes one chunk's logits
at a time. Peak memory is then a few chunks of logits instead of all of them;
the values are the same as the naive computation (tested).

The head is called as a module (not by reading its weight), so ZeRO-3's
parameter-gathering hooks still fire per call.

`install_token_forward` makes this the forward of the learner's model itself, so the trainer calls the
root module: DeepSpeed hooks the root's forward (ZeRO-3 resets its parameter-fetch trace there at the
start of every forward; without it the trace never completes and nothing is prefetched).
"""

from __future__ import annotations

import types

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = head(hidden).float() / temperature  # [c, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def logprobs_and_entropy(
    head: torch.nn.Module,
    hidden: torch.Tensor,  # [N, H] final hidden states
    targets: torch.Tensor,  # [N] token ids to score
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] log pi(target), [N] entropy), both differentiable w.r.t. hidden and the head."""
    logps, ents = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if grad:
            lp, en = checkpoint(_chunk_stats, head, h, t, temperature, use_reentrant=False)
        else:
            lp, en = _chunk_stats(head, h, t, temperature)
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


def naive_logprobs_and_entropy(head, hidden, targets, *, temperature: float = 1.0):
    """The reference: all logits at once (what chunking must reproduce)."""
    return _chunk_stats(head, hidden, targets, temperature)


def _token_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, *,
                   temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, targets [1, N] (one packed row) -> ([1, N-1] log pi(target), [1, N-1] entropy)."""
    hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    logp, ent = logprobs_and_entropy(self.lm_head, hidden[0, :-1], targets[0], temperature=temperature, chunk=chunk)
    return logp[None], ent[None]


def install_token_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Give a Hugging Face causal LM (`.model` body, `.lm_head`) the learner's forward as its own:
    `model(input_ids=, position_ids=, targets=, temperature=, chunk=)` -> (log pi(target), entropy), with the head
    in chunks. An instance attribute: the class's forward is untouched for every other model. Calling the root
    module (not `model.model` and `model.lm_head` one by one) is what lets DeepSpeed's root hooks run."""
    model.forward = types.MethodType(_token_forward, model)
    return model
