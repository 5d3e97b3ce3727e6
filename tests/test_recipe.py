"""The rules in `autofit.recipe`, held to the code that applies them (torchao, the builder), not to
themselves. The state bytes per value are held to a hand count in tests/builder/test_optim_state.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torchao.optim

from autofit.builder.checkpoint import apply_checkpointing
from autofit.builder.model import decoder_layers
from autofit.config import Config
from autofit.layout import layout_of
from autofit.models import PRESETS
from autofit.recipe import LOW_BIT_STATES, checkpointed_layers, low_bit_quantizes


@pytest.mark.parametrize("name", sorted(LOW_BIT_STATES))
@pytest.mark.parametrize("numel", [4096, 4095, 4096 + 128, 16384, 2048])
def test_low_bit_quantizes_says_which_tensors_torchao_quantizes(name: str, numel: int) -> None:
    """torchao decides per (local) tensor in `_AdamBase._new_buffer`: >= 4096 values and whole
    blocks (4096 + 128 is whole 128-blocks for 4-bit, not 256-blocks for 8-bit)."""
    state = LOW_BIT_STATES[name]
    cls = getattr(torchao.optim, state.torchao_class)
    param = torch.nn.Parameter(torch.zeros(numel))
    opt = cls([param], lr=1e-3, block_size=state.block)
    buffer = opt._new_buffer(param, signed=True)
    assert hasattr(buffer, "codes") == low_bit_quantizes(name, numel)


def test_the_recipes_block_sizes_are_torchaos_defaults() -> None:
    """The builder passes `block_size` itself; this notices when torchao's default moves away."""
    import inspect

    for state in LOW_BIT_STATES.values():
        cls = getattr(torchao.optim, state.torchao_class)
        assert inspect.signature(cls).parameters["block_size"].default == state.block


@pytest.mark.parametrize("mode", ["none", "full", "every-2", "selective"])
def test_the_builder_checkpoints_the_layers_the_estimate_counts(mode: str) -> None:
    from transformers import LlamaForCausalLM

    spec = dataclasses.replace(PRESETS["llama-debug"], layers=5)  # odd: every-2 wraps 3 of 5
    with torch.device("meta"):
        model = LlamaForCausalLM(spec.to_hf_config())
    layout = layout_of(Config(checkpointing=mode), 1, n_layers=spec.layers)
    apply_checkpointing(model, layout.checkpointed, layout.selective)
    layers = decoder_layers(model)
    wrapped = tuple(i for i, layer in enumerate(layers) if "Checkpoint" in type(layer).__name__)
    assert wrapped == checkpointed_layers(mode, spec.layers)
    assert len(wrapped) == {"none": 0, "full": 5, "every-2": 3, "selective": 5}[mode]
    # the step time re-runs the forward of exactly those layers (every-2 of 5: 3/5, not half);
    # op-level `selective` re-runs no matmul
    from autofit.estimate.speed import dequant_passes

    rerun = 0 if mode == "selective" else len(wrapped)
    assert dequant_passes(mode, spec.layers) == 2 + rerun / spec.layers


@pytest.mark.parametrize(
    ("optimizer", "impl", "offload", "cls", "fused"),
    [
        ("adamw8bit", None, "none", "AdamW8bit", None),
        ("adamw4bit", None, "optimizer", "AdamW4bit", None),
        ("adamw", "fused", "none", "AdamW", True),
        ("adamw", "foreach", "none", "AdamW", None),
        ("adamw", "for-loop", "none", "AdamW", None),  # Trainer has no for-loop: its plain one
        ("adamw", "fused", "optimizer", "AdamW", None),  # the host step: not Trainer's fused
    ],
)
def test_the_hf_optim_name_builds_the_optimizer_autofit_builds(
    optimizer: str, impl: str | None, offload: str, cls: str, fused: bool | None, tmp_path
) -> None:
    """`hf_optim` (what the TrainingArguments export writes) held to transformers itself: the
    class and `fused` argument Trainer builds from the name are the ones the builder builds, and
    the block size it gives a torchao class is `HF_TRAINER_LOW_BIT_BLOCK` (the export's note
    says where that is not the measured one)."""
    from transformers import Trainer, TrainingArguments

    from autofit.recipe import HF_TRAINER_LOW_BIT_BLOCK, hf_optim

    args = TrainingArguments(output_dir=str(tmp_path), optim=hf_optim(optimizer, impl, offload))
    built, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert built.__name__ == cls
    assert kwargs.get("fused") is fused
    assert kwargs.get("block_size") == (HF_TRAINER_LOW_BIT_BLOCK if cls != "AdamW" else None)
