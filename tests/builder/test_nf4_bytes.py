"""The NF4 block rule the estimator prices against the bytes of a real quantized weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao.quantization import NF4Tensor

from autofit.builder.quantize import quantize_layer
from autofit.estimate.memory import base_bytes_per_param

ROWS, COLS = 1024, 4096  # a 7B-wide projection, quartered to keep the test near a second


class OneProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(COLS, ROWS, bias=False)


def storage_bytes(t: torch.Tensor) -> dict[str, int]:
    """Bytes of each inner tensor of a tensor subclass (`__tensor_flatten__`)."""
    names, _ = t.__tensor_flatten__()
    return {name: getattr(t, name).untyped_storage().nbytes() for name in names}


def test_nf4_weight_bytes_match_the_block_rule():
    torch.manual_seed(0)
    layer = quantize_layer(OneProjection(), "nf4", {"q_proj"})  # the builder: `to_shardable_nf4`
    weight = layer.q_proj.weight
    assert isinstance(weight.data, NF4Tensor) and not weight.requires_grad
    inner = storage_bytes(weight.data)

    # By hand (QLoRA, Dettmers et al. 2023, double quantization; torchao `to_nf4` 64 x 256):
    #   n = 1024 x 4096                       = 4,194,304 weights
    #   codes: 4 bits each, 2 per byte  n/2   = 2,097,152 B
    #   one int8 absmax scale per 64    n/64  =    65,536 B
    #   one bf16 factor per 64 x 256    2n/16384 =    512 B
    #   total                                 = 2,163,200 B = 4.126 bits per weight
    # (the paper's 4.127 bits counts the second-level constants in fp32: 32/(64 x 256)).
    # Besides these, every NF4Tensor holds its 16-entry bf16 code book and a bf16 scaler mean:
    # 34 B per tensor, whatever its size.
    assert inner["quantized_data"] == 2_097_152
    assert inner["quantized_scalers"] == 65_536
    assert inner["quantization_factor"] == 512
    assert inner["nf4"] + inner["scaler_mean"] == 34
    measured = sum(inner.values())
    assert measured == 2_163_200 + 34

    # The estimator's bytes per NF4 weight, times the weights, lands on the same count (the 34 B
    # per tensor aside: 224 projections of a 7B model add 7.6 KiB to 3.5 GiB).
    estimated = base_bytes_per_param("nf4") * ROWS * COLS
    assert estimated == 2_163_200
    assert measured == pytest.approx(estimated, rel=1e-4)
