"""The Optuna study behind a search: its name, its storage, and what each trial records.

Every trial stores its config, the napkin estimate and the measured `TrialResult` as user attrs,
and the study stores the request it was made for (`PlanRequest.to_dict()`). That is enough to
rebuild the whole plan from storage alone (`load_study_plan`, `autofit export`) and to resume
without repeating a finished trial, after Ctrl-C, a killed process, or on another machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import optuna

from autofit.checks import sqlite_path
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import AutofitError
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.request import PlanRequest
from autofit.search.storage_file import (
    SQLITE_READONLY,
    check_sqlite_file,
    check_sqlite_study,
    lost_schema_race,
    not_a_study_database,
    read_only_sqlite,
    sqlite_code,
    storage_error,
)
from autofit.space import Space
from autofit.trials.channel import STORAGE_ERRORS
from autofit.trials.devlock import lock_dir
from autofit.trials.guard import alive, hostname, identity

SCHEMA = 2  # 2: the metadata is `PlanRequest.to_dict()`; 1 had a subset of its keys
META_KEY = "autofit"
# A worker that stops sending heartbeats for GRACE_S (killed, machine lost) has its running trial
# marked FAIL by the next worker that starts a trial; that config may then be tried again. On the
# worker's own host nobody waits that long: every trial names its owner (host and process), and a
# trial whose owner process is gone is failed at once (`fail_orphans`) and its candidate re-run.
HEARTBEAT_S = 10
GRACE_S = 60
OWNER = "owner"  # user attr: {"host": ..., "process": "<pid>:<start time>"}
RERUN_OF = "rerun_of"  # user attr of a trial that re-runs an interrupted one (its number)
CALIBRATED = "calibrated"  # user attr: the calibrated estimate made before the trial ran
TIMING = "timing"  # user attr: the trial's expected seconds, its limit and its slow mark
STOPPED = "stopped"  # user attr: why a trial was stopped without a result (a node of it lost)
QUEUED_BY = "queued_by"  # user attr of a queued trial: the planner that queued it (`owner()`)

# Trial outcomes (user attr "outcome"). Only "trial" spends a real trial.
TRIAL = "trial"  # a real trial ran (or is running)
PRUNED = "pruned"  # the estimate rules it out: recorded as infeasible, no trial
DUPLICATE = "duplicate"  # a finished trial already measured this config
INVALID = "invalid"  # the sampler combined knobs that break a rule or the global batch
BUSY = "busy"  # another worker is measuring this config right now
SKIPPED = "skipped"  # the trial budget (or the search's time) was spent before it ran


def config_key(cfg: Config | dict[str, Any] | None) -> str:
    """One string per config, for a `Config` or the `config` user attr a trial stores."""
    return json.dumps(cfg.to_dict() if isinstance(cfg, Config) else cfg, sort_keys=True)


_ADDED_KNOBS = ("loss", "compile", "shard", "batching")
"""Knobs added after the first release: a space that leaves them at their default alone keeps the
study name it had before they existed."""


def runs_of(space: Space, hardware: Hardware, data: bool) -> dict[str, tuple[Any, ...]]:
    """The space's values that make different runs on `hardware` (`Space.knobs_on`: on one node
    `shard: all` alone, `wrap: auto` as what it stands for on these GPUs, and `batching` only
    with the data's lengths): what names a study and what a resumed study must match."""
    return space.knobs_on(hardware.nodes, hardware.n_gpus, data=data)


