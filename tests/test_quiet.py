"""Only autofit's own lines on a user's terminal: other libraries' notices are dropped inside
`quiet_libraries()` (autofit's traces and trial workers) and nowhere else, and `--verbose` shows
them raw."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from autofit.quiet import VERBOSE_ENV, quiet_libraries


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _notices() -> None:
    """What torchao does at import and transformers during a trace: a warning on their logger,
    and a library's Python deprecation warning."""
    logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
    warnings.warn_explicit("deprecated", FutureWarning, "generic.py", 1, module="transformers.x")


@pytest.fixture
def kept():  # type: ignore[no-untyped-def]
    handler, logger = Kept(), logging.getLogger("torchao")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_notices_are_dropped_inside_the_scope_and_shown_after_it(kept, monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_libraries():
            _notices()
            logging.getLogger("torchao").error("a real error")
            warnings.warn("autofit's own", UserWarning, stacklevel=1)
        assert [r.getMessage() for r in kept.records] == ["a real error"]
        assert [str(w.message) for w in shown] == ["autofit's own"]
        _notices()  # after the scope (a user's own `autofit.apply` run): as the library says it
    assert [r.getMessage() for r in kept.records][-1] == "Failed to load _C_mxfp8.so"
    assert [str(w.message) for w in shown][-1] == "deprecated"
    assert logging.root.manager.disable == logging.NOTSET


def test_verbose_keeps_every_notice(kept, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_libraries():
            _notices()
    assert [r.getMessage() for r in kept.records] == ["Failed to load _C_mxfp8.so"]
    assert [str(w.message) for w in shown] == ["deprecated"]


def _cold(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = {**os.environ, "AUTOFIT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(VERBOSE_ENV, None)
    return subprocess.run([sys.executable, "-m", "autofit", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path)  # fmt: skip


@pytest.mark.slow
def test_the_readme_main_job_cold_writes_nothing_on_stderr(tmp_path):
    done = _cold(tmp_path, "plan", "--model", "llama-7b", "--gpus", "2xrtx3090", "--no-trials")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "llama-7b" in done.stdout


@pytest.mark.slow
def test_a_traced_model_says_so_in_its_own_words_and_verbose_shows_the_rest(tmp_path):
    """A model no shipped trace covers (llama-debug at 32 tokens) is traced: one progress line
    of autofit's; with --verbose also the libraries' own lines (with torch 2.13 and torchao 0.18:
    torch's `_pytree` deprecation of torchao's enums, and torchao's kernels a build lacks)."""
    args = ["estimate", "--model", "llama-debug", "--gpus", "1", "--device", "cpu",
            "--seq-len", "32"]  # fmt: skip
    (tmp_path / "quiet").mkdir()
    quiet = _cold(tmp_path / "quiet", *args)
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Tracing llama-debug's decoder layer"), lines
    (tmp_path / "loud").mkdir()
    loud = _cold(tmp_path / "loud", "--verbose", *args)
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout == quiet.stdout
    assert len(loud.stderr.splitlines()) > 1, loud.stderr
