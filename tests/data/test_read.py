"""Reading a dataset's token counts (`autofit.data.read`): the counts of tests/data/lengths.jsonl
against counts made by hand (one token per word with the tokenizers built in `words`), every
file format against the same records, and the length files of `--lengths`."""

from __future__ import annotations

import csv
import gzip
import json
import warnings
from collections import Counter
from pathlib import Path

import pytest

from autofit.checks import AutofitWarning
from autofit.data import LengthHistogram
from autofit.data.read import read_length_file, read_lengths
from tests.data.words import (
    CHAT_WORDS,
    FIXTURE,
    FIXTURE_COUNTS,
    model_folder,
    word_tokenizer,
)


def expected(chat: int) -> dict[int, int]:
    """The fixture's histogram by hand, its chat counted as `chat` tokens."""
    return dict(Counter(chat if n == "chat" else n for n in FIXTURE_COUNTS))


def as_dict(hist: LengthHistogram) -> dict[int, int]:
    return dict(zip(hist.lengths, hist.counts, strict=True))


def test_jsonl_counts_are_the_words_and_a_chat_without_template_its_lines(tmp_path):
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    with pytest.warns(AutofitWarning, match="no chat template"):
        hist = read_lengths(FIXTURE, tokenizer=tok)
    # without a template each message is a `role: content` line: the role is one word more
    assert as_dict(hist) == expected(chat=(1 + CHAT_WORDS[0]) + (1 + CHAT_WORDS[1]))
    assert hist.source == str(FIXTURE)
    # what the plan shows at --seq-len 128, by hand over the 36 sorted counts: the 18th is 16,
    # the 33rd 52, the 36th 300; two (150 and 300) are longer than 128
    assert hist.summary(128) == {
        "examples": 36, "median": 16, "p90": 52, "p99": 300, "max": 300,
        "truncated_share": 2 / 36,
    }  # fmt: skip


def test_a_model_folder_renders_chats_with_its_template(tmp_path):
    folder = model_folder(tmp_path / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutofitWarning)  # it has a template: no warning
        hist = read_lengths(FIXTURE, tokenizer=folder)
    # the template writes `<|start|> <role> ... <|end|>`: three tokens per message
    assert as_dict(hist) == expected(chat=(3 + CHAT_WORDS[0]) + (3 + CHAT_WORDS[1]))


def test_special_tokens_are_counted_and_saved_truncation_is_not(tmp_path):
    bos = word_tokenizer(tmp_path / "bos.json", bos=True)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a b c"}\n{"text": "one two three four five six"}\n')
    assert as_dict(read_lengths(data, tokenizer=bos)) == {4: 1, 7: 1}  # [BOS] + words
    cut = word_tokenizer(tmp_path / "cut.json", truncate=4)
    assert as_dict(read_lengths(data, tokenizer=cut)) == {3: 1, 6: 1}


def test_input_ids_need_no_tokenizer_and_text_field_picks_the_field(tmp_path):
    data = tmp_path / "ids.jsonl"
    data.write_text('{"input_ids": [5, 6, 7], "prompt": "x y"}\n{"input_ids": [1]}\n\n')
    assert as_dict(read_lengths(data)) == {1: 1, 3: 1}
    other = tmp_path / "prompt.jsonl"
    other.write_text('{"prompt": "a b c d", "text": "a"}\n{"prompt": "a b"}\n')
    tok = word_tokenizer(tmp_path / "t.json")
    assert as_dict(read_lengths(other, tokenizer=tok, text_field="prompt")) == {2: 1, 4: 1}


RECORDS = [
    {"text": "the model reads data", "n": 1},
    {"text": "a b", "n": 2},
    {"text": "one two three four five six seven", "n": 3},
    {"text": "a b", "n": 4},
]
HAND = {2: 2, 4: 1, 7: 1}  # the words of RECORDS' texts


def write_arrow_folder(folder: Path, table) -> None:  # type: ignore[no-untyped-def]
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files named by state.json."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    halves = [table.slice(0, 2), table.slice(2)]
    names = [f"data-0000{i}-of-00002.arrow" for i in range(2)]
    for name, part in zip(names, halves, strict=True):
        with pa.ipc.new_stream(str(folder / name), part.schema) as writer:
            writer.write_table(part)
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_split": "train"})
    )


