"""`torch.compile` of each decoder layer, as torchtitan's `apply_compile` does it
(torchtitan/distributed/compile.py): in place, `fullgraph=True`, after activation checkpointing
and before `fully_shard`.

In place is `nn.Module.compile`: the layer's `__call__` is compiled and the module stays where
it is, so parameter names and state-dict keys do not change (`torch.compile(layer)` would wrap it
in an `OptimizedModule` whose names all gain `_orig_mod.`, which torchtitan left for this reason,
pytorch/torchtitan#2688). Dynamo skips `nn.Module._call_impl` and compiles the frame it calls
(the layer's, or `checkpoint_wrapper`'s, `forward`), so FSDP2's hooks, registered later on the same
module, run eagerly around the compiled graph (they are `torch._dynamo.disable`d besides).
`fullgraph=True`: a graph break is an error, never a silent fall back to eager code. Identical
layers share their graphs; the first layer of a LoRA model gets one of its own (its input, the
frozen embedding's output, does not require grad).

`CompileStats` reads dynamo's own counters, so a trial can report what was compiled, how long it
took and whether anything was compiled again later.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from autofit.builder.model import decoder_layers
from autofit.config import Config
from autofit.values import Quant


def apply_compile(model: nn.Module, config: Config) -> nn.Module:
    """Compile every decoder layer of `model` in place when `config.compile` (`nn.Module.compile`,
    torchtitan's `fullgraph=True`): the layers of `autofit.builder.model.decoder_layers`, checkpoint
    wrappers included. NF4 layers compile without joint-graph CSE (`keep_nf4_packed`)."""
    if not config.compile:
        return model
    for layer in decoder_layers(model):
        layer.compile(fullgraph=True, options=inductor_options(config.quant))
        if config.quant == Quant.NF4:
            keep_nf4_packed(layer)
    return model


def inductor_options(quant: str) -> dict[str, Any] | None:
    """The inductor settings a compiled layer of this `quant` needs (None: inductor's own), given
    to that layer's `compile` alone, never set process-wide.

    int8 weight-only (torchao `Int8Tensor`: `mm(x, w_int8.t().to(bf16)) * scale`): inductor's
    post-grad pattern matcher rewrites that into `aten._weight_int8pack_mm` (its weight-only
    quantization lowering, `_register_woq_lowerings`, registered for CPU, CUDA and XPU alike).
    On CUDA that op is a kernel for a few rows of activations (decoding); a training step's
    thousands of rows took 3.3 s against 0.11 s eager on 4 layers of llama-7b at mb4 x 2048 on an
    H200 (2026-11-27: 98% of the step in `weight_int8pack_mm_kernel`). Pattern matching off for
    those layers keeps the cast and cuBLAS's matmul, as eager runs it."""
    return {"pattern_matcher": False} if quant == Quant.INT8 else None


def keep_nf4_packed(layer: nn.Module) -> None:
    """Compile `layer` with AOTAutograd's common-subexpression elimination off, so backward keeps
    the packed NF4 weight, not its dequantized bf16 copy, as eager QLoRA does.

    torchao's `linear_nf4` saves the `NF4Tensor` and dequantizes it again in backward. Compiled,
    CSE merges that second dequantization into the forward's, and the min-cut partitioner then
    saves the dequantized weight for backward (it feeds a matmul there, so recomputing it is
    banned: `ban_recompute_materialized_backward`), every projection of every layer in bf16
    until backward: on llama-debug QLoRA +31% peak over eager, at 7B about 13 GB. Without CSE
    each pass dequantizes its own copy and only the packed weight (a parameter) is kept. The
    joint graph is traced and partitioned in the layer's first forward, so the config patch is
    held around the compiled forward (`torch._functorch.config.patch`), not globally.
    """
    import torch._functorch.config as functorch_config

    compiled = layer._compiled_call_impl

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with functorch_config.patch(cse=False):
            return compiled(*args, **kwargs)

    layer._compiled_call_impl = call


def is_compiled(module: nn.Module) -> bool:
    """Whether `module.compile()` was applied (its `__call__` runs a compiled function)."""
    return getattr(module, "_compiled_call_impl", None) is not None


@dataclass(frozen=True)
class CompileStats:
    """What dynamo has compiled in this process so far (or, as a difference, in between).

    `graphs`: FX graphs dynamo captured (`counters["stats"]["unique_graphs"]`, one per compiled
    frame and guard set, so a recompile is one more); `graph_breaks`: graph breaks
    (`counters["graph_break"]`, by reason); `seconds`: wall time dynamo spent compiling, forward
    frames and the lazily compiled backward graphs (`calculate_time_spent()`'s
    `entire_frame_compile` + `entire_backward_compile`, its `total_wall_time`), inductor included.
    """

    graphs: int = 0
    graph_breaks: int = 0
    seconds: float = 0.0

    @classmethod
    def now(cls) -> CompileStats:
        from torch._dynamo.utils import calculate_time_spent, counters

        return cls(
            graphs=int(counters["stats"]["unique_graphs"]),
            graph_breaks=int(sum(counters["graph_break"].values())),
            seconds=float(calculate_time_spent()["total_wall_time"]),
        )

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            self.graphs - other.graphs,
            self.graph_breaks - other.graph_breaks,
            self.seconds - other.seconds,
        )

    def __add__(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            self.graphs + other.graphs,
            self.graph_breaks + other.graph_breaks,
            self.seconds + other.seconds,
        )


def recompile_reasons(last: int) -> list[str]:
    """Why dynamo compiled its `last` frames again (its guard failures), newest last."""
    from torch._dynamo.utils import get_compilation_metrics

    metrics = get_compilation_metrics()[-last:] if last > 0 else []
    return [m.recompile_reason for m in metrics if m.recompile_reason]
