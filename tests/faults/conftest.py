"""Fault tests run the real CLI in subprocesses and kill it the way clusters do.

Every process check is scoped to the processes a test started: a trial process carries its
planner's identity in `AUTOFIT_PLANNER` (`<pid>:<start time>`), so a test finds the trial of the
planner it launched by that pid and nothing else on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from autofit.files import atomic_write
from autofit.trials.guard import PLANNER_ENV

AUTOFIT = [sys.executable, "-m", "autofit.cli"]
SPACE = """\
seq_len: 32
knobs:
  lora_rank: [8]
  micro_batch: [1, 2]
  wrap: [layer]
"""


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: its own device-lock folder (so the test's planners
    take turns with each other only), its own temp folder, no terminal colours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOFIT_")}
    env.update({"AUTOFIT_LOCK_DIR": str(tmp_path / "locks"), "NO_COLOR": "1", **extra})
    env["TMPDIR"] = str(tmp_path)  # the trials' scratch folders, where the test can see them
    return env


def plan_cmd(tmp_path: Path, *extra: str, gpus: str = "2", space_text: str = SPACE) -> list[str]:
    space = tmp_path / "S.yaml"
    # planners started one after another read this file while the next command is made: it is
    # written once (a rewrite truncates it first, and a planner reading it then finds it empty)
    if not space.exists() or space.read_text() != space_text:
        atomic_write(space, space_text)
    return [
        *AUTOFIT, "plan", "--model", "llama-debug", "--gpus", gpus, "--device", "cpu",
        "--seq-len", "32", "--space", str(space), *extra,
    ]  # fmt: skip


def trial_processes(planner_pid: int) -> list[psutil.Process]:
    """Live processes (torchrun and workers) of trials that planner `planner_pid` launched."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            planner = proc.environ().get(PLANNER_ENV, "")
            if planner.split(":", 1)[0] == str(planner_pid) and proc.status() != "zombie":
                found.append(proc)
    return found


def workers_of(planner_pid: int) -> list[psutil.Process]:
    out = []
    for proc in trial_processes(planner_pid):
        with contextlib.suppress(psutil.Error):
            cmd = proc.cmdline()
            if cmd[1:4] == ["-u", "-m", "autofit.trials.worker"]:  # not torchrun, which names it
                out.append(proc)
    return out


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@pytest.fixture
def spawn() -> Iterator:  # type: ignore[type-arg]
    """Start CLI subprocesses; whatever a test leaves behind is killed at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        leftovers = trial_processes(proc.pid)
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait(timeout=30)
        for left in leftovers:
            with contextlib.suppress(psutil.Error):
                left.kill()


# ----- a throw-away PostgreSQL server -------------------------------------------------------------
def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).is_file():
            return str(folder / name)
    return None


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PostgreSQL server of its own in a temp dir, reached through a Unix socket only (no port
    to race for); yields its SQLAlchemy URL. Skips where PostgreSQL or psycopg is missing, unless
    AUTOFIT_REQUIRE_POSTGRES=1 (`.ci/run`), where that is a failure."""
    initdb, server = _pg_bin("initdb"), _pg_bin("postgres")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        initdb = None
    if initdb is None or server is None:
        if os.environ.get("AUTOFIT_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL (initdb, postgres) or psycopg is missing")
        pytest.skip("PostgreSQL (initdb, postgres) or psycopg is not installed")
    root = tmp_path_factory.mktemp("pg")
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
        root.chmod(0o755)
        for parent in root.parents:
            with contextlib.suppress(OSError):
                parent.chmod(parent.stat().st_mode | 0o005)
        as_user = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "autofit", "--no-sync"],
        check=True, capture_output=True,
    )  # fmt: skip
    log = open(root / "server.log", "w")  # noqa: SIM115 - open for the server's lifetime
    proc = subprocess.Popen(
        [*as_user, server, "-D", str(data), "-k", str(sock), "-c", "listen_addresses=",
         "-c", "fsync=off", "-c", "max_connections=50"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"postgresql://autofit@/postgres?host={sock}"
    try:
        import psycopg

        def ready() -> bool:
            try:
                psycopg.connect(f"host={sock} user=autofit dbname=postgres").close()
                return True
            except psycopg.OperationalError:
                return proc.poll() is not None  # died: stop waiting, fail below

        wait_for(ready, 60, "the PostgreSQL server")
        assert proc.poll() is None, (root / "server.log").read_text()
        yield url
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
