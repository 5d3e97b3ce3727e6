"""Trials across nodes (issue 13, item 4): two "nodes" of one gloo process each on localhost, one
planner per node on one SQLite study. A two-node trial is `ok` and both planners return the same
plan; a planner killed mid-trial fails the trial on both nodes and leaves no process."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import optuna
import psutil
import pytest

from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.search import study as st
from autofit.trials.channel import PREFIX
from autofit.trials.cluster import Cluster, NodeLost
from autofit.trials.result import TrialResult
from tests.faults.conftest import cli_env, plan_cmd, wait_for, workers_of
from tests.faults.inject import fault_env

ONE = """\
seq_len: 32
knobs:
  lora_rank: [8]
  micro_batch: [1]
  wrap: [layer]
"""


def _node(tmp_path: Path, rank: int, *extra: str, storage: str | None = None) -> list[str]:
    return plan_cmd(
        tmp_path, "--gpu-memory", "256MiB", "--trials", "1", "--steps", "1",
        "--storage", storage or f"sqlite:///{tmp_path}/s.db", "--study", "two-nodes",
        "--node-rank", str(rank), "--run-dir", str(tmp_path / f"run{rank}"),
        "--calibration", "off", "--json", *extra,
        gpus="2x1", space_text=ONE,
    )  # fmt: skip


def _study(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="two-nodes", storage=st.open_storage(storage))


def _real_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials() if t.user_attrs.get("outcome") == st.TRIAL]


@pytest.mark.slow
def test_a_trial_spans_two_nodes_and_both_planners_agree(spawn, tmp_path: Path) -> None:
    start = time.monotonic()
    nodes = [spawn(_node(tmp_path, r), cli_env(tmp_path), tmp_path) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (_stdout, stderr) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, (stderr, _stdout)
    plans = [json.loads(stdout) for stdout, _ in outs]
    print(f"two-node plan: {time.monotonic() - start:.1f} s")
    leader, follower = plans
    assert leader["best"]["verified"] and follower["best"]["verified"]
    assert leader["best"]["config"] == follower["best"]["config"]
    [trial] = leader["trials"]
    assert trial["trial"]["status"] == "ok" and trial["trial"]["nprocs"] == 2
    assert trial["trial"]["tokens_per_s"] == follower["trials"][0]["trial"]["tokens_per_s"]
    assert leader["run_dir"] == str(tmp_path / "run0") and (tmp_path / "run0").is_dir()
    [t] = _real_trials(_study(f"sqlite:///{tmp_path}/s.db"))
    assert t.state == optuna.trial.TrialState.COMPLETE
    assert not list(tmp_path.glob("autofit-trial-*"))  # both nodes' scratch folders are gone


def _tree(pids: list[int]) -> list[psutil.Process]:
    """The processes and every descendant of theirs, as they are now."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("killed", "store"),
    [(1, "sqlite"), (0, "sqlite"), (1, "postgres")],
    ids=["kill-node-1", "kill-node-0", "kill-node-1-postgres"],
)
def test_killed_node_fails_the_trial_on_both_and_leaves_no_process(
    request, spawn, tmp_path: Path, killed: int, store: str
) -> None:  # type: ignore[no-untyped-def]
    url = request.getfixturevalue("postgres") if store == "postgres" else None
    url = url or f"sqlite:///{tmp_path}/s.db"
    env = cli_env(tmp_path, **fault_env("hang"))  # every rank hangs once it joined the group
    cmds = [_node(tmp_path, r, "--trial-timeout", "120", storage=url) for r in (0, 1)]
    nodes = [spawn(cmd, env, tmp_path) for cmd in cmds]
    wait_for(lambda: all(workers_of(p.pid) for p in nodes), 120, "both nodes' workers")
    # each rank writes its pid once it runs its rank (torch imported), then joins the group
    wait_for(lambda: len(list(tmp_path.glob("autofit-trial-*/pid.*"))) == 2, 120, "both ranks")
    procs = _tree([p.pid for p in nodes])  # planners, torchruns, workers
    assert len(procs) >= 6

    nodes[killed].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = nodes[1 - killed]
    try:
        stdout, stderr = survivor.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the other node's planner did not stop")
    stopped_in = time.monotonic() - killed_at
    print(f"node {1 - killed} stopped {stopped_in:.1f} s after node {killed} was killed:")
    print(stdout)
    assert survivor.returncode == 2, stderr
    said = json.loads(stdout)
    error = said["error"]
    assert f"Node {killed}'s planner" in error and "is gone" in error, error
    assert "start every node's `autofit plan` again" in said["hint"]
    assert "Traceback" not in stderr

    wait_for(lambda: not _alive(procs), 10, "every process of both nodes to die")
    study = _study(url)
    [t] = _real_trials(study)
    assert t.state == optuna.trial.TrialState.FAIL and "result" not in t.user_attrs
    if killed == 1:  # node 0 recorded why
        assert "Node 1's planner" in t.user_attrs[st.STOPPED]
    assert st.interrupted(study) == [t]  # a re-run of every node measures it again, first


