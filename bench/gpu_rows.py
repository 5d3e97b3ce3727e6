"""This commit's estimate against every row autofit's own trials measured on a GPU (CPU, seconds).

    python bench/gpu_rows.py [--json PATH]

Reads the rows of autofit's own GPU trials kept in the repository:

- `bench/data/gpu-measurements/autofit-h200-*.json` (the first GPU run: one row per trial, the
  bytes in `measured`: `max_memory_allocated`, `max_memory_reserved`, `device_level`);
- the `replay` rows of `bench/data/gpu-check/*.json` (`bench/gpu_check.py`'s rows: the same
  configs again, the same three levels as `allocated_gib`, `peak_gib`, `device_gib`).

Both ran on one NVIDIA H200 capped at 24 GiB per GPU (`gpu_check.CAP`; the folders' READMEs say
which commit and torch), so each row is estimated as `bench/gpu_check.py` estimates its replay:
`autofit.estimate.estimate(resolve_model(model), hardware, Config.from_dict(config))` on that
GPU at that cap (here the `h200` preset, as no GPU is needed: estimates only). Each level is
compared with the matching part of the estimate as `bench/published.py` matches them
(`published.metric_bytes`): allocated -> `peak_allocated_bytes`, reserved -> `peak_bytes`, the
device level (`mem_get_info`: reserved plus the CUDA context, cuBLAS and NCCL outside the
allocator) -> `device_bytes`, plus NCCL's one-rank buffer where the config's own layout has no
communicator (those trials started a one-rank NCCL group for every config; autofit's trials now
start one only where the job has one, `Layout.communicators`); tokens/s (the whole run's) ->
`tokens_per_s`. Error = (estimate - measured) / measured.

Prints one table (80 columns: a row's model and config, then its numbers), the median error, the
median |error| and the worst per column, the tokens/s of each config that ran in several files
(their spread, and the estimate against their median), and the rows that ran out of memory or
did not run, each with whether the estimate foresaw the OOM (its device level above the cap).
`--json` writes every row. `tests/test_gpu_rows.py` holds what it prints to the files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _path in (ROOT, BENCH):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import gpu_check  # noqa: E402
import published  # noqa: E402

from autofit.units import GiB  # noqa: E402

MEASUREMENTS = ROOT / "bench" / "data" / "gpu-measurements"
GPU_CHECK = ROOT / "bench" / "data" / "gpu-check"
GPUS = "1xh200"  # the GPU every row ran on, at `gpu_check.CAP` per GPU
LEVELS = ("allocated", "reserved", "device")  # `published.METRICS`, the memory levels compared
COLUMNS = (*LEVELS, "tokens_per_s")
# The keys of a gpu-check row holding each level, in GiB (`gpu_check.trial_row`)
CHECK_KEYS = {"allocated": "allocated_gib", "reserved": "peak_gib", "device": "device_gib"}
# The keys of an autofit-h200 row's `measured`, in bytes
RUN_KEYS = {
    "allocated": "max_memory_allocated",
    "reserved": "max_memory_reserved",
    "device": "device_level",
}


@dataclass
class Row:
    """One trial as a file holds it: what it measured and this commit's estimate of it."""

    id: str  # the file's letter and the row's index in it, e.g. "a9"
    file: str
    model: str
    config: dict[str, Any]
    label: str  # model and `Config.short()`
    status: str  # ok, oom, error, ...
    measured: dict[str, float | None]  # COLUMNS -> bytes (memory) or tokens/s
    estimated: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float | None] = field(default_factory=dict)
    estimated_oom: bool = False  # the estimate's device level above the cap
    message: str = ""
    # whether the trial joined a process group: None where the file does not say (the first
    # run's and 2026-11-27's gpu_check rows, whose trials all joined a one-rank NCCL group)
    process_group: bool | None = None


def source_files() -> list[Path]:
    """The files read, in order: the first run's, then gpu_check's (not the plan documents its
    `plan` sections wrote beside them, `*-plan.json`)."""
    checks = [p for p in sorted(GPU_CHECK.glob("*.json")) if not p.name.endswith("-plan.json")]
    return [*sorted(MEASUREMENTS.glob("autofit-h200-*.json")), *checks]


def load_rows(files: list[Path] | None = None) -> list[Row]:
    """Every trial row of `files` (default `source_files()`), estimate not yet made. A file's
    rows are lettered in order: a, b, ...; a row keeps its index in the file's list."""
    from autofit.config import Config

    out: list[Row] = []
    for letter, path in zip("abcdefghijklmnopqrstuvwxyz", files or source_files(), strict=False):
        data = json.loads(path.read_text())
        if isinstance(data, list):  # autofit-h200-*.json: a list of trials, bytes
            for i, r in enumerate(data):
                m = r["measured"]
                measured = {k: m[RUN_KEYS[k]] for k in LEVELS}
                measured["tokens_per_s"] = m["tokens_per_s"]
                out.append(_row(f"{letter}{i}", path, r, measured, r.get("message", "")))
        else:  # gpu_check.json: its replay rows, GiB
            for i, r in enumerate(data["rows"]):
                if r.get("section") != "replay" or "config" not in r:
                    continue
                measured = {k: _bytes(r.get(CHECK_KEYS[k])) for k in LEVELS}
                measured["tokens_per_s"] = r.get("tokens_per_s")
                out.append(_row(f"{letter}{i}", path, r, measured, r.get("note") or ""))
    for row in out:
        row.label = f"{row.model} {Config.from_dict(row.config).short()}"
    return out


