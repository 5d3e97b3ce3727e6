"""Optimizer state bytes of the builder's AdamW variants, held to a hand count of torchao 0.18.

torchao `_AdamBase._new_buffer` (torchao/optim/adam.py) quantizes a state tensor only when the
parameter has >= 4096 values and a whole number of blocks ("follow bitsandbytes"); smaller ones get
`torch.zeros_like(p)`, in the parameter's dtype. AdamW8bit: uint8 codes, one fp32 scale per 256
values, a 256-entry fp32 code map per state tensor (`OptimState8bit.zeros`); AdamW4bit: 4-bit codes
two per byte, one fp32 scale per 128 values, a 16-entry fp32 code map (`OptimState4bit.zeros`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from autofit.builder.optim import build_optimizer
from autofit.config import Config
from autofit.estimate.memory import optimizer_bytes_per_param
from autofit.layout import layout_of

BIG = 1024 * 1024  # a 1024 x 1024 fp32 parameter
SMALL = 32 * 64  # 2048 values: under torchao's 4096 minimum

# exp_avg + exp_avg_sq, bytes per state tensor pair, by hand:
EXPECTED = {
    # torch AdamW: two fp32 tensors of the parameter's size, 8 B per value
    "adamw": {"big": 8 * BIG, "small": 8 * SMALL},
    # 2 x (1 B codes + 4 B / 256 scale) + 2 x 256 x 4 B code maps = 2,097,152 + 32,768 + 2,048
    "adamw8bit": {"big": 2 * (BIG + 4 * BIG // 256 + 256 * 4), "small": 8 * SMALL},
    # 2 x (0.5 B codes + 4 B / 128 scale) + 2 x 16 x 4 B code maps = 1,048,576 + 65,536 + 128
    "adamw4bit": {"big": 2 * (BIG // 2 + 4 * BIG // 128 + 16 * 4), "small": 8 * SMALL},
}


def plain_bytes(t: torch.Tensor) -> int:
    """Storage bytes of `t`, or of its inner tensors for a torchao subclass (codes, scale, qmap)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return t.untyped_storage().nbytes()
    names, _ = t.__tensor_flatten__()
    return sum(plain_bytes(getattr(t, name)) for name in names)


def state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    state = optimizer.state[param]
    return plain_bytes(state["exp_avg"]) + plain_bytes(state["exp_avg_sq"])


@pytest.fixture
def eager_torchao_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torchao's step `torch.compile`s its update (10 s of inductor on CPU per optimizer). The state
    is allocated before that call (`_new_buffer`, on the first step), so run the update eagerly."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    yield


@pytest.mark.parametrize("name", list(EXPECTED))
def test_optimizer_state_bytes_match_a_hand_count(name, eager_torchao_step):
    torch.manual_seed(0)
    params = nn.ParameterDict(
        {"big": nn.Parameter(torch.randn(1024, 1024)), "small": nn.Parameter(torch.randn(32, 64))}
    )
    config = Config(optimizer=name)
    optimizer = build_optimizer(params, config, layout_of(config, 1, device="cpu").adamw, "cpu")
    for p in params.values():
        p.grad = torch.randn_like(p)
    before = {k: p.detach().clone() for k, p in params.items()}
    optimizer.step()
    assert all(not torch.equal(before[k], p) for k, p in params.items())  # a real step ran

    measured = {k: state_bytes(optimizer, p) for k, p in params.items()}
    assert measured == EXPECTED[name]

    # The estimator's bytes per trainable parameter (fp32 masters: bf16-mixed) against the large
    # tensor: exact for AdamW, within the code maps (0.1%) for the low-bit ones.
    per_param = optimizer_bytes_per_param(name, "bf16-mixed")
    assert per_param * BIG == pytest.approx(measured["big"], rel=2e-3)


@pytest.mark.parametrize(
    ("impl", "device", "offload", "fused", "foreach"),
    [
        ("auto", "cuda", "none", True, None),  # a GPU run: fused, as every export pins
        ("auto", "cuda", "params", None, False),  # FSDP2's CPU-offloaded params: torch's loop
        ("auto", "cpu", "none", None, False),  # a CPU trial: torch's own choice on CPU
        ("fused", "cpu", "none", True, None),  # torch's CPU kernel (torch >= 2.4)
        ("foreach", "cuda", "none", None, True),
        ("for-loop", "cuda", "none", None, False),
    ],
)
def test_the_builder_gives_torch_adamw_the_implementation_chosen(
    impl, device, offload, fused, foreach
):
    # torch.optim.AdamW keeps its `fused` and `foreach` arguments in `defaults`; on CPU
    # parameters each of them builds (the device type only picks what `auto` resolves to)
    param = nn.Parameter(torch.randn(8, 8))
    config = Config(optimizer_impl=impl, offload=offload, wrap="layer")
    impl = layout_of(config, 1, device=device).adamw  # what the builder's `apply` passes
    optimizer = build_optimizer(nn.ParameterList([param]), config, impl, device)
    assert type(optimizer) is torch.optim.AdamW
    assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (fused, foreach)
