"""Planners that open one new study storage at the same moment all get it: SQLite's tables are
made by one process of the host at a time, a server's races are told by their SQLSTATE and
opened again. Without either, one in six of such processes failed here in most tries."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy.exc import IntegrityError, OperationalError

from autofit.search.storage_file import (
    SQLITE_BUSY,
    SQLITE_NOTADB,
    lost_schema_race,
    sqlite_code,
    storage_error,
)

# each process waits for the same instant, then opens the storage and makes the study in it
OPEN_AT = r"""
import sys, time
import optuna
from autofit.errors import AutofitError
from autofit.search import study as st
at = float(sys.argv[2])
while time.time() < at:
    time.sleep(0.0005)
try:
    storage = st.open_storage(sys.argv[1])
    optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
    print("ok")
except AutofitError as exc:
    print(exc)
"""


def open_at_once(url: str, n: int = 6) -> list[str]:
    at = time.time() + 5  # past every process's imports on a loaded machine
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_AT, url, str(at)], stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for _ in range(n)
    ]
    return [p.communicate(timeout=120)[0].strip() for p in procs]


@pytest.mark.timeout(180)
def test_six_planners_open_one_new_sqlite_file_at_once(tmp_path: Path) -> None:
    assert open_at_once(f"sqlite:///{tmp_path / 'study.db'}") == ["ok"] * 6


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_six_planners_open_one_new_postgres_database_at_once(postgres: str) -> None:
    import psycopg

    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute("CREATE DATABASE fresh")
    assert open_at_once(postgres.replace("/postgres?", "/fresh?")) == ["ok"] * 6


def test_a_duplicate_or_a_busy_database_is_a_race_and_other_errors_are_not(tmp_path: Path) -> None:
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE v (n INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO v VALUES (1)")
    with pytest.raises(IntegrityError) as duplicate, engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO v VALUES (1)")
    assert lost_schema_race(duplicate.value)

    holder = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process writing
    impatient = sqlalchemy.create_engine(
        f"sqlite:///{tmp_path / 'a.db'}", connect_args={"timeout": 0}
    )
    with pytest.raises(OperationalError) as busy, impatient.begin() as conn:
        conn.exec_driver_sql("INSERT INTO v VALUES (2)")
    holder.rollback()
    assert sqlite_code(busy.value) == SQLITE_BUSY and lost_schema_race(busy.value)

    with pytest.raises(OperationalError) as syntax, engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLEE w (n INTEGER)")
    assert not lost_schema_race(syntax.value)


def test_a_file_that_is_not_a_database_is_told_by_sqlites_code(tmp_path: Path) -> None:
    path = tmp_path / "study.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\x07" * 4000)  # its header, then garbage
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    with pytest.raises(sqlalchemy.exc.DatabaseError) as bad, engine.begin() as conn:
        conn.exec_driver_sql("SELECT * FROM sqlite_master")
    assert sqlite_code(bad.value) == SQLITE_NOTADB
    message = str(storage_error(f"sqlite:///{path}", bad.value))
    assert message.startswith(f"The study database {path} is corrupt")
