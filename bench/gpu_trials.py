"""Real GPU trials beside the napkin estimate (needs a CUDA GPU; not runnable on CPU).

    python bench/gpu_trials.py [--gpus N] [--gpu-memory 24GiB] [--seq-len 2048] [--json out.json]

One command for a GPU session. Runs answer.ai's published Llama-2-7B QLoRA and LoRA recipes
(micro-batch 1-8, seq 2048) on one GPU as the plain module and as FSDP2 on a one-rank mesh (with
param offload, as answer.ai offloads), full fine-tunes of tinyllama-1.1b with and without
`offload=params`, four of these again with each decoder layer compiled (`compile: true`: compile
time, graphs, graph breaks), and a `--gpu-memory` cap that must produce a real OOM. Prints, per
trial, how the model was held, the estimated vs measured reserved peak (`max_memory_reserved`), the
device-level peak (`mem_get_info`: allocator + CUDA context + NCCL) against capacity, the build's
own peak, and estimated vs measured tokens/s; then the median and worst |error| of the memory
estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from autofit.config import Config  # noqa: E402
from autofit.estimate import estimate  # noqa: E402
from autofit.hardware import resolve_hardware  # noqa: E402
from autofit.models import resolve_model  # noqa: E402
from autofit.trials import run_trial  # noqa: E402
from autofit.units import GiB  # noqa: E402


def cases(seq: int) -> list[tuple[str, Config, str]]:
    ck = {"seq_len": seq, "checkpointing": "full"}
    qlora = {"quant": "nf4", "lora_rank": 64, **ck}
    lora = {"lora_rank": 64, **ck}
    rows = []
    for mb in (1, 2, 4, 8):  # answer.ai's 7B QLoRA/LoRA sweep, one GPU, plain module
        rows.append(("llama-7b", Config(micro_batch=mb, wrap="none", **qlora), "ok"))
    for mb in (1, 4):
        rows.append(("llama-7b", Config(micro_batch=mb, wrap="none", **lora), "ok"))
    # the same on FSDP2 (one-rank mesh, params offloaded: answer.ai's one-GPU FSDP recipe)
    for mb in (1, 4):
        rows.append(("llama-7b", Config(micro_batch=mb, offload="params", **qlora), "ok"))
    rows.append(("llama-7b", Config(micro_batch=2, offload="params", **lora), "ok"))
    rows += [
        ("tinyllama-1.1b", Config(micro_batch=4, wrap="none", **ck), "ok"),
        ("tinyllama-1.1b", Config(micro_batch=4, offload="params", **ck), "ok"),
    ]
    # each decoder layer compiled (compile: true), beside the eager rows above: the speed-up the
    # estimate assumes (`autofit.estimate.speed.COMPILE_TIME_SAVED`) and the eager memory bound
    rows += [
        ("llama-7b", Config(micro_batch=4, wrap="none", compile=True, **qlora), "ok"),
        ("llama-7b", Config(micro_batch=4, wrap="none", compile=True, **lora), "ok"),
        ("llama-7b", Config(micro_batch=4, offload="params", compile=True, **qlora), "ok"),
        ("tinyllama-1.1b", Config(micro_batch=4, wrap="none", compile=True, **ck), "ok"),
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-memory", default="24GiB", help="cap per GPU (a 24 GiB card)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_trials.py needs a CUDA GPU; use bench/accuracy.py on CPU.")
    hardware = resolve_hardware(str(args.gpus), gpu_memory=args.gpu_memory)
    cap = hardware.capacity_bytes
    rows = [*cases(args.seq_len)]
    # A cap far below the need must come back as a real CUDA OOM, not a crash.
    rows.append(("tinyllama-1.1b", Config(micro_batch=16, seq_len=args.seq_len), "oom"))
    print(f"GPU: {torch.cuda.get_device_name(0)}; cap {cap / GiB:.1f} GiB per GPU")
    print(f"{'model':15} {'config':50} {'path':5} {'status':7} {'est GiB':>8} {'meas GiB':>8} "
          f"{'err':>7} {'device':>7} {'build':>7} {'tok/s':>7} {'est':>7}")  # fmt: skip
    out, errors = [], []
    for model, cfg, expect in rows:
        gpu_memory = cap if expect == "ok" else 8 * GiB
        spec = resolve_model(model)
        est = estimate(spec, hardware, cfg)
        res = run_trial(spec, cfg, nprocs=args.gpus, device="cuda", gpu_memory=gpu_memory,
                        steps=args.steps, warmup=1)  # fmt: skip
        gib = lambda b: f"{b / GiB:7.2f}" if b else "      -"  # noqa: E731
        err = (est.peak_bytes - res.peak_bytes) / res.peak_bytes if res.ok else None
        if err is not None:
            errors.append(abs(err))
        shown = f"{err:+7.1%}" if err is not None else "      -"
        tps = f"{res.tokens_per_s:7.0f}" if res.tokens_per_s else "      -"
        flag = "" if res.status == expect else f"  <-- expected {expect}"
        print(f"{model:15} {cfg.short():50} {res.sharding or '-':5} {res.status:7} "
              f"{est.peak_bytes / GiB:8.2f} {gib(res.peak_bytes)} {shown} "
              f"{gib(res.device_peak_bytes)} {gib(res.build_peak_bytes)} {tps} "
              f"{est.tokens_per_s:7.0f}{flag}", flush=True)  # fmt: skip
        if res.compile_s is not None:
            print(f"    compiled: {res.graphs} graph(s), {res.graph_breaks} graph break(s), "
                  f"{res.recompiles} recompile(s), {res.compile_s:.1f} s compiling")  # fmt: skip
        if res.status != "ok" and res.message:
            print("   ", res.message.splitlines()[0])
        out.append({"model": model, "config": cfg.to_dict(), "expect": expect,
                    "estimate": est.to_dict(), "trial": res.to_dict()})  # fmt: skip
    if errors:
        print(f"\n{len(errors)} trials: median |error| {statistics.median(errors):.1%}, "
              f"worst {max(errors):.1%}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
