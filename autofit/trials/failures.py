"""Why a trial failed, read from what its processes left: the ranks' own reports (the exception
each caught), which worker died of which signal (torchrun's stderr, or a one-rank launch's own
exit status), and the kernel's OOM-kill count (a host out of RAM). `autofit.trials.launcher`
calls `classify_failure` for a launch that wrote no result."""

from __future__ import annotations

import contextlib
import json
import re
import signal
from pathlib import Path
from typing import Any

from autofit.errors import GPU, HOST, oom_kind
from autofit.trials.result import TrialResult

STDERR_TAIL_LINES = 25
_KILLED = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(text: str, n: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-n:])


def host_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (None where unknown)."""
    for line in read_text(Path("/proc/vmstat")).splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return None


def worker_pids(workdir: Path) -> dict[int, int]:
    """pid -> rank of every worker that wrote its pid (`pid.<rank>`) at start."""
    ranks: dict[int, int] = {}
    for pid_file in workdir.glob("pid.*"):
        with contextlib.suppress(ValueError, OSError):
            ranks[int(pid_file.read_text())] = int(pid_file.name.split(".", 1)[1])
    return ranks


def _rank_reports(workdir: Path) -> list[dict[str, Any]]:
    reports = []
    for path in sorted(workdir.glob("result.json.rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text()))
    return reports


def _killed_ranks(stderr: str, workdir: Path, returncode: int | None) -> dict[int, str]:
    """Ranks that died of a signal, and which one (`SIGKILL`...): those torchrun saw, or the one
    worker of a one-rank launch (no torchrun: its own exit status says the signal)."""
    rank_of = worker_pids(workdir)
    killed = {rank_of.get(int(pid), -1): name for _sig, name, pid in _KILLED.findall(stderr)}
    if not killed and returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            only = next(iter(rank_of.values())) if len(rank_of) == 1 else -1
            killed[only] = signal.Signals(-returncode).name
    return killed


def classify_failure(
    result: TrialResult,
    workdir: Path,
    stderr: str,
    stdout: str,
    returncode: int | None,
    oom_kills_before: int | None,
) -> None:
    """Why a trial that wrote no result failed: what its ranks reported (from the exception they
    caught) first, then ranks the kernel killed, then all of the output when no rank reported."""
    reports = _rank_reports(workdir)
    tail = _tail(stderr)
    ooms = [r for r in reports if r.get("status") == "oom"]
    if ooms:
        result.status, result.oom_of = "oom", ooms[0].get("oom_of") or GPU
        result.message = ooms[0]["message"]
        return
    killed = _killed_ranks(stderr, workdir, returncode)
    sigkilled = ""  # which worker died of SIGKILL not sent by the OOM killer
    if "SIGKILL" in killed.values():
        rank = next(r for r, name in killed.items() if name == "SIGKILL")
        who = f"rank {rank}" if rank >= 0 else "a worker"
        after = host_oom_kills()
        if oom_kills_before is not None and after is not None and after > oom_kills_before:
            result.status, result.oom_of = "oom", HOST
            result.message = (
                f"{who} was killed by the kernel's OOM killer: the host ran out of RAM "
                f"({after - oom_kills_before} OOM kill(s) during the trial)."
            )
            return
        sigkilled = f"{who} was killed by SIGKILL (not by the kernel's OOM killer)."
    errors = [r["message"] for r in reports if r.get("status") == "error"]
    if not reports and not sigkilled:
        kind = oom_kind(stderr + "\n" + stdout)
        if kind is not None:
            result.status, result.oom_of = "oom", kind
            result.message = _tail(stderr, 5)
            return
    result.status = "error"
    head = errors[0] if errors else sigkilled or f"the trial exited with code {returncode}"
    result.message = f"{head}\n--- last lines of stderr ---\n{tail}"
