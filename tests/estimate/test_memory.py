"""Napkin memory terms checked against published and hand-worked numbers. The estimate as a
whole is held to measured trials in `test_against_trials.py`."""

from __future__ import annotations

import pytest

from autofit.arch import structure_of
from autofit.estimate import memory as mem
from autofit.layout import Sharding
from autofit.models import PRESETS
from tests.conftest import LLAMA_7B

S7 = structure_of(LLAMA_7B)  # Llama-2-7B's parameters by role, read from its meta model


def _adamw_bytes(dtype) -> tuple[int, int, float]:  # type: ignore[no-untyped-def]
    """What torch stores per parameter of `dtype` trained by AdamW, measured: the weight, its
    gradient, and the optimizer state after a step (the moments; not the scalar step count)."""
    import torch

    param = torch.nn.Parameter(torch.zeros(1024, dtype=dtype))
    param.grad = torch.zeros_like(param)
    optimizer = torch.optim.AdamW([param])
    optimizer.step()
    state = [t for t in optimizer.state[param].values() if t.dim() > 0]
    per_param = sum(t.numel() * t.element_size() for t in state) / param.numel()
    return param.element_size(), param.grad.element_size(), per_param


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "float32"), ("bf16", "bfloat16")])
def test_adamw_bytes_per_param_are_what_torch_stores(precision: str, dtype: str) -> None:
    import torch

    weight, grad, state = _adamw_bytes(getattr(torch, dtype))
    assert mem.master_bytes(precision) == weight
    assert mem.grad_bytes(precision) == grad
    assert mem.optimizer_bytes_per_param("adamw", precision) == state


def test_zero_paper_seed_figure_1_5b_params_is_24_gb_of_model_states():
    # ZeRO (Rajbhandari et al. 2020), section 3.1: mixed-precision Adam holds 16 B per parameter
    per_param = (
        mem.master_bytes("bf16-mixed")
        + mem.grad_bytes("bf16-mixed")
        + mem.optimizer_bytes_per_param("adamw", "bf16-mixed")
    )
    assert 1.5e9 * per_param == pytest.approx(24e9)


def test_nf4_bytes_per_param_are_what_torchao_stores():
    import torch
    from torchao.quantization import to_nf4

    # the outside truth: a real torchao NF4 tensor of a Llama-7B projection's shape
    nf4 = to_nf4(torch.randn(4096, 4096, dtype=torch.bfloat16))
    stored = sum(
        t.numel() * t.element_size()
        for t in (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor)
    )
    assert mem.base_bytes_per_param("nf4") == pytest.approx(stored / nf4.numel(), rel=1e-9)
    # by hand: 4-bit code + int8 scaler per 64 values + bf16 factor per 256 blocks of 64
    assert mem.base_bytes_per_param("nf4") == pytest.approx(0.5 + 1 / 64 + 2 / (64 * 256))


def test_a_bf16_base_is_the_width_of_a_bf16_weight():
    import torch

    # int8's 1 B per weight is held by hand with its scales below
    assert mem.base_bytes_per_param("none") == torch.empty(0, dtype=torch.bfloat16).element_size()


def test_int8_base_adds_one_bf16_scale_per_output_row():
    # by hand: 32 layers of q, k, v, o (4096 x 4096) and gate, up, down (4096 x 11008), 1 B
    # each, plus a bf16 scale per output row of q k v o gate up down
    weights = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rows = 4096 + 4096 + 4096 + 4096 + 11008 + 11008 + 4096
    assert mem.base_weight_bytes(S7, "int8") == weights * 1 + 32 * rows * 2


def test_low_bit_optimizer_state_does_not_depend_on_precision():
    for opt in ("adamw8bit", "adamw4bit"):
        assert mem.optimizer_bytes_per_param(opt, "bf16") == mem.optimizer_bytes_per_param(
            opt, "bf16-mixed"
        )


def test_lora_trainable_params_of_llama_7b_rank_64_by_hand():
    # per layer, r * (in + out) for the 7 projections:
    #   q, k, v, o: 4096 + 4096 each; gate, up: 4096 + 11008; down: 11008 + 4096
    per_layer = 4 * (4096 + 4096) + 3 * (4096 + 11008)
    assert per_layer == 78_080
    assert mem.trainable_params(S7, 64) == 64 * per_layer * 32 == 159_907_840


def test_full_fine_tune_trains_every_parameter():
    assert mem.trainable_params(S7, 0) == 6_738_415_616


