"""`autofit.layout.Layout`: one run's layout, resolved once, held to torchtitan's `ParallelDims`
and to what the builder builds (the HSDP trial in tests/builder/test_hsdp.py builds its mesh from
it)."""

from __future__ import annotations

import dataclasses

import pytest

from autofit.arch import structure_of
from autofit.config import DECLARED, Config
from autofit.errors import ConfigError
from autofit.layout import LAYOUT_KNOBS, Layout, Sharding, layout_of
from autofit.models import PRESETS


def test_hsdp_over_two_nodes_of_eight_is_torchtitans_two_by_eight_mesh():
    # torchtitan's ParallelDims(dp_replicate=2, dp_shard=8) on 16 GPUs: each state is split over
    # a node's 8 GPUs and replicated on the other node; Llama-2-70B's 80 layers, one unit each
    layout = layout_of(Config(shard="node"), 16, 8, n_layers=80)
    assert layout.sharding is Sharding.FSDP2
    assert layout.mesh == (2, 8) and layout.shard == 8
    assert len(layout.units) == 80 and layout.units[79] == (79,)
    flat = layout_of(Config(shard="all"), 16, 8, n_layers=80)
    assert flat.mesh == (1, 16)
    # FSDP2 casts through its MixedPrecisionPolicy: no autocast; fp32 masters reduced in fp32
    assert not layout.autocast
    assert (layout.param_dtype, layout.compute_dtype, layout.reduce_dtype) == (
        "fp32",
        "bf16",
        "fp32",
    )


def test_the_plain_module_and_ddp_hold_everything_on_every_gpu():
    one = layout_of(Config(wrap="none"), 1)
    ddp = layout_of(Config(wrap="none"), 4, n_layers=32)
    assert (one.sharding, one.replicas, one.shard) == (Sharding.NONE, 1, 1)
    assert (ddp.sharding, ddp.replicas, ddp.shard, ddp.units) == (Sharding.DDP, 4, 1, ())
    assert ddp.mesh == (1, 1)  # no FSDP2 mesh
    # HF Trainer's bf16=True: autocast around fp32 params
    assert one.autocast and ddp.autocast
    assert not layout_of(Config(wrap="none", precision="bf16"), 1).autocast


def test_the_adamw_step_resolves_where_its_parameters_live():
    # torch's `_default_to_fused_or_foreach` has no foreach kernels on CPU: its for-loop there
    assert layout_of(Config(), 8).adamw == "fused"
    assert layout_of(Config(), 2, device="cpu").adamw == "for-loop"
    assert layout_of(Config(offload="params"), 8).adamw == "for-loop"  # CPU-offloaded params
    assert layout_of(Config(optimizer="adamw8bit"), 8).adamw is None  # torchao's own step
    assert Layout.of(wrap="layer", shard="all", n_gpus=8, optimizer_impl="foreach").adamw == (
        "foreach"
    )


LLAMA_PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
"""transformers' `LlamaDecoderLayer`: its seven `nn.Linear`s, in module order."""


def test_what_is_checkpointed_quantized_and_trained_is_resolved_once():
    # every-2 over 4 layers checkpoints 0 and 2 (torchtune's `ac_mode="selective", ac_option=2`:
    # every other layer starting from the first); QLoRA on q and v: all seven projections NF4,
    # adapters on two of them
    cfg = Config(
        checkpointing="every-2", quant="nf4", lora_rank=8, lora_targets=("q_proj", "v_proj")
    )
    layout = layout_of(cfg, 1, n_layers=4, projections=LLAMA_PROJECTIONS)
    assert layout.checkpointed == (0, 2) and not layout.selective
    assert layout.quant == "nf4" and layout.quantized == LLAMA_PROJECTIONS
    assert layout.adapted == ("self_attn.q_proj", "self_attn.v_proj")
    assert not layout.trains_all and layout.fp32_trainable  # bf16-mixed: fp32 adapters
    # by path inside the layer too; a full fine-tune trains everything and adapts nothing
    by_path = layout_of(
        cfg.replace(lora_targets=("mlp.down_proj",)), 1, 4, 4, "cuda", LLAMA_PROJECTIONS
    )
    assert by_path.adapted == ("mlp.down_proj",)
    full = layout_of(Config(checkpointing="selective", precision="bf16"), 1, n_layers=5)
    assert full.checkpointed == (0, 1, 2, 3, 4) and full.selective
    assert full.trains_all and full.quant is None and full.quantized == full.adapted == ()
    assert not full.fp32_trainable  # pure bf16 with torch AdamW
    assert layout_of(Config(checkpointing="every-2"), 1, n_layers=5).checkpointed == (0, 2, 4)


def test_wrap_auto_is_what_it_stands_for_and_never_read_unresolved():
    # the default config on one GPU is the plain module, on two FSDP2, and with param offload
    # FSDP2 even on one (offload needs it): the README's rule for `wrap: auto`
    assert layout_of(Config(), 1).sharding is Sharding.NONE
    assert layout_of(Config(), 2).sharding is Sharding.FSDP2
    assert layout_of(Config(offload="params"), 1).sharding is Sharding.FSDP2
    # a term handed `auto` itself (not the config) would resolve it without the offload and
    # shard beside it: it is refused, not guessed
    with pytest.raises(ValueError, match="unresolved"):
        Layout.of(wrap="auto", shard="all", n_gpus=1, offload="params")


def _values(name: str) -> tuple[object, ...]:
    """Values of a knob or setting to try: its choices, or a whole number's ends and a middle."""
    d = DECLARED[name]
    if d.choices is not None:
        return d.choices
    low = d.minimum if d.minimum is not None else 0
    return (low, low + 1, 8, d.maximum or 4096)


@pytest.mark.parametrize(
    "base",
    [
        Config(lora_rank=16, quant="nf4", wrap="layer", checkpointing="full"),
        Config(wrap="none", precision="bf16", optimizer_impl="foreach"),
        Config(lora_rank=64, quant="nf4", quant_backend="bitsandbytes", wrap="none",
               launch="trainer", precision="bf16"),
    ],
    ids=["nf4-lora-fsdp2", "full-ddp", "bnb-qlora-trainer"],
)  # fmt: skip
def test_a_layout_is_a_function_of_its_knobs_alone(base: Config) -> None:
    """`LAYOUT_KNOBS` is what the estimator keys the layouts it resolves by: every other knob
    and setting, set to each of its values, leaves `layout_of` of a config as it was (on 2 nodes
    of 4 GPUs, of llama-debug's layers and projections). A knob `layout_of` came to read without
    being listed would hand configs another's layout."""
    s = structure_of(PRESETS["llama-debug"])
    names = tuple(p.name for p in s.projections)
    before = layout_of(base, 8, 4, s.layers, projections=names)
    changed = 0
    for name in DECLARED:
        if name in LAYOUT_KNOBS:
            continue
        for value in _values(name):
            try:
                other = dataclasses.replace(base, **{name: value})
            except ConfigError:  # a combination the rules refuse has no layout
                continue
            assert layout_of(other, 8, 4, s.layers, projections=names) == before, (name, value)
            changed += other != base
    assert changed > 10  # the knobs were varied, not refused
