"""What would make a config fit, checked against the estimate before anyone reads it: each change
is estimated, and only those the estimate says fit are named (`autofit estimate`'s next step, a
plan's advice when nothing fits)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.estimate import Estimate, estimate, estimate_many
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.units import fmt_size
from autofit.values import Checkpointing, Loss, Offload, Quant, Wrap

Fits = Callable[[Estimate, Hardware], bool]
"""Whether an estimate fits its hardware: the bare capacity (`autofit estimate`) or the plan's
headroom line."""

MORE_GPUS = (2, 4, 8, 16, 32, 64)
"""How many times the GPUs a fix may ask for."""


@dataclass(frozen=True)
class Change:
    """One change to a config: the knobs it sets, and how a plan's advice words it."""

    knobs: dict[str, Any]
    space: str = ""  # the space's values that hold it (not flags)

    @property
    def flags(self) -> str:
        """As flags of `autofit estimate` and `trial`."""
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.knobs.items())


def changes_for(cfg: Config) -> list[Change]:
    """The changes that lower a config's memory, each alone, in the order people try them: the
    chunked loss, full recomputation, a smaller micro-batch (the batch kept by accumulation),
    NF4 with LoRA, optimizer offload, param offload (FSDP2)."""
    out = []
    if cfg.loss == Loss.STANDARD:
        out.append(Change({"loss": Loss.CHUNKED}, "loss chunked"))
    if cfg.checkpointing != Checkpointing.FULL:
        out.append(Change({"checkpointing": Checkpointing.FULL}, "checkpointing full"))
    mb = cfg.micro_batch // 2
    while mb >= 1:
        ga = cfg.grad_accum * cfg.micro_batch // mb
        out.append(Change({"micro_batch": mb, "grad_accum": ga}, f"micro_batch {mb}"))
        mb //= 2
    if cfg.quant != Quant.NF4:
        out.append(Change({"quant": Quant.NF4, "lora_rank": cfg.lora_rank or 16},
                          "quant nf4 (--space qlora)"))  # fmt: skip
    if cfg.offload == Offload.NONE:
        out.append(Change({"offload": Offload.OPTIMIZER}, "offload optimizer"))
    if cfg.offload != Offload.PARAMS and cfg.quant != Quant.INT8:
        wrap = {"wrap": Wrap.LAYER} if cfg.wrap == Wrap.NONE else {}  # param offload needs FSDP2
        space = "offload params (--space full or default)"
        out.append(Change({"offload": Offload.PARAMS, **wrap}, space))
    return out


def fitting_changes(
    model: ModelSpec, hardware: Hardware, cfg: Config, device: str, fits: Fits,
    lengths: LengthHistogram | None = None,
) -> tuple[list[Change], Change | None]:  # fmt: skip
    """The changes of `changes_for` that make `cfg` fit by the estimate, each alone (of the
    micro-batches, the largest that fits); and, when none does alone, all of them together if
    that fits (else None). `lengths`: the data's sequence lengths the estimates read."""
    changes = changes_for(cfg)
    configs = [cfg.replace(**c.knobs) for c in changes]
    fitting, smaller = [], False
    ests = estimate_many(model, hardware, configs, device=device, lengths=lengths)
    for change, est in zip(changes, ests, strict=True):
        if not fits(est, hardware):
            continue
        if "micro_batch" in change.knobs:
            if smaller:
                continue
            smaller = True
        fitting.append(change)
    if fitting or not changes:
        return fitting, None
    knobs: dict[str, Any] = {}
    for change in changes:  # the smallest micro-batch and param offload come last of their kind
        knobs.update(change.knobs)
    together = cfg.replace(**knobs)
    if fits(estimate(model, hardware, together, device=device, lengths=lengths), hardware):
        return [], Change(knobs)
    return [], None


def more_gpus_that_fit(
    model: ModelSpec, hardware: Hardware, cfg: Config, device: str, fits: Fits,
    lengths: LengthHistogram | None = None,
) -> int | None:  # fmt: skip
    """The fewest GPUs of this kind (a multiple of today's, up to 64x) on which `cfg` fits by the
    estimate (on the data's `lengths`, when known), or None."""
    gpus = hardware.gpus
    for k in MORE_GPUS:
        n = len(gpus) * k
        more = replace(hardware, gpus=tuple(replace(gpus[0], index=i) for i in range(n)))
        if fits(estimate(model, more, cfg, device=device, lengths=lengths), more):
            return n
    return None


def too_small(est: Estimate, where: str) -> str | None:
    """When what lies outside the allocator (the CUDA context, NCCL's buffers) alone fills the
    card, so that no config can fit: the sentence that says so. Else None."""
    if est.usable_bytes > 0:
        return None
    labels = {"cuda_context": "CUDA context", "nccl": "NCCL buffers"}
    outside = ", ".join(
        f"{label} {fmt_size(est.overhead[name])}"
        for name, label in labels.items()
        if est.overhead.get(name)
    )
    return (
        f"Nothing can fit {where}: what each GPU holds outside PyTorch's allocator ({outside}) "
        f"alone is more than its {fmt_size(est.capacity_bytes)}. Plan for GPUs with more memory "
        "(--gpus, --gpu-memory)."
    )
