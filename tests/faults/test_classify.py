"""Why a trial failed (issue 8, fault 4): OOM from the worker's exception first, then ranks the
kernel killed, then all of the output; a hung collective costs seconds, not --trial-timeout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import pytest
import torch

from autofit.config import Config
from autofit.errors import GPU, HOST, oom_kind
from autofit.trials import TrialResult, run_trial
from autofit.trials.failures import classify_failure
from autofit.trials.memory import TensorTracker
from tests.faults.inject import fault_env

SHORT = {"seq_len": 32, "micro_batch": 1, "lora_rank": 8}


def _caught(fn) -> tuple[BaseException, str]:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc, "".join(traceback.format_exception(exc))
    raise AssertionError("did not raise")


def test_real_allocation_failures_are_told_apart() -> None:
    def device_cap() -> None:  # a CPU trial's emulated GPU: torch.OutOfMemoryError
        with TensorTracker(cap_bytes=1024):
            torch.ones(4096)

    def host_ram() -> None:  # a real failed host allocation: a plain RuntimeError
        torch.empty(2**50, dtype=torch.uint8)

    assert oom_kind(*_caught(device_cap)) == GPU
    assert oom_kind(*_caught(host_ram)) == HOST
    assert oom_kind(MemoryError()) == HOST
    assert oom_kind(*_caught(lambda: int("x"))) is None
    assert oom_kind(RuntimeError("Expected all tensors to be on the same device")) is None


def test_a_failed_pinned_allocation_is_the_hosts_not_the_gpus() -> None:
    # cudaHostAlloc fails with the runtime's generic text; the traceback shows where it was
    pinned_tb = 'File ".../torch/utils/_device.py", in pin_memory\nRuntimeError: CUDA error: out of'
    gpu_tb = 'File ".../torch/nn/modules/linear.py", in forward\nRuntimeError: CUDA error: out of'
    assert oom_kind(RuntimeError("CUDA error: out of memory"), pinned_tb) == HOST
    assert oom_kind(RuntimeError("CUDA error: out of memory"), gpu_tb) == GPU


def test_oom_text_before_torchruns_long_summary_is_still_found(tmp_path: Path) -> None:
    """No rank could report (killed mid-write): the OOM line is 40+ lines above the end."""
    stderr = "\n".join(
        ["[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
        + [f"torchrun summary line {i}" for i in range(40)]
    )
    result = TrialResult(status="error", config={}, model="m")
    classify_failure(result, tmp_path, stderr, "", 1, None)
    assert (result.status, result.oom_of) == ("oom", GPU)


def test_a_rank_that_reported_an_error_is_not_reread_as_oom(tmp_path: Path) -> None:
    report = {"status": "error", "message": "rank 0: ValueError: bad shape"}
    (tmp_path / "result.json.rank0.json").write_text(json.dumps(report))
    result = TrialResult(status="error", config={}, model="m")
    classify_failure(result, tmp_path, "... out of memory ...", "", 1, None)
    assert result.status == "error" and result.message.startswith("rank 0: ValueError")


@pytest.mark.slow
def test_hung_collective_fails_in_seconds_not_at_the_trial_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in fault_env("hang-collective").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AUTOFIT_COLLECTIVE_TIMEOUT_S", "3")
    result = run_trial("llama-debug", Config(**SHORT), nprocs=2, device="cpu", timeout_s=120)
    # the collective's own 3 s limit ended it: the trial's 120 s limit would be a `timeout`
    assert result.status == "error", result.message
    assert "rank 0" in result.message


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A cgroup-v1 memory cgroup with a hard limit, where the host allows one (root)."""
    root = Path("/sys/fs/cgroup/memory")
    if not root.is_dir() or os.geteuid() != 0:
        return None
    group = root / f"autofit-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


@pytest.mark.slow
def test_a_worker_killed_by_the_hosts_oom_killer_is_an_oom_of_host_memory(tmp_path: Path) -> None:
    """The real thing: the trial runs in a memory cgroup of 3 GiB and a worker outgrows it; the
    kernel's OOM killer kills it (the worker offers itself first) and the planner says why."""
    group = _memory_cgroup(3 << 30)
    if group is None:
        pytest.skip("no writable cgroup-v1 memory controller here")
    env = {**os.environ, **fault_env("host-oom"), "TMPDIR": str(tmp_path),
           "AUTOFIT_LOCK_DIR": str(tmp_path / "locks")}  # fmt: skip
    cmd = [sys.executable, "-m", "autofit.cli", "trial", "--model", "llama-debug", "--gpus", "1",
           "--device", "cpu", "--seq-len", "32", "--json"]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=300,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
    result = json.loads(proc.stdout)
    assert (result["status"], result["oom_of"]) == ("oom", HOST), result["message"]
    assert "OOM killer" in result["message"]