# ----- the channel alone (no trial runs): a fake launch in a thread per node ------------------
def _fake_launch(calls: list[dict]):  # type: ignore[no-untyped-def,type-arg]
    def launch(model, config, *, nprocs, rendezvous, abort, timeout_s, **kwargs):  # type: ignore[no-untyped-def]
        calls.append({"rdzv": rendezvous, "nprocs": nprocs, "timeout_s": timeout_s, **kwargs})
        return TrialResult("ok", config.to_dict(), "llama-debug", "cpu", nprocs, tokens_per_s=1.0)

    return launch


def _channel(tmp_path: Path) -> tuple[optuna.storages.RDBStorage, optuna.Study]:
    storage = st.open_storage(f"sqlite:///{tmp_path}/c.db")
    return storage, optuna.create_study(study_name="c", storage=storage)


def test_node_0_announces_each_launch_and_the_other_node_joins_its_rendezvous(
    tmp_path: Path,
) -> None:
    storage, study = _channel(tmp_path)
    calls: list[dict] = []  # type: ignore[type-arg]
    leader = Cluster(storage, "c", 2, 0, launch=_fake_launch(calls))
    follower = Cluster(storage, "c", 2, 1, launch=_fake_launch(calls))
    leader.lead(gpus_per_node=1)
    parts: list[tuple[int, str]] = []
    thread = threading.Thread(
        target=follower.follow,
        args=(lambda seq, r: parts.append((seq, r.status)), lambda process: []),
    )
    thread.start()
    for steps in (1, 3):  # a trial, then a longer verification
        result = leader.run_trial("llama-debug", Config(), nprocs=2, device="cpu", steps=steps,
                                  gpu_memory=256 << 20, timeout_s=30)  # fmt: skip
        assert result.ok
    leader.finish()
    thread.join(timeout=10)
    assert not thread.is_alive() and parts == [(1, "ok"), (2, "ok")]
    by_launch: dict[str, list[dict]] = {}  # type: ignore[type-arg]
    for call in calls:
        by_launch.setdefault(call["rdzv"].run_id, []).append(call)
    assert len(by_launch) == 2  # a rendezvous of its own per launch
    for launch in by_launch.values():
        assert sorted(c["rdzv"].is_host for c in launch) == [False, True]  # node 0 hosts it
        assert len({c["rdzv"].endpoint for c in launch}) == 1
        assert {(c["nprocs"], c["rdzv"].nodes, c["steps"], c["gpu_memory"]) for c in launch} in (
            {(2, 2, 1, 256 << 20)},
            {(2, 2, 3, 256 << 20)},
        )


def test_every_node_draws_its_batches_from_the_same_lengths(tmp_path: Path) -> None:
    """A trial on data: node 0's ranks draw their micro-batches from the lengths (one extra
    warm-up step, one more all_reduce), so every other node's ranks must too, or their
    collectives do not match."""
    storage, _study = _channel(tmp_path)
    calls: list[dict] = []  # type: ignore[type-arg]
    leader = Cluster(storage, "c", 2, 0, launch=_fake_launch(calls))
    follower = Cluster(storage, "c", 2, 1, launch=_fake_launch(calls))
    leader.lead(gpus_per_node=1)
    thread = threading.Thread(target=follower.follow, args=(lambda s, r: None, lambda p: []))
    thread.start()
    data = LengthHistogram((12, 32, 50), (9, 3, 1), "data.jsonl")
    result = leader.run_trial("llama-debug", Config(), nprocs=2, device="cpu", steps=1,
                              timeout_s=30, lengths=data)  # fmt: skip
    leader.finish()
    thread.join(timeout=10)
    assert result.ok and not thread.is_alive()
    assert sorted((c["rdzv"].is_host, c.get("lengths")) for c in calls) == [
        (False, data),
        (True, data),
    ]


