"""Second yardstick for the napkin at real scale (7B-70B) without a GPU.

torch's `FSDPMemTracker` runs the real FSDP2 training step of autofit's own builder under
`FakeTensorMode` with the `fake` process group (no memory is allocated, no rank exists but 0) and
reports the peak tensor memory of one rank by category. This script compares it with the napkin's
`peak_allocated_bytes` for the same configs and prints the error of each.

    python bench/fake_yardstick.py                 # the default grid (a few minutes)
    python bench/fake_yardstick.py --quick         # two configs

What the tracker does not see: CUDA context and caching-allocator slack (compared: allocated
bytes only), and quantized tensor subclasses it cannot fake (NF4/int8 rows are skipped where
torchao's subclasses refuse fake tensors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = [
    # (model, gpus, knobs)
    ("llama-7b", 8, {}),
    ("llama-7b", 8, {"checkpointing": "full", "micro_batch": 4}),
    ("llama-7b", 8, {"checkpointing": "selective", "micro_batch": 2}),
    ("llama-7b", 8, {"reshard": False, "micro_batch": 2, "checkpointing": "full"}),
    ("llama-7b", 8, {"precision": "bf16", "micro_batch": 2, "checkpointing": "every-2"}),
    # grad_accum > 1 is not traceable: FSDPMemTracker refuses several forwards per step.
    ("llama-7b", 2, {"lora_rank": 64, "checkpointing": "full", "micro_batch": 4}),
    ("llama-7b", 1, {"lora_rank": 16, "micro_batch": 1}),
    ("llama-7b", 8, {"wrap": "every-2", "checkpointing": "full", "micro_batch": 2}),
    ("llama-13b", 8, {"checkpointing": "full", "micro_batch": 2}),
    ("llama-3-8b", 8, {"checkpointing": "full", "micro_batch": 2}),
    ("llama-70b", 8, {"lora_rank": 16, "checkpointing": "full", "micro_batch": 1}),
    ("llama-70b", 8, {"checkpointing": "full", "micro_batch": 1}),
    ("llama-7b", 8, {"wrap": "model", "checkpointing": "full", "micro_batch": 2}),
    ("llama-7b", 2, {"wrap": "none", "lora_rank": 16, "micro_batch": 2, "checkpointing": "full"}),
    ("mistral-7b", 4, {"lora_rank": 32, "micro_batch": 2, "checkpointing": "selective"}),
]


def trace(model_name: str, world: int, knobs: dict) -> dict:
    """Peak bytes of rank 0 for one config, traced under FakeTensorMode by FSDPMemTracker."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autofit.config import Config
    from autofit.models import resolve_model
    from autofit.trial.apply import cast_base, cast_trainable
    from autofit.trial.build import build_meta_model, materialize
    from autofit.trial.checkpoint import apply_checkpointing
    from autofit.trial.fsdp import apply_fsdp, fsdp_root, make_mesh
    from autofit.trial.lora import apply_lora
    from autofit.trial.optim import build_optimizer

    spec = resolve_model(model_name)
    cfg = Config(**{"seq_len": 2048, **knobs})
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = make_mesh("cpu", world, cfg.wrap)  # made outside the fake mode
    # The builder's steps before sharding run on the meta device outside the fake mode (peft's
    # adapter moves cannot swap fake tensors); sharding and materialising run inside it.
    model = build_meta_model(spec)
    cast_base(model, cfg)
    model = apply_lora(model, cfg.lora_rank, cfg.alpha)
    cast_trainable(model, cfg)
    apply_checkpointing(model, cfg.checkpointing)
    with FakeTensorMode(allow_non_fake_inputs=True):
        apply_fsdp(model, cfg, mesh)
        materialize(model, torch.device("cpu"))
        opt = build_optimizer(model, cfg.optimizer, cfg.offload, "cpu", grad_accum=cfg.grad_accum)
        root = fsdp_root(model)
        batch = torch.randint(0, spec.vocab, (cfg.micro_batch, cfg.seq_len))
        tracker = FSDPMemTracker(root, opt)
        tracker.track_inputs((batch,))
        with tracker:
            for step in range(2):
                for micro in range(cfg.grad_accum):
                    root.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
                    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                    (loss / cfg.grad_accum).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step == 0:
                    tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
    dist.destroy_process_group()
    per_dev = next(iter(snap.values()))
    return {str(k).split(".")[-1]: int(v) for k, v in per_dev.items()}, cfg, spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configs only")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--only", help="only rows whose 'model knobs' text contains this")
    args = parser.parse_args()

    from autofit.estimate import estimate
    from autofit.hardware import preset_hardware

    grid = GRID[:2] if args.quick else GRID
    if args.only:
        grid = [row for row in grid if args.only in f"{row[0]} {row[2]}"]
    rows = []
    for model_name, world, knobs in grid:
        start = time.perf_counter()
        try:
            measured, cfg, spec = trace(model_name, world, knobs)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{model_name} x{world} {knobs}: tracer failed: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=2)
            continue
        est = estimate(spec, preset_hardware(world, "h100-80gb"), cfg, device="cuda")
        total = measured["Total"]
        err = (est.peak_allocated_bytes - total) / total
        rows.append(
            {
                "model": model_name,
                "gpus": world,
                "config": cfg.short(),
                "tracker_bytes": total,
                "estimate_bytes": est.peak_allocated_bytes,
                "error": err,
                "tracker": measured,
                "estimate": est.breakdown,
                "seconds": time.perf_counter() - start,
            }
        )
        print(
            f"{model_name:>11} x{world} {cfg.short():<48} tracker {total / 2**30:7.2f} GiB  "
            f"napkin {est.peak_allocated_bytes / 2**30:7.2f} GiB  error {err:+7.1%}  "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    if rows:
        errs = [abs(r["error"]) for r in rows]
        below = sum(r["error"] < 0 for r in rows)
        print(
            f"\n{len(rows)} configs: median |error| {statistics.median(errs):.1%}, "
            f"worst {max(errs):.1%}, napkin below tracker in {below}/{len(rows)}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
