"""The TRL peer of the peer comparison: TRL's GRPOTrainer on covrl's built-in `arith` task, same model and reward.

Runs in the bench-only environment `.venv-bench` (TRL is not a covrl dependency; `make bench-env` builds it):
    .venv-bench/bin/python tests/bench/trl_peer.py --steps 24 --out /tmp/trl.json
and writes one JSON object: versions, the wall time at the end of every step, the reward per step, and the settings.

What is kept the same as `launch/cluster.py --gens 1 --learners 1` with covrl's defaults:
- model and tokenizer: assets/arith-base (local directory, offline);
- prompts: covrl's `PromptSource` (common/data.py) in the hub's order for epoch 0, so step s trains on the same
  16 prompts in both systems; rendered by common/templates.py;
- reward: `common.rewards.score` (last \\boxed{} vs the ground truth, integers compared exactly), called from a
  TRL reward function;
- GRPO: group size 8, 16 prompts per step (128 samples), one optimizer step per batch, up to 64 new tokens,
  temperature 1, top-p 1, advantages normalised by the group's std, token-mean loss over the batch (TRL "dapo"),
  clip 0.2 / 0.28, no KL term, AdamW lr 1e-4 (betas 0.9 / 0.999, eps 1e-8, no weight decay, constant schedule),
  gradient clipping 1.0, seed 0.
What differs (TRL's design, not a setting): one process generates (transformers `generate`, one padded batch of
128) and then trains, synchronously, in one process, so it can use the two cores only as torch threads
(`--threads`; test_bench_trl.py runs 1 and 2 and compares the faster: 2 on an idle machine, while with other work
beside it 2 threads made each step 2-5x slower for this 1 M-parameter model). TRL does no dynamic sampling, so covrl runs with it off for this comparison. covrl trains one step off-policy
(max_staleness_steps 1) with its truncated importance weights and dual-clip (c = 3); TRL is on-policy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

T_START = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--groups-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the single TRL process")
    ap.add_argument("--out", required=True, help="JSON file to write the measurements to")
    ap.add_argument("--model", default=os.path.join(REPO, "assets", "arith-base"), help="model directory")
    ap.add_argument("--forced-length-median", type=int, default=0,
                    help="the generation-heavy workload: impose covrl's forced lengths (rollout.forced_length_median)")
    ap.add_argument("--forced-length-sigma", type=float, default=1.0)
    return ap.parse_args(argv)


def arith_dataset(tokenizer, n_prompts: int, seed: int):
    """covrl's first n training prompts in the hub's epoch-0 order, with their answers."""
    from datasets import Dataset

    from common.config import load_config
    from common.data import PromptSource

    source = PromptSource(load_config(None, [f"run.seed={seed}"]), tokenizer)
    order = source.order(0)[:n_prompts]
    return Dataset.from_list([{"prompt": source[i].text, "answer": source[i].answer} for i in order])


def arith_reward(prompts, completions, answer, **_):
    """TRL reward function over covrl's verifier: 1.0 for a correct last \\boxed{} answer, else 0.0."""
    from common.rewards import score

    return [score(c, a) for c, a in zip(completions, answer)]


def force_lengths(model, tokenizer, args) -> None:
    """The generation-heavy workload on TRL's side: every `model.generate` call TRL makes (one per step, 16 prompts
    x 8 rows, prompt-major) gets a logits processor imposing the very lengths covrl's torch engine imposes on the
    same rows: `actors.engine.forced_lengths` of the same row seeds (the hub's prompt seeds, sample index j). The
    stop token is withheld before a row's length and forced there, as in covrl."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from actors.engine import forced_lengths, row_seeds
    from common.config import load_config
    from common.data import PromptSource
    from common.seeds import prompt_seed

    order = PromptSource(load_config(None, [f"run.seed={args.seed}"]), tokenizer).order(0)
    eos = tokenizer.eos_token_id
    calls = [0]

    class Forced(LogitsProcessor):
        def __init__(self, lengths: torch.Tensor, start: int):
            self.lengths, self.start = lengths, start

        def __call__(self, input_ids, scores):
            t = input_ids.shape[1] - self.start  # tokens generated so far in every row
            scores[t + 1 < self.lengths, eos] = -float("inf")
            force = t + 1 == self.lengths
            scores[force] = -float("inf")
            scores[force, eos] = 0.0
            return scores

    plain = model.generate

    def generate(*a, **k):
        step = calls[0]
        calls[0] += 1
        pids = order[step * args.groups_per_step:(step + 1) * args.groups_per_step]
        seeds = row_seeds([prompt_seed(args.seed, 0, p) for p in pids], args.group_size)
        lengths = forced_lengths(seeds, args.forced_length_median, args.forced_length_sigma, args.max_new_tokens)
        if len(lengths) != k["input_ids"].shape[0]:
            raise SystemExit(f"TRL generated {k['input_ids'].shape[0]} rows at once, expected {len(lengths)}")
        return plain(*a, logits_processor=LogitsProcessorList([Forced(lengths, k["input_ids"].shape[1])]), **k)

    model.generate = generate


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_path = args.model
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = args.groups_per_step * args.group_size
    dataset = arith_dataset(tokenizer, args.steps * args.groups_per_step, args.seed)
    if args.forced_length_median:
        force_lengths(model, tokenizer, args)

    class Clock(TrainerCallback):
        """Wall time at the start of training and at the end of each optimizer step; every logged row."""

        def __init__(self):
            self.train_begin, self.step_end, self.logs = None, [], []

        def on_train_begin(self, *a, **k):
            self.train_begin = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_end.append(time.perf_counter())

        def on_log(self, _args, state, _control, logs=None, **k):
            if logs and "reward" in logs:
                self.logs.append({"step": state.global_step, **{key: float(v) for key, v in logs.items()
                                                                if isinstance(v, (int, float))}})

    clock = Clock()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=False, fp16=False,
            per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            num_generations=args.group_size, max_completion_length=args.max_new_tokens,
            temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
            beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
            logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[arith_reward], args=config,
                              train_dataset=dataset, callbacks=[clock])
        trainer.train()
    if len(clock.step_end) != args.steps or len(clock.logs) != args.steps:
        raise SystemExit(f"TRL ran {len(clock.step_end)} steps and logged {len(clock.logs)} rewards; expected {args.steps} "
                         f"of each (did the dataset run out? it holds {len(dataset)} prompts)")
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "threads": args.threads, "samples_per_step": batch, "steps": args.steps,
        "startup_s": clock.train_begin - T_START,
        "step_end_s": [t - clock.train_begin for t in clock.step_end],
        "reward": [row["reward"] for row in clock.logs],
        "completion_length": [row.get("completions/mean_length", float("nan")) for row in clock.logs],
        "entropy": [row.get("entropy", float("nan")) for row in clock.logs],
        "wall_s": time.perf_counter() - T_START,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"trl_peer: {args.steps} steps, reward first {result['reward'][0]:.3f} last {result['reward'][-1]:.3f}, "
          f"{result['step_end_s'][-1]:.1f}s of training after {result['startup_s']:.1f}s start-up -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
