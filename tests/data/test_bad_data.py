"""Bad data (issue 26): one paragraph naming the file and the line, exit 2, no traceback, one JSON
object under --json; all before anything is estimated or tried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autofit.cli import app
from tests.data.words import FIXTURE, word_tokenizer
from tests.test_bad_input import assert_clean_failure, assert_json_failure

runner = CliRunner()
PLAN = ["plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials", "--seq-len", "128"]


def plan(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, [*PLAN, *args])


@pytest.fixture
def tok(tmp_path: Path) -> str:
    return str(word_tokenizer(tmp_path / "tokenizer.json"))


def jsonl(tmp_path: Path, text: str | bytes, name: str = "data.jsonl") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def test_a_line_that_is_not_json(tmp_path, tok):
    data = jsonl(tmp_path, '{"text": "a b"}\n\n{"text": "c"\n')
    assert_clean_failure(plan("--dataset", data, "--tokenizer", tok), f"{data}, line 3: not JSON")


def test_a_missing_field(tmp_path, tok):
    data = jsonl(tmp_path, '{"prompt": "a", "text": "a b"}\n{"prompt": "b"}\n')
    result = plan("--dataset", data, "--tokenizer", tok, "--text-field", "text")
    assert_clean_failure(result, f"{data}, line 2", "'text' (--text-field) is missing", "prompt")
    result = plan("--dataset", data, "--tokenizer", tok)  # autodetected: line 2 has no text
    assert_clean_failure(result, f"{data}, line 2: no field to count", "--text-field NAME")


def test_a_null_field_and_a_field_of_another_kind(tmp_path, tok):
    data = jsonl(tmp_path, '{"text": "a"}\n{"text": "b", "x": 1}\n{"text": null}\n')
    result = plan("--dataset", data, "--tokenizer", tok, "--text-field", "text")
    assert_clean_failure(result, f"{data}, line 3: the field 'text' is null")
    data = jsonl(tmp_path, '{"text": "a"}\n{"text": 5}\n', "kinds.jsonl")
    assert_clean_failure(plan("--dataset", data, "--tokenizer", tok), f"{data}, line 2", "int")


def test_an_empty_file(tmp_path, tok):
    for text in ("", "\n\n  \n"):
        data = jsonl(tmp_path, text)
        assert_clean_failure(plan("--dataset", data, "--tokenizer", tok), data, "is empty")
    header_only = jsonl(tmp_path, "text,n\n", "d.csv")
    assert_clean_failure(plan("--dataset", header_only, "--tokenizer", tok), "is empty")


def test_a_binary_file(tmp_path, tok):
    data = jsonl(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    assert_clean_failure(plan("--dataset", data, "--tokenizer", tok), data, "not a text file")
    not_gzip = jsonl(tmp_path, b'{"text": "a"}\n', "d.jsonl.gz")
    assert_clean_failure(plan("--dataset", not_gzip, "--tokenizer", tok), "not a whole gzip file")
    fake = jsonl(tmp_path, b"PAR1 not really", "d.parquet")
    pytest.importorskip("pyarrow")
    assert_clean_failure(plan("--dataset", fake, "--tokenizer", tok), fake, "not a Parquet file")


def test_a_tokenizer_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nope" / "tokenizer.json")
    result = plan("--dataset", str(FIXTURE), "--tokenizer", missing)
    assert_clean_failure(result, f"The tokenizer {missing!r} does not exist", "downloads nothing")
    result = plan("--dataset", str(FIXTURE), "--tokenizer", "meta-llama/Llama-3.1-8B")
    assert_clean_failure(result, "Hugging Face Hub name is not fetched")
    not_one = jsonl(tmp_path, "{}", "tokenizer.json")
    result = plan("--dataset", str(FIXTURE), "--tokenizer", not_one)
    assert_clean_failure(result, f"The tokenizer file {not_one!r} cannot be read")
    # text without a tokenizer: which flag to add
    assert_clean_failure(plan("--dataset", str(FIXTURE)), str(FIXTURE), "--tokenizer PATH")


def test_a_dataset_that_does_not_exist_or_is_no_dataset(tmp_path, tok):
    missing = str(tmp_path / "train.jsonl")
    assert_clean_failure(plan("--dataset", missing), f"The dataset {missing!r} does not exist")
    other = jsonl(tmp_path, "a b c", "train.txt")
    assert_clean_failure(plan("--dataset", other, "--tokenizer", tok), "(.txt)", ".jsonl")
    empty = tmp_path / "empty"
    (empty / ".cache").mkdir(parents=True)
    (empty / ".cache" / "x.jsonl").write_text('{"text": "hidden"}\n')
    assert_clean_failure(plan("--dataset", str(empty)), "holds no dataset", "save_to_disk")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"text": "a"}\n')
    (mixed / "b.csv").write_text("text\nb\n")
    assert_clean_failure(plan("--dataset", str(mixed)), "several formats (csv, jsonl)")


def test_dataset_and_lengths_together_and_flags_without_data(tmp_path, tok):
    lengths = jsonl(tmp_path, "12\n40\n", "lengths.txt")
    result = plan("--dataset", str(FIXTURE), "--lengths", lengths)
    assert_clean_failure(result, "--dataset and --lengths both", "give one")
    assert_clean_failure(plan("--tokenizer", tok), "--tokenizer says how", "no --dataset")


def test_a_bad_length_file(tmp_path):
    result = plan("--lengths", str(FIXTURE))
    assert_clean_failure(result, "looks like a dataset, not a length file", "--dataset")
    bad = jsonl(tmp_path, "12\n40\nforty\n", "lengths.txt")
    assert_clean_failure(plan("--lengths", bad), f"{bad}, line 3: 'forty' is not a token count")
    bad = jsonl(tmp_path, '{"512": 0}', "hist.json")
    assert_clean_failure(plan("--lengths", bad), f"The length file {bad}", "0 is not a whole")
    for empty in ("{}", '{"lengths": [], "counts": []}'):  # both forms, nothing in them
        bad = jsonl(tmp_path, empty, "hist.json")
        assert_clean_failure(plan("--lengths", bad), f"The length file {bad}: it holds no lengths")


def test_json_output(tmp_path, tok):
    data = jsonl(tmp_path, '{"text": "a"}\nnot json\n')
    result = plan("--dataset", data, "--tokenizer", tok, "--json")
    assert_json_failure(result, f"{data}, line 2: not JSON")
    estimate = ["estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--json"]
    result = runner.invoke(app, [*estimate, "--dataset", str(FIXTURE)])
    assert_json_failure(result, "--tokenizer PATH")


def test_a_bad_dataset_in_a_space_file(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs: {micro_batch: [1]}\ndataset: {path: a.jsonl, lengths: b.txt}\n")
    assert_clean_failure(plan("--space", str(space)), "dataset needs exactly one of path")
    space.write_text("knobs: {micro_batch: [1]}\ndataset: {file: a.jsonl}\n")
    assert_clean_failure(plan("--space", str(space)), "dataset must be a path or a mapping")
    space.write_text(json.dumps({"knobs": {"micro_batch": [1]}, "dataset": "gone.jsonl"}))
    gone = str(tmp_path / "gone.jsonl")
    assert_clean_failure(plan("--space", str(space)), f"The dataset {gone!r} does not exist")


def test_a_chat_the_template_refuses_or_that_is_no_chat(tmp_path):
    from tests.data.words import model_folder

    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('a chat starts with the user') }}"
        "{% endif %}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    )
    folder = str(model_folder(tmp_path / "model", template=strict))
    chats = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "assistant", "content": "hello"}],
    ]
    data = jsonl(tmp_path, "".join(json.dumps({"messages": c}) + "\n" for c in chats))
    result = plan("--dataset", data, "--tokenizer", folder)
    assert_clean_failure(result, f"{data}, line 2: the chat template", "starts with the user")
    data = jsonl(tmp_path, '{"messages": [{"role": "user", "content": "a"}, {"role": "x"}]}\n')
    result = plan("--dataset", data, "--tokenizer", folder)
    fragments = ('"messages" must be a non-empty list', 'got a message {"role": "x"}')
    assert_clean_failure(result, f"{data}, line 1", *fragments)


def test_an_empty_chat_is_refused_whichever_record_comes_first(tmp_path):
    """An empty `messages` list is no chat, before a real chat as after one: a record's kind is
    not read from the first record alone (an empty list first used to count the chat as its
    number of messages, 2, and drop the empty one with a warning)."""
    from autofit.data.read import read_lengths
    from autofit.errors import DataError
    from tests.data.words import model_folder

    folder = model_folder(tmp_path / "model")
    chat = [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d"}]
    for name, records, line in (
        ("empty-first.jsonl", [[], chat], 1),
        ("chat-first.jsonl", [chat, []], 2),
    ):
        data = jsonl(tmp_path, "".join(json.dumps({"messages": m}) + "\n" for m in records), name)
        with pytest.raises(DataError) as caught:
            read_lengths(data, tokenizer=folder)
        assert str(caught.value) == (
            f'{data}, line {line}: "messages" must be a non-empty list of {{"role": ..., '
            '"content": "..."} objects (a chat); got an empty list.'
        )
