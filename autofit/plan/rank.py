"""Ranking: fastest first, speeds within `TIE_TOLERANCE` count as equal, then the plainest config,
then the lower peak."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autofit.config import Config
from autofit.values import Checkpointing, Loss, Offload, Optimizer, Precision

if TYPE_CHECKING:
    from autofit.plan.types import Candidate

TIE_TOLERANCE = 0.005
"""Two speeds within 0.5% of each other are a tie: below what a few trial steps can tell apart."""


def complexity(cfg: Config) -> int:
    """How far a config departs from the plain recipe (AdamW, no offload, mixed precision, no
    recompute, the model's own loss): among equally fast configs users want the plainest."""
    return (
        (cfg.optimizer != Optimizer.ADAMW)
        + (cfg.loss != Loss.STANDARD)
        + (cfg.offload != Offload.NONE)
        + (cfg.precision != Precision.BF16_MIXED)
        + (cfg.checkpointing != Checkpointing.NONE)
        + (not cfg.reshard)
    )


TIE_BREAK = (
    "the plainest config first (the fewest of: a low-bit optimizer, a chunked or fused loss, "
    "offload, bf16 precision, recomputation, gathered weights kept), then the lower peak"
)
"""How configs of equal speed are ordered (`complexity`, then the peak), as users read it."""

RECIPE_KNOBS = ("quant", "lora_rank", "micro_batch", "grad_accum", "wrap", "shard",
                "checkpointing", "loss", "compile", "batching")  # fmt: skip
"""Knobs that make a recipe different to a reader; configs that differ only in the others
(reshard, offload, optimizer, precision) are variants of one recipe: the plan's table folds
them into one row, and the runner-up a winner is compared with differs in one of these."""


def recipe_key(cfg: Config) -> tuple[object, ...]:
    """The values of `RECIPE_KNOBS`: configs with the same key are variants of one recipe."""
    return tuple(getattr(cfg, k) for k in RECIPE_KNOBS)


def speed_bucket(tokens_per_s: float) -> int:
    """Speeds on a log scale in steps of `TIE_TOLERANCE`: equal buckets rank as equally fast."""
    return int(math.log(max(tokens_per_s, 1e-9)) / math.log(1 + TIE_TOLERANCE))


def rank_key(c: Candidate) -> tuple[int, int, int]:
    """Fastest first; speeds within 0.5% count as equal, then the plainest, then the lower peak."""
    return (-speed_bucket(c.tokens_per_s), complexity(c.config), c.peak_bytes)


def faster(a: float, b: float) -> bool:
    """Speed `a` beats `b` by more than the tie tolerance."""
    return a > b * (1 + TIE_TOLERANCE)


def slower(a: float, b: float) -> bool:
    """Speed `a` is below `b` by more than the tie tolerance."""
    return a < b / (1 + TIE_TOLERANCE)
