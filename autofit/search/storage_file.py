"""The study's storage, in words: an SQLite file checked before it is opened (a folder, a device,
a file that is not an SQLite database are refused without touching them), and a storage that
fails to open (a full disk, a corrupt database, a bad URL) told in one paragraph that names the
file and what is wrong with it, instead of SQLAlchemy's dump."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from autofit.checks import STUDY_DB_HINT, check_sqlite_exists, sqlite_path
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


def check_sqlite_study(url: str, study: str) -> None:
    """A study only read (`autofit export`) must be in an SQLite file that exists and is not
    empty: SQLite would make a new database of either, and Optuna would fill it with its tables,
    only to report that no study is there."""
    check_sqlite_exists(url)
    path = sqlite_path(url)
    if path is not None and path.is_file() and path.stat().st_size == 0:
        raise AutofitError(
            f"No study named {study!r} in {path} (--storage {url}): the file is empty (0 "
            f"bytes), so it holds no study; autofit leaves it as it is. {STUDY_DB_HINT}"
        )


def read_only_sqlite(url: str) -> Callable[[], sqlite3.Connection]:
    """A connection maker that opens the SQLite file of `url` read-only (SQLite's `mode=ro`):
    a write, Optuna's tables created in a database without them included, fails instead."""
    path = sqlite_path(url)
    assert path is not None, url
    uri = f"{path.resolve().as_uri()}?mode=ro"
    return lambda: sqlite3.connect(uri, uri=True, timeout=60, check_same_thread=False)


def not_a_study_database(url: str) -> AutofitError:
    """An SQLite database without Optuna's tables: no study was ever stored in it."""
    return AutofitError(
        f"{sqlite_path(url)} (--storage {url}) is an SQLite database but holds no Optuna study "
        f"(it has none of Optuna's tables); autofit leaves it as it is. {STUDY_DB_HINT}"
    )


# SQLite's primary result codes (sqlite.org/rescode.html; `sqlite3.SQLITE_*` from Python 3.11):
# an error's `sqlite_errorcode` is one of them, or an extended code whose low byte is
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY = 5, 6, 8
SQLITE_CORRUPT, SQLITE_FULL, SQLITE_CANTOPEN, SQLITE_NOTADB = 11, 13, 14, 26
# PostgreSQL's SQLSTATEs (postgresql.org/docs/current/errcodes-appendix.html) of one schema or
# its first rows made by two processes at once: unique_violation (both insert Optuna's
# version row, or the same type name), duplicate_table, duplicate_object, deadlock_detected
SCHEMA_RACE_SQLSTATES = frozenset({"23505", "42P07", "42710", "40P01"})


def sqlite_code(error: BaseException) -> int | None:
    """The primary SQLite result code of a storage error (SQLAlchemy's, or the driver's own),
    None where SQLite did not raise it."""
    cause = getattr(error, "orig", None) or error
    code = getattr(cause, "sqlite_errorcode", None)  # Python 3.11+
    if code is None and isinstance(cause, sqlite3.Error):  # Python 3.10: its words alone
        said = str(cause).lower()
        words = {"locked": SQLITE_BUSY, "readonly": SQLITE_READONLY, "malformed": SQLITE_CORRUPT,
                 "disk is full": SQLITE_FULL, "unable to open": SQLITE_CANTOPEN,
                 "not a database": SQLITE_NOTADB}  # fmt: skip
        code = next((c for w, c in words.items() if w in said), None)
    return None if code is None else code & 0xFF


def lost_schema_race(error: BaseException) -> bool:
    """Another process made the storage's tables or their first rows at the same moment: the
    database refused a duplicate (SQLAlchemy's typed `IntegrityError`, a PostgreSQL SQLSTATE of
    `SCHEMA_RACE_SQLSTATES`) or was busy past its timeout. Opening it again finds them made."""
    from sqlalchemy.exc import IntegrityError

    if isinstance(error, IntegrityError):
        return True
    cause = getattr(error, "orig", None)
    state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)  # psycopg 3, 2
    if state is not None:
        return state in SCHEMA_RACE_SQLSTATES
    return sqlite_code(error) in (SQLITE_BUSY, SQLITE_LOCKED)


def storage_error(url: str, error: BaseException) -> AutofitError:
    """One paragraph for a storage that could not be opened: what the database said (not the
    SQL), the file, and what to do."""
    cause = getattr(error, "orig", None) or error  # the driver's own error, without SQL text
    said = " ".join(str(cause).split()) or type(cause).__name__
    path = sqlite_path(url)
    code = sqlite_code(error)
    if path is not None and code == SQLITE_FULL:
        return AutofitError(
            f"The study database {path} cannot be written: the disk it is on is full (SQLite: "
            f"{said}). Nothing was run. Free some space, or pass --run-dir (or --storage "
            "sqlite:///PATH) a folder on another disk."
        )
    if path is not None and code in (SQLITE_NOTADB, SQLITE_CORRUPT):
        return AutofitError(
            f"The study database {path} is corrupt (SQLite: {said}); autofit leaves it as it is. "
            f"{_FRESH}; `sqlite3 {path} .recover` may save its trials."
        )
    if path is not None and code in (SQLITE_CANTOPEN, SQLITE_READONLY):
        return AutofitError(
            f"Cannot open the study database {path} (SQLite: {said}): its folder must exist "
            "and be writable. Pass --run-dir a folder you can write in, or --storage another path."
        )
    return AutofitError(
        f"Cannot open the Optuna storage {url!r} ({type(cause).__name__}: {said}). Pass an "
        "Optuna RDB URL such as sqlite:///autofit.db or "
        "postgresql://user:password@host/db (its driver: pip install 'autofit[postgres]')."
    )
