"""The held-out evaluation schedule: which eval prompts are owed at which version, and their scores.

At each evaluated version v (`common.config.eval_versions`) every held-out prompt is queued; the hub serves
queued eval prompts before training work, and does not let the learner publish v + 1 until all of them are
scored (`busy_through(v)` is false), so every eval sample comes from exactly version v. A result is accepted
only for a ticket in flight for that generator incarnation; a lost generator's eval tickets are queued again.
Called with the hub's lock held.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

from common import messages
from common.config import Config, eval_versions
from common.data import Prompt
from common.heldout import eval_item, eval_metrics, eval_params, eval_room


@dataclass
class EvalTicket:
    ticket: int
    version: int
    data_source: str
    index: int
    gen_id: int
    incarnation: str


class EvalSchedule:
    def __init__(self, cfg: Config, prompts: dict[str, list[Prompt]] | None):
        self.cfg = cfg
        self.prompts = prompts or {}
        self.versions = set(eval_versions(cfg)) if self.prompts else set()
        self.pending: collections.deque[tuple[int, str, int]] = collections.deque()  # (version, source, index)
        self.in_flight: dict[int, EvalTicket] = {}
        self.scores: dict[int, dict[str, list[messages.EvalResult]]] = {}
        self.texts: dict[int, list[tuple[str, int, messages.EvalResult]]] = {}  # version -> (source, prompt, result)

    def schedule(self, version: int) -> None:
        """Queue every held-out prompt for `version` if it is an evaluated version not yet queued."""
        if version not in self.versions or version in self.scores:
            return
        self.scores[version] = {ds: [] for ds in self.prompts}
        for ds, prompts in self.prompts.items():
            self.pending.extend((version, ds, i) for i in range(len(prompts)))

    def restart(self, version: int) -> None:
        """After a resume: whatever was owed is forgotten, and `version`'s evaluation (if any) is owed again."""
        self.pending.clear()
        self.in_flight.clear()
        self.scores.clear()
        self.texts.clear()
        self.schedule(version)

    def busy_through(self, version: int) -> bool:
        """Some eval prompt of a version <= `version` is still queued or in flight."""
        return (any(v <= version for v, _, _ in self.pending)
                or any(t.version <= version for t in self.in_flight.values()))

    def serve(self, gen_id: int, incarnation: str, new_ticket: Callable[[], int],
              capacity: int = 0) -> messages.EvalWork | None:
        """The next chunk of one data source's queued prompts for this generator, or None if none are queued.
        `capacity`: the training groups the generator keeps in flight (its request says; 0: unknown)."""
        if not self.pending:
            return None
        version, ds, _ = self.pending[0]
        sampling, k = eval_params(self.cfg, ds)
        room = eval_room(self.cfg, k, capacity)
        items = []
        while self.pending and len(items) < room and self.pending[0][:2] == (version, ds):
            _, _, i = self.pending.popleft()
            t = EvalTicket(new_ticket(), version, ds, i, gen_id, incarnation)
            self.in_flight[t.ticket] = t
            p = self.prompts[ds][i]
            items.append(eval_item(self.cfg, t.ticket, ds, i, p, messages.to_bytes(p.ids, messages.TOKEN_DTYPE)))
        return messages.EvalWork(items=items, k=k, sampling=sampling, policy_version=version,
                          keep_texts=self.cfg.logging.eval_samples)

    def accept(self, res: messages.EvalResult) -> str | None:
        """Record a result; or the reason it was refused ("unknown_ticket", or `check_eval`'s, then re-queued)."""
        t = self.in_flight.get(res.ticket)
        if t is None or t.gen_id != res.gen_id or t.incarnation != res.incarnation:
            return "unknown_ticket"
        del self.in_flight[res.ticket]
        sampling, k = eval_params(self.cfg, t.data_source)
        reason = messages.check_eval(res, k=k, version=t.version, max_tokens=sampling.max_new_tokens)
        if reason is not None:
            self.pending.appendleft((t.version, t.data_source, t.index))
            return reason
        self.scores[t.version][t.data_source].append(res)
        if res.texts:
            self.texts.setdefault(t.version, []).append((t.data_source, t.index, res))
        return None

    def holds(self, gen_id: int) -> bool:
        """This generator has eval prompts in flight (a draining generator is stopped only once it has none)."""
        return any(e.gen_id == gen_id for e in self.in_flight.values())

    def versions_held(self) -> dict[int, int]:
        """gen_id -> the newest version among the eval prompts it holds (the weights it needs to answer them)."""
        out: dict[int, int] = {}
        for e in self.in_flight.values():
            out[e.gen_id] = max(out.get(e.gen_id, -1), e.version)
        return out

    def requeue(self, gen_id: int) -> int:
        """A generator is gone: its eval prompts go back to the front of the queue. Returns how many."""
        lost = [tid for tid, e in self.in_flight.items() if e.gen_id == gen_id]
        for tid in lost:
            e = self.in_flight.pop(tid)
            self.pending.appendleft((e.version, e.data_source, e.index))
        return len(lost)

    def take(self, version: int) -> tuple[dict[str, float], list[tuple[str, int, messages.EvalResult]]]:
        """The eval metrics of `version` (empty if it was not evaluated) and the results that carry response texts
        as (data source, prompt index, result) in source and prompt order; forgotten once taken. Whatever is still
        owed for versions <= `version` is dropped with them (a stop or a deadline cut the learner's wait short, and
        the next version is published next): never served again, and a late result is an unknown ticket."""
        self.pending = collections.deque(p for p in self.pending if p[0] > version)
        for tid in [tid for tid, e in self.in_flight.items() if e.version <= version]:
            del self.in_flight[tid]
        return eval_metrics(self.scores.pop(version, {})), sorted(self.texts.pop(version, []), key=lambda x: x[:2])
