"""The evaluation schedule after a cut wait (broker/evals.py): once a version's scores are taken, what is still owed
for it is dropped, so a late result is refused as an unknown ticket (it used to raise KeyError in the hub thread)
and nothing of it is served after the next version is published."""

import itertools

from broker.evals import EvalSchedule
from common import messages
from common.config import load_config
from common.data import Prompt


def test_taking_a_versions_scores_drops_what_is_still_owed_for_it():
    cfg = load_config(None, ["eval.every_steps=2", "run.steps=4"])
    prompts = {"src": [Prompt(f"p{i}", "1", "src", (1, 2, 3)) for i in range(6)]}
    ev = EvalSchedule(cfg, prompts)
    ev.schedule(2)
    tickets = itertools.count()
    work = ev.serve(0, "a", lambda: next(tickets), capacity=1)
    assert work is not None and work.policy_version == 2 and ev.busy_through(2)
    ev.take(2)  # the learner's wait was cut short (a stop, a deadline): version 3 is published next
    assert not ev.busy_through(2) and ev.serve(0, "a", lambda: next(tickets)) is None
    it = work.items[0]
    late = messages.EvalResult(gen_id=0, incarnation="a", ticket=it.ticket, policy_version=2, rewards=[1.0],
                               lengths=[3], score_status=["ok"])
    assert ev.accept(late) == "unknown_ticket"
