"""Trials across nodes: one planner per node, node 0 choosing each trial, the others joining it.

Every node's planner opens the same study (`--storage`, `--study`); the study's system attrs are
the one channel between them, so whatever storage every planner reaches (PostgreSQL across hosts,
SQLite on one) carries it. Under `autofit:cluster:` there:

- `session`: node 0's search of now (`id`, nodes, devices per node, its planner); a planner of a
  node >0 joins the session whose node 0 is alive and not done (`joined:<id>:<node>`);
- `beat:<id>:<node>`: every planner's heartbeat, a counter it bumps every `BEAT_S` (and a last
  word, `gone`, when it stops on an error);
- `launch:<id>`: node 0's latest launch, `{seq, endpoint, run_id, payload, nprocs, timeout_s}`;
  every other node acknowledges it (`ack:<id>:<seq>:<node>`) and starts its part: the same
  torchrun, `--nnodes=N --rdzv-backend=c10d` at node 0's endpoint, where node 0 hosts the store;
- `part:<id>:<seq>:<node>`: how that node's part ended;
- `done:<id>`: node 0's search ended (`ok`, `message`).

Every launch of node 0 (search trials, re-runs, the winner's verification) goes through
`Cluster.run_trial`. Faults: a node's planner is lost when its heartbeat stands still for `LOST_S`
(at once when it ran on this host and its process is gone). A trial's processes die with their
own planner (`guard`); a node whose peer is lost stops its part at once (`run_trial`'s `abort`).
Node 0 then fails the trial (FAIL without a result, so a re-run of every planner measures it
again) and stops the search with `NodeLost`; a node >0 whose node 0 is lost fails node 0's running
trials in the study and stops with `NodeLost`. A node that never acknowledges a launch within
`JOIN_S` stops the search the same way.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, NoReturn

import optuna

from autofit.checks import TRIAL_TIMEOUT_S
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import AutofitError
from autofit.models import ModelSpec, resolve_model
from autofit.trials.channel import (
    JOIN_ENV,
    POLL_S,
    STORAGE_ERRORS,
    Channel,
)
from autofit.trials.guard import alive, hostname
from autofit.trials.launcher import Rendezvous
from autofit.trials.launcher import run_trial as launch_trial
from autofit.trials.result import MEASURED, TrialResult

PART_WAIT_S = 10.0  # how long node 0 waits for the other parts' reports after its own
RESUME = (
    "The study keeps its finished trials: start every node's `autofit plan` again (the same "
    "--storage and --study) to resume; the interrupted trial runs first."
)


class NodeLost(AutofitError):
    """Another node's planner stopped (or never came): the search cannot go on."""


