"""A small byte-level BPE trained offline, so tests and the warm start need no hub.

Invariant: the tokenizer we train with is the tokenizer every reader gets back.
transformers 5 loads the tokenizer of any directory whose config.json says
`model_type: qwen2` as the stock `Qwen2Tokenizer`, ignoring `tokenizer_class`
in tokenizer_config.json, and that class rebuilds its pipeline from the
vocabulary and merges with its own normaliser and pre-tokenizer. A BPE trained
with any other pre-tokenizer silently tokenises differently once the asset is
reloaded (measured: our warm-started model dropped from 28 % to 0 % accuracy).
So we train with exactly Qwen2's pipeline and return a `Qwen2Tokenizer`:
  * NFC normaliser, then Qwen2's split regex, then byte-level with the full
    256-byte alphabet: any NFC text encodes without an unknown token and
    decodes back to itself (non-NFC text comes back NFC-normalised).
  * Every digit is its own token (the regex isolates each \\p{N}): a tiny model
    learns carrying far more easily than with arbitrary multi-digit merges, and
    "Answer:" + "23" tokenises the same jointly or separately.
  * One special token, `<|endoftext|>`, serving as eos and pad. No BOS and no
    template post-processor, so `add_special_tokens=True` adds nothing: prompt
    and response can be tokenised separately and concatenated.
  * Deterministic: same texts in the same order give the same files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

EOS_TOKEN = "<|endoftext|>"
_MIN_VOCAB = 257  # 256 bytes + the special token


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; save it to `out_dir` if given.

    The vocabulary can end up smaller than `vocab_size` when the corpus runs
    out of pairs worth merging (the arith corpus is narrow); callers should
    size embeddings with `len(tokenizer)`, not `vocab_size`.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is below {_MIN_VOCAB}: a byte-level BPE needs all 256 bytes "
            "plus <|endoftext|> so any text round-trips; raise vocab_size"
        )
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(texts), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    # Built the way a reload builds it (from vocab + merges), so memory and disk cannot disagree.
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        tokenizer.save_pretrained(out_dir)
    return tokenizer
