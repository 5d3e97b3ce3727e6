"""Up-front checks of what a user asked for, so nothing fails after a search has run.

Outputs (the run folder, an export file) are checked writable before any trial; study names that
become folder names are held to safe characters; and `AutofitWarning` is what autofit warns with
when a request is allowed but probably not what the user meant (the CLI prints it on stderr as
one `warning:` paragraph).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from autofit.errors import AutofitError


class AutofitWarning(UserWarning):
    """Allowed, but probably not what was meant; the message says why and what to do."""


MAX_SEQ_LEN = 16_777_216
"""The longest sequence `seq_len` takes (its declaration, `autofit.config.Config`, reads it):
16 Mi tokens, past the longest context of any model; no length of the data is longer (a length
file's are held to it, `autofit.data.read`)."""


# ----- the terminal's width -----------------------------------------------------------------------
DEFAULT_COLUMNS = 80
"""The width of what autofit prints where `COLUMNS` names one no terminal has (rich's default)."""
MAX_COLUMNS = 1000
"""The widest `COLUMNS` taken as a terminal's width: past it the value is a mistake (a help page
or a table ruled that wide would be megabytes of spaces)."""


def terminal_columns(value: str | None) -> int | None:
    """The width `COLUMNS` (`value`) names: None where it is unset or blank (the terminal is
    measured); `DEFAULT_COLUMNS` where no terminal has that width (0, negative, not a whole
    number, above `MAX_COLUMNS`)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_COLUMNS:
        return DEFAULT_COLUMNS
    return int(text)


def sane_columns() -> None:
    """`COLUMNS` in this process's environment made a width a terminal can have
    (`terminal_columns`), for every reader of it: autofit's consoles, typer's help pages, rich's
    progress bar (and the trial processes that inherit it)."""
    columns = terminal_columns(os.environ.get("COLUMNS"))
    if columns is not None:
        os.environ["COLUMNS"] = str(columns)


def user_error(message: str, hint: str, cls: type[AutofitError] = AutofitError) -> AutofitError:
    """An `AutofitError` whose paragraph is `message` then `hint`; `exc.hint` keeps the hint
    apart for the CLI's `--json` error object."""
    exc = cls(f"{message} {hint}")
    exc.hint = hint  # type: ignore[attr-defined]
    return exc


# ----- outputs ------------------------------------------------------------------------------------
def _nearest_existing(path: Path) -> Path:
    """`path` itself or its nearest ancestor that exists (as anything: folder, file, link)."""
    probe = path
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    return probe


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_dir_writable(folder: str | Path, what: str, hint: str) -> Path:
    """Fail with one paragraph unless files can be written in `folder` (made if missing).

    Nothing is left behind: a folder that does not exist yet is tried by making and removing a
    temporary folder in its nearest existing ancestor. `what` names the folder for the user
    (e.g. "--run-dir /x"); `hint` says what to do instead."""
    folder = Path(folder).expanduser()
    base = _nearest_existing(folder)
    if base.exists() and not base.is_dir():
        raise user_error(f"Cannot write {what}: {base} is a file, not a folder.", hint)
    try:
        if base == folder:
            fd, tmp = tempfile.mkstemp(prefix=".autofit-check-", dir=folder)
            os.close(fd)
            os.unlink(tmp)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".autofit-check-", dir=base))
    except OSError as exc:
        raise user_error(
            f"Cannot write {what}: no file can be made in {base} ({_why(exc)}).", hint
        ) from None
    return folder


def check_file_writable(path: str | Path, what: str, hint: str) -> Path:
    """Fail with one paragraph unless a file can be written at `path`: its folder must exist
    (autofit makes none for a file the user names: a typo in it would be made without a word).
    An existing folder at `path` is refused too."""
    from autofit.files import special_kind

    path = Path(path).expanduser()
    if path.is_dir():
        raise user_error(f"Cannot write {what}: it is a folder; pass a file path.", hint)
    kind = special_kind(path)
    if kind is not None:  # /dev/full, a FIFO: replacing it, or reading it first, is never meant
        raise user_error(
            f"Cannot write {what}: {path} is {kind}, not a regular file; autofit writes only "
            "regular files (a new one, or one it wrote before).",
            hint,
        )
    folder = path.parent
    if _nearest_existing(folder).is_dir() and not folder.is_dir():
        raise user_error(
            f"Cannot write {what}: the folder {folder} does not exist, and autofit makes no "
            "folder for a file you name.",
            f"Make it first (mkdir -p {folder}), or choose a file in a folder that exists.",
        )
    check_dir_writable(folder, what, hint)
    return path


