"""Tokenizers built here, in code, whose counts are known by hand: one token per
whitespace-separated word (a `tokenizers` WordLevel model behind a WhitespaceSplit pre-tokenizer),
so a text's count is its number of words."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

DATA = Path(__file__).parent
FIXTURE = DATA / "lengths.jsonl"
# tests/data/lengths.jsonl, line by line, counted by hand: a text's words; line 6 is a chat
# (user: 7 words, assistant: 4), line 31 is 36 pre-tokenized input_ids
FIXTURE_COUNTS = [5, 8, 12, 17, 23, "chat", 9, 31, 14, 6, 40, 150, 11, 19, 27, 7, 52, 13, 10, 21,
                  16, 300, 64, 4, 33, 18, 25, 9, 12, 45, 36, 15, 20, 3, 29, 8]  # fmt: skip
CHAT_WORDS = (7, 4)
# a chat template that writes 3 tokens of its own per message: `<|start|> <role> ... <|end|>`
TEMPLATE = (
    "{% for m in messages %}<|start|> <{{ m['role'] }}> {{ m['content'] }} <|end|>\n{% endfor %}"
)


def word_tokenizer(path: Path, bos: bool = False, truncate: int | None = None) -> Path:
    """A word-level tokenizer.json at `path`: every word one token (unknown words `[UNK]`);
    `bos` adds a `[BOS]` token to every text (a post-processor, as Llama's adds `<s>`);
    `truncate` saves a truncation setting in the file (which counting must ignore)."""
    vocab = {"[UNK]": 0, "[BOS]": 1, "the": 2, "model": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", pair="[BOS] $A $B", special_tokens=[("[BOS]", 1)]
        )
    if truncate is not None:
        tok.enable_truncation(max_length=truncate)
    tok.save(str(path))
    return path


def model_folder(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A model folder as save_pretrained writes one: tokenizer.json and tokenizer_config.json
    (with the chat template)."""
    folder.mkdir(parents=True, exist_ok=True)
    word_tokenizer(folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
