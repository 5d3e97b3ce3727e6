"""User-facing errors and the one place that recognises out-of-memory failures.

Every error a user can cause (a bad flag, a malformed space file, an unknown model) is an
`AutofitError` whose message is one paragraph naming what was wrong and what is allowed. The CLI
prints that paragraph and exits 2; it never shows a traceback for them.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class AutofitError(Exception):
    """A problem the user can fix; the message says what was wrong and what is allowed."""


class ConfigError(AutofitError):
    """A knob value, or a combination of knob values, that autofit does not accept."""


class SpaceError(AutofitError):
    """A search-space file that is missing, malformed or has a value outside a knob's range."""


class ModelError(AutofitError):
    """An unknown model name or an unreadable model config."""


class HardwareError(AutofitError):
    """A `--gpus` value that names no GPUs, or a GPU preset autofit does not know."""


class DataError(AutofitError):
    """A dataset, tokenizer or length file that is missing or unreadable, naming the file and
    the line (`autofit.data`)."""


class WriteError(AutofitError):
    """A file autofit writes for the user could not be written (a full disk, a read-only
    folder); the message says what was kept. `plan` is the plan whose files these were, when
    there is one: a search's result outlives a failed write."""

    def __init__(
        self, message: str, plan: object = None, path: object = None, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.plan, self.path, self.reason = plan, path, reason  # the file and why, when known


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The `n` names in `choices` nearest to `word` (for 'did you mean' hints)."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.4)
    if not hits:
        hits = [c for c in lowered if word.lower() in c or c in word.lower()][:n]
    return [lowered[h] for h in hits]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    hits = closest(word, choices)
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


# Where an out-of-memory failure ran out: the GPU (or the capacity a CPU trial emulates), or the
# host's RAM (a failed CPU or pinned allocation, Python's MemoryError, the kernel's OOM killer).
# The search treats both as a violated memory constraint; the plan says which.
GPU = "gpu"
HOST = "host"

# Substrings that PyTorch and the CUDA runtime use for an allocation failure. This is the single
# place autofit decides "this failure was an out-of-memory"; the trial worker classifies from the
# exception first (`oom_kind(exc)`), the launcher from the text it has when no rank could report.
_OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "CPU trial out of memory",  # autofit's own capacity of a CPU trial (TensorTracker)
    "DefaultCPUAllocator: can't allocate memory",
)
# ... and the ones that say the memory that ran out was the host's. A pinned allocation fails with
# the CUDA runtime's generic "out of memory" from cudaHostAlloc inside the host allocator.
_HOST_MARKERS = (
    "DefaultCPUAllocator",
    "CachingHostAllocator",
    "cudaHostAlloc",
    "pin_memory",
    "pinned memory",
)
_PY_MEMORY_ERROR = re.compile(r"\bMemoryError\b")  # Python's own; not torch's OutOfMemoryError


def oom_kind(error: BaseException | str, traceback_text: str = "") -> str | None:
    """`GPU` or `HOST` when `error` (an exception or its text) is an out-of-memory failure, else
    None. `traceback_text` (the formatted traceback) tells a failed pinned host allocation, whose
    message is the CUDA runtime's generic one, from a GPU one."""
    if isinstance(error, MemoryError):
        return HOST
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    py_memory_error = bool(_PY_MEMORY_ERROR.search(text))
    oom = py_memory_error or any(marker in text for marker in _OOM_MARKERS)
    if not oom and not isinstance(error, str):
        try:
            import torch

            oom = isinstance(error, torch.OutOfMemoryError)
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
    if not oom:
        return None
    where = text + "\n" + traceback_text
    host = py_memory_error or any(marker in where for marker in _HOST_MARKERS)
    return HOST if host else GPU


def is_oom(error: BaseException | str) -> bool:
    """True when `error` (an exception or its text) is an out-of-memory failure."""
    return oom_kind(error) is not None
