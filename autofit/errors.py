"""User-facing errors and the one place that recognises out-of-memory failures.

Every error a user can cause (a bad flag, a malformed space file, an unknown model) is an
`AutofitError` whose message is one paragraph naming what was wrong and what is allowed. The CLI
prints that paragraph and exits 2; it never shows a traceback for them.
"""

from __future__ import annotations

import difflib
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


# Substrings that PyTorch and the CUDA runtime use for an allocation failure. This is the single
# place autofit decides "this failure was an out-of-memory"; the trial worker, the launcher and the
# CPU memory cap all call `is_oom`.
_OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "out of memory",  # generic allocator messages, and autofit's own CPU cap (SimulatedOOM)
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom(error: BaseException | str) -> bool:
    """True when `error` (an exception or its text) is an out-of-memory failure."""
    try:
        import torch

        if isinstance(error, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return any(marker in text for marker in _OOM_MARKERS)