def default_study_name(
    model: ModelSpec,
    hardware: Hardware,
    space: Space,
    seq_len: int,
    global_batch: int | None,
    device: str,
    lengths: LengthHistogram | None = None,
) -> str:
    """Stable, readable and unique per setting: the same command always finds the same study
    (the data's lengths, when given, are part of it)."""
    # the family (`model_type`) and an empty `extra` are left out so names stay those of studies
    # made before specs recorded them; the numbers and the name already tell two models apart
    ident = {
        "model": {
            k: v
            for k, v in asdict(model).items()
            if k != "model_type" and not (k == "extra" and not v)
        },
        "gpus": [
            hardware.smallest_gpu.name,
            hardware.n_gpus,
            hardware.capacity_bytes,
            hardware.link,
            # only past one node: names of one-node studies stay those made before nodes existed
            *([hardware.nodes, hardware.inter_node_bw_gbs] if hardware.nodes > 1 else []),
        ],
        "device": device,
        "space": {  # the values that make different runs here: on one node, `shard: all` alone
            k: list(v)
            for k, v in runs_of(space, hardware, lengths is not None).items()
            if not (k in _ADDED_KNOBS and v == (getattr(Config(), k),))
        },
        "seq_len": seq_len,
        "global_batch": global_batch,
    }
    if lengths is not None:  # only then: names of studies without data stay as they were
        ident["lengths"] = hashlib.sha1(lengths.to_json().encode()).hexdigest()
    if space.settings:  # only then: the names of studies made before settings existed stay
        ident["settings"] = space.to_dict()["settings"]
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:8]
    gpu = re.sub(r"[^a-z0-9]+", "-", hardware.smallest_gpu.name.lower()).strip("-")
    batch = f"-gb{global_batch}" if global_batch else ""
    gpus = f"{hardware.nodes}x{hardware.gpus_per_node}" if hardware.nodes > 1 else hardware.n_gpus
    return f"{model.name}-{gpus}x{gpu}-{space.name}-s{seq_len}{batch}-{digest}"


def default_storage(run_dir: Path) -> str:
    return f"sqlite:///{run_dir.resolve() / 'study.db'}"


def _serialize_sqlite(engine: Any) -> None:
    """Make every SQLite transaction take the write lock when it begins.

    pysqlite starts a transaction only at its first write, so two workers can both read an
    enqueued trial as WAITING and both run it (optuna issue #4621: SQLite has no row locks).
    SQLAlchemy's documented pysqlite recipe (driver autocommit off, `BEGIN IMMEDIATE` on begin)
    makes the read-then-claim atomic; workers then wait for each other's short transactions.
    """
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened while the schema was created predate the listeners


def storage_url(url: str) -> str:
    """`postgresql://...` names SQLAlchemy's psycopg2 driver; use psycopg 3 (`autofit[postgres]`)
    when that is the driver installed."""
    import importlib.util

    scheme = next((s for s in ("postgresql://", "postgres://") if url.startswith(s)), None)
    if scheme is None or importlib.util.find_spec("psycopg2") is not None:
        return url
    if importlib.util.find_spec("psycopg") is None:
        return url
    return "postgresql+psycopg://" + url[len(scheme) :]


@contextlib.contextmanager
def _making_tables(url: str, read_only: bool) -> Iterator[None]:
    """Held while Optuna makes (or finds) its tables in an SQLite file: one process of the host
    at a time. SQLAlchemy looks for each table, then creates it; two planners starting on one new
    file both look, and the second's `CREATE TABLE` fails with SQLite's generic SQLITE_ERROR
    ("table studies already exists"), which no code tells from a real error. A server database
    reports such races by SQLSTATE instead (`lost_schema_race`)."""
    path = sqlite_path(url)
    if path is None or read_only:
        yield
        return
    from filelock import FileLock

    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    with FileLock(lock_dir() / f"sqlite-{key}.lock", mode=0o666):
        yield


def open_storage(url: str, read_only: bool = False) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage with heartbeats (so a killed worker's trial is failed, not stuck).
    `read_only`: a study only read (`autofit export`): an SQLite file is opened read-only, so
    nothing is created or changed in it (`check_sqlite_study`), not even Optuna's tables."""
    url = storage_url(url)
    check_sqlite_file(url)  # a folder, a device, a file that is not SQLite: refused untouched
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # the heartbeat thread writes while the main thread reads: wait for the lock, don't fail
        kwargs["connect_args"] = {"timeout": 60}
        if read_only:
            kwargs = {"creator": read_only_sqlite(url)}
    for attempt in range(3):
        try:
            with warnings.catch_warnings(), _making_tables(url, read_only):
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=kwargs,
                    heartbeat_interval=HEARTBEAT_S,
                    grace_period=GRACE_S,
                )
                if url.startswith("sqlite") and not read_only:
                    _serialize_sqlite(storage.engine)
                return storage
        except Exception as exc:  # sqlalchemy raises many types for a bad URL or an unreachable DB
            if read_only and sqlite_code(exc) == SQLITE_READONLY:  # it lacks Optuna's tables
                raise not_a_study_database(url) from None
            if attempt < 2 and lost_schema_race(exc):  # two planners made a new database at once
                time.sleep(0.5 * (attempt + 1))
                continue
            error = exc
            break
    raise storage_error(url, error) from None


