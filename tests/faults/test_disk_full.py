"""A full disk and a broken study storage (issue 25, section 4). The search's result is printed
before its run folder is written and outlives a write that fails; a storage that is not an SQLite
database, a corrupt one or one on a full disk is one paragraph naming the file; and a plan whose
study is gone is never overwritten. In-process CLI runs with fake trials (`FakeTrials`): a disk
that fills is injected at the one write path, `autofit.files.atomic_write`'s fsync; the storage
on a full disk is a real full filesystem (a 256 KiB tmpfs in a user namespace) where one can be
made."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autofit.cli import app
from tests.faults.conftest import AUTOFIT, SPACE, cli_env
from tests.search.conftest import TINY_SPACE, FakeTrials

runner = CliRunner()


@pytest.fixture(autouse=True)
def fake_trials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeTrials:
    """Trials "measure" from the estimate (no process starts); the work folder is a temp one."""
    fake = FakeTrials()
    monkeypatch.setattr("autofit.search.driver.trials_run_trial", fake)
    monkeypatch.setattr("autofit.hardware.cpu_cores", lambda: 2)
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.chdir(tmp_path)
    return fake


def plan(run_dir: Path, *extra: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, [
        "plan", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--trials", "2",
        "--seq-len", "64", "--space", str(TINY_SPACE), "--gpu-memory", "56MiB",
        "--run-dir", str(run_dir), *extra,
    ])  # fmt: skip


@pytest.fixture
def disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file autofit writes from here on fails as on a full disk (ENOSPC at the fsync of
    `atomic_write`; SQLite's own writes are untouched, as on a disk that still has its pages)."""

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "study.db"}


def test_a_full_disk_keeps_the_result_and_says_what_was_kept(tmp_path, disk_full):
    run_dir = tmp_path / "run"
    result = plan(run_dir)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "Winner (measured, verified): " in result.stdout  # the report, first
    assert "Run folder:" not in result.stdout  # it holds no plan
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    error = errors[0]
    for fragment in (f"the run folder {run_dir} could not be written", "plan.json",
                     "No space left on device", "Kept: no new file", f"{run_dir}/study.db",
                     "autofit export --storage sqlite:///"):  # fmt: skip
        assert fragment in error, error
    assert [p.name for p in run_dir.iterdir()] == ["study.db"]  # no half file, no temp file
    # what it says was kept is kept: the study rebuilds the same winner
    import autofit.search

    data = json.loads(plan(run_dir, "--json").stdout)  # still full: the plan, and why not written
    again = autofit.search.load_study_plan(data["storage"], data["study"])
    assert again.best is not None and again.best.config.to_dict() == data["best"]["config"]
    assert "No space left on device" in data["error"]


def test_a_full_disk_leaves_an_earlier_run_folder_whole(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert plan(run_dir).exit_code == 0
    before = contents(run_dir)
    assert {"plan.json", "plan.yaml", "trials.png"} <= set(before)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC,
                        "No space left on device")))  # fmt: skip
    result = plan(run_dir, "--export", str(tmp_path / "winner.yaml"))
    assert result.exit_code == 2 and "No space left on device" in result.stderr, result.output
    assert contents(run_dir) == before
    assert not (tmp_path / "winner.yaml").exists()


def test_an_empty_study_file_does_not_overwrite_the_plan_it_made(tmp_path):
    run_dir = tmp_path / "run"
    assert plan(run_dir).exit_code == 0
    before = contents(run_dir)
    (run_dir / "study.db").write_bytes(b"")  # 0 bytes: SQLite would take it for a new database
    result = plan(run_dir)
    assert result.exit_code == 2, result.output
    text = " ".join(result.stderr.split())
    assert f"{run_dir / 'plan.json'} holds an earlier plan" in text, text
    assert "is empty (0 bytes)" in text and "It is kept as it is" in text, text
    assert contents(run_dir) == before and (run_dir / "study.db").stat().st_size == 0
    (run_dir / "study.db").unlink()
    gone = plan(run_dir, "--json")
    assert gone.exit_code == 2 and "no longer exists" in json.loads(gone.stdout)["error"]
    assert contents(run_dir) == before and not (run_dir / "study.db").exists()
    elsewhere = plan(run_dir, "--storage", f"sqlite:///{tmp_path / 'other.db'}")
    assert elsewhere.exit_code == 2 and "this search would replace the plan. It is kept" in (
        " ".join(elsewhere.stderr.split())
    )
    assert contents(run_dir) == before and not (tmp_path / "other.db").exists()


