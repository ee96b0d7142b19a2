"""Readable rollouts: what the model generated, as text, next to what the learner made of it.

Learner rank 0 writes, per step, `RUN_DIR/rollouts/step_N.jsonl` (`logging.rollouts`: "all" groups, or a "sample"
of `logging.rollout_groups` groups picked by a draw seeded with the run's seed and the step), one record per
response:

    step, policy_version (the learner version the step trains from), group, generator, prompt_id, epoch,
    data_source, prompt, ground_truth, sample, response, reward (the verifier's score), answer (what the reward's
    extractor read from the response, null if none), advantage, length (tokens), finish_reason, score_status,
    token_versions (the policy versions its tokens were sampled with), staleness (policy_version - the oldest)

and, per evaluated version, `RUN_DIR/rollouts/eval_step_N.jsonl` with the k responses to the first
`logging.eval_samples` prompts of each data source (step, policy_version, data_source, prompt_id, prompt,
ground_truth, sample, response, reward, answer, length, score_status). The first `logging.text_samples` records
of each file also go to TensorBoard (and W&B) as text, tags `rollouts/train` and `rollouts/eval`. A resumed run
writes the files of the steps it trains again over the old ones.
"""

from __future__ import annotations

import json
import os
import random

from common import messages
from common.config import Config
from common.rewards import extract_answer


class RolloutLog:
    def __init__(self, cfg: Config, run_dir: str, tokenizer, prompts, eval_prompts: dict | None, sink):
        self.cfg, self.log = cfg, cfg.logging
        self.dir = os.path.join(run_dir, "rollouts")
        self.tokenizer, self.prompts, self.eval_prompts, self.sink = tokenizer, prompts, eval_prompts or {}, sink

    def _text(self, token_ids: bytes) -> str:
        return self.tokenizer.decode(messages.as_array(token_ids, messages.TOKEN_DTYPE).tolist(), skip_special_tokens=True)

    def _picked(self, step: int, n: int) -> list[int]:
        if self.log.rollouts == "all" or n <= self.log.rollout_groups:
            return list(range(n))
        return sorted(random.Random(self.cfg.run.seed * 1_000_003 + step).sample(range(n), self.log.rollout_groups))

    def train(self, step: int, groups: list[messages.RolloutGroup], advantages: list[float]) -> None:
        """The step's groups (in batch order) and each response's advantage (same order, flattened)."""
        if self.log.rollouts == "off" or not groups:
            return
        version = step - 1
        starts = [0]
        for g in groups:
            starts.append(starts[-1] + len(g.samples))
        records = []
        for gi in self._picked(step, len(groups)):
            g = groups[gi]
            p = self.prompts[g.prompt_id]
            for si, s in enumerate(g.samples):
                text = self._text(s.token_ids)
                versions = sorted({int(v) for v in messages.as_array(s.versions, messages.VERSION_DTYPE)})
                records.append({
                    "step": step, "policy_version": version, "group": gi, "generator": g.gen_id,
                    "prompt_id": g.prompt_id, "epoch": g.epoch, "data_source": p.data_source, "prompt": p.text,
                    "ground_truth": p.answer, "sample": si, "response": text, "reward": s.reward,
                    "answer": extract_answer(text, self.cfg.reward.extract), "advantage": advantages[starts[gi] + si],
                    "length": messages.n_tokens(s.token_ids), "finish_reason": s.finish_reason,
                    "score_status": s.score_status, "token_versions": versions,
                    "staleness": version - versions[0] if versions else 0,
                })
        self._write(f"step_{step}.jsonl", records, "rollouts/train", step)

    def evaluated(self, version: int, results: list[tuple[str, int, messages.EvalResult]]) -> None:
        """Eval results that carry texts, as (data source, prompt index, result) (`Hub.take_eval`)."""
        records = []
        for ds, index, res in results:
            p = self.eval_prompts[ds][index]
            for j, text in enumerate(res.texts):
                records.append({
                    "step": version, "policy_version": res.policy_version, "data_source": ds, "prompt_id": index,
                    "prompt": p.text, "ground_truth": p.answer, "sample": j, "response": text,
                    "reward": res.rewards[j], "answer": extract_answer(text, self.cfg.reward.extract),
                    "length": res.lengths[j], "score_status": res.score_status[j],
                })
        if records:
            self._write(f"eval_step_{version}.jsonl", records, "rollouts/eval", version)

    def _write(self, name: str, records: list[dict], tag: str, step: int) -> None:
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, name)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        os.replace(path + ".tmp", path)
        shown = records[:self.log.text_samples]
        if shown:
            self.sink.text(tag, "\n\n---\n\n".join(_markdown(r) for r in shown), step)


def _markdown(r: dict) -> str:
    head = f"**{r['data_source']}** prompt {r['prompt_id']}, sample {r['sample']}: reward {r['reward']:g}"
    if "advantage" in r:
        head += f", advantage {r['advantage']:+.3f}, staleness {r['staleness']}"
    return (f"{head}, answer `{r['answer']}` (ground truth `{r['ground_truth']}`), {r['length']} tokens\n\n"
            f"```\n{r['prompt']}\n```\n\n```\n{r['response']}\n```")