def metadata(request: PlanRequest) -> dict[str, Any]:
    """What a study stores about itself: the request it was made for (`PlanRequest.to_dict`)."""
    return {"schema": SCHEMA, **request.to_dict()}


def stored_request(study: optuna.Study) -> PlanRequest | None:
    """The request a study was made for, or None for a study `autofit plan` did not make.

    Studies of schema 1 (before `PlanRequest`) stored model, hardware, space, seq_len,
    global_batch, device and margin under the same keys; `from_dict` reads them too."""
    meta = study.user_attrs.get(META_KEY)
    return PlanRequest.from_dict(meta) if meta else None


def check_metadata(study: optuna.Study, request: PlanRequest) -> None:
    """A study made for another model, hardware or space cannot be resumed with these settings."""
    old = stored_request(study)
    if old is None:
        study.set_user_attr(META_KEY, metadata(request))
        return
    for key in ("model", "seq_len", "global_batch", "device"):
        was, now = getattr(old, key), getattr(request, key)
        if was != now:
            raise AutofitError(
                f"Study {study.study_name!r} was made for another setting ({key} differs: "
                f"{_short(was)} there, {_short(now)} now). Drop --study to get "
                "a study named for these settings, or pass a new --study name."
            )
    if old.lengths != request.lengths:
        raise AutofitError(
            f"Study {study.study_name!r} was made for other data ({_data_text(old.lengths)} "
            f"there, {_data_text(request.lengths)} now). Drop --study to get a study named for "
            "these settings, or pass a new --study name."
        )
    # the values that make different runs here (a space stored before `batching` existed lists
    # none, which is the one value it has without the data's lengths)
    hardware, data = request.hardware, request.lengths is not None
    if runs_of(old.space, hardware, data) != runs_of(request.space, hardware, data):
        raise AutofitError(
            f"Study {study.study_name!r} was made for a different search space. Drop --study, "
            "or pass a new --study name."
        )
    if old.space.settings != request.space.settings:
        raise AutofitError(
            f"Study {study.study_name!r} was made for other LoRA settings "
            f"({_settings_text(old.space)} there, {_settings_text(request.space)} now). Drop "
            "--study to get a study named for these settings, or pass a new --study name."
        )
    if old.margin != request.margin:
        stored = study.user_attrs[META_KEY]
        study.set_user_attr(META_KEY, {**stored, "margin": request.margin})


def _data_text(lengths: LengthHistogram | None) -> str:
    if lengths is None:
        return "no data lengths"
    source = f" of {lengths.source}" if lengths.source else ""
    return f"the lengths{source}: {lengths.examples:,} examples, longest {lengths.longest:,}"


def _settings_text(space: Space) -> str:
    shown = space.to_dict().get("settings") or {}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "the defaults"


def _short(value: Any) -> str:
    if isinstance(value, ModelSpec):
        return repr(value.name)
    return repr(value)


def load_study(
    storage: str | optuna.storages.BaseStorage, name: str, read_only: bool = False
) -> optuna.Study:
    """An existing study; a clear error naming the studies that exist when it is not there.
    `read_only` (`autofit export`): nothing in its storage is created or changed, and a missing
    or empty SQLite file is refused, never made into a database."""
    if isinstance(storage, str) and read_only:
        check_sqlite_study(storage, name)
    store = open_storage(storage, read_only) if isinstance(storage, str) else storage
    try:
        return optuna.load_study(study_name=name, storage=store)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(store)]
        listed = ", ".join(names[:10]) if names else "none"
        raise AutofitError(
            f"No study named {name!r} in {storage}. Studies there: {listed}."
        ) from None


