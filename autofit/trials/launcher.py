"""Launch trials as subprocesses (one process per device: a plain `python` process for one rank,
`torchrun` for several) and read their JSON results.

`run_trial` runs one config; `run_trials` runs several configs of one model on the same devices in
one launch, one after the other (the processes' start and imports, most of a small trial's time,
are paid once). Each config is built, stepped and measured on its own, and its time limit starts
when the config before it ended. When a config fails (OOM, error, timeout) its ranks end the
launch at once, so no rank waits in a collective for a config its peers left: the failed config
is reported, the configs before it keep their results, and those after it run again in a new
launch. A stopped launch (`abort`) reports every config it had not finished as stopped.

The caller always survives: an OOM on any rank is status `oom` (of the GPU or of the host), a run
past `timeout_s` is killed with every process it started and is `timeout`, anything else is
`error` with the first rank's error and the last lines of stderr. Trials on one host take turns on
their devices (`devlock`), and every process of a trial dies with the caller however the caller
dies (`guard`). A launch of several ranks on one node lets torchrun pick its own free port
(`--standalone`), and a one-rank worker meets in a store of its own (`rank.join_group`), so there
is no port race.

A trial that spans nodes (`rendezvous`) starts this node's part: torchrun joins the others through
the c10d rendezvous node 0 hosts (`autofit.trials.cluster` says who starts what, and when).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from autofit.checks import TRIAL_TIMEOUT_S
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import AutofitError
from autofit.estimate.memory import outside_allocator_bytes
from autofit.layout import layout_of
from autofit.models import ModelSpec, resolve_model
from autofit.trials import guard
from autofit.trials.devlock import device_lock
from autofit.trials.failures import classify_failure, host_oom_kills, read_text, worker_pids
from autofit.trials.result import TrialResult, config_result

POLL_S = 0.2
# Trial processes kill themselves this long after the trial's limit, should the caller be stuck.
DEADLINE_GRACE_S = 30.0
WORKER_MODULE = "autofit.trials.worker"


@dataclass(frozen=True)
class Rendezvous:
    """This node's place in a trial that spans `nodes` nodes: torchrun's c10d rendezvous at
    `endpoint` (`host:port`, whose store node 0's torchrun hosts: `is_host`) under `run_id`;
    every node's part must have joined within `join_timeout` seconds."""

    nodes: int
    endpoint: str
    run_id: str
    is_host: bool
    join_timeout: float = 300.0

    def torchrun_args(self, per_node: int) -> list[str]:
        join = max(1, round(self.join_timeout))
        conf = f"is_host={str(self.is_host).lower()},join_timeout={join}"
        return [
            f"--nnodes={self.nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}", f"--rdzv-conf={conf}",
        ]  # fmt: skip


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


# What torchrun's agent sets for the processes it starts (torch.distributed.run's documented
# environment). A planner started by torchrun (one per node) carries them; the trial's own
# torchrun, and its workers, must not see the planner's world.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_ERROR_FILE")  # fmt: skip


# A one-rank launch's worker, started without torchrun: the ranks torchrun would set, and no
# MASTER_ADDR/MASTER_PORT (its group of one meets in a store of its own: `rank.join_group`).
ONE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}


