"""Fingerprints of the estimator: one SHA-256 per (model, hardware) over every candidate's estimate.

A refactor that must not change estimates runs this before and after and compares the digests (or,
with `--dump FILE`, the full JSON). Every valid candidate of the space is estimated, in space order,
with its prune reason, and the ranked order of the fitting ones is hashed too.
Run: `python bench/estimate_digest.py [--space default] [--dump out.json]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys

from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import estimate_all, prune_reason, rank_key
from autofit.request import DEFAULT_MARGIN, PlanRequest
from autofit.space_file import load_space

CASES = (
    ("llama-7b", "1xrtx4090", "cuda", None),
    ("llama-7b", "2xrtx3090", "cuda", None),
    ("llama-70b", "8xh100-80gb", "cuda", None),
    ("llama-3-8b", "1xrtx4090", "cuda", None),
    ("llama-debug", "2", "cpu", "30MiB"),
)
# A `--device cpu` case's hardware is this machine's (`cpu_hardware`: its RAM and cores, which
# the host-RAM verdicts and the host's speed read); the digest pins them to the suite's machine,
# so that it fingerprints the code, not the machine it ran on (its RAM moves by some MiB from one
# machine to the next, and 300 MiB less turned some verdicts)
CPU_HOST = {"host_ram_bytes": 24 * 2**30, "cpu_cores": 2}


def fingerprint(model: str, gpus: str, device: str, gpu_memory: str | None, space: str) -> dict:
    spec = resolve_model(model)
    hw = resolve_hardware(gpus, device=device, gpu_memory=gpu_memory)
    if device == "cpu":
        hw = dataclasses.replace(hw, **CPU_HOST)
    sp = load_space(space)
    cands, skipped, considered = estimate_all(PlanRequest.of(spec, hw, sp, device=device))
    rows = []
    for c in cands:
        reason = prune_reason(c.estimate, DEFAULT_MARGIN, hw)
        rows.append({"estimate": c.estimate.to_dict(), "pruned": str(reason)})
    fitting = sorted(
        (c for c, r in zip(cands, rows, strict=True) if r["pruned"] == "None"), key=rank_key
    )
    doc = {
        "candidates": rows,
        "skipped": {str(k): v for k, v in sorted(skipped.items(), key=str)},
        "considered": considered,
        "ranked": [c.config.short() for c in fitting],
    }
    blob = json.dumps(doc, sort_keys=True).encode()
    return {"case": f"{model} {gpus} {device} {gpu_memory}", "n": len(cands),
            "sha256": hashlib.sha256(blob).hexdigest(), "doc": doc}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", default="default")
    parser.add_argument("--dump", help="write every case's full JSON here")
    args = parser.parse_args(argv)
    out = [fingerprint(*case, args.space) for case in CASES]
    for f in out:
        print(f"{f['sha256'][:16]}  {f['n']:6,} candidates  {f['case']}")
    if args.dump:
        with open(args.dump, "w") as fh:
            json.dump(out, fh, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
