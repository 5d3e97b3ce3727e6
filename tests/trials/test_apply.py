"""`autofit.apply` on a user's own (small) model: the same builder steps the trials measure,
returning the model, the optimizer and the autocast context a training loop uses directly."""

from __future__ import annotations

import pytest
import torch

from autofit.builder import apply
from autofit.builder.apply import Applied
from autofit.config import Config
from autofit.layout import Sharding
from autofit.models import PRESETS


def small_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(PRESETS["llama-debug"].to_hf_config())


def train(run: Applied, steps: int = 4) -> list[float]:
    """The loop `Applied`'s docstring shows, with 2 micro-steps per optimizer step."""
    batch = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        for micro in range(2):
            with run.gradient_sync(micro == 1):
                with run.autocast():
                    loss = run.model(input_ids=batch, labels=batch).loss
                (loss / 2).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_wrap_auto_is_resolved_by_apply_to_the_plain_module_on_one_rank() -> None:
    run = apply(small_model(), Config(lora_rank=8))  # wrap: auto, the default
    assert run.sharding is Sharding.NONE and run.config.wrap == "none"
    assert not any(type(m).__name__.startswith("FSDP") for m in run.model.modules())


def test_one_device_lora_is_the_plain_module_with_fp32_adapters_under_bf16_autocast() -> None:
    run = apply(small_model(), Config(lora_rank=8, checkpointing="full", wrap="none"))
    assert run.sharding is Sharding.NONE
    trainable = {n: p for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    frozen = [p for p in run.model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    # no DTensor anywhere: the plain module, as single-device recipes train it
    assert not any(type(p.data).__name__ == "DTensor" for p in run.model.parameters())
    assert isinstance(run.optimizer, torch.optim.AdamW)
    with run.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    losses = train(run)
    assert losses[-1] < losses[0]


def test_apply_qlora_stores_projections_in_nf4() -> None:
    from torchao.quantization import NF4Tensor

    run = apply(small_model(), Config(lora_rank=8, quant="nf4", wrap="none"))
    q_proj = run.model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer.weight.data, NF4Tensor)
    assert q_proj.lora_A["default"].weight.dtype == torch.float32
    assert torch.count_nonzero(q_proj.lora_B["default"].weight) == 0  # peft's B = 0 start
    losses = train(run)
    assert losses[-1] < losses[0]


def test_apply_full_finetune_in_pure_bf16_keeps_everything_bf16_without_autocast() -> None:
    run = apply(small_model(), Config(precision="bf16", checkpointing="selective", wrap="none"))
    assert all(p.dtype == torch.bfloat16 and p.requires_grad for p in run.model.parameters())
    with run.autocast():
        assert not torch.is_autocast_enabled("cpu")
    losses = train(run, steps=3)
    assert losses[-1] < losses[0]


def test_low_bit_optimizer_is_built_as_trials_build_it() -> None:
    from torchao.optim import AdamW8bit

    run = apply(small_model(), Config(lora_rank=8, optimizer="adamw8bit", wrap="none"))
    assert isinstance(run.optimizer, AdamW8bit)


def test_train_step_is_the_hand_written_loop() -> None:
    """`Applied.train_step` against the loop written out by hand (`train` above): the same
    losses and the same weights after four optimizer steps of two micro-steps each."""
    cfg = Config(lora_rank=8, grad_accum=2, wrap="none")
    by_hand = apply(small_model(), cfg)
    expected = train(by_hand)
    run = apply(small_model(), cfg)
    batch = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = [run.train_step([batch, batch]).item() for _ in range(4)]
    assert losses == pytest.approx(expected, rel=1e-6)
    for (name, a), (_, b) in zip(
        by_hand.model.named_parameters(), run.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="grad_accum=2"):
        run.train_step([batch])


def test_a_users_nf4tensor_keeps_torchaos_behaviour_after_apply_builds_qlora() -> None:
    """autofit's uneven sharding lives on its own subclass: torchao's op table, FSDP2 methods and
    `CHUNK_SIZE` are as torchao ships them after `apply` quantized a model in this process."""
    from torchao.quantization import NF4Tensor
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor as torchao_nf4

    from autofit.builder.nf4 import ShardableNF4Tensor, to_shardable_nf4

    run = apply(small_model(), Config(lora_rank=8, quant="nf4", wrap="none"))
    built = run.model.get_base_model().model.layers[0].mlp.down_proj.base_layer.weight.data
    assert type(built) is ShardableNF4Tensor

    aten = torch.ops.aten
    table = torchao_nf4.NF4_OPS_TABLE
    assert table[aten.split.Tensor] is torchao_nf4.nf4_split
    assert table[aten.slice.Tensor] is torchao_nf4.nf4_slice
    assert table[aten.new_zeros.default] is torchao_nf4.nf4_new_zeros
    assert aten.new_empty.default not in table
    for method in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
        assert getattr(NF4Tensor, method).__module__ == torchao_nf4.__name__
    assert torchao_nf4.CHUNK_SIZE == 1024**2

    # The same 256 x 1024 weight, the user's in torchao's default 64 x 256 blocks, autofit's in
    # blocks for 3 shards.
    weight = torch.randn(256, 1024, dtype=torch.bfloat16)
    users, ours = torchao_nf4.to_nf4(weight), to_shardable_nf4(weight, shards=3)
    assert type(users) is NF4Tensor and type(users.detach()) is NF4Tensor
    # torch.chunk into 3 splits by ceil(256 / 3) = 86 rows; torchao's split makes 256 // 86 = 2
    # chunks of 128 rows, where autofit's subclass makes torch.chunk's 86, 86, 84.
    assert [c.size(0) for c in torch.chunk(users, 3)] == [128, 128]
    assert [c.size(0) for c in torch.chunk(ours, 3)] == [86, 86, 84]
    with pytest.raises(NotImplementedError):  # torchao slices only from row 0
        users[64:128]
    with pytest.raises(NotImplementedError):  # and makes no new_empty
        users.new_empty((64, 1024))
