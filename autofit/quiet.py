"""Other libraries' notices kept off a user's terminal while autofit's own code imports and runs
them (a layer trace, a trial worker), shown raw under `--verbose`.

What torch 2.13, torchao 0.18 and transformers 5 print there, and why none of it is the user's
business: torchao's "Failed to load ..._C_mxfp8....so" and "_C_cutlass_90a" (its logger
`torchao`, at import, where a build lacks those kernels: MX formats and CUTLASS kernels, which
autofit never uses), torch's `_pytree` "register_constant() on Enum subclasses is deprecated"
(torchao registering its enums, at import), and transformers' "`past_key_values`/`cache_params`
are deprecated" (the model's output read by a library, during a trace). A warning that matters
is autofit's to say in its own words (autofit raises or warns with `AutofitWarning`), and errors
(`logging.ERROR` and above, exceptions) always show.

`quiet_libraries()` is a scope, not a setting: on exit the logging threshold and the warning
filters are what they were, so a user's own `autofit.apply` run in the same process logs as the
libraries would. `--verbose` (or `AUTOFIT_VERBOSE=1`, which trial workers inherit) turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

__all__ = ["VERBOSE_ENV", "quiet_libraries", "set_verbose", "verbose"]

VERBOSE_ENV = "AUTOFIT_VERBOSE"

LIBRARIES = r"(torch|torchao|transformers|peft|accelerate)(\.|$)"
"""The modules whose Python warnings the scope hides (a regex of the warning's module)."""


def verbose() -> bool:
    """Whether other libraries' notices are shown raw (`--verbose`, `AUTOFIT_VERBOSE=1`)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    """Show (or hide) other libraries' notices from now on, in this process and in the trial
    processes it starts (through the environment they inherit)."""
    if on:
        os.environ[VERBOSE_ENV] = "1"
    else:
        os.environ.pop(VERBOSE_ENV, None)


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """While autofit imports or runs torch, torchao, transformers or peft for its own ends: their
    log records below ERROR and their Python warnings are dropped (nothing is changed with
    `verbose()`). A threshold (`logging.disable`), not a logger's level: transformers resets its
    loggers' levels when it is first imported, which happens inside the scope."""
    if verbose():
        yield
        return
    threshold = logging.root.manager.disable
    logging.disable(max(threshold, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=LIBRARIES)
            yield
    finally:
        logging.disable(threshold)