def test_frozen_non_projection_weights_are_bf16():
    # embeddings + LM head + final norm + 2 norms per layer, 2 bytes each
    others = 32000 * 4096 * 2 + 4096 + 32 * 2 * 4096
    assert mem.frozen_other_bytes(S7) == 2 * others


def test_gathered_units_follow_torchtitans_layout():
    # Llama-2-7B by hand: [norm, head] = (32000 x 4096 + 4096) bf16 stays gathered after forward;
    # the embedding unit (32000 x 4096 bf16) is resharded after forward; a layer is 202,383,360
    # bf16 params (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096).
    head = (32000 * 4096 + 4096) * 2
    embed = 32000 * 4096 * 2
    layer = (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) * 2
    fsdp = Sharding.FSDP2
    assert mem.gathered_bytes(S7, "none", 0, "layer", True, fsdp) == head + 2 * layer
    assert mem.gathered_bytes(S7, "none", 0, "every-2", True, fsdp) == head + 4 * layer
    # without reshard_after_forward every unit stays gathered: the whole model in bf16
    assert mem.gathered_bytes(S7, "none", 0, "layer", False, fsdp) == (head + embed + 32 * layer)
    # `model`: every layer in the root unit, which FSDP2 never reshards after forward
    assert mem.gathered_bytes(S7, "none", 0, "model", True, fsdp) == head + 32 * layer


def test_replicas_and_the_plain_module_gather_nothing():
    for sharding in (Sharding.NONE, Sharding.DDP):
        assert mem.gathered_bytes(S7, "none", 0, "none", True, sharding) == 0
        assert mem.unit_grad_bytes(S7, 0, "none", sharding) == 0


def test_int8_base_is_never_all_gathered():
    nf4 = mem.gathered_layer_bytes(S7, "nf4", 16)
    int8 = mem.gathered_layer_bytes(S7, "int8", 16)
    assert int8 < nf4


# the shipped spaces' sequence length: the presets' traces at it ship in the package
SHIPPED_SEQ = 2048


def act(model, micro_batch: int, seq_len: int, lora: int, ckpt: str, autocast: bool = False):  # type: ignore[no-untyped-def]
    """Activation bytes of one micro-batch: the decoder layers' and those outside them."""
    layers, outside = mem.activation_bytes(
        model, structure_of(model), micro_batch, seq_len, lora, ckpt, autocast
    )
    return layers + outside


@pytest.mark.parametrize("name", [n for n, m in PRESETS.items() if m.layers >= 4])
@pytest.mark.parametrize("lora", [0, 16, 64])
def test_checkpointing_full_below_every_2_below_none(name, lora):
    model = PRESETS[name]
    full, every2, none = (act(model, 2, SHIPPED_SEQ, lora, c) for c in ("full", "every-2", "none"))
    assert full < every2 < none


@pytest.mark.parametrize("name", [n for n, m in PRESETS.items() if m.layers >= 4])
def test_selective_checkpointing_below_none_for_full_fine_tune(name):
    model = PRESETS[name]
    assert act(model, 2, SHIPPED_SEQ, 0, "selective") < act(model, 2, SHIPPED_SEQ, 0, "none")


@pytest.mark.parametrize("name", ["llama-7b", "llama-13b", "llama-3-8b", "llama-70b"])
def test_selective_checkpointing_below_none_with_lora(name):
    model = PRESETS[name]
    assert act(model, 2, SHIPPED_SEQ, 64, "selective") < act(model, 2, SHIPPED_SEQ, 64, "none")


@pytest.mark.parametrize("autocast", [False, True])
def test_activations_scale_linearly_with_tokens(autocast):
    # SDPA's fused kernels keep O(seq) per sequence, never the s x s scores (Dao et al. 2022,
    # FlashAttention; torch's CPU flash kernel likewise): tokens are tokens, in a micro-batch or
    # in a longer sequence.
    one = act(LLAMA_7B, 1, 2048, 0, "none", autocast)
    assert act(LLAMA_7B, 4, 2048, 0, "none", autocast) == pytest.approx(4 * one)
    assert act(LLAMA_7B, 1, 8192, 0, "none", autocast) == pytest.approx(4 * one)


def test_allocator_overhead_grows_with_allocation():
    assert mem.allocator_overhead(0) > 0
    assert mem.allocator_overhead(10 * 1024**3) > mem.allocator_overhead(1024**3)
