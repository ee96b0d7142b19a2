"""The rollout broker: which prompt goes out, to whom, and which scored groups get trained.

It runs as a thread of learner rank 0 but is its own component, with its own files:
- `rules.py`: the one rule set that decides which groups are trained and with what reward (admission,
  staleness, dynamic sampling, overlong shaping), every knob from the run config;
- `evals.py`: the held-out evaluation schedule (which prompts at which version, their scores);
- `state.py`: what a resumed broker needs, as a msgpack struct saved in every checkpoint;
- `hub.py`: the `Hub` itself, the ZeroMQ loop that talks to the generators, and its locked API for the trainer.

It imports `common` only; the learner imports it, never the other way round.
"""
