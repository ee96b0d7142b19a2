"""Convert a local math dataset to covrl's layout (`prompt`, `reward_model.ground_truth`, `data_source`).

    covrl prepare-data IN_FILE OUT_FILE [--prompt-key problem] [--answer-key answer] [--data-source NAME]

IN_FILE is a .jsonl or .parquet file with one problem per row (e.g. MATH-500's `problem` / `answer`
columns); OUT_FILE (.parquet or .jsonl) gets one row per input row, with the question as a plain-string
`prompt` (the configured `data.instruction` asks for the boxed answer at training time). Numbers in the
answer column become strings. A row without the prompt or answer key stops the conversion with its row
number. Nothing is downloaded: fetch the source files yourself.
"""

from __future__ import annotations

import argparse
import os
import sys

from common.datasets import DatasetError, iter_rows, parse_row, write_rows


def convert(src: str, prompt_key: str, answer_key: str, data_source: str) -> list[dict]:
    out = []
    for i, row in iter_rows(src):
        for key in (prompt_key, answer_key):
            if row.get(key) is None:
                raise DatasetError(f"{src}: row {i}: no field {key!r} (fields: {', '.join(sorted(row))}); "
                                   f"name the right one with --prompt-key / --answer-key")
        value = row[answer_key]
        new = {"prompt": row[prompt_key], "reward_model": {"ground_truth": str(value)}, "data_source": data_source}
        parse_row(new, src, i)  # the converted row must load: fail here, not at training time
        out.append(new)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="covrl prepare-data", description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--prompt-key", default="problem")
    ap.add_argument("--answer-key", default="answer")
    ap.add_argument("--data-source", help="tag of every row (default: the output file's stem)")
    args = ap.parse_args(argv)
    source = args.data_source or os.path.splitext(os.path.basename(args.dst))[0]
    try:
        rows = convert(args.src, args.prompt_key, args.answer_key, source)
        write_rows(rows, args.dst)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.dst} (data_source {source!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
