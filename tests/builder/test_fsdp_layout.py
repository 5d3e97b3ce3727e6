"""The builder's FSDP2 layout, held to torchtitan's `apply_fsdp` and to `torch.chunk` sharding.

Two ranks in one process: the `fake` backend (torch's `FakeStore` process group) answers the
collectives of `fully_shard` without a second process, and each rank's layout is built in turn.
Nothing is gathered, so only the layout is checked, not the numbers a forward would compute.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from autofit.builder import apply
from autofit.builder.model import build_meta_model, model_parts
from autofit.config import Config
from autofit.models import PRESETS

# llama-debug (4 layers, hidden 256) with a vocabulary of 1001: odd rows, so the two ranks' shards
# of the embedding and the LM head differ in size.
SPEC = dataclasses.replace(PRESETS["llama-debug"], vocab=1001)


def unit(module: nn.Module) -> object | None:
    """The FSDP2 state (one per `fully_shard` call) that owns `module`, or None."""
    return fully_shard.state(module) if isinstance(module, FSDPModule) else None


# torchtitan's `apply_fsdp`: each decoder-layer group, the token embeddings, `[norm, output]`
# together, then the root. Per wrap, the decoder layers each unit holds (by hand).
LAYER_UNITS = {
    "layer": [[0], [1], [2], [3]],
    "every-2": [[0, 1], [2, 3]],
    "model": [],  # every layer left to the root unit
}


@pytest.mark.parametrize("wrap", list(LAYER_UNITS))
def test_units_are_laid_out_as_torchtitan_does(rank, wrap):
    config = Config(wrap=wrap, precision="bf16", seq_len=64)
    run = apply(build_meta_model(SPEC), config, device="cpu")
    parts = model_parts(run.model)

    root = unit(run.model)
    embed, norm, head = unit(parts.embed), unit(parts.norm), unit(parts.head)
    layers = [unit(layer) for layer in parts.layers]
    assert root is not None and embed is not None and norm is not None
    assert norm is head  # `[norm, lm_head]` is one unit
    assert len({id(root), id(embed), id(norm)}) == 3  # and the embedding another, the root a third

    expected = LAYER_UNITS[wrap]
    if not expected:
        assert layers == [None] * SPEC.layers  # not sharded on their own: the root holds them
    for group in expected:
        assert all(layers[i] is layers[group[0]] for i in group), group
    firsts = [layers[g[0]] for g in expected]
    assert len({id(u) for u in firsts} | {id(root), id(embed), id(norm)}) == len(expected) + 3


def test_each_rank_holds_torch_chunk_rows_of_every_parameter(rank):
    run = apply(build_meta_model(SPEC), Config(wrap="layer", precision="bf16"), device="cpu")
    shapes = {}
    for name, param in run.model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        shapes[name] = (tuple(param.shape), tuple(param.to_local().shape))

    # FSDP2 shards dim 0 as `torch.chunk(rows, 2)`: rank 0 ceil(rows / 2), rank 1 the rest.
    # By hand for the odd vocabulary: 1001 rows -> 501 + 500; k_proj's 128 rows -> 64 + 64;
    # gate_proj's 688 rows -> 344 + 344; a norm's 256 weights -> 128 + 128.
    local = {
        "model.embed_tokens.weight": ((1001, 256), [(501, 256), (500, 256)]),
        "lm_head.weight": ((1001, 256), [(501, 256), (500, 256)]),
        "model.layers.0.self_attn.k_proj.weight": ((128, 256), [(64, 256), (64, 256)]),
        "model.layers.3.mlp.gate_proj.weight": ((688, 256), [(344, 256), (344, 256)]),
        "model.layers.3.mlp.down_proj.weight": ((256, 688), [(128, 688), (128, 688)]),
        "model.norm.weight": ((256,), [(128,), (128,)]),
    }
    for name, (full, per_rank) in local.items():
        assert shapes[name] == (full, per_rank[rank]), name
