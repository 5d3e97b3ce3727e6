"""Launch one trial as `torchrun` subprocess (one process per device) and read its JSON result.

The caller always survives: an OOM on any rank is status `oom`, a run past `timeout_s` is killed
with every process it started and is `timeout`, anything else is `error` with the last lines of
its stderr. torchrun starts each worker in a session of its own, so killing torchrun's process
group is not enough: the workers write their pids at start and are killed by those too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from autofit.config import Config, sharding_for
from autofit.errors import AutofitError, is_oom
from autofit.models import ModelSpec, resolve_model
from autofit.trial.result import TrialResult

STDERR_TAIL_LINES = 25


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _env(nprocs: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_repo_root(), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def _tail(path: Path, n: int = STDERR_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _kill_tree(proc: subprocess.Popen[bytes], workdir: Path) -> None:
    """SIGKILL torchrun's group, every descendant's group, and every worker that wrote a pid."""
    victims: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        victims = psutil.Process(proc.pid).children(recursive=True)
    for pid_file in workdir.glob("pid.*"):
        with contextlib.suppress(ValueError, OSError, psutil.Error):
            worker = psutil.Process(int(pid_file.read_text()))
            if any("autofit.trial.worker" in part for part in worker.cmdline()):
                victims.append(worker)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for victim in victims:
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(victim.pid) == victim.pid:
                os.killpg(victim.pid, signal.SIGKILL)
            victim.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    psutil.wait_procs(victims, timeout=10)


def _rank_reports(workdir: Path) -> list[dict[str, Any]]:
    reports = []
    for path in sorted(workdir.glob("result.json.rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text()))
    return reports


def run_trial(
    model: str | ModelSpec,
    config: Config,
    *,
    nprocs: int = 1,
    device: str = "cuda",
    gpu_memory: int | None = None,
    steps: int = 3,
    warmup: int = 1,
    timeout_s: float = 600.0,
) -> TrialResult:
    """Run `config` for real on `nprocs` devices; never raises for oom, timeout or error."""
    start = time.monotonic()
    result = TrialResult(
        status="error",
        config=config.to_dict(),
        model=model.name if isinstance(model, ModelSpec) else str(model),
        device=device,
        nprocs=nprocs,
        capacity_bytes=gpu_memory,
        sharding=str(sharding_for(config.wrap, nprocs)),
    )
    problem = _precheck(device, nprocs)
    try:
        spec = resolve_model(model)
    except AutofitError as exc:
        problem = str(exc)
    if problem:
        result.message = problem
        result.wall_s = time.monotonic() - start
        return result
    result.model = spec.name
    payload = {
        "model": asdict(spec),
        "config": config.to_dict(),
        "device": device,
        "gpu_memory": gpu_memory,
        "steps": steps,
        "warmup": warmup,
    }
    with tempfile.TemporaryDirectory(prefix="autofit-trial-") as tmp:
        workdir = Path(tmp)
        _launch(payload, nprocs, timeout_s, workdir, result)
    result.wall_s = time.monotonic() - start
    return result


def _precheck(device: str, nprocs: int) -> str:
    if device not in ("cuda", "cpu"):
        return f"device must be 'cuda' or 'cpu'; got {device!r}."
    if nprocs < 1:
        return f"nprocs must be at least 1; got {nprocs}."
    if device == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < nprocs:
            return (
                f"The trial needs {nprocs} CUDA GPU(s) but this machine has {have}. Run with "
                "fewer GPUs, or use device='cpu' (--device cpu) to run the same code on CPU."
            )
    return ""


def _launch(
    payload: dict[str, Any], nprocs: int, timeout_s: float, workdir: Path, result: TrialResult
) -> None:
    spec_path, out_path = workdir / "spec.json", workdir / "result.json"
    spec_path.write_text(json.dumps(payload))
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={nprocs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "--max-restarts=0", "--monitor-interval=0.2",
        "-m", "autofit.trial.worker", "--spec", str(spec_path), "--out", str(out_path),
    ]  # fmt: skip
    stdout_path, stderr_path = workdir / "stdout.log", workdir / "stderr.log"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=_env(nprocs), start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_tree(proc, workdir)  # also clears stragglers after a normal exit
    stderr = _tail(stderr_path)
    if timed_out:
        result.status = "timeout"
        result.message = f"The trial ran past its limit of {timeout_s:g} s and was killed."
        return
    if out_path.is_file():
        data = json.loads(out_path.read_text())
        for key, value in data.items():
            setattr(result, key, value)
        return
    reports = _rank_reports(workdir)
    ooms = [r for r in reports if r.get("status") == "oom"]
    if ooms or (not reports and is_oom(stderr)):
        result.status = "oom"
        result.message = ooms[0]["message"] if ooms else stderr
        return
    result.status = "error"
    errors = [r["message"] for r in reports if r.get("status") == "error"]
    head = errors[0] if errors else f"torchrun exited with code {proc.returncode}"
    result.message = f"{head}\n--- last lines of stderr ---\n{stderr}"