def node_lost(message: str) -> NodeLost:
    """`NodeLost` saying `message` (a sentence, capitalised here) and how to resume."""
    from autofit.checks import user_error

    error = user_error(message[:1].upper() + message[1:], RESUME, NodeLost)
    assert isinstance(error, NodeLost)
    return error


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A TCP port of this host, held for the block: bound with `SO_REUSEADDR` and never
    listening, so torchrun's store (c10d's TCPStore binds with `SO_REUSEADDR` too, libuv or
    not) can bind and listen on it later, while the kernel gives it to no one else meanwhile (a
    port found free and let go could be taken between the choice and torchrun's bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        yield int(sock.getsockname()[1])


RDZV_HOST_ENV = "AUTOFIT_RDZV_HOST"


def endpoint_host() -> str:
    """Where the other nodes reach node 0's rendezvous: `AUTOFIT_RDZV_HOST` (an address they can
    reach), else this host's name. Not `MASTER_ADDR`: under a torchrun of the planners it names
    the host of that launch's store, which need not be the node of `GROUP_RANK` 0."""
    return os.environ.get(RDZV_HOST_ENV) or hostname()


class Cluster(Channel):
    """One node's end of a multi-node search (see the module docstring)."""

    def __init__(self, *where: Any, launch: Callable[..., TrialResult] = launch_trial) -> None:
        """`where`: `Channel`'s storage, study name, nodes and node rank; `launch`: what starts
        this node's part of a trial (`autofit.trials.run_trial`)."""
        super().__init__(*where)
        self.launch = launch

    # ----- node 0 ------------------------------------------------------------------------------
    def lead(self, gpus_per_node: int) -> None:
        """Open a new session (this search) and start the heartbeat."""
        self.session = uuid.uuid4().hex[:12]
        session = {"id": self.session, "nodes": self.nodes, "gpus_per_node": gpus_per_node}
        self._put("session", value={**session, "leader": self._me()})
        self.start_heartbeat()

    def finish(self, error: str | None = None) -> None:
        """Node 0's search ended: tell the other nodes (and what went wrong, if it did)."""
        with contextlib.suppress(*STORAGE_ERRORS):
            self._put("done", self.session, value={"ok": error is None, "message": error or ""})
        self.stop_heartbeat(error)

    def stop_if_failed(self, study: optuna.Study, _trial: Any = None) -> None:
        """An `optimize` callback: no further trial once a node is lost."""
        if self.failure:
            study.stop()

    def raise_if_failed(self) -> None:
        if self.failure:
            error = NodeLost(self.failure)
            error.hint = RESUME  # type: ignore[attr-defined]
            raise error

    def run_trial(
        self,
        model: str | ModelSpec,
        config: Config,
        *,
        nprocs: int = 1,
        timeout_s: float = TRIAL_TIMEOUT_S,
        **kwargs: Any,
    ) -> TrialResult:
        """`autofit.trials.run_trial` across the nodes: announce, wait for every node's ack,
        launch this node's part as the rendezvous host, gather the other parts' reports."""
        self.raise_if_failed()
        attrs = self._attrs()
        lost = self._any_lost(attrs)
        if lost:
            self._fail(f"{lost}, before the trial started")
        seq = int((attrs.get(f"launch:{self.session}") or {}).get("seq", 0)) + 1
        spec = resolve_model(model)
        run_id = f"autofit-{self.session}-{seq}"
        payload = {
            "model": asdict(spec), "config": config.to_dict(),
            # every node's ranks judge a slow step alike: they all take part in that judgement
            **{k: kwargs[k] for k in ("device", "gpu_memory", "steps", "warmup", "slow_after_s")
               if k in kwargs},
        }  # fmt: skip
        if kwargs.get("lengths") is not None:  # every node's ranks draw the same batches
            payload["lengths"] = kwargs["lengths"].to_dict()
        with reserved_port() as port:  # held until this node's torchrun is done with it
            endpoint = f"{endpoint_host()}:{port}"
            self._put("launch", self.session, value={
                "seq": seq, "endpoint": endpoint, "run_id": run_id, "payload": payload,
                "nprocs": nprocs, "timeout_s": timeout_s, "join_timeout": self.join_s,
            })  # fmt: skip
            self._wait_acks(seq)
            rdzv = Rendezvous(self.nodes, endpoint, run_id, True, self.join_s)
            result = self.launch(spec, config, nprocs=nprocs, timeout_s=timeout_s,
                                 rendezvous=rdzv, abort=self._watch(seq), **kwargs)  # fmt: skip
        self._report(seq, result)
        parts = self._gather_parts(seq, result)
        lost = self._any_lost()
        if lost and not result.measured:
            first = (result.message or result.status).strip().splitlines()[0]
            detail = "" if lost in first else f" ({first})"
            self._fail(f"{lost}, during the trial of '{config.short()}'{detail}")
        _blame(result, parts)
        return result

    def _fail(self, message: str) -> NoReturn:
        error = node_lost(
            f"{message}. A trial that spans {self.nodes} nodes needs every node's planner, so "
            "the search stops here."
        )
        self.failure = str(error)
        raise error

    def _wait_acks(self, seq: int) -> None:
        deadline = time.monotonic() + self.join_s
        while True:
            attrs = self._attrs()
            waiting = [n for n in self._peers() if f"ack:{self.session}:{seq}:{n}" not in attrs]
            if not waiting:
                return
            lost = self._any_lost(attrs)
            if lost:
                self._fail(f"{lost}, before the trial started")
            if time.monotonic() > deadline:
                names = ", ".join(str(n) for n in waiting)
                self._fail(
                    f"node{'s' if len(waiting) > 1 else ''} {names} did not join the trial "
                    f"within {self.join_s:g} s (is "
                    "`autofit plan` running there, on the same --storage and --study, with its "
                    f"node rank? {JOIN_ENV} sets this limit)"
                )
            time.sleep(POLL_S)

    def _gather_parts(self, seq: int, result: TrialResult) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + (PART_WAIT_S if not result.measured else 2 * POLL_S)
        parts: dict[int, dict[str, Any]] = {}
        while True:
            attrs = self._attrs()
            parts = {n: attrs[k] for n in self._peers()
                     if (k := f"part:{self.session}:{seq}:{n}") in attrs}  # fmt: skip
            if len(parts) == len(self._peers()) or time.monotonic() > deadline:
                return parts
            if self._any_lost(attrs):
                return parts
            time.sleep(POLL_S)

    # ----- nodes > 0 ---------------------------------------------------------------------------
    def follow(
        self,
        on_part: Callable[[int, TrialResult], None],
        fail_trials_of: Callable[[str | None], list[int]],
    ) -> None:
        """Join node 0's session, run this node's part of each launch until node 0 is done.
        Raises `NodeLost` when node 0's planner is lost (its running trials failed first, by
        `fail_trials_of(node 0's process)`, which returns their numbers) or node 0's search
        stopped on an error."""
        self._join()
        self.say(f"node {self.node_rank} of {self.nodes}: joined node 0's search")
        self.start_heartbeat()
        last, gone = 0, None
        try:
            while True:
                attrs = self._attrs()
                done = attrs.get(f"done:{self.session}")
                if done is not None:
                    if not done["ok"]:
                        raise NodeLost(f"Node 0's search stopped: {done['message']}")
                    return
                lost = self.lost(0, attrs)
                if lost:
                    failed = fail_trials_of(self.leader_process())
                    which = f"trial(s) {', '.join(f'#{n}' for n in failed)}" if failed else "none"
                    raise node_lost(
                        f"{lost}. Its running trial is failed ({which}) and node "
                        f"{self.node_rank} stops too."
                    )
                launch = attrs.get(f"launch:{self.session}")
                if launch is not None and launch["seq"] > last:
                    last = launch["seq"]
                    on_part(last, self._part(launch))
                    continue
                time.sleep(POLL_S)
        except BaseException as exc:
            gone = str(exc) or type(exc).__name__
            raise
        finally:
            self.stop_heartbeat(gone)

    def _join(self) -> None:
        """Wait for a session of node 0 that is not done and whose planner lives (on this host:
        its process runs; elsewhere: its heartbeat moves), and join it."""
        deadline = time.monotonic() + self.join_s
        first: dict[str, int] = {}  # session -> the first heartbeat of its node 0 seen
        while time.monotonic() <= deadline:
            attrs = self._attrs()
            session = attrs.get("session")
            if session and session["nodes"] != self.nodes:
                raise NodeLost(
                    f"Node 0 plans for {session['nodes']} nodes and this node for {self.nodes}: "
                    "give every node's `autofit plan` the same --gpus."
                )
            sid = (session or {}).get("id")
            beat = attrs.get(f"beat:{sid}:0")
            if sid and beat and f"done:{sid}" not in attrs and not beat.get("gone"):
                if beat["host"] == hostname():
                    live = alive(beat["process"])
                else:
                    live = first.setdefault(sid, beat["n"]) != beat["n"]
                if live:
                    self.session = sid
                    self._put("joined", sid, self.node_rank, value=self._me())
                    return
            time.sleep(POLL_S)
        raise NodeLost(
            f"Node 0's search did not begin within {self.join_s:g} s: start `autofit plan` on "
            "node 0 with the same --storage and --study (and node rank 0)."
        )

    def _part(self, launch: dict[str, Any]) -> TrialResult:
        """This node's part of node 0's launch `launch`."""
        seq = launch["seq"]
        self._put("ack", self.session, seq, self.node_rank, value=self._me())
        leader = self._attrs().get(f"beat:{self.session}:0") or {}
        payload = launch["payload"]
        lengths = payload.get("lengths")
        rdzv = Rendezvous(self.nodes, launch["endpoint"], launch["run_id"], False,
                          launch["join_timeout"])  # fmt: skip
        result = self.launch(
            ModelSpec(**payload["model"]), Config.from_dict(payload["config"]),
            nprocs=launch["nprocs"], device=payload.get("device", "cuda"),
            gpu_memory=payload.get("gpu_memory"), steps=payload.get("steps", 3),
            warmup=payload.get("warmup", 1), timeout_s=launch["timeout_s"], rendezvous=rdzv,
            slow_after_s=payload.get("slow_after_s"),
            abort=self._watch(seq),
            lengths=LengthHistogram.from_dict(lengths) if lengths is not None else None,
            lock=leader.get("host") != hostname(),  # on node 0's host, its part holds the lock
        )  # fmt: skip
        self._report(seq, result)
        return result

    def leader_process(self) -> str | None:
        """`identity()` of node 0's planner in this session (None before one is known)."""
        session = self._attrs().get("session") or {}
        return (session.get("leader") or {}).get("process")


def _blame(result: TrialResult, parts: dict[int, dict[str, Any]]) -> None:
    """A trial that failed on node 0 because another node's part ran out of memory (or failed
    first) says so: that node's status and message, named."""
    if result.measured:
        return
    for node, part in sorted(parts.items()):
        if part.get("status") == "oom" and result.status != "oom":
            result.status, result.oom_of = "oom", part.get("oom_of")
            result.message = f"node {node}: {part.get('message', '')}"
            return
    if result.status in ("error", "timeout"):
        extra = [f"node {n}: {p['message'].splitlines()[0]}" for n, p in sorted(parts.items())
                 if p.get("status") not in MEASURED and p.get("message")]  # fmt: skip
        if extra:
            result.message += "\n--- other nodes ---\n" + "\n".join(extra)
