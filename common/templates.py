"""The one prompt template every role uses.

Invariant: the response is whatever the model writes *after* `render_prompt(q)`,
and the prompt and the response are tokenised separately and concatenated
(`tok(prompt).input_ids + tok(response).input_ids`). Warm-start SFT, RL
generation and evaluation must all render prompts here so the token boundary
the base model was trained on is the one it is sampled from.

The template is a plain completion prompt, not a chat template: the base model
is tiny, its context is 256 tokens, and it has never seen chat markup.
"""

from __future__ import annotations

BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."



def render_prompt(question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """Return the completion prompt for `question`; the model's answer follows it.

    `instruction` (the answer-format request) goes on its own line; an empty one is left out.
    """
    middle = f"\n{instruction}" if instruction else ""
    return f"Question: {question}{middle}\nAnswer:"
