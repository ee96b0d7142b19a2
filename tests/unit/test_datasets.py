"""Datasets in the common RL layout, from .jsonl and .parquet, with errors that name file, row, field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.datasets import DatasetError, Record, fit_prompt, read_records, render_prompt_text

ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}, "data_source": "toy"},
    {"prompt": "What is 7 - 9?", "answer": -2, "data_source": "toy_plain"},
    {"prompt": "Simplify 2/4.", "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"}},
]


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _parquet(path, rows):
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), str(path))  # schema inferred from every row
    return str(path)


@pytest.mark.parametrize("write", [_jsonl, _parquet])
def test_both_formats_give_the_same_records(tmp_path, write):
    ext = "jsonl" if write is _jsonl else "parquet"
    # A parquet column has one type: chat-message and plain-string prompts live in different files.
    recs = read_records(write(tmp_path / f"chat.{ext}", ROWS[:1])) + read_records(write(tmp_path / f"math.{ext}", ROWS[1:]))
    assert recs[0] == Record((("user", "What is 2 + 3?"),), None, "5", "toy")
    assert recs[1] == Record(None, "What is 7 - 9?", "-2", "toy_plain")  # numbers become strings
    assert recs[2].answer == "\\frac{1}{2}" and recs[2].data_source == "math"  # default: the file's stem


@pytest.mark.parametrize("row, field", [
    ({"answer": "1"}, "field prompt"),
    ({"prompt": "", "answer": "1"}, "field prompt"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "field prompt[0]"),
    ({"prompt": [{"role": "system", "content": "x"}], "answer": "1"}, "role \"user\""),
    ({"prompt": "q"}, "reward_model.ground_truth"),
    ({"prompt": "q", "reward_model": {"ground_truth": ["1", "2"]}}, "field reward_model.ground_truth"),
    ({"prompt": "q", "answer": "  "}, "field answer is empty"),
    ({"prompt": "q", "answer": "1", "data_source": "a/b"}, "field data_source"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, row, field):
    path = _jsonl(tmp_path / "bad.jsonl", [ROWS[1], row])
    with pytest.raises(DatasetError) as e:
        read_records(path)
    assert f"{path}: row 1:" in str(e.value) and field in str(e.value)
    ppath = _parquet(tmp_path / "bad.parquet", [row])
    # a parquet file whose rows have no prompt has no prompt column: said before any row is read
    with pytest.raises(DatasetError, match=f"{ppath}: row 0:" if "prompt" in row else f"{ppath}: no column prompt"):
        read_records(ppath)


def test_bad_files(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read_records(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type"):
        read_records(str(tmp_path / "x.csv"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "q", "answer": "1"}\n\n{"prompt": \n')
    with pytest.raises(DatasetError, match="row 2: not valid JSON"):
        read_records(str(tmp_path / "broken.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        read_records(str(tmp_path / "empty.jsonl"))


class _ChatTok:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


class _BaseTok:
    chat_template = None


def test_rendering_chat_and_plain():
    text = Record(None, "What is 7 - 9?", "-2", "s")
    msgs = Record((("user", "Solve x. Answer: $X"),), None, "1", "s")
    kw = dict(instruction="Put the final answer in \\boxed{}.", system_prompt="")
    # Chat: the instruction joins plain-string prompts; message prompts are used as the dataset wrote them.
    assert render_prompt_text(text, _ChatTok(), template="auto", **kw) == \
        "<user>What is 7 - 9?\n\nPut the final answer in \\boxed{}.</user><assistant>"
    assert render_prompt_text(msgs, _ChatTok(), template="chat", **kw) == "<user>Solve x. Answer: $X</user><assistant>"
    with_system = render_prompt_text(msgs, _ChatTok(), template="chat", instruction="", system_prompt="Be brief.")
    assert with_system.startswith("<system>Be brief.</system><user>")
    # Plain (base models): the built-in completion template.
    assert render_prompt_text(text, _BaseTok(), template="auto", **kw) == \
        "Question: What is 7 - 9?\nPut the final answer in \\boxed{}.\nAnswer:"
    with pytest.raises(DatasetError, match="no chat_template"):
        render_prompt_text(text, _BaseTok(), template="chat", **kw)


def test_prompt_length_policies():
    ids = list(range(10))
    assert fit_prompt(ids, 10, "error", "f: row 0") == ids
    assert fit_prompt(ids, 4, "drop", "f: row 0") is None
    assert fit_prompt(ids, 4, "left", "f: row 0") == [6, 7, 8, 9]
    with pytest.raises(DatasetError, match="f: row 3: prompt has 10 tokens > data.max_prompt_tokens=4"):
        fit_prompt(ids, 4, "error", "f: row 3")


def test_prepare_data_converts_problem_answer_files(tmp_path):
    from launch.prepare_data import main

    src = _jsonl(tmp_path / "MATH-500.jsonl", [{"problem": "Compute 1/2 + 1/2.", "answer": 1, "solution": "..."},
                                               {"problem": "What is $\\sqrt{4}$?", "answer": "2"}])
    assert main([src, str(tmp_path / "math500.parquet")]) == 0
    recs = read_records(str(tmp_path / "math500.parquet"))
    assert [(r.text, r.answer, r.data_source) for r in recs] == [("Compute 1/2 + 1/2.", "1", "math500"),
                                                                ("What is $\\sqrt{4}$?", "2", "math500")]
    assert main([src, str(tmp_path / "x.parquet"), "--prompt-key", "question"]) == 2  # names the missing field


@pytest.mark.parametrize("truncation, said", [
    ("drop", "data: 2 training prompts (dropped 1 of 3 prompts longer than data.max_prompt_tokens=48)"),
    ("left", "data: 3 training prompts (cut 1 of 3 prompts to their last data.max_prompt_tokens=48 tokens)"),
])
def test_the_start_banner_says_what_the_length_limit_did(tmp_path, truncation, said):
    from common.config import load_config
    from common.data import check_inputs

    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is " + " + ".join(["1"] * 60) + "?",
                                                         "answer": "60"}, {"prompt": "What is 1 + 1?", "answer": "2"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ['data.task="files"', f'data.train_files=["{path}"]', "data.max_prompt_tokens=48",
                             f'data.truncation="{truncation}"'])
    assert check_inputs(cfg) == [said]  # no eval files: no eval line


def test_a_chat_template_that_refuses_a_prompt_names_the_row(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from common.config import load_config
    from common.data import PromptSource

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}) + "\n")
    cfg = load_config(None, ['data.task="files"', f'data.train_files=["{path}"]', 'data.system_prompt="Be brief."'])
    with pytest.raises(DatasetError, match=rf"{path}: row 0: the tokenizer's chat template refuses this prompt "
                                           rf"\(System role not supported\); .* data.system_prompt = \"\""):
        PromptSource(cfg, tok)