def test_every_format_counts_the_same_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    tok = word_tokenizer(tmp_path / "t.json")
    (tmp_path / "d.json").write_text(json.dumps(RECORDS))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "n"])
        writer.writeheader()
        writer.writerows(RECORDS)
    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, str(tmp_path / "d.parquet"))
    write_arrow_folder(tmp_path / "saved", table)
    dict_folder = tmp_path / "dict"
    write_arrow_folder(dict_folder / "train", table)
    (dict_folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    shards = tmp_path / "snapshot" / "data"  # a Hub snapshot's shards, in name order
    shards.mkdir(parents=True)
    pq.write_table(table.slice(0, 3), str(shards / "train-00000-of-00002.parquet"))
    pq.write_table(table.slice(3), str(shards / "train-00001-of-00002.parquet"))
    (tmp_path / "snapshot" / "README.md").write_text("a dataset card")  # not data: left out
    for name in ("lines.json", "d.csv"):  # gzip-compressed text, as Hub datasets ship it
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress((tmp_path / name).read_bytes()))
    names = ("d.json", "lines.json", "d.csv", "lines.json.gz", "d.csv.gz", "d.parquet", "saved",
             "dict", "snapshot")  # fmt: skip
    for name in names:
        assert as_dict(read_lengths(tmp_path / name, tokenizer=tok)) == HAND, name
    ids = pa.Table.from_pylist([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    pq.write_table(ids, str(tmp_path / "ids.parquet"))
    assert as_dict(read_lengths(tmp_path / "ids.parquet")) == {1: 1, 3: 1}


def test_progress_reaches_the_end_of_the_file(tmp_path):
    tok = word_tokenizer(tmp_path / "t.json")
    seen: list[tuple[int, int | None]] = []
    with pytest.warns(AutofitWarning):
        read_lengths(FIXTURE, tokenizer=tok, progress=lambda *at: seen.append(at))
    size = FIXTURE.stat().st_size
    assert seen and seen[-1] == (size, size)
    shards = tmp_path / "shards"  # several files: bytes of them all
    shards.mkdir()
    for i in range(2):
        (shards / f"part-{i}.jsonl").write_text('{"input_ids": [1, 2]}\n' * (i + 1))
    seen.clear()
    hist = read_lengths(shards, progress=lambda *at: seen.append(at))
    assert hist.counts == (3,) and seen == [(22, 66), (66, 66)]  # 22 bytes a line


def test_length_files(tmp_path):
    lines = tmp_path / "lengths.txt"
    lines.write_text("# counted elsewhere\n12\n7\n\n12  # a comment\n300\n")
    assert as_dict(read_length_file(lines)) == {7: 1, 12: 2, 300: 1}
    mapping = tmp_path / "hist.json"
    mapping.write_text('{"512": 10, "64": 3}')
    assert as_dict(read_length_file(mapping)) == {64: 3, 512: 10}
    saved = tmp_path / "lengths.json"  # a run folder's, as autofit writes it
    saved.write_text(LengthHistogram((5, 9), (2, 1), "train.jsonl").to_json())
    back = read_length_file(saved)
    assert as_dict(back) == {5: 2, 9: 1} and back.source == "train.jsonl"


def test_no_progress_bar_where_stderr_is_not_a_terminal():
    from autofit.data.progress import stderr_bar

    with stderr_bar("Counting", enabled=True) as bar:  # pytest captures stderr: no terminal
        assert bar is None


def test_the_shipped_instruct_lengths_follow_their_lognormal():
    """examples/instruct_lengths.json (README, docs/data.md) holds 20,000 draws of a lognormal of
    median 256 and sigma 0.9: its quantiles are 256 x exp(0.9 z), z = 0, 1.2816 (90%), 2.3263
    (99%), i.e. 256, 811 and 2,078 tokens; 20,000 draws land within 3% of each."""
    hist = read_length_file(Path(__file__).parents[2] / "examples" / "instruct_lengths.json")
    assert hist.examples == 20_000 and hist.longest == 8192
    for q, truth in ((0.5, 256), (0.9, 811.3), (0.99, 2078.3)):
        assert abs(hist.quantile(q) / truth - 1) < 0.03, (q, hist.quantile(q))
