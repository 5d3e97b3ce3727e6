"""The builder builds what `autofit.layout.Layout` resolves: the checkpointed decoder layers, the
quantized projections and the adapted ones of a built model, read off its modules, are Layout's,
and Layout's are the hand-written lists of `tests/test_layout.py` for llama-debug."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autofit.builder.apply import build_for_trial
from autofit.builder.model import decoder_layers, decoder_projections
from autofit.config import Config
from autofit.models import PRESETS

SPEC = dataclasses.replace(PRESETS["llama-debug"], layers=4)
QLORA_QV = dict(
    checkpointing="every-2", quant="nf4", lora_rank=4, lora_targets=("q_proj", "v_proj")
)


def built_parts(model: torch.nn.Module) -> tuple[tuple[int, ...], set[str], set[str]]:
    """(checkpointed layer indices, quantized projections, adapted projections) of a built model,
    projections by path inside a layer, the same in every layer (asserted)."""
    layers = decoder_layers(model)
    wrapped = tuple(i for i, layer in enumerate(layers) if "Checkpoint" in type(layer).__name__)
    quantized, adapted = [], []
    for layer in layers:
        q = {n for n, m in decoder_projections(layer) if "NF4" in type(m.weight).__name__}
        names = {n for n, _ in layer.named_modules()}
        a = {n for n, _ in decoder_projections(layer) if any(f"{n}.lora_A" in x for x in names)}
        quantized.append(q)
        adapted.append(a)
    assert all(q == quantized[0] for q in quantized) and all(a == adapted[0] for a in adapted)
    return wrapped, quantized[0], adapted[0]


@pytest.mark.parametrize(
    ("knobs", "checkpointed", "quantized", "adapted"),
    [
        (
            QLORA_QV,
            (0, 2),
            {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"},
            {"self_attn.q_proj", "self_attn.v_proj"},
        ),
        (dict(checkpointing="full", lora_rank=4, lora_targets=("mlp.down_proj",)), (0, 1, 2, 3),
         set(), {"mlp.down_proj"}),
        (dict(checkpointing="none"), (), set(), set()),
    ],
)  # fmt: skip
def test_the_built_model_is_the_layout(knobs, checkpointed, quantized, adapted):
    config = Config(seq_len=32, micro_batch=1, **knobs)
    run = build_for_trial(SPEC, config, torch.device("cpu"))
    layout = run.layout
    assert layout.checkpointed == checkpointed
    assert set(layout.quantized) == quantized and set(layout.adapted) == adapted
    assert built_parts(run.model) == (
        layout.checkpointed,
        set(layout.quantized),
        set(layout.adapted),
    )
    trained = [p for p in run.model.parameters() if p.requires_grad]
    if layout.trains_all:  # a full fine-tune: every parameter
        assert len(trained) == len(list(run.model.parameters()))
    else:  # the adapters only: A and B of each adapted projection of each layer
        assert len(trained) == 2 * len(adapted) * SPEC.layers


def test_layers_that_differ_each_get_their_own_projections_adapted():
    # Qwen2-MoE with `mlp_only_layers=[0]`: layer 0's MLP is dense, layer 1's a sparse MoE block
    # with a shared expert. LoRA's default targets are every linear projection of every layer
    # (peft's all-linear), so each layer is adapted on its own projections, written out here.
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from autofit.builder.apply import adapt, model_layout

    cfg = Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
        config = Config(lora_rank=4)
        model = adapt(model, config, model_layout(model, config))
    attention = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    expected = [
        attention | {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"},
        attention | {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                     "mlp.shared_expert.down_proj", "mlp.shared_expert_gate"},
    ]  # fmt: skip
    for layer, want in zip(decoder_layers(model), expected, strict=True):
        names = {n for n, _ in layer.named_modules()}
        adapted = {n for n, _ in decoder_projections(layer) if f"{n}.lora_A" in names}
        assert adapted == want
