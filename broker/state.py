"""What a resumed broker needs: saved as msgpack in every checkpoint (`hub.msgpack`, learner/checkpoint.py)."""

from __future__ import annotations

import msgspec

from common import messages


class ReadyState(msgspec.Struct, frozen=True):
    slot: int
    issue_version: int  # the policy version its slot was issued at; the name checkpoints already carry
    group: messages.RolloutGroup


class HubState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    slots: int
    filtered: int
    filtered_this_step: int
    epoch: int
    pos: int
    n_trained: int
    settled_floor: int
    settled: list[int]
    counters: dict[str, float]
    ready: list[ReadyState]  # generated, not yet trained: kept, so a resume trains on the very same rollouts
    pending: list[tuple[int, int, int]]  # (slot, prompt_id, epoch) in flight or waiting: re-issued on resume


def encode(state: HubState) -> bytes:
    return msgspec.msgpack.encode(state)


def decode(blob: bytes) -> HubState:
    return msgspec.msgpack.decode(blob, type=HubState)
