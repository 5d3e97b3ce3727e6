"""Plan from Python: search on CPU with llama-debug, then export for your launcher.

    python examples/plan_from_python.py            # ~1-2 minutes on a laptop CPU

On real GPUs, drop `device`/`gpu_memory`, use your model and `gpus="auto"`, and a shipped space
(`space="default"`, `"qlora"`, ...). Running it again resumes the study: no finished trial repeats.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

import autofit

HERE = Path(__file__).resolve().parent


def main() -> None:
    plan = autofit.plan(
        "llama-debug",
        gpus="2",  # on --device cpu: 2 gloo processes stand in for 2 GPUs
        device="cpu",
        gpu_memory="56MiB",  # each process is held to this, like a small GPU
        space=HERE / "tiny_space.yaml",
        seq_len=64,
        trials=6,
        steps=2,
        run_dir="autofit-runs/example",
        console=Console(),
    )
    if plan.best is None:
        print("Nothing fits:", plan.advice)
        return
    best = plan.best
    print(f"winner: {best.config.short()}: {best.tokens_per_s:,.0f} tokens/s; {plan.reason}")
    for fmt, name in (("autofit", "plan.yaml"), ("accelerate", "accelerate.yaml"),
                      ("trainer", "training_args.json")):  # fmt: skip
        for path in plan.export(fmt, Path("autofit-runs/example") / name):
            print("wrote", path)
    print("next: torchrun --nproc-per-node 2 examples/train_with_plan.py "
          "--plan autofit-runs/example/plan.yaml")  # fmt: skip


if __name__ == "__main__":
    main()