def corrupt_sqlite(path: Path) -> None:
    """A real SQLite database whose schema page is overwritten (the header kept)."""
    db = sqlite3.connect(path)
    db.execute("create table t (x text)")
    db.executemany("insert into t values (?)", [("x" * 500,)] * 200)
    db.commit()
    db.close()
    data = bytearray(path.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (lambda p: p.write_text("name,score\nx,1\n"), ["is not an SQLite database",
                                                        "b'name,sco'"]),
        (corrupt_sqlite, ["is corrupt", "SQLite: ", ".recover"]),
        (lambda p: p.mkdir(), ["is a folder, not an SQLite database file"]),
    ],
    ids=["csv", "corrupt", "folder"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["plan", "export"])
def test_a_bad_storage_file_is_one_paragraph_naming_it(tmp_path, make, fragments, command):
    db = tmp_path / "study.db"
    make(db)
    before = db.read_bytes() if db.is_file() else None
    url = f"sqlite:///{db}"
    if command == "plan":
        result = plan(tmp_path / "run", "--storage", url)
    else:
        result = runner.invoke(app, ["export", "--storage", url, "--study", "s",
                                     "--output", str(tmp_path / "p.yaml")])  # fmt: skip
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in [str(db), *fragments]:
        assert fragment in lines[0], lines[0]
    for dump in ("[SQL", "sqlalche.me", "Pass an Optuna RDB URL"):
        assert dump not in lines[0]
    assert (db.read_bytes() if db.is_file() else None) == before  # left as it was


def full_filesystem_available(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k none {tmp_path}"],
                           capture_output=True)  # fmt: skip
    return probe.returncode == 0


def test_a_study_on_a_full_filesystem_is_one_paragraph(tmp_path):
    """The real CLI, its run folder on a tmpfs filled to the last byte."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if not full_filesystem_available(mount):
        pytest.skip("no user namespace with a tmpfs mount here (unshare --map-root-user)")
    (tmp_path / "S.yaml").write_text(SPACE)
    cmd = [*AUTOFIT, "plan", "--model", "llama-debug", "--gpus", "1", "--device", "cpu",
           "--seq-len", "32", "--space", str(tmp_path / "S.yaml"), "--trials", "1",
           "--run-dir", str(mount / "run")]  # fmt: skip
    script = (f"mount -t tmpfs -o size=256k none {mount} && "
              f"(head -c 1000000 /dev/zero > {mount}/fill 2>/dev/null; exec \"$@\")")  # fmt: skip
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *cmd],
        env=cli_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert f"The study database {mount}/run/study.db cannot be written: the disk it is on is " \
           "full" in errors[0], errors[0]  # fmt: skip
    assert "[SQL" not in result.stderr and "sqlalche.me" not in result.stderr


def test_a_calibration_that_cannot_be_stored_keeps_the_earlier_one(monkeypatch, fake_trials):
    from autofit.calibration import store

    monkeypatch.setattr("autofit.trials.run_trials", fake_trials.batch)
    args = ["calibrate", "--device", "cpu", "--gpus", "1", "--quick", "--steps", "2"]
    assert runner.invoke(app, args).exit_code == 0
    stored = {p: p.read_bytes() for p in store.calibration_dir().iterdir()}
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC,
                        "No space left on device")))  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    measured = [line for line in result.stdout.splitlines() if line.startswith("  ok ")]
    assert len(measured) == 6, result.stdout  # each trial shown as it finished, before the store
    error = " ".join(result.stderr.split())
    assert "this machine's calibration could not be stored (No space left on device)" in error
    assert "the one stored before, if any, is whole" in error
    assert {p: p.read_bytes() for p in store.calibration_dir().iterdir()} == stored