def _row(id_: str, path: Path, r: dict[str, Any], measured: dict[str, Any], msg: str) -> Row:
    return Row(id_, path.name, r["model"], r["config"], "", r["status"], measured, message=msg,
               process_group=r.get("process_group"))  # fmt: skip


def _bytes(gib: float | None) -> float | None:
    return gib * GiB if gib is not None else None


def estimate_rows(rows: list[Row]) -> list[Row]:
    """Each row's estimate, as `bench/gpu_check.py` makes its replay's, on the H200 at the cap."""
    from autofit.config import Config
    from autofit.estimate import estimate
    from autofit.estimate.memory import nccl_bytes
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model

    hardware = resolve_hardware(GPUS, gpu_memory=gpu_check.CAP)
    for row in rows:
        est = estimate(resolve_model(row.model), hardware, Config.from_dict(row.config))
        row.estimated = {k: float(published.metric_bytes(est, k)) for k in LEVELS}
        # trials before `TrialResult.process_group` ran in a one-rank NCCL group whatever the
        # config (`trials/rank.py` of their commits): its communicator was on the device though
        # the config's own job has none
        if not est.overhead.get("nccl") and row.process_group is not False:
            row.estimated["device"] += nccl_bytes("cuda", 1, "pcie", 1)
        row.estimated["tokens_per_s"] = float(est.tokens_per_s)
        row.errors = {
            k: (row.estimated[k] - m) / m if m else None for k, m in row.measured.items()
        }  # fmt: skip
        row.estimated_oom = not est.within_capacity
    return rows


def ran(row: Row) -> bool:
    return row.status == "ok" and row.measured["reserved"] is not None


# ----- report -------------------------------------------------------------------------------------
def _cell(value: float | None, tokens: bool = False) -> str:
    """A measured or estimated number: GiB in 6 characters, tokens/s in 7."""
    if tokens:
        return f"{value:7,.0f}" if value is not None else "      -"
    return f"{value / GiB:6.2f}" if value is not None else "     -"


def table(rows: list[Row]) -> list[str]:
    """The rows that ran: a line with the row's model and config, a line with its numbers."""
    top = "".join(f"{name + ' GiB':^19}" for name in LEVELS) + f"{'tokens/s':^20}"
    names = f"{'meas':>6}{'est':>6}{'err':>7}" * len(LEVELS) + f"{'meas':>7}{'est':>7}{'err':>6}"
    lines = [f"  {top}".rstrip(), f"id{names}", "-" * 80]
    for row in rows:
        if not ran(row):
            continue
        lines.append(f"{row.id:<4}{row.label}"[:80])
        cells = []
        for k in LEVELS:
            m, e, err = row.measured[k], row.estimated[k], row.errors[k]
            cells.append(f"{_cell(m)}{_cell(e)}{_pct(err, 7)}")
        k = "tokens_per_s"
        m, e, err = row.measured[k], row.estimated[k], row.errors[k]
        cells.append(f"{_cell(m, True)}{_cell(e, True)}{_pct(err, 6, 0)}")
        lines.append("  " + "".join(cells))
    return lines


def _pct(err: float | None, width: int, digits: int = 1, sign: str = "+") -> str:
    if err is None:
        return " " * (width - 1) + "-"
    return f"{err * 100:{sign}{width - 1}.{digits}f}%"


