"""What the data's sequence lengths change in an estimate (docs/estimator.md, "The data").

Every term of the napkin counts a micro-batch of `micro_batch` rows of `seq_len` tokens. With the
data's lengths (`autofit.data.LengthHistogram`) a config's `batching` lays them out as
`autofit.data.batching` says, the one rule the trials run too, and the estimate reads three
numbers of that layout (`DataShape`):

- the peak is the napkin's peak at the longest micro-batch the data can produce: rows as wide as
  the longest sequence (truncated to `seq_len`) for `padded` and `grouped` (the longest sequence
  pads its whole micro-batch), rows of `seq_len` for `packed`;
- the step time is the napkin's at the mean row width (what a step computes, padding included);
- tokens/s counts useful tokens, the mean tokens a row holds (padding excluded).

`packed` attention is modelled as dense causal attention over the row: SDPA runs the packed rows
with a block-diagonal mask (transformers builds it from the position ids), which costs what a
causal row does; flash-attention's varlen kernel, which skips the blocks between documents, is
not modelled (it would only be faster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.data.batching import data_shape

Shaped = tuple[Config, Config, float, float]
"""(the config at the longest micro-batch's width, at the mean width, useful tokens per row,
padding share)."""


def with_checked(config: Config, name: str, value: Any) -> Config:
    """`config` with the knob `name` at `value`, a value its declaration allows (an estimate's
    own: the rows' width, `padded`), not checked again (`Config.of_checked_values`); `config`
    itself when it holds that value already."""
    if value == config.__dict__[name]:
        return config
    return Config.of_checked_values({**config.__dict__, name: value})


def shapes_of(lengths: LengthHistogram) -> Callable[[Config], Shaped]:
    """A config's shapes under `lengths`, computed once per (batching, micro_batch, seq_len)."""
    found: dict[tuple[str, int, int], tuple[int, int, float, float]] = {}

    def shaped(config: Config) -> Shaped:
        key = (config.batching, config.micro_batch, config.seq_len)
        known = found.get(key)
        if known is None:
            shape = data_shape(lengths, *key)
            known = found[key] = (
                shape.peak_len, max(round(shape.mean_width), 1), shape.mean_useful,
                shape.padding_share,
            )  # fmt: skip
        peak_len, width, useful, padding = known
        at_peak = with_checked(config, "seq_len", peak_len)
        return at_peak, with_checked(config, "seq_len", width), useful, padding

    return shaped
