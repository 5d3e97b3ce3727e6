"""`train_embeddings`: what the builder trains beside a LoRA base, held to what the estimate counts
and to peft's own modules, on the three paths (the plain module, DDP, FSDP2 units).

The trainable parameters are counted on the built model (`requires_grad`) and compared with the
estimate's count; the FSDP2 layout is checked on two fake ranks in one process (as
`test_fsdp_layout.py`); the plain module trains a few steps on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from autofit.builder import apply
from autofit.builder.apply import adapt, model_layout
from autofit.builder.model import build_meta_model, model_parts
from autofit.config import Config
from autofit.estimate.peak import Peaks
from autofit.models import PRESETS

FAMILIES = ["llama-debug", "qwen2-debug", "qwen3-debug", "gemma2-debug", "gemma3-debug",
            "phi3-debug", "mixtral-debug"]  # fmt: skip
VALUES = ["none", "full", "tokens:5"]


def trained(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable parameters the builder left, by name (each shared one once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("name", FAMILIES)
def test_the_builder_trains_as_many_parameters_as_the_estimate_counts(name, value):
    spec = PRESETS[name]
    config = Config(lora_rank=4, train_embeddings=value, seq_len=32)
    meta = build_meta_model(spec)
    model = adapt(meta, config, model_layout(meta, config))  # the builder's steps, on meta
    built = sum(p.numel() for p in trained(model).values())
    assert built == Peaks(spec, 1, "cpu").of(config.resolved(1)).trainable
    if value != "none":  # and it is more than the adapters alone
        plain = config.replace(train_embeddings="none").resolved(1)
        assert built > Peaks(spec, 1, "cpu").of(plain).trainable


@pytest.mark.parametrize("value", ["full", "tokens:5"])
def test_trained_weights_are_in_the_trainable_dtype_beside_frozen_bf16_originals(value):
    for precision, dtype in (("bf16-mixed", torch.float32), ("bf16", torch.bfloat16)):
        config = Config(lora_rank=4, train_embeddings=value, precision=precision)
        meta = build_meta_model(PRESETS["llama-debug"])
        model = adapt(meta, config, model_layout(meta, config))
        extra = {n: p for n, p in trained(model).items() if "lora_" not in n}
        assert len(extra) == 2, extra  # the embedding's and the (untied) head's
        assert all(p.dtype == dtype for p in extra.values())
        frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
        assert all(p.dtype == torch.bfloat16 for p in frozen)
        originals = [b for n, b in model.named_buffers() if "trainable_tokens_original" in n]
        assert all(b.dtype == torch.bfloat16 for b in originals)  # peft's copy of the rows


@pytest.mark.parametrize(("value", "kept"), [("full", "modules_to_save"), ("tokens:5", "token")])
@pytest.mark.parametrize("name", ["llama-debug", "qwen2-debug"])  # untied, tied head
def test_under_trainer_peft_holds_copies_bf16_and_token_rows_fp32(name, value, kept):
    # launch: trainer builds nothing itself: peft's own `get_peft_model` upcasts its adapter
    # layers (autocast_adapter_dtype: the LoRA adapters and the trainable token rows) and
    # deep-copies the bf16 modules for `modules_to_save`, which stay bf16; that is the rule the
    # estimate reads (`autofit.layout.embedding_precision`)
    from autofit.builder.trainer import trainer_model
    from autofit.export.schema import lora_section
    from autofit.layout import embedding_precision, layout_of

    spec = PRESETS[name]
    config = Config(lora_rank=4, train_embeddings=value, launch="trainer")
    layout = layout_of(config, 1)
    model = trainer_model(spec, config, layout, lora_section(config, spec), torch.device("cpu"))
    params = trained(model)
    extra = {n: p for n, p in params.items() if "lora_" not in n}
    assert extra and all(kept in n for n in extra), list(extra)
    assert len(extra) == (1 if spec.tied_embeddings else 2)
    held = {"bf16": torch.bfloat16, "bf16-mixed": torch.float32}[
        embedding_precision(config.precision, config.launch, value)
    ]
    assert {p.dtype for p in extra.values()} == {held}
    assert held == (torch.bfloat16 if value == "full" else torch.float32)
    assert {p.dtype for n, p in params.items() if "lora_" in n} == {torch.float32}
    # and as many parameters as the estimate counts
    built = sum(p.numel() for p in params.values())
    assert built == Peaks(spec, 1, "cpu").of(config.resolved(1)).trainable


def small(name: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(PRESETS[name].to_hf_config())


@pytest.mark.parametrize("value", ["full", "tokens:5"])
@pytest.mark.parametrize("name", ["llama-debug", "qwen2-debug"])  # untied, tied head
def test_the_plain_module_trains_them_and_a_tied_head_stays_tied(name, value):
    run = apply(small(name), Config(lora_rank=4, wrap="none", train_embeddings=value))
    parts = model_parts(run.model)
    ids = torch.randint(0, PRESETS[name].vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with run.autocast():  # the fp32 copy hands on bf16, as the frozen bf16 base computes
        assert parts.embed(ids).dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in trained(run.model).items() if "lora_" not in n}
    losses = [run.train_step([ids]).item() for _ in range(4)]
    assert losses[-1] < losses[0]
    after = trained(run.model)
    assert all(not torch.equal(before[n], after[n]) for n in before)  # they train
    if PRESETS[name].tied_embeddings:
        assert parts.tied and len(before) == 1  # one trained weight: the head's is the embedding's
        if value == "full":
            assert parts.head.weight is parts.embed.weight
    else:
        assert len(before) == 2


def managed(module: nn.Module) -> set[int]:
    """ids of the (sharded) parameters the FSDP2 unit of `module` holds."""
    assert isinstance(module, FSDPModule), type(module).__name__
    group = fully_shard.state(module)._fsdp_param_group
    return {id(p.sharded_param) for p in group.fsdp_params}


@pytest.mark.parametrize("name", ["llama-debug", "qwen2-debug"])
def test_fsdp2_units_hold_the_copies_and_the_originals_apart(rank, name):
    config = Config(lora_rank=4, wrap="layer", train_embeddings="full")
    run = apply(build_meta_model(PRESETS[name]), config, device="cpu")
    parts = model_parts(run.model)
    copies = {id(parts.embed.weight), id(parts.head.weight)}
    originals = parts.embed.original_module, parts.head.original_module
    # the frozen originals: one unit of their own (a tied head's shares the embedding's weight),
    # which forward never calls, so never gathered
    assert managed(originals[0]) == managed(originals[1]) == {id(m.weight) for m in originals}
    assert not copies & managed(originals[0])
    if parts.tied:  # the tied copy lives in the root unit, as a tied head does without LoRA
        assert copies <= managed(run.model)
    else:  # the embedding unit and [norm, head] hold the trainable copies
        assert managed(parts.embed) == {id(parts.embed.weight)}
        assert managed(parts.head) == {id(parts.head.weight), id(parts.norm.weight)}
    assert all(p.requires_grad for p in (parts.embed.weight, parts.head.weight))


def test_fsdp2_embedding_unit_holds_the_frozen_weight_and_its_trained_rows(rank):
    config = Config(lora_rank=4, wrap="layer", train_embeddings="tokens:5")
    run = apply(build_meta_model(PRESETS["llama-debug"]), config, device="cpu")
    parts = model_parts(run.model)
    for wrapper in (parts.embed, parts.head):  # peft merges the rows into the gathered weight
        adapter = wrapper.token_adapter
        rows = adapter.trainable_tokens_delta["default"]
        assert managed(wrapper) >= {id(adapter.base_layer.weight), id(rows)}
        assert rows.requires_grad and not adapter.base_layer.weight.requires_grad
