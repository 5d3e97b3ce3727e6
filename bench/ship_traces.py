"""Make the structures and layer traces shipped inside the package (`autofit/arch/shipped/`).

For every preset (or those named), its structure and the layer traces of every `ActivationKey` a
plan of a shipped search space or of the README's example space asks for (`shipped_keys`: each
space's sequence length, LoRA ranks and checkpointing, both dtype paths, each loss the trace
tells apart), read from the model now,
one gzipped JSON file per architecture named by its hash and stamped with the versions it was
made with (`autofit.arch.shipped`). Re-run it after a change of `TRACE_VERSION` or of the pinned
torch, transformers or peft (a plan reads no entry made with other versions; it traces instead).
Files of architectures no preset has any more are removed when every preset is made. A file made
with these very versions keeps its structure and traces, and only the keys it lacks are traced
(after a space gained a rank, say); `--fresh` traces everything again.

Run: `python bench/ship_traces.py` (every preset from scratch: about half an hour on two cores),
or `--models llama-7b,llama-debug`, `--fresh`; `--ops` adds only the op counts a plan reads
(`autofit.arch.ops_of`, the files' `ops` section: a few minutes; with `--fresh` counted again);
`--check NAME` compares a fresh trace of NAME with its shipped file (its structure, traces and
step logs, not the versions stamped) and exits 1 where they differ: run under other releases of
torch, transformers or peft, it is the evidence a group of `autofit.arch.shipped.TRACED_ALIKE`
needs.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import time
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from typing import Any

from autofit.arch import TRACE_VERSION, ops_entry, traced_entry
from autofit.arch.shipped import SHIPPED_DIR, arch_id, made_with, shipped_path
from autofit.config import Config
from autofit.estimate.memory.widths import traced_loss
from autofit.files import atomic_write
from autofit.models import PRESETS, ModelSpec
from autofit.space_file import available_spaces, load_space
from autofit.structure import ActivationKey, OpsKey

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _spaces() -> Iterator[tuple[Any, dict[str, Any], list[str], Config]]:
    """Each shipped space (`search_spaces/*.yaml`) and the README's example space: the space,
    its knobs, the checkpointing policies a trace tells apart (`none` always, `full` for `full`
    and `every-2`, `selective`) and its LoRA settings (else their defaults)."""
    for path in [*available_spaces(), *sorted(EXAMPLES.glob("*.yaml"))]:
        space = load_space(path)
        knobs = space.knobs
        policies = {"none"} | {
            "selective" if c == "selective" else "full" for c in knobs["checkpointing"]
        }
        yield space, knobs, sorted(policies), Config(**space.settings)


def shipped_keys() -> tuple[list[ActivationKey], list[ActivationKey]]:
    """The activation keys and the step-event keys a plan of a shipped space with its own
    sequence length and LoRA settings asks for: each LoRA rank x the checkpointing policies it
    traces x autocast or not (the plain module or DDP under bf16-mixed, or bf16 compute) x each
    loss as traced (`fused` is traced as `chunked`). Both kinds have the same keys."""
    acts: dict[str, ActivationKey] = {}
    for space, knobs, policies, lora in _spaces():
        losses = sorted({traced_loss(v) for v in knobs["loss"]})
        targets, dropout = lora.lora_targets, lora.lora_dropout
        for rank, policy, autocast in product(knobs["lora_rank"], policies, (False, True)):
            base = ActivationKey(space.seq_len, rank, targets, dropout, policy, autocast)
            for loss in losses:
                key = ActivationKey(**{**base.__dict__, "loss": loss})
                acts[key.text()] = key
    return list(acts.values()), list(acts.values())


def shipped_ops_keys() -> list[OpsKey]:
    """The op-count keys a plan of a shipped space asks for (`autofit.estimate.step._host_ops`):
    each quantization x LoRA or not (quantization only with LoRA) x the space's targets and
    dropout x the checkpointing policies it counts x autocast or not; the standard loss."""
    keys: dict[str, OpsKey] = {}
    for _, knobs, policies, lora in _spaces():
        for quant, rank in product(knobs["quant"], knobs["lora_rank"]):
            if rank == 0 and quant != "none":
                continue
            for policy, autocast in product(policies, (False, True)):
                key = OpsKey(
                    quant, rank > 0, lora.lora_targets if rank else None,
                    bool(rank) and lora.lora_dropout > 0, policy, autocast,
                )  # fmt: skip
                keys[key.text()] = key
    return list(keys.values())


def add_ops(spec: ModelSpec, fresh: bool = False, variant: str | None = None) -> int:
    """Add the op counts of `shipped_ops_keys` to `spec`'s shipped file (its `ops` section;
    nothing else in it changes), counting only the keys it lacks (all of them again when
    `fresh`). Returns the keys counted."""
    path = shipped_path(spec, variant)
    data = read(path)
    if fresh:
        data.pop("ops", None)
    have = data.setdefault("ops", {})
    missing = [k for k in shipped_ops_keys() if k.text() not in have]
    have.update(ops_entry(spec, missing))
    atomic_write(path, gzipped(data))
    return len(missing)


def entry(spec: ModelSpec, kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """The shipped file's content for `spec`: what it is, the versions, the traces and the op
    counts; those `kept` (an earlier file made with these versions) are reused and only the rest
    traced or counted."""
    acts, events = shipped_keys()
    kept = kept or {}
    old_acts, old_events = kept.get("activations", {}), kept.get("events", {})
    fresh = traced_entry(
        spec,
        [k for k in acts if k.text() not in old_acts],
        [k for k in events if k.text() not in old_events],
        structure=kept.get("structure"),
    )
    wanted_events = {k.text() for k in events}
    old_ops = kept.get("ops", {})
    ops_keys = shipped_ops_keys()
    fresh_ops = ops_entry(spec, [k for k in ops_keys if k.text() not in old_ops])
    wanted_ops = [k.text() for k in ops_keys]
    return {
        "model": spec.name,
        "arch_id": arch_id(spec),
        "made_with": made_with(TRACE_VERSION),
        "structure": fresh["structure"],
        "activations": {
            t: old_acts[t] if t in old_acts else fresh["activations"][t]
            for t in (k.text() for k in acts)
        },
        "events": {
            k: old_events[k] if k in old_events else fresh["events"][k]
            for k in sorted(wanted_events)
            if k in old_events or k in fresh["events"]
        },
        "ops": {t: old_ops[t] if t in old_ops else fresh_ops[t] for t in wanted_ops},
    }


def _kept(spec: ModelSpec, variant: str | None = None) -> dict[str, Any] | None:
    """The shipped file of `spec` (`variant`) if it was made with these versions, else None."""
    try:
        data = read(shipped_path(spec, variant))
    except (OSError, ValueError):
        return None
    return data if data.get("made_with") == made_with(TRACE_VERSION) else None


def gzipped(data: dict[str, Any]) -> bytes:
    """The entry as gzipped JSON, the same bytes for the same entry (no time stamp, no name)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:
        f.write(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    return buffer.getvalue()


def read(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def without_empty(events: list[Any]) -> list[Any]:
    """A step log (`StepEvents.to_list()`) without the storages of no bytes: their birth reads
    `(id, 0)` like a death and the allocator replay skips it, as the allocator does (torch 2.11's
    chunked loss makes two a step, 2.13's none; 2.13's autocast of Phi-3 six). Ids are numbered
    again in order of birth, the marks and the fixed and gradient ids follow."""
    log, marks, fixed, grads = events
    first: dict[int, int] = {}
    for sid, size in log:
        first.setdefault(sid, size)
    kept, ids, before = [], {}, [0]
    for sid, size in log:
        if first[sid]:
            kept.append([ids.setdefault(sid, len(ids)), size])
        before.append(len(kept))
    return [kept, [before[m] for m in marks], sorted(ids[i] for i in fixed if i in ids),
            sorted(ids[i] for i in grads if i in ids)]  # fmt: skip


def check(spec: ModelSpec, variant: str | None = None) -> int:
    """Trace `spec` now and compare every section but the stamp with its shipped file (or that
    `variant`; step logs `without_empty`): 0 where all are the same, else 1 (the differing keys of
    each are named)."""
    fresh, shipped = entry(spec), read(shipped_path(spec, variant))
    stamp = ", ".join(f"{k} {v}" for k, v in sorted(shipped["made_with"].items()))
    print(f"{spec.name}: traced with {made_with(TRACE_VERSION)}; shipped made with {stamp}")
    differ = 0
    for section in ("structure", "activations", "events"):
        new, old = fresh.get(section), shipped.get(section)
        if section == "structure":
            bad = [] if new == old else ["(the structure)"]
        else:
            norm = without_empty if section == "events" else (lambda x: x)
            bad = sorted(
                k
                for k in set(new or {}) | set(old or {})
                if k not in new or k not in old or norm(new[k]) != norm(old[k])
            )
        differ += len(bad)
        print(f"  {section}: {'same' if not bad else f'{len(bad)} DIFFER: ' + ', '.join(bad[:4])}")
    print(f"{spec.name}: {'same as shipped' if not differ else 'DIFFERS from shipped'}")
    return 0 if not differ else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated presets (default: every preset)")
    parser.add_argument("--check", metavar="NAME", help="compare a fresh trace with the shipped")
    parser.add_argument("--fresh", action="store_true", help="trace every key again")
    parser.add_argument("--ops", action="store_true", help="add the op counts only")
    parser.add_argument("--variant", help="the files of releases that trace otherwise, by name")
    args = parser.parse_args(argv)
    variant = args.variant
    if args.ops:
        for name in args.models.split(",") if args.models else list(PRESETS):
            started = time.perf_counter()
            n = add_ops(PRESETS[name], args.fresh, variant)
            print(f"{name}: {n} op counts, {time.perf_counter() - started:.0f} s", flush=True)
        return 0
    if args.check:
        return check(PRESETS[args.check], variant)
    names = args.models.split(",") if args.models else list(PRESETS)
    made = set()
    for name in names:
        spec = PRESETS[name]
        started = time.perf_counter()
        data = entry(spec, None if args.fresh else _kept(spec, variant))
        path = shipped_path(spec, variant)
        atomic_write(path, gzipped(data))
        made.add(path.name)
        took = time.perf_counter() - started
        print(f"{name}: {len(data['activations'])} traces, {len(data['events'])} step logs, "
              f"{took:.0f} s -> {path.name}", flush=True)  # fmt: skip
    if not args.models:  # this variant's files (or the pinned releases') of no preset
        suffix = f".{variant}.json.gz" if variant else ".json.gz"
        for stale in SHIPPED_DIR.glob(f"*{suffix}"):
            if len(stale.name) == 20 + len(suffix) and stale.name not in made:
                stale.unlink()
                print(f"removed {stale.name} (no preset has its architecture)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
