"""The channel between the planners of a multi-node search: the study's system attrs under
`autofit:cluster:`, each planner's heartbeat, which peer is lost, and how each node's part of a
launch ended. `autofit.trials.cluster` (whose docstring lays out the keys) runs trials over it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import optuna
import sqlalchemy.exc

from autofit.trials.guard import alive, hostname, identity
from autofit.trials.result import MEASURED, TrialResult

PREFIX = "autofit:cluster:"
# What a write to or read of the shared storage raises when the storage is out of reach for a
# moment (a lost connection, a locked SQLite file, a network file system): optuna's RDB storage
# wraps a failed commit in StorageInternalError; a failed connection surfaces from sqlalchemy.
# Anything else is a bug and surfaces.
STORAGE_ERRORS = (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError, OSError)
BEAT_S = 1.0
LOST_ENV, LOST_S = "AUTOFIT_NODE_LOST_S", 15.0  # a heartbeat that stood still this long: lost
JOIN_ENV, JOIN_S = "AUTOFIT_NODE_JOIN_S", 300.0  # the most a launch waits for every node
POLL_S = 0.25
LOOK_S = 1.0  # how often a running trial looks at its peers' heartbeats


def _seconds(env: str, default: float) -> float:
    try:
        return float(os.environ.get(env) or default)
    except ValueError:
        return default


class Channel:
    """One node's end of the channel between planners (`autofit.trials.cluster`'s docstring):
    the study's system attrs, heartbeats, who is lost, how each part of a launch ended."""

    def __init__(
        self,
        storage: optuna.storages.BaseStorage,
        study_name: str,
        nodes: int,
        node_rank: int,
    ) -> None:
        self.storage, self.nodes, self.node_rank = storage, nodes, node_rank
        self.study_id = storage.get_study_id_from_name(study_name)
        self.say: Callable[[str], None] = lambda _text: None
        self.session = ""
        self.failure: str | None = None  # why the search must stop (a node lost)
        self.lost_s, self.join_s = _seconds(LOST_ENV, LOST_S), _seconds(JOIN_ENV, JOIN_S)
        self._seen: dict[int, tuple[Any, float]] = {}  # node -> (beat, when it last changed)
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- the channel ---------------------------------------------------------------------
    def _key(self, *parts: Any) -> str:
        return PREFIX + ":".join(str(p) for p in parts)

    def _attrs(self) -> dict[str, Any]:
        attrs = self.storage.get_study_system_attrs(self.study_id)
        return {k[len(PREFIX) :]: v for k, v in attrs.items() if k.startswith(PREFIX)}

    def _put(self, *key: Any, value: Any) -> None:
        self.storage.set_study_system_attr(self.study_id, self._key(*key), value)

    def _me(self) -> dict[str, Any]:
        return {"host": hostname(), "process": identity(), "node": self.node_rank}

    def _beat(self, gone: str | None = None) -> None:
        self._beats += 1
        self._put("beat", self.session, self.node_rank,
                  value={**self._me(), "n": self._beats, "gone": gone})  # fmt: skip

    def start_heartbeat(self) -> None:
        self._beat()

        def loop() -> None:
            while not self._stop.wait(BEAT_S):
                with contextlib.suppress(*STORAGE_ERRORS):  # a lost beat is sent again on the next
                    self._beat()

        self._thread = threading.Thread(target=loop, name="autofit-node-beat", daemon=True)
        self._thread.start()

    def stop_heartbeat(self, gone: str | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if gone:
            with contextlib.suppress(*STORAGE_ERRORS):
                self._beat(gone)

    def lost(self, node: int, attrs: dict[str, Any] | None = None) -> str | None:
        """Why node `node`'s planner is lost, or None while it lives (or has not begun)."""
        attrs = self._attrs() if attrs is None else attrs
        beat = attrs.get(f"beat:{self.session}:{node}")
        if beat is None:
            return None
        who = f"node {node}'s planner (process {beat['process'].split(':')[0]} on {beat['host']})"
        if beat.get("gone"):
            return f"{who} stopped: {beat['gone']}"
        if beat["host"] == hostname() and not alive(beat["process"]):
            return f"{who} is gone (killed, or it crashed)"
        now, last = time.monotonic(), self._seen.get(node)
        if last is None or last[0] != beat["n"]:
            self._seen[node] = (beat["n"], now)
            return None
        if now - last[1] > self.lost_s:
            return f"{who} sent no heartbeat for {now - last[1]:.0f} s (killed, or its host lost)"
        return None

    def _peers(self) -> list[int]:
        return [n for n in range(self.nodes) if n != self.node_rank]

    def _any_lost(self, attrs: dict[str, Any] | None = None) -> str | None:
        attrs = self._attrs() if attrs is None else attrs
        return next(filter(None, (self.lost(n, attrs) for n in self._peers())), None)

    def _watch(self, seq: int) -> Callable[[], str | None]:
        """`run_trial`'s `abort` for this node's part of launch `seq`: why to stop it (a peer
        lost, or another node's part ended without success), looked up at most every `LOOK_S`."""
        look: list[Any] = [0.0, None]

        def abort() -> str | None:
            now = time.monotonic()
            if now - look[0] >= LOOK_S:
                look[0] = now
                with contextlib.suppress(*STORAGE_ERRORS):  # the storage out of reach: look later
                    attrs = self._attrs()
                    look[1] = self._any_lost(attrs) or self._failed_part(seq, attrs)
            return look[1]

        return abort

    def _failed_part(self, seq: int, attrs: dict[str, Any]) -> str | None:
        for node in self._peers():
            part = attrs.get(f"part:{self.session}:{seq}:{node}")
            if part and part["status"] not in MEASURED:
                first = (part.get("message") or "no message").strip().splitlines()[0]
                return f"node {node}'s part of it ended first ({part['status']}: {first})"
        return None

    def _report(self, seq: int, result: TrialResult) -> None:
        """How this node's part of launch `seq` ended, for the other nodes."""
        with contextlib.suppress(*STORAGE_ERRORS):
            self._put("part", self.session, seq, self.node_rank,
                      value={"status": result.status, "message": result.message,
                             "oom_of": result.oom_of})  # fmt: skip
