"""The study's storage, in words: an SQLite file checked before it is opened (a folder, a device,
a file that is not an SQLite database are refused without touching them), and a storage that
fails to open (a full disk, a corrupt database, a bad URL) told in one paragraph that names the
file and what is wrong with it, instead of SQLAlchemy's dump."""

from __future__ import annotations

from autofit.checks import sqlite_path
from autofit.errors import AutofitError
from autofit.files import NotARegularFile, read_head

SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite 3 database file
_FRESH = "Pass --storage a new file (or --run-dir a new folder) to start a new study"


def check_sqlite_file(url: str) -> None:
    """An existing SQLite storage file must be a regular file that is empty (SQLite makes a new
    database of it) or starts with SQLite's header; anything else is refused, untouched."""
    path = sqlite_path(url)
    if path is None or not path.exists():
        return
    try:
        head = read_head(path, len(SQLITE_HEADER))
    except NotARegularFile as exc:
        raise AutofitError(
            f"The study storage {path} (--storage {url}) is {exc.kind}, not an SQLite database "
            f"file. {_FRESH}, or give the path of the study.db file itself."
        ) from None
    except OSError as exc:
        raise AutofitError(
            f"Cannot read the study storage {path} (--storage {url}): {exc.strerror or exc}."
        ) from None
    if head and head != SQLITE_HEADER:
        raise AutofitError(
            f"The study storage {path} (--storage {url}) is not an SQLite database: it does not "
            f"start with SQLite's header (its first bytes: {head[:8]!r}). autofit leaves it as "
            f"it is. {_FRESH}, or point it at the study.db of an earlier plan."
        )


def storage_error(url: str, error: BaseException) -> AutofitError:
    """One paragraph for a storage that could not be opened: what the database said (not the
    SQL), the file, and what to do."""
    cause = getattr(error, "orig", None) or error  # the driver's own error, without SQL text
    said = " ".join(str(cause).split()) or type(cause).__name__
    lowered = said.lower()
    path = sqlite_path(url)
    if path is not None and ("disk is full" in lowered or "no space" in lowered):
        return AutofitError(
            f"The study database {path} cannot be written: the disk it is on is full (SQLite: "
            f"{said}). Nothing was run. Free some space, or pass --run-dir (or --storage "
            "sqlite:///PATH) a folder on another disk."
        )
    if path is not None and ("not a database" in lowered or "malformed" in lowered):
        return AutofitError(
            f"The study database {path} is corrupt (SQLite: {said}); autofit leaves it as it is. "
            f"{_FRESH}; `sqlite3 {path} .recover` may save its trials."
        )
    if path is not None and ("unable to open" in lowered or "readonly" in lowered):
        return AutofitError(
            f"Cannot open the study database {path} (SQLite: {said}): its folder must exist "
            "and be writable. Pass --run-dir a folder you can write in, or --storage another path."
        )
    return AutofitError(
        f"Cannot open the Optuna storage {url!r} ({type(cause).__name__}: {said}). Pass an "
        "Optuna RDB URL such as sqlite:///autofit.db or "
        "postgresql://user:password@host/db (its driver: pip install 'autofit[postgres]')."
    )