def test_a_node_that_never_joins_stops_the_search(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AUTOFIT_NODE_JOIN_S", "1")
    storage, _study = _channel(tmp_path)
    leader = Cluster(storage, "c", 2, 0, launch=_fake_launch([]))
    leader.lead(gpus_per_node=1)
    with pytest.raises(NodeLost, match="Node 1 did not join the trial within 1 s"):
        leader.run_trial("llama-debug", Config(), nprocs=2, device="cpu", timeout_s=30)
    with pytest.raises(NodeLost):  # and no later launch starts
        leader.run_trial("llama-debug", Config(), nprocs=2, device="cpu", timeout_s=30)
    leader.finish(leader.failure)


def test_the_other_node_stops_when_node_0_stops_on_an_error(tmp_path: Path) -> None:
    storage, study = _channel(tmp_path)
    leader = Cluster(storage, "c", 2, 0, launch=_fake_launch([]))
    follower = Cluster(storage, "c", 2, 1, launch=_fake_launch([]))
    leader.lead(gpus_per_node=1)
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            follower.follow(lambda seq, r: None, lambda process: [])
        except NodeLost as exc:
            errors.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    joined = f"{PREFIX}joined:{leader.session}:1"
    wait_for(lambda: joined in storage.get_study_system_attrs(study._study_id), 10, "the join")
    leader.finish("the disk is full")
    thread.join(timeout=10)
    assert [str(e) for e in errors] == ["Node 0's search stopped: the disk is full"]


# ----- the CLI: several nodes need a shared study and a node rank ---------------------------------
@pytest.fixture
def no_launch(monkeypatch):  # type: ignore[no-untyped-def]
    for name in ("AUTOFIT_NODES", "AUTOFIT_NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "SLURM_STEP_NUM_NODES", "SLURM_NODEID"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


NODES_PLAN = ["plan", "--model", "llama-debug", "--device", "cpu", "--gpus", "2x1",
              "--seq-len", "32", "--trials", "1", "--json"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "env", "fragments"),
    [
        ([], {}, ["one shared study", "--storage URL --study NAME", "--no-trials"]),
        (["--storage", "sqlite:///s.db"], {}, ["does not know which node", "--node-rank N"]),
        (
            ["--storage", "sqlite:///s.db", "--node-rank", "2"],
            {},
            ["--node-rank 2 is not a node", "give 0 to 1"],
        ),
        (
            ["--storage", "sqlite:///s.db"],
            {"AUTOFIT_NODES": "3", "AUTOFIT_NODE_RANK": "1"},
            ["a launch of 3 nodes", "has 2 node(s)"],
        ),
    ],
    ids=["no-storage", "no-rank", "rank-too-big", "launch-disagrees"],
)
def test_plan_on_nodes_refuses_what_cannot_work(no_launch, tmp_path: Path, extra, env, fragments):  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from autofit.cli import app

    no_launch.chdir(tmp_path)
    for name, value in env.items():
        no_launch.setenv(name, value)
    result = CliRunner().invoke(app, [*NODES_PLAN, *extra])
    assert result.exit_code == 2, result.output
    said = json.loads(result.stdout)
    for fragment in fragments:
        assert fragment in said["error"], said
    assert not list(tmp_path.iterdir())  # refused before any run folder or study was made


def test_a_planner_on_another_host_is_lost_when_its_heartbeat_stands_still(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AUTOFIT_NODE_LOST_S", "0.3")
    storage, study = _channel(tmp_path)
    leader = Cluster(storage, "c", 2, 0)
    leader.lead(gpus_per_node=1)
    beat = {"host": "elsewhere", "process": "4242:1.0", "node": 1, "n": 7, "gone": None}
    storage.set_study_system_attr(study._study_id, f"{PREFIX}beat:{leader.session}:1", beat)
    assert leader.lost(1) is None  # first seen: alive
    time.sleep(0.5)
    said = leader.lost(1)
    assert said is not None and said.startswith("node 1's planner (process 4242 on elsewhere)")
    assert "sent no heartbeat for" in said
    beat["n"] = 8  # it beat again: alive, and its clock starts anew
    storage.set_study_system_attr(study._study_id, f"{PREFIX}beat:{leader.session}:1", beat)
    assert leader.lost(1) is None
    leader.finish()