def real_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that spent (or are spending) a real trial, in order."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("outcome") == TRIAL
        and t.state
        in (
            optuna.trial.TrialState.RUNNING,
            optuna.trial.TrialState.COMPLETE,
            optuna.trial.TrialState.FAIL,
        )
    ]


def finished(t: optuna.trial.FrozenTrial) -> bool:
    """A real trial that reported a result (ok, oom, timeout or error): never run again."""
    return t.user_attrs.get("outcome") == TRIAL and "result" in t.user_attrs


def verify_key(cfg: Config) -> str:
    return "verify:" + hashlib.sha1(config_key(cfg).encode()).hexdigest()[:16]


@contextlib.contextmanager
def heartbeat(storage: Any, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat every HEARTBEAT_S while it runs (what `Study.optimize` does
    for the trials it runs itself)."""
    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            with contextlib.suppress(*STORAGE_ERRORS):  # a lost beat is retried on the next
                storage.record_heartbeat(trial_id)
            done.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="autofit-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def owner() -> dict[str, str]:
    """This process, as the owner of the trial it is about to run."""
    return {"host": hostname(), "process": identity()}


def owner_gone(t: optuna.trial.FrozenTrial) -> bool:
    """A trial whose owner is a process on this host that no longer runs. (An owner on another
    host is judged by its heartbeat instead.)"""
    who = t.user_attrs.get(OWNER)
    return bool(who) and who.get("host") == hostname() and not alive(who.get("process"))


def fail_orphans(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Mark FAIL the running trials whose owner on this host is gone; return the ones this call
    failed (of two workers that race for the same trial, only one gets it)."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return [t for t in running if owner_gone(t) and fail_running(study, t)]


def fail_running(study: optuna.Study, t: optuna.trial.FrozenTrial) -> bool:
    """Mark FAIL a trial another worker left RUNNING (its planner is gone): `Study.tell` takes a
    trial number and does not ask which worker runs it. True when this call failed it; False when
    it finished meanwhile: `tell` refuses a trial that is no longer running (ValueError "Cannot
    tell a ... trial"), the storage one that finishes during the write."""
    try:
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
        return False
    return True


@contextlib.contextmanager
def claimed(study: optuna.Study, t: optuna.trial.FrozenTrial) -> Iterator[optuna.Trial | None]:
    """Run the WAITING trial `t` now, ahead of older queued ones: yields its `Trial`, RUNNING and
    heartbeating, or None when another worker took it first.

    No public API serves: `Study.ask` pops the oldest waiting trial and cannot be given one
    (optuna 5.0), so this does for `t` what `ask` and `optimize` do: the storage's compare-and-set
    WAITING -> RUNNING (`study._storage`, `t._trial_id`), a `Trial` over it (`optuna.Trial(study,
    trial_id)`), and its heartbeat. docs/architecture.md, "Private APIs", lists these."""
    storage, trial_id = study._storage, t._trial_id  # noqa: SLF001 - see the docstring
    try:
        took = storage.set_trial_state_values(trial_id, optuna.trial.TrialState.RUNNING)
    except optuna.exceptions.UpdateFinishedTrialError:
        took = False
    if not took:
        yield None
        return
    with heartbeat(storage, trial_id):
        yield optuna.Trial(study, trial_id)


def interrupted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Real trials that were cut off before they reported (their planner was interrupted, killed or
    lost) and whose candidate nobody has measured, is measuring, or has queued again since."""
    trials = study.get_trials(deepcopy=False)
    taken = {t.user_attrs.get(RERUN_OF) for t in trials}
    busy = {
        config_key(t.user_attrs.get("config"))
        for t in trials
        if finished(t)
        or t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
    }
    out, seen = [], set()
    for t in trials:
        key = config_key(t.user_attrs.get("config"))
        cut = t.user_attrs.get("outcome") == TRIAL and t.state == optuna.trial.TrialState.FAIL
        if cut and not finished(t) and t.number not in taken and key not in busy | seen:
            out.append(t)
            seen.add(key)
    return out


def spent(study: optuna.Study) -> int:
    """Real trials that count against the budget: finished, or running now (any worker)."""
    running = optuna.trial.TrialState.RUNNING
    return sum(1 for t in real_trials(study) if finished(t) or t.state == running)