# ----- trial lengths ------------------------------------------------------------------------------
def check_steps(steps: int) -> None:
    if steps < 1:
        raise AutofitError(
            f"--steps must be at least 1 (optimizer steps measured per trial, after one warm-up "
            f"step); got {steps}."
        )


TRIAL_TIMEOUT_S = 600.0
"""Seconds one trial may run before every process of it is killed, unless --trial-timeout says
otherwise: the default of every command, API function and launcher that runs trials. A search
holds each trial to less where its estimate says it should take less
(`autofit.trials.budget.TrialTime.limit_s`)."""

SEARCH_TIMEOUT_S = 900.0
"""Seconds a search starts trials for unless --search-timeout says otherwise (no trial starts
after it; the last one and the verification still finish): a plan of a 7B model on one GPU is
done in about a quarter of an hour, about 20 trials of 40-50 s on an H200."""


def check_trial_timeout(seconds: float | None) -> None:
    """None (each trial's limit from its estimate) or a positive number of seconds."""
    if seconds is not None and not seconds > 0:
        raise AutofitError(
            f"The trial timeout (--trial-timeout) must be a positive number of seconds; got "
            f"{seconds}."
        )


def check_search_flags(timeout: float | None, node_rank: int | None) -> None:
    """The whole search's limit (--search-timeout): None (no limit) or a positive number; and
    --node-rank, a node's index from 0 (checked against the nodes with the hardware:
    `autofit.arguments.node_rank_of`). Checked with or without trials: a bad value is never
    just ignored."""
    if timeout is not None and not timeout > 0:
        raise AutofitError(
            f"--search-timeout must be a positive number of seconds (no new trial starts after "
            f"it), or left out for no limit; got {timeout}."
        )
    if node_rank is not None and node_rank < 0:
        raise AutofitError(
            f"--node-rank must be 0 or more (0 is the node that chooses the trials, 1, 2, ... the "
            f"others); got {node_rank}."
        )


# ----- names that become folder names -------------------------------------------------------------
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SAFE_NAME_TEXT = (
    "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters"
)


def check_study_name(name: str) -> str:
    """A study name that becomes the run folder's name must be one plain folder name."""
    if not SAFE_NAME.fullmatch(name):
        raise user_error(
            f"--study {name!r} cannot name a run folder: a study name that becomes a folder "
            f"name may use only {SAFE_NAME_TEXT}.",
            "Choose such a name, or keep the name and pick the folder with --run-dir.",
        )
    return name


RUNS_DIR = Path("autofit-runs")
"""Where a search keeps its run folder unless --run-dir names one: `autofit-runs/<study>`."""


def default_run_dir(study: str) -> Path:
    """The run folder of study `study` when no --run-dir is given."""
    return RUNS_DIR / folder_name(study)


def folder_name(name: str) -> str:
    """`name` made into one safe folder name (a default study name of a model given by path
    holds slashes): unsafe runs of characters become '-'."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    return safe[-128:].strip("-.") or "study"  # the tail keeps the settings' digest


# ----- storages that must exist -------------------------------------------------------------------
def sqlite_path(url: str) -> Path | None:
    """The file of an SQLite storage URL; None for other storages, in-memory databases and a
    malformed URL (opening the storage says what is wrong with it)."""
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        database = make_url(url).database
    except (ArgumentError, ValueError):  # not a URL sqlalchemy can parse; a port not a number
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser()


STUDY_DB_HINT = (
    "Check the path: `autofit plan` keeps its study in the run folder's study.db "
    "(autofit-runs/<study>/study.db unless --run-dir or --storage said otherwise)."
)


def check_sqlite_exists(url: str) -> None:
    """A study to read (`autofit export`) must be in an existing SQLite file: opening a missing
    one, as SQLite does, would create an empty database and then report no study."""
    path = sqlite_path(url)
    if path is None or path.exists():  # not a file: opening the storage says what it is
        return
    found = sorted(str(p) for p in RUNS_DIR.glob("*/study.db"))[:5]
    here = f" SQLite files of autofit studies here: {', '.join(found)}." if found else ""
    raise user_error(
        f"No SQLite database at {str(path)!r} (from --storage {url}); autofit does not create "
        f"one to export from.{here}",
        STUDY_DB_HINT,
    )
