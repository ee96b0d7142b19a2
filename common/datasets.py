"""Prompts from local files in the common RL layout, for training and evaluation.

One row per problem (the verl / DAPO / PRIME layout):

    prompt                     chat messages [{"role": "user", "content": "..."}, ...] or a plain string
    reward_model.ground_truth  the reference answer (or a top-level `answer`); a string or a number
    data_source                tag of per-source eval metrics (optional: defaults to the file's stem)

Files are `.jsonl` (one JSON object per line) or `.parquet`, read row by row (parquet in record
batches), so memory holds the parsed records, never a whole decoded table. A row that does not fit
the layout stops the load with a `DatasetError` naming the file, the row (0-based, blank jsonl lines
counted) and the field, before anything trains.

Rendering (`render_prompt_text`): with the chat template of the tokenizer (`template = "chat"`, or
`"auto"` when the tokenizer has one) or the plain completion template of `common.templates` (base
models). The answer instruction (`\\boxed{}`) is added to plain-string prompts only: chat-message
prompts are used as the dataset wrote them, since datasets such as DAPO-Math-17k already carry their
own instruction. `fit_prompt` applies the length limit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Template = Literal["auto", "chat", "plain"]
Truncation = Literal["drop", "left", "error"]


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names file, row and field."""


@dataclass(frozen=True)
class Record:
    """One problem. Exactly one of `messages` (role, content pairs) and `text` is set."""

    messages: tuple[tuple[str, str], ...] | None
    text: str | None
    answer: str
    data_source: str


def iter_rows(path: str) -> Iterator[tuple[int, dict]]:
    """(row index, row) of a .jsonl or .parquet file, streaming."""
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file; data files are local .jsonl or .parquet paths")
    if path.endswith(".jsonl"):
        yield from _jsonl_rows(path)
    elif path.endswith(".parquet"):
        yield from _parquet_rows(path)
    else:
        raise DatasetError(f"{path}: unsupported file type; use .jsonl (one JSON object per line) or .parquet")


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}: row {i}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                   f"save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: row {i}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: row {i}: a JSON object is needed, got {type(row).__name__}")
            yield i, row


def _parquet_rows(path: str) -> Iterator[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]}); write it with "
                           f"pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    with pf:
        columns = pf.schema_arrow.names
        if "prompt" not in columns:
            raise DatasetError(f"{path}: no column prompt (columns: {', '.join(columns) or 'none'}); the layout needs "
                               f"prompt and reward_model.ground_truth (or answer), see covrl-prepare-data")
        yield from _parquet_batches(pf, path)


def _parquet_batches(pf, path: str) -> Iterator[tuple[int, dict]]:
    """The rows of an open parquet file, numbered; a damaged batch is refused with the row it starts at."""
    import pyarrow as pa

    n = 0  # rows read so far
    try:
        for batch in pf.iter_batches(batch_size=1024):
            rows = batch.to_pylist()
            yield from zip(range(n, n + len(rows)), rows)
            n += len(rows)
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: row {n} onwards cannot be read ({str(e).splitlines()[0]}); the file is "
                           f"damaged: write it again") from None


def _answer(row: dict, where: str) -> str:
    rm = row.get("reward_model")
    value = rm.get("ground_truth") if isinstance(rm, dict) else None
    field = "reward_model.ground_truth"
    if value is None:
        value, field = row.get("answer"), "answer"
    if value is None:
        raise DatasetError(f"{where}: no reference answer; set field reward_model.ground_truth (or answer)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {field} must be a string or a number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise DatasetError(f"{where}: field {field} is empty; every completion would score 0")
    return text


def parse_row(row: dict, path: str, index: int) -> Record:
    where = f"{path}: row {index}"
    prompt = row.get("prompt")
    messages = text = None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: field prompt is an empty string")
        text = prompt
    elif isinstance(prompt, (list, tuple)) and prompt:
        pairs = []
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: field prompt[{j}] must be a message {{\"role\": str, \"content\": str}}")
            pairs.append((m["role"], m["content"]))
        if not any(r == "user" for r, _ in pairs):
            raise DatasetError(f"{where}: field prompt has no message with role \"user\"")
        messages = tuple(pairs)
    else:
        raise DatasetError(f"{where}: field prompt is missing or not chat messages / a string "
                           f"(got {type(prompt).__name__})")
    source = row.get("data_source")
    if source is None:
        source = os.path.splitext(os.path.basename(path))[0]
    if not isinstance(source, str) or not source or "/" in source:
        raise DatasetError(f"{where}: field data_source must be a non-empty string without '/', got {source!r}")
    return Record(messages, text, _answer(row, where), source)


def read_records(path: str) -> list[Record]:
    """Every row of one file, parsed and checked."""
    records = [parse_row(row, path, i) for i, row in iter_rows(path)]
    if not records:
        raise DatasetError(f"{path}: the file has no rows")
    return records


def write_rows(rows: list[dict], path: str, *, compression: str = "snappy", level: int | None = None) -> None:
    """Write rows of this layout to a .jsonl or .parquet file (parquet compressed with `compression` at `level`,
    pyarrow's default snappy unless asked); DatasetError for any other suffix."""
    if path.endswith(".jsonl"):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    elif path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path, compression=compression,
                       compression_level=level)
    else:
        raise DatasetError(f"{path}: write .parquet or .jsonl")


def template_mode(tokenizer, template: Template) -> str:
    if template == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DatasetError("data.template = \"chat\" but the tokenizer has no chat_template; use \"plain\" for a base "
                           "model or a model directory whose tokenizer_config.json defines one")
    return template


def render_prompt_text(rec: Record, tokenizer, *, template: Template, instruction: str, system_prompt: str) -> str:
    """The prompt text the model continues from."""
    from common.templates import render_prompt

    if template_mode(tokenizer, template) == "plain":
        if rec.text is not None:
            return render_prompt(rec.text, instruction)
        body = "\n\n".join(c for r, c in rec.messages if r != "assistant")
        return render_prompt(body, "")
    if rec.messages is not None:
        messages = [{"role": r, "content": c} for r, c in rec.messages]
    else:
        messages = [{"role": "user", "content": f"{rec.text}\n\n{instruction}" if instruction else rec.text}]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # e.g. "System role not supported", roles that must alternate
        raise DatasetError(f"the tokenizer's chat template refuses this prompt ({e}); for a template without a system "
                           f"role set data.system_prompt = \"\", or use data.template = \"plain\"") from None


def fit_prompt(ids: list[int], max_tokens: int, truncation: Truncation, where: str) -> list[int] | None:
    """Apply the prompt length limit: None means drop this prompt."""
    if len(ids) <= max_tokens:
        return ids
    if truncation == "drop":
        return None
    if truncation == "left":
        return ids[-max_tokens:]  # keep the end: the question's last words and the generation prompt
    raise DatasetError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_tokens={max_tokens}; raise the "
                       f"limit or set data.truncation to \"drop\" or \"left\"")
