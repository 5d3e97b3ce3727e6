"""bitsandbytes NF4: the estimate's count of its stored bytes against what bitsandbytes stores,
and its 4-bit training path (peft LoRA over `Linear4bit`) on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autofit.estimate.memory import bnb_nf4_weight_bytes
from autofit.recipe import NF4_BLOCK

bnb = pytest.importorskip("bitsandbytes")

# Llama-2-7B's q/k/v/o and gate/up shapes, and one whose 999,999 elements are odd and no whole
# number of 64-weight blocks, nor of 64 x 256 (a short last block at both levels).
SHAPES = [(4096, 4096), (11008, 4096), (1001, 999)]


def stored_bytes(param: torch.Tensor) -> int:
    """Bytes of a `Params4bit`'s data and of every tensor of its `QuantState`, nested included."""
    from bitsandbytes.functional import QuantState

    def state_bytes(state: QuantState) -> int:
        total = 0
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                total += value.nbytes
            elif isinstance(value, QuantState):
                total += state_bytes(value)
        return total

    return param.data.nbytes + state_bytes(param.quant_state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_stored_bytes_match_the_count_exactly(shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for double_quant in (False, True):
        param = bnb.nn.Params4bit(
            weight, requires_grad=False, blocksize=NF4_BLOCK, compress_statistics=double_quant,
            quant_type="nf4", quant_storage=torch.uint8,
        ).to("cpu")  # fmt: skip
        assert param.bnb_quantized and param.quant_state.nested == double_quant
        assert stored_bytes(param) == bnb_nf4_weight_bytes(*shape, double_quant), double_quant
        # FSDP's quant_storage views the same bytes as another dtype: same count
        for storage, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            data = param.data.view(-1).view(dtype)
            assert data.nbytes == param.data.nbytes
            assert bnb_nf4_weight_bytes(*shape, double_quant, storage) == stored_bytes(param)


@pytest.mark.timeout(60)
def test_quant_storage_wider_than_the_packed_bytes_is_refused_as_bitsandbytes_does() -> None:
    assert bnb_nf4_weight_bytes(3, 1, quant_storage="bf16") == 2 + 4 + 64  # 2 B: one bf16
    weight = torch.randn(3, 2).to(torch.bfloat16)  # 6 codes, 3 bytes: no whole bf16
    with pytest.raises(RuntimeError):
        bnb.functional.quantize_4bit(weight, blocksize=NF4_BLOCK, quant_type="nf4",
                                     quant_storage=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="uint8"):
        bnb_nf4_weight_bytes(3, 2, quant_storage="bf16")


@pytest.mark.timeout(120)
def test_lora_over_linear4bit_trains_on_cpu() -> None:
    """bitsandbytes 0.50's CPU backend runs QLoRA's training step: peft LoRA over `Linear4bit`
    (double quantization, bf16 compute) of a tiny llama, forward, backward and AdamW, under
    bf16 autocast as autofit's plain-module trials run; the adapters learn."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    linear.in_features, linear.out_features, bias=False,
                    compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                )  # fmt: skip
                q.weight = bnb.nn.Params4bit(
                    linear.weight.data, requires_grad=False, blocksize=NF4_BLOCK,
                    compress_statistics=True, quant_type="nf4",
                )  # fmt: skip
                setattr(parent, name, q.to("cpu"))
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()  # fp32 masters, bf16 compute (precision bf16-mixed)
    opt = torch.optim.AdamW(trained, lr=1e-2)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None for p in trained)  # A's are 0 while B is (peft's init)
        assert sum(float(p.grad.abs().sum()) for p in trained) > 0
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q_proj, bnb.nn.Linear4bit) and q_proj.weight.quant_state.nested


def test_the_builders_storage_dtypes_are_the_recipes_names() -> None:
    from autofit.builder.quantize import BNB_STORAGE_DTYPES
    from autofit.recipe import BNB_QUANT_STORAGE

    assert list(BNB_STORAGE_DTYPES) == list(BNB_QUANT_STORAGE)
    for name, dtype in BNB_STORAGE_DTYPES.items():
        assert dtype.itemsize == BNB_QUANT_STORAGE[name]


@pytest.mark.timeout(120)
def test_the_builder_stores_what_the_estimate_counts_under_peft() -> None:
    """`quantize_layer` with `Layout.bnb` replaces peft's `base_layer` with a `Linear4bit` of the
    settings' storage, whose bytes are the estimate's count; the adapter still runs on it."""
    from peft import LoraConfig, get_peft_model

    from autofit.builder.quantize import quantize_layer
    from autofit.recipe import Bnb4bit

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(1024, 512, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q_proj(x)

    torch.manual_seed(0)
    model = get_peft_model(Layer(), LoraConfig(r=4, target_modules=["q_proj"]))
    layer = model.base_model.model
    quantize_layer(layer, "nf4", {"q_proj"}, bnb=Bnb4bit(double_quant=True, quant_storage="bf16"))
    base = layer.q_proj.base_layer
    assert isinstance(base, bnb.nn.Linear4bit) and base.weight.dtype == torch.bfloat16
    assert base.weight.quant_state.nested and not base.weight.requires_grad
    assert stored_bytes(base.weight) == bnb_nf4_weight_bytes(512, 1024, True, "bf16")
    out = model(torch.randn(3, 1024, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert layer.q_proj.lora_B["default"].weight.grad is not None