def _env(nprocs: int, timeout_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_repo_root(), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env[guard.PLANNER_ENV] = guard.identity()
    env[guard.DEADLINE_ENV] = f"{time.time() + timeout_s + DEADLINE_GRACE_S:.3f}"
    return env


def _kill_tree(proc: subprocess.Popen[bytes], workdir: Path) -> None:
    """SIGKILL the launch's group (torchrun's, or a one-rank launch's worker's), every
    descendant's group, and every worker that wrote a pid."""
    victims: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        victims = psutil.Process(proc.pid).children(recursive=True)
    for pid in worker_pids(workdir):
        with contextlib.suppress(psutil.Error):
            worker = psutil.Process(pid)
            if any(WORKER_MODULE in part for part in worker.cmdline()):
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


def run_trial(model: str | ModelSpec, config: Config, **options: Any) -> TrialResult:
    """Run `config` for real on `nprocs` devices; never raises for oom, timeout or error.
    `options`: those of `run_trials`, which this is for one config, and `rendezvous`: the trial
    spans its nodes (`nprocs` is the devices of all of them; this call starts this node's share).
    """
    return run_trials(model, [config], **options)[0]


def _outside_bytes(
    device: str, nprocs: int, configs: Sequence[Config], context: int | None = None
) -> int:
    """What the estimate puts outside the allocator for a launch of `configs` (the CUDA context,
    this machine's measured `context` where there is one, and NCCL's buffers of the most
    communicators one of them has): a capped trial's cap counts it."""
    k = max((layout_of(c, nprocs).communicators for c in configs), default=0)
    return sum(outside_allocator_bytes(device, nprocs, "pcie", k, context).values())


def run_trials(
    model: str | ModelSpec,
    configs: Sequence[Config],
    *,
    nprocs: int = 1,
    device: str = "cuda",
    gpu_memory: int | None = None,
    steps: int = 3,
    warmup: int = 1,
    timeout_s: float = TRIAL_TIMEOUT_S,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_wait: Callable[[str, str], None] | None = None,
    abort: Callable[[], str | None] | None = None,
    lock: bool = True,
    on_result: Callable[[int, TrialResult], None] | None = None,
    lengths: LengthHistogram | None = None,
    rendezvous: Rendezvous | None = None,
    slow_after_s: float | Sequence[float | None] | None = None,
    context_bytes: int | None = None,
) -> list[TrialResult]:
    """Run each of `configs` for real on `nprocs` devices, in as few launches as their failures
    allow (one when none fails; see the module's rule), and return one result per config, in
    order; never raises for oom, timeout or error.

    Waits while another trial on this host holds the same devices (`on_wait(device, holder)` is
    called first; `lock=False`: the caller holds them); `timeout_s` is each config's limit,
    starting when it does. `on_progress` gets local rank 0's `{"phase": "build"|"warmup"|"step",
    "step": k, "steps": n, "config": i}` as it changes; `on_result(i, result)` is called as soon
    as config i is settled. `abort()`, asked while a trial runs, stops it as an `error` with the
    reason it returns (None: go on). `lengths`: the data's sequence lengths, which the trial's
    micro-batches are drawn from as the config's `batching` lays them out (the first the longest
    the data can produce); its tokens/s then counts useful tokens (padding excluded). Without
    them every micro-batch is `micro_batch x seq_len` random tokens. `rendezvous`: one config's
    trial across nodes (`run_trial`). `slow_after_s` (one for all configs, or one each; None:
    never): a measured step longer than this ends that config's steps, and its result, of the
    steps it measured, is `slow` (`autofit.trials.budget`). `context_bytes`: the CUDA context
    this machine's calibration measured (`Hardware.context_bytes`), which a capped trial's cap
    counts instead of the estimate's default.
    """
    if rendezvous is not None and len(configs) != 1:
        raise ValueError("a trial across nodes runs one config (run_trial)")
    start = time.monotonic()
    configs = [c.resolved(nprocs) for c in configs]  # `wrap: auto` as it runs on these devices
    results = _unsettled_results(model, configs, device, nprocs, gpu_memory)
    nodes = rendezvous.nodes if rendezvous is not None else 1
    per_node = nprocs // nodes
    problem, spec = _launch_problem(model, device, nprocs, nodes)
    if problem:
        return _all_failed(results, problem, start, on_result)
    assert spec is not None
    payload = {
        "model": asdict(spec),
        "device": device,
        "gpu_memory": gpu_memory,
        "outside_bytes": _outside_bytes(device, nprocs, configs, context_bytes),
        "steps": steps,
        "warmup": warmup,
    }
    if lengths is not None:
        payload["lengths"] = lengths.to_dict()
    slow = [slow_after_s] * len(configs) if not isinstance(slow_after_s, Sequence) else slow_after_s
    if len(slow) != len(configs):
        raise ValueError(f"{len(slow)} slow_after_s for {len(configs)} configs")
    launches = _Launches(spec, configs, results, payload, slow, per_node, timeout_s, rendezvous,
                         abort, on_progress, on_result)  # fmt: skip
    guard.sweep_orphans(WORKER_MODULE)
    guard.sweep_stale_workdirs()
    held = device_lock(device, per_node, on_wait) if lock else contextlib.nullcontext()
    with held:
        todo = list(range(len(configs)))
        while todo:
            todo = todo[launches.launch(todo) :]
    return results


def _unsettled_results(
    model: str | ModelSpec, configs: list[Config], device: str, nprocs: int,
    gpu_memory: int | None,
) -> list[TrialResult]:  # fmt: skip
    """One result per config, an `error` until its launch settles it."""
    return [
        TrialResult(
            status="error",
            config=config.to_dict(),
            model=model.name if isinstance(model, ModelSpec) else str(model),
            device=device,
            nprocs=nprocs,
            capacity_bytes=gpu_memory,
            sharding=str(layout_of(config, nprocs).sharding),
        )
        for config in configs
    ]


def _launch_problem(
    model: str | ModelSpec, device: str, nprocs: int, nodes: int
) -> tuple[str, ModelSpec | None]:
    """Why no launch of `nprocs` devices over `nodes` nodes can run here ("": none), and the
    model resolved (None where it cannot be: the problem says why)."""
    per_node = nprocs // nodes
    problem = _precheck(device, per_node)
    if not problem and per_node * nodes != nprocs:
        problem = f"{nprocs} devices cannot be split evenly over {nodes} nodes."
    try:
        spec = resolve_model(model)
    except AutofitError as exc:
        return str(exc), None
    return problem, spec


def _all_failed(
    results: list[TrialResult], problem: str, start: float,
    on_result: Callable[[int, TrialResult], None] | None,
) -> list[TrialResult]:  # fmt: skip
    """Every result an `error` that says `problem`, each settled in turn."""
    for i, result in enumerate(results):
        result.message = problem
        result.wall_s = time.monotonic() - start
        if on_result is not None:
            on_result(i, result)
    return results


@dataclass
class _Launches:
    """What every launch of one `run_trials` call shares: the model, the configs and their
    results, the payload the workers read (its `configs` and `slow_after_s` are each launch's),
    and the caller's limits and callbacks."""

    spec: ModelSpec
    configs: list[Config]
    results: list[TrialResult]
    payload: dict[str, Any]
    slow: Sequence[float | None]
    per_node: int
    timeout_s: float
    rendezvous: Rendezvous | None
    abort: Callable[[], str | None] | None
    on_progress: Callable[[dict[str, Any]], None] | None
    on_result: Callable[[int, TrialResult], None] | None

    def launch(self, todo: list[int]) -> int:
        """Launch the configs `todo` (the caller's indices, in order) in fresh processes, in a
        work folder removed after; how many of them are settled (`_launch`)."""
        batch = [self.results[i] for i in todo]
        for result in batch:
            result.model = self.spec.name
        self.payload["configs"] = [self.configs[i].to_dict() for i in todo]
        self.payload["slow_after_s"] = [self.slow[i] for i in todo]
        workdir = guard.make_workdir()
        first = todo[0]
        settle = _settler(self.on_result, self.results, first)
        try:
            return _launch(
                self.payload, self.per_node, self.timeout_s, workdir, batch,
                _offset(self.on_progress, first), self.rendezvous, self.abort, settle,
            )  # fmt: skip
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _settler(
    on_result: Callable[[int, TrialResult], None] | None, results: list[TrialResult], first: int
) -> Callable[[int], None] | None:
    """`on_result` for a launch whose first config is the caller's `first`-th."""
    if on_result is None:
        return None
    return lambda i: on_result(first + i, results[first + i])


def _offset(
    on_progress: Callable[[dict[str, Any]], None] | None, first: int
) -> Callable[[dict[str, Any]], None] | None:
    """`on_progress` for a launch whose first config is the caller's `first`-th."""
    if on_progress is None or first == 0:
        return on_progress
    return lambda info: on_progress({**info, "config": info.get("config", 0) + first})


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
    payload: dict[str, Any],
    nprocs: int,
    timeout_s: float,
    workdir: Path,
    results: list[TrialResult],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    rendezvous: Rendezvous | None = None,
    abort: Callable[[], str | None] | None = None,
    settle: Callable[[int], None] | None = None,
) -> int:
    """Start this node's `nprocs` ranks (all of them without `rendezvous`: one rank as a plain
    process, several under torchrun) over the payload's configs; fill in `results` (one per
    config, `settle(i)` told as each is final) and return how many are settled: all of them, or
    those before the first that failed and that one (the rest must run again)."""
    settle = settle or (lambda _i: None)
    spec_path, out_path = workdir / "spec.json", workdir / "result.json"
    spec_path.write_text(json.dumps(payload))
    worker = ["-m", WORKER_MODULE, "--spec", str(spec_path), "--out", str(out_path)]
    env = _env(nprocs, timeout_s * len(results))
    one_rank = rendezvous is None and nprocs == 1
    cmd = _command(worker, nprocs, rendezvous)
    if one_rank:
        env.update(ONE_RANK_ENV)
    stdout_path, stderr_path = workdir / "stdout.log", workdir / "stderr.log"
    oom_kills = host_oom_kills()
    watch = _Watch(results, out_path, workdir / "progress.json", settle, on_progress)
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            timed_out, stopped = _wait(proc, watch, timeout_s, abort)
        finally:
            _kill_tree(proc, workdir)  # also clears stragglers after a normal exit
    watch.collect()
    done = watch.done
    if done == len(results):
        return done
    failed = results[done]
    failed.wall_s = time.monotonic() - watch.ended[-1]
    if stopped:
        for i, result in enumerate(results[done:], done):
            result.status, result.message = "error", f"The trial was stopped: {stopped}"
            settle(i)
        return len(results)
    if timed_out:
        failed.status = "timeout"
        failed.message = f"The trial ran past its limit of {timeout_s:g} s and was killed."
    else:
        stderr = read_text(stderr_path)
        classify_failure(
            failed, workdir, stderr, read_text(stdout_path), proc.returncode, oom_kills
        )
    settle(done)
    return done + 1


