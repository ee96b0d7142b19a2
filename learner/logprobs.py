"""Token log-probabilities and full-vocabulary entropy without materialising [tokens x vocab] logits.

A 152k vocabulary makes the logits of 8k tokens 5 GB in fp32, and softmax
intermediates several times that. Two ways through the LM head, picked once at setup (`install_token_forward`,
`learner.logprob_head` through `resolve_head`), equal to rounding (tests/unit/test_fused_head.py):

- "chunked" (`logprobs_and_entropy`): the head over `chunk` tokens at a time under activation checkpointing,
  by autograd: the forward keeps only the per-token outputs ([N] logp, [N] entropy), and the backward recomputes
  one chunk's logits at a time. Peak memory is then a few chunks of logits instead of all of them; the values are
  the same as the naive computation (tested). The head is called as a module once per chunk (not by reading its
  weight), so ZeRO-3's parameter-gathering hooks still fire per call. The CPU recordings were made with it.
- "fused" (`learner/fused_head.py`): one autograd op per micro-batch that forms d logits directly from one
  recompute per chunk; the lm_head module is called once per micro-batch (its forward replaced on the instance),
  so ZeRO-3 gathers the head's weight once for the forward and once for the backward.
- "triton" and "inductor": the same op, its passes over a chunk's logits done by Triton kernels or by inductor's
  fused reductions instead of eager fp32 torch ops (learner/head_kernels.py): one read of the model-dtype logits
  forward, one read and one write backward.

`install_token_forward` makes this the forward of the learner's model itself, so the trainer calls the
root module: DeepSpeed hooks the root's forward (ZeRO-3 resets its parameter-fetch trace there at the
start of every forward; without it the trace never completes and nothing is prefetched).
"""

from __future__ import annotations

import types

import torch
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from common.config import triton_refusal
from learner.fused_head import PROFILE_LABEL, fused_logprobs_and_entropy
from learner.head_kernels import KERNELS

HEADS = ("chunked", *KERNELS)  # chunked, fused, triton, inductor


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
    """([N] log pi(target), [N] entropy), both differentiable w.r.t. hidden and the head. Under the profiler's
    `covrl/head` range, as the fused head is: the learner stage's time split compares the two."""
    with record_function(PROFILE_LABEL):
        return _chunked(head, hidden, targets, temperature, chunk)


def _chunked(head, hidden, targets, temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def resolve_head(choice: str, cuda: bool) -> str:
    """`learner.logprob_head` -> the head `install_token_forward` takes: "auto" is fused on CUDA, chunked elsewhere
    (the CPU recordings were made with the chunked head). "auto" stays "fused" on CUDA until the GPU proof's learner
    stage has measured "triton" and "inductor" beside it (docs/gpu.md, Pending). ValueError in one line for a head
    that cannot run here (triton without CUDA or its interpreter)."""
    if choice == "auto":
        return "fused" if cuda else "chunked"
    if choice not in HEADS:
        raise ValueError(f"learner.logprob_head = {choice!r}: it must be \"auto\" or one of {HEADS}")
    if choice == "triton" and (why := triton_refusal(cuda)):
        raise ValueError(why)
    return choice


def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
    """[1, N] one packed row -> [N-1, H] final hidden states of the positions that predict a target."""
    out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attn_kwargs)
    return out.last_hidden_state[0, :-1]


def _token_forward_chunked(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float, chunk: int, **attn_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, targets [1, N] (one packed row) -> ([1, N-1] log pi(target), [1, N-1] entropy).
    `attn_kwargs` go to the body (`self.model`) as they are."""
    hidden = _hidden(self, input_ids, position_ids, attn_kwargs)
    logp, ent = logprobs_and_entropy(self.lm_head, hidden, targets[0], temperature=temperature, chunk=chunk)
    return logp[None], ent[None]


def _token_forward_fused(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, *,
                         temperature: float, chunk: int, **attn_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """As `_token_forward_chunked`, the head being one `self.lm_head` call (`_fused_head_forward`)."""
    hidden = _hidden(self, input_ids, position_ids, attn_kwargs)
    logp, ent = self.lm_head(hidden, targets[0], temperature=temperature, chunk=chunk)
    return logp[None], ent[None]


def _fused_head_forward(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lm_head's forward under head="fused": [N, H] hidden, [N] targets -> ([N] log pi(target), [N] entropy).
    Reads its own weight inside the module call, where ZeRO-3's hooks have gathered it."""
    return fused_logprobs_and_entropy(hidden, self.weight, self.bias, targets, temperature=temperature, chunk=chunk,
                                      kernels=self.covrl_head_kernels)


_TOKEN_FORWARDS = {"chunked": _token_forward_chunked, **dict.fromkeys(KERNELS, _token_forward_fused)}


def install_token_forward(model: torch.nn.Module, head: str = "chunked") -> torch.nn.Module:
    """Give a Hugging Face causal LM (`.model` body, `.lm_head` a Linear) the learner's forward as its own:
    `model(input_ids=, position_ids=, targets=, temperature=, chunk=, **attn_kwargs)` -> (log pi(target), entropy),
    extra keyword arguments passed to the body. `head`: "chunked" (the head in chunks, by autograd) or "fused",
    "triton", "inductor" (`learner/fused_head.py` with those kernels; the lm_head's own forward becomes (hidden,
    targets, temperature, chunk) -> (logp, entropy), so the head is one module call per micro-batch). Instance attributes: the classes' forwards
    are untouched for every other model. Calling the root module (not `model.model` and `model.lm_head` one by
    one) is what lets DeepSpeed's root hooks run."""
    if head not in _TOKEN_FORWARDS:
        raise ValueError(f"head={head!r}: install_token_forward takes one of {HEADS}; "
                         "resolve learner.logprob_head = \"auto\" with resolve_head(choice, cuda) first")
    model.forward = types.MethodType(_TOKEN_FORWARDS[head], model)
    if head in KERNELS:
        model.lm_head.forward = types.MethodType(_fused_head_forward, model.lm_head)
        model.lm_head.covrl_head_kernels = head
    else:
        model.lm_head.__dict__.pop("forward", None)  # the chunked path calls the head as the plain Linear
        model.lm_head.__dict__.pop("covrl_head_kernels", None)
    return model
