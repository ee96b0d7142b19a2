"""`Hooks`: a stand-in for learner rank 0's GeneratorHooks (broker/hooks.py), for a hub run without a learner."""

from broker.hooks import GeneratorHooks


class Hooks(GeneratorHooks):
    """A stand-in for learner rank 0's `GeneratorHooks`: each event is handed to its callable, if one is given."""

    def __init__(self, join=None, leave=None, lost=None):
        self.on = {"join": join, "leave": leave, "lost": lost}

    def join(self, gen_id, incarnation):
        self._tell("join", gen_id, incarnation)

    def leave(self, gen_id, incarnation):
        self._tell("leave", gen_id, incarnation)

    def lost(self, gen_id, incarnation, pid, why, detail):
        self._tell("lost", gen_id, incarnation, pid, why, detail)

    def _tell(self, event, *args):
        if self.on[event] is not None:
            self.on[event](*args)
