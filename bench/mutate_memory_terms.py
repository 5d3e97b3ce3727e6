"""Does the suite notice a wrong memory term? Scale each term of the estimator by 0.7 and 1.3.

    python bench/mutate_memory_terms.py [--json measured.json]

Runs the CPU trials of `tests/estimate/measured.py` once (or reads them from `--json`, which it
writes after measuring) and the FSDPMemTracker traces of `tests/estimate/tracked.py` (seconds, no
cache), prints each case's error against what docs/accuracy.md records, then for every
byte-counting function of `autofit/estimate/memory/` and each factor replaces the function with
one that returns factor x the original and asks the tests' own checks (`measured.problem`,
`tracked.problem`) whether any case now fails. A function that returns several byte counts
(`activation_bytes`: the decoder layers' and those outside them) is scaled whole and then one part
at a time. Every cell of the table should say "caught".
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.estimate import memory as mem  # noqa: E402
from autofit.trials import TrialResult  # noqa: E402
from tests.estimate import tracked  # noqa: E402
from tests.estimate.measured import CASES, error, measure, problem  # noqa: E402

FACTORS = (0.7, 1.3)
# GPU-only terms: a CPU trial has no CUDA context, NCCL, cuBLAS workspace nor caching allocator to
# hold them to.
GPU_ONLY = {"outside_allocator_bytes", "nccl_bytes", "workspace_bytes", "usable_bytes",
            "allocator_overhead"}  # fmt: skip
# Not a term of any peak: the share of host RAM offloaded state may take, which the estimate's
# `host_bytes` is compared with (`within_capacity`, pruning). No measured peak can hold it.
CAPACITIES = {"usable_host_bytes"}


Term = tuple[str, int | None]  # a function of memory.py, and which part of its tuple (None: all)


def memory_terms() -> list[Term]:
    """Every function of `memory.py` that returns bytes (`*_bytes`, `*_bytes_per_param`, ...);
    one returning a tuple of byte counts is a term whole and a term per part."""
    terms: list[Term] = []
    for name, fn in vars(mem).items():
        if not callable(fn) or not getattr(fn, "__module__", "").startswith(f"{mem.__name__}."):
            continue
        if inspect.isclass(fn) or name.startswith("_") or name in GPU_ONLY | CAPACITIES:
            continue
        if "bytes" in name:
            terms.append((name, None))
            returns = str(inspect.signature(fn).return_annotation)
            if returns.startswith("tuple["):
                parts = returns.removeprefix("tuple[").removesuffix("]").split(",")
                terms.extend((name, i) for i in range(len(parts)))
    return terms


def label(term: Term) -> str:
    name, part = term
    return name if part is None else f"{name}[{part}]"


def scale(value, factor: float, part: int | None):  # type: ignore[no-untyped-def]
    if not isinstance(value, tuple):
        return value * factor
    return tuple(v * factor if part in (None, i) else v for i, v in enumerate(value))


def caught(
    term: Term,
    factor: float,
    measured: dict[str, TrialResult],
    traced: dict[str, tracked.Traced],
) -> list[str]:
    name, part = term
    original = getattr(mem, name)

    def scaled(*args, **kwargs):  # type: ignore[no-untyped-def]
        return scale(original(*args, **kwargs), factor, part)

    # the term is bound in its own module, in the package and in every module that imported it
    bound = [m for m in list(sys.modules.values()) if getattr(m, name, None) is original]
    with contextlib.ExitStack() as stack:
        for module in bound:
            stack.enter_context(mock.patch.object(module, name, scaled))
        return [c.name for c in CASES if problem(c, measured[c.name])] + [
            c.name for c in tracked.CASES if tracked.problem(c, traced[c.name])
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="read measured trials here, or write them")
    args = parser.parse_args()
    if args.json and args.json.is_file():
        data = json.loads(args.json.read_text())
        measured = {k: TrialResult.from_dict(v) for k, v in data.items()}
    else:
        measured = {c.name: measure(c) for c in CASES}
        if args.json:
            args.json.write_text(json.dumps({k: r.to_dict() for k, r in measured.items()}))
    print(f"{'case':30} {'measured MiB':>12} {'error':>7} {'recorded':>9}  check")
    for c in CASES:
        r = measured[c.name]
        err = error(c, r.peak_bytes) if r.peak_bytes else float("nan")
        mib = (r.peak_bytes or 0) / 2**20
        print(f"{c.name:30} {mib:12.2f} {err:+7.1%} {c.expected:+9.1%}  "
              f"{'ok' if problem(c, r) is None else 'FAILS'}")  # fmt: skip
    traced = {c.name: tracked.measure(c) for c in tracked.CASES}
    for c in tracked.CASES:
        t = traced[c.name]
        check = "ok" if tracked.problem(c, t) is None else "FAILS"
        err = tracked.error(c, t.peak_bytes)
        print(f"{c.name:30} {t.peak_bytes / 2**20:12.2f} {err:+7.1%} {c.expected:+9.1%}  {check}")
    print(f"\n{'term':34} {'x0.7':42} {'x1.3':42}")
    missed = 0
    for term in memory_terms():
        cells = []
        for factor in FACTORS:
            by = caught(term, factor, measured, traced)
            missed += not by
            cells.append(f"caught ({by[0]})" if by else "NOT CAUGHT")
        print(f"{label(term):34} {cells[0]:42} {cells[1]:42}")
    print(f"\n{missed} of {2 * len(memory_terms())} mutations not caught")


if __name__ == "__main__":
    main()
