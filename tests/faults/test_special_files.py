"""Special files as targets (issue 25, section 4): `/dev/full` as an export target grew autofit to
23.7 GB (the whole "existing file" was read to look at its first 4,000 characters) and a FIFO hung
it forever. Each is refused at once, with one paragraph, by the real CLI in a subprocess held to
4 GiB of address space and a timeout: a regression fails here instead of eating the machine or
hanging the suite."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.files import NotARegularFile, read_head
from tests.faults.conftest import AUTOFIT, cli_env

LIMIT_S = 90  # a refused target answers in the CLI's start-up time (seconds on a loaded machine)
MEMORY_CAP = 4 << 30  # address space: the refusing CLI imports no torch and maps far less


def cap_memory() -> None:  # pragma: no cover - runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*AUTOFIT, *args], env=cli_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
        timeout=LIMIT_S, preexec_fn=cap_memory,
    )  # fmt: skip


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def targets(fifo: Path) -> dict[str, tuple[Path, str]]:
    return {"/dev/full": (Path("/dev/full"), "a character device"),
            "fifo": (fifo, "a FIFO (named pipe)")}  # fmt: skip


def assert_refused(result: subprocess.CompletedProcess[str], target: Path, kind: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert f"{target} is {kind}, not a regular file" in lines[0], lines[0]


@pytest.mark.parametrize("which", ["/dev/full", "fifo"])
@pytest.mark.parametrize("fmt", ["autofit", "accelerate", "trainer"])
def test_export_to_a_special_file_is_refused_at_once(tmp_path, fifo, which, fmt):
    target, kind = targets(fifo)[which]
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    result = run_cli(tmp_path, "export", "--storage", storage, "--study", "s", "--format", fmt,
                     "--output", str(target))  # fmt: skip
    assert_refused(result, target, kind)
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # the FIFO is still a FIFO, nothing replaced it
    assert not (tmp_path / "study.db").exists()


@pytest.mark.parametrize("which", ["/dev/full", "fifo"])
def test_plan_export_to_a_special_file_is_refused_before_planning(tmp_path, fifo, which):
    target, kind = targets(fifo)[which]
    result = run_cli(tmp_path, "plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials",
                     "--export", str(target))  # fmt: skip
    assert_refused(result, target, kind)
    assert result.stdout == ""  # refused up front: no plan was made


def test_a_fifo_as_the_space_file_is_refused_not_waited_on(tmp_path, fifo):
    result = run_cli(tmp_path, "plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials",
                     "--space", str(fifo))  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"--space '{fifo}' is a FIFO (named pipe), not a space file" in result.stderr


def sparse(path: Path, size: int = 1 << 40) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # a sparse 1 TiB file: reading all of it would fill any memory
    return path


def test_a_huge_model_config_or_space_file_is_refused_unread(tmp_path):
    config, space = sparse(tmp_path / "config.json"), sparse(tmp_path / "space.yaml")
    model = run_cli(tmp_path, "estimate", "-m", str(config), "-g", "2xrtx3090")
    plan = run_cli(tmp_path, "plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials",
                   "--space", str(space))  # fmt: skip
    for result, what in ((model, "a HF model config"), (plan, "a search-space file")):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"cannot be {what}: it is 1,099,511,627,776 bytes" in result.stderr


def test_a_device_as_the_study_storage_is_refused(tmp_path):
    result = run_cli(tmp_path, "export", "--storage", "sqlite:////dev/full", "--study", "s",
                     "--output", str(tmp_path / "p.yaml"))  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "The study storage /dev/full (--storage sqlite:////dev/full) is a character device" in (
        result.stderr
    )


def test_read_head_reads_only_what_it_is_asked_for(tmp_path, fifo):
    assert read_head(sparse(tmp_path / "big"), 16) == b"\0" * 16
    for special in (fifo, Path("/dev/zero"), tmp_path):
        with pytest.raises(NotARegularFile):
            read_head(special, 16)


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("/dev/full and FIFOs as used here are Linux's", allow_module_level=True)
