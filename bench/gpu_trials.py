"""Real GPU trials beside the napkin estimate (needs a CUDA GPU; not runnable on CPU).

    python bench/gpu_trials.py [--gpus N] [--gpu-memory 24GiB] [--seq-len 2048]

Runs QLoRA (nf4) and LoRA trials of llama-7b, full fine-tunes of tinyllama-1.1b with and without
`offload=params`, and a `--gpu-memory` cap that must produce a real OOM; prints estimated vs
measured reserved peak and tokens/s for each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from autofit.config import Config  # noqa: E402
from autofit.estimate import estimate  # noqa: E402
from autofit.hardware import local_hardware  # noqa: E402
from autofit.models import resolve_model  # noqa: E402
from autofit.trial import run_trial  # noqa: E402
from autofit.units import GiB, parse_size  # noqa: E402


def cases(seq: int) -> list[tuple[str, Config, str]]:
    ck = {"seq_len": seq, "checkpointing": "full"}
    return [
        ("llama-7b", Config(quant="nf4", lora_rank=64, micro_batch=4, **ck), "ok"),
        ("llama-7b", Config(lora_rank=16, micro_batch=2, **ck), "ok"),
        ("tinyllama-1.1b", Config(micro_batch=4, **ck), "ok"),
        ("tinyllama-1.1b", Config(micro_batch=4, offload="params", **ck), "ok"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-memory", default=None, help="cap per GPU, e.g. 24GiB")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_trials.py needs a CUDA GPU; use bench/accuracy.py on CPU.")
    cap = parse_size(args.gpu_memory) if args.gpu_memory else None
    hardware = local_hardware()  # estimates assume every NVML GPU; pass --gpus to match it
    rows = [*cases(args.seq_len)]
    # A cap far below the need must come back as a real CUDA OOM, not a crash.
    rows.append(("tinyllama-1.1b", Config(micro_batch=16, seq_len=args.seq_len), "oom"))
    print(f"{'model':15} {'config':44} {'status':7} {'est GiB':>8} {'meas GiB':>8} {'tok/s':>9}")
    for model, cfg, expect in rows:
        gpu_memory = cap if expect == "ok" else 8 * GiB
        spec = resolve_model(model)
        est = estimate(spec, hardware, cfg)
        res = run_trial(spec, cfg, nprocs=args.gpus, device="cuda", gpu_memory=gpu_memory,
                        steps=args.steps, warmup=1)  # fmt: skip
        meas = f"{res.peak_bytes / GiB:8.2f}" if res.peak_bytes else "       -"
        tps = f"{res.tokens_per_s:9.0f}" if res.tokens_per_s else "        -"
        flag = "" if res.status == expect else f"  <-- expected {expect}"
        print(f"{model:15} {cfg.short():44} {res.status:7} {est.peak_bytes / GiB:8.2f} {meas} "
              f"{tps}  (est {est.tokens_per_s:.0f} tok/s){flag}")  # fmt: skip
        if res.status != "ok" and res.message:
            print("   ", res.message.splitlines()[0])


if __name__ == "__main__":
    main()
