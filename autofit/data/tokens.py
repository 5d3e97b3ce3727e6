"""Counting tokens with the model's own tokenizer, read from local files only: a `tokenizer.json`
(the `tokenizers` library) or a model folder (transformers' `AutoTokenizer`, `local_files_only`,
which also brings the chat template). Texts are encoded in batches (`encode_batch_fast`, Rust,
on every core); chats are rendered with the tokenizer's chat template first. Nothing is
downloaded. Torch-free (transformers is imported only for a model folder).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from autofit.checks import AutofitWarning
from autofit.errors import DataError

NEEDS_TOKENIZER = (
    "Counting the tokens of {what} needs the model's own tokenizer: pass --tokenizer PATH, a "
    "local tokenizer.json or a model folder holding one (autofit downloads nothing). Data that "
    "is already tokenized (an input_ids field) needs none, nor does --lengths FILE."
)


class TokenCounter:
    """Token counts of texts and chats with one tokenizer. `backend` is a `tokenizers.Tokenizer`
    (fast path); `hf` the transformers tokenizer when a model folder was given (its chat
    template, and slow tokenizers)."""

    def __init__(self, path: str, backend: Any, hf: Any = None) -> None:
        self.path = path
        self.backend = backend
        self.hf = hf
        self._warned = False
        if backend is not None:  # count every token: a tokenizer.json may carry truncation
            backend.no_truncation()
            backend.no_padding()

    @property
    def has_chat_template(self) -> bool:
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def count_texts(self, texts: list[str], special: bool = True) -> list[int]:
        """Tokens of each text, with the special tokens the tokenizer adds (BOS, EOS) when
        `special`: what a training collator sees."""
        if self.backend is not None:
            encoded = self.backend.encode_batch_fast(texts, add_special_tokens=special)
            return [len(e) for e in encoded]
        ids = self.hf(texts, add_special_tokens=special)["input_ids"]
        return [len(i) for i in ids]

    def count_chats(self, chats: list[Any], path: Path, where: list[str]) -> list[int]:
        """Tokens of each chat (a list of {"role", "content"} messages) as the chat template
        renders it; without a template, each message as a `role: content` line (a warning says
        the count leaves the template's own tokens out)."""
        for chat, at in zip(chats, where, strict=True):
            _check_chat(chat, path, at)
        if not self.has_chat_template:
            if not self._warned:
                warnings.warn(
                    f"The tokenizer {self.path} has no chat template, so each chat's messages "
                    "are counted as 'role: content' lines; the template's own tokens are left "
                    "out. Pass --tokenizer the model folder (its tokenizer_config.json holds "
                    "the template) to count them.",
                    AutofitWarning,
                    stacklevel=2,
                )
                self._warned = True
            texts = ["\n".join(f"{m['role']}: {m['content']}" for m in c) for c in chats]
            return self.count_texts(texts)
        try:
            texts = self.hf.apply_chat_template(chats, tokenize=False)
        except Exception as exc:  # jinja's TemplateError and whatever the template raises
            for chat, at in zip(chats, where, strict=True):  # find the chat it fails on
                try:
                    self.hf.apply_chat_template(chat, tokenize=False)
                except Exception:
                    raise DataError(
                        f"{path}, {at}: the chat template of {self.path} refuses these messages "
                        f"({exc.__class__.__name__}: {exc}). Fix the record, or pass "
                        "--text-field to count another field."
                    ) from None
            raise  # pragma: no cover - the batch failed but no single chat does
        return self.count_texts(texts, special=False)  # the template wrote the special tokens


def _check_chat(chat: Any, path: Path, where: str) -> None:
    if not isinstance(chat, list) or not chat:
        got = "an empty list" if isinstance(chat, list) else type(chat).__name__
    else:
        bad = next(
            (m for m in chat if not isinstance(m, dict)
             or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)),
            None,
        )  # fmt: skip
        if bad is None:
            return
        got = f"a message {json.dumps(bad, default=str)[:60]}"
    raise DataError(
        f'{path}, {where}: "messages" must be a non-empty list of {{"role": ..., "content": '
        f'"..."}} objects (a chat); got {got}.'
    )


def load_tokenizer(path: str | Path) -> TokenCounter:
    """The tokenizer at `path`: a tokenizer.json file, or a model folder (`AutoTokenizer` with
    `local_files_only`; its tokenizer.json alone when transformers cannot load the folder)."""
    where = Path(path).expanduser()
    if not where.exists():
        looks_like_hub = "/" in str(path) and not str(path).startswith((".", "/", "~"))
        hub = " (a Hugging Face Hub name is not fetched)" if looks_like_hub else ""
        raise DataError(
            f"The tokenizer {str(path)!r} does not exist{hub}; autofit downloads nothing. Pass "
            "--tokenizer a local tokenizer.json or a model folder holding the tokenizer files "
            "(e.g. one saved by save_pretrained or downloaded with huggingface-cli)."
        )
    from tokenizers import Tokenizer

    if where.is_file():
        try:
            return TokenCounter(str(where), Tokenizer.from_file(str(where)))
        except Exception as exc:  # tokenizers raises its own Exception for a bad file
            raise DataError(
                f"The tokenizer file {str(where)!r} cannot be read ({_first_line(exc)}). Pass a "
                "tokenizer.json written by the tokenizers library or save_pretrained, or the "
                "model folder holding it."
            ) from None
    hf = _auto_tokenizer(where)
    if hf is not None:
        backend = getattr(hf, "backend_tokenizer", None)
        return TokenCounter(str(where), backend, hf)
    if (where / "tokenizer.json").is_file():
        return load_tokenizer(where / "tokenizer.json")
    raise DataError(
        f"The folder {str(where)!r} holds no tokenizer autofit can load (no tokenizer.json, and "
        "transformers' AutoTokenizer cannot load it from local files). Pass --tokenizer a "
        "tokenizer.json or a model folder saved by save_pretrained."
    )


def _auto_tokenizer(folder: Path) -> Any:
    if not any((folder / n).is_file() for n in ("tokenizer_config.json", "tokenizer.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # a folder transformers cannot read: tokenizer.json alone, if there is one
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__