def stats(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per column over the rows that ran: n, median error, median |error| and the worst (signed,
    the largest |error|, with its row)."""
    out: dict[str, dict[str, Any]] = {}
    for k in COLUMNS:
        found = [(r.errors[k], r.id) for r in rows if ran(r) and r.errors.get(k) is not None]
        if not found:
            out[k] = {"n": 0}
            continue
        errors = [e for e, _ in found]
        worst, worst_id = max(found, key=lambda f: abs(f[0]))
        out[k] = {
            "n": len(errors),
            "median": statistics.median(errors),
            "median_abs": published.stats(errors)["median"],
            "worst": worst,
            "worst_row": worst_id,
        }
    return out


def summary_lines(rows: list[Row]) -> list[str]:
    lines = ["", "Per column, the rows that ran (error = (estimate - measured) / measured):"]
    lines.append(f"{'':14}{'allocated':>14}{'reserved':>14}{'device':>14}{'tokens/s':>14}")
    groups = [("all files", rows)]
    files = list(dict.fromkeys(r.file for r in rows))
    if len(files) > 1:
        groups += [(f"{_letter(rows, f)}: {f}", [r for r in rows if r.file == f]) for f in files]
    for name, group in groups:
        s = stats(group)
        n = max(v["n"] for v in s.values())
        lines.append(f"{name} ({n} rows)"[:80])
        for what, key, sign in (("median", "median", "+"), ("median |err|", "median_abs", "")):
            cells = "".join(f"{_pct(s[k].get(key), 14, sign=sign)}" for k in COLUMNS)
            lines.append(f"  {what:<12}{cells}")
        worst = "".join(
            f"{_pct(s[k].get('worst'), 9)} {s[k].get('worst_row', ''):>4}" for k in COLUMNS
        )
        lines.append(f"  {'worst':<12}{worst}")
    return lines


def same_configs(rows: list[Row]) -> list[dict[str, Any]]:
    """The configs that ran in more than one file (the same trial again, minutes or a day
    apart), each with its rows' measured tokens/s, their spread (largest / smallest - 1), their
    median and the estimate's error against that median: how far one run is from another,
    beside how far the estimate is from their middle."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        if ran(r) and r.measured.get("tokens_per_s"):
            by.setdefault(r.label, []).append(r)
    out = []
    for label, group in by.items():
        if len(group) < 2:
            continue
        measured = [r.measured["tokens_per_s"] for r in group]
        middle = statistics.median(measured)
        estimate = group[0].estimated["tokens_per_s"]
        out.append({
            "label": label, "ids": [r.id for r in group], "tokens_per_s": measured,
            "spread": max(measured) / min(measured) - 1, "median": middle,
            "estimate": estimate, "error": (estimate - middle) / middle,
        })  # fmt: skip
    return out


def same_config_lines(rows: list[Row]) -> list[str]:
    found = same_configs(rows)
    if not found:
        return []
    lines = [
        "",
        "Tokens/s of the configs measured in several runs",
        "(spread = largest / smallest - 1; error = (estimate - median) / median):",
        f"{'runs':<16}{'min':>8}{'max':>8}{'spread':>8}{'median':>8}{'est':>8}{'err':>7}",
    ]
    for c in found:
        lines.append(f"{c['label']}"[:80])
        ids = ",".join(c["ids"])
        lines.append(
            f"  {ids:<14}{min(c['tokens_per_s']):>8,.0f}{max(c['tokens_per_s']):>8,.0f}"
            f"{c['spread'] * 100:>7.0f}%{c['median']:>8,.0f}{c['estimate']:>8,.0f}"
            f"{_pct(c['error'], 7, digits=1)}"
        )
    worst = max(found, key=lambda c: abs(c["error"]))
    widest = max(found, key=lambda c: c["spread"])
    lines.append(
        f"worst error against a median {worst['error'] * 100:+.1f}% ({worst['ids'][0]}...); "
        f"widest spread {widest['spread'] * 100:.0f}% ({widest['ids'][0]}...)"
    )
    return lines


def _letter(rows: list[Row], file: str) -> str:
    return next(r.id[0] for r in rows if r.file == file)


def not_run_lines(rows: list[Row]) -> list[str]:
    """Rows that ran out of memory or did not run, with whether the estimate foresaw an OOM."""
    left = [r for r in rows if not ran(r)]
    lines = ["", f"Out of memory or not run: {len(left)} rows (cap {gpu_check.CAP / GiB:.0f} GiB)"]
    for r in left:
        said = "OOM" if r.estimated_oom else "fits"
        right = (r.status == "oom") == r.estimated_oom
        verdict = "as estimated" if right else "NOT as estimated"
        if r.status not in ("oom", "ok"):
            verdict = "did not run"
        lines.append(f"{r.id:<4}{r.label}"[:80])
        lines.append(
            f"    {r.status}; estimate {said} (device {r.estimated['device'] / GiB:.2f} GiB): "
            f"{verdict}"
        )
        if r.message and r.status != "oom":
            lines.append(f"    {r.message.splitlines()[0]}"[:80])
    return lines


def report(rows: list[Row]) -> str:
    lines = ["This commit's estimate vs autofit's own GPU trials (one H200, 24 GiB cap)"]
    lines.append("error = (estimate - measured) / measured; tokens/s of the whole run")
    letters = dict.fromkeys((r.id[0], r.file) for r in rows)
    lines += [f"  {letter}: bench/data/{_folder(file)}/{file}" for letter, file in letters]
    lines.append("  (the commit and torch of each: the README.md beside it)")
    lines.append("")
    lines += table(rows)
    lines += summary_lines(rows)
    lines += same_config_lines(rows)
    lines += not_run_lines(rows)
    return "\n".join(lines)


def _folder(file: str) -> str:
    return "gpu-measurements" if (MEASUREMENTS / file).exists() else "gpu-check"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every row here")
    args = parser.parse_args(argv)
    rows = estimate_rows(load_rows())
    print(report(rows))
    if args.json:
        doc = {"rows": [asdict(r) for r in rows], "stats": stats(rows),
               "same_configs": same_configs(rows)}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