def _command(worker: list[str], nprocs: int, rendezvous: Rendezvous | None) -> list[str]:
    """The command that starts this node's `nprocs` ranks of `worker`: one rank as a plain
    process (the caller adds `ONE_RANK_ENV`), several under torchrun."""
    if rendezvous is None and nprocs == 1:
        # one GPU runs as `python train.py` does, without torchrun: its start (importing torch
        # once more) and its exit take seconds of every one-rank launch, for a group of one
        return [sys.executable, "-u", *worker]  # as torchrun starts a worker
    where = (
        ["--standalone", f"--nproc-per-node={nprocs}"]
        if rendezvous is None
        else rendezvous.torchrun_args(nprocs)
    )
    return [
        sys.executable, guard.__file__,  # torchrun, guarded to die with this process
        *where, "--max-restarts=0", "--monitor-interval=0.2", *worker,
    ]  # fmt: skip


@dataclass
class _Watch:
    """What the caller reads of a running launch: the results rank 0 writes (each restarts the
    limit) and local rank 0's progress."""

    results: list[TrialResult]
    out_path: Path
    progress_path: Path
    settle: Callable[[int], None]
    on_progress: Callable[[dict[str, Any]], None] | None
    # when the launch started, then when each config's result came
    ended: list[float] = field(default_factory=lambda: [time.monotonic()])
    last_progress: str = ""

    @property
    def done(self) -> int:
        """How many configs have their result."""
        return len(self.ended) - 1

    def collect(self) -> None:
        """Take the results rank 0 has written since the last look; each restarts the limit."""
        ended, results, out_path = self.ended, self.results, self.out_path
        while len(ended) <= len(results) and config_result(out_path, len(ended) - 1).is_file():
            result = results[len(ended) - 1]
            result.update(json.loads(config_result(out_path, len(ended) - 1).read_text()))
            ended.append(time.monotonic())
            result.wall_s = ended[-1] - ended[-2]
            self.settle(len(ended) - 2)

    def report_progress(self) -> None:
        """Pass local rank 0's progress on, where it changed since the last look."""
        now = read_text(self.progress_path)
        if self.on_progress is not None and now and now != self.last_progress:
            self.last_progress = now
            with contextlib.suppress(ValueError):
                self.on_progress(json.loads(now))


def _wait(
    proc: subprocess.Popen[bytes], watch: _Watch, timeout_s: float,
    abort: Callable[[], str | None] | None,
) -> tuple[bool, str | None]:  # fmt: skip
    """Watch the launch until its processes exit, a config runs past `timeout_s`, or `abort()`
    gives a reason to stop: (whether it timed out, the reason it was stopped)."""
    stopped = None
    while True:
        try:
            proc.wait(timeout=POLL_S)
            watch.report_progress()  # the last step, when it ended between two looks
            return False, stopped
        except subprocess.TimeoutExpired:
            pass
        watch.collect()
        if time.monotonic() > watch.ended[-1] + timeout_s:
            return True, stopped
        stopped = abort() if abort is not None else None
        if stopped:
            return False, stopped
        watch.report_progress()
