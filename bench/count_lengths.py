"""How long does counting a dataset's token lengths take? (issue 26: 1,000,000 short examples in
well under a minute)

    .venv/bin/python bench/count_lengths.py [examples] [--folder DIR] [--format jsonl|parquet]

Writes a JSON Lines file of `examples` (default 1,000,000) short synthetic records, {"text": "w12
w7 ..."} of 5 to 120 words from a 5,000-word vocabulary, and a word-level tokenizer built in code
with `tokenizers` (whitespace pre-tokenizer, one token per word, saved as tokenizer.json), then
times `autofit.data.read.read_lengths` over them (the reader, JSON parsing and batch encoding
together; the files written beforehand are not timed), with the CPU seconds of all its threads
beside the wall time (on a shared machine the wall time is the neighbours' too: idle, it is about
the CPU time over the cores), and checks the histogram against the word counts the generator
wrote. `--format parquet` writes the same records as Parquet (pyarrow).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from autofit.data.read import read_lengths

VOCAB = 5000


def word_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer of the words w0..w4999 (and [UNK]): one token per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def write_data(path: Path, n: int, fmt: str, seed: int = 0) -> Counter[int]:
    """`n` records of 5-120 words; returns how many records have each word count."""
    rng = random.Random(seed)
    truth: Counter[int] = Counter()
    texts = []
    for _ in range(n):
        k = rng.randint(5, 120)
        truth[k] += 1
        texts.append(" ".join(f"w{rng.randrange(VOCAB)}" for _ in range(k)))
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), str(path))
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", nargs="?", type=int, default=1_000_000)
    ap.add_argument("--folder", type=Path, default=None, help="keep the files here")
    ap.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / f"synthetic.{args.format}"
        t0 = time.perf_counter()
        truth = write_data(data, args.examples, args.format)
        tokenizer = word_tokenizer(folder / "tokenizer.json")
        made = time.perf_counter() - t0
        size = data.stat().st_size
        t0, c0 = time.perf_counter(), time.process_time()
        hist = read_lengths(data, tokenizer=tokenizer)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        ok = dict(zip(hist.lengths, hist.counts, strict=True)) == dict(truth)
        print(
            f"{args.examples:,} examples ({args.format}, {size / 2**20:.0f} MiB, written in "
            f"{made:.1f} s): counted in {took:.1f} s ({args.examples / took:,.0f} examples/s, "
            f"{hist.tokens() / took:,.0f} tokens/s; {cpu:.1f} CPU-s on all threads); "
            f"median {hist.quantile(0.5)}, p99 {hist.quantile(0.99)}, max {hist.longest}; "
            f"histogram {'equals' if ok else 'DIFFERS FROM'} the generator's word counts"
        )
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
