"""`autofit.apply` on a user's own (small) model: the same builder steps the trials measure."""

from __future__ import annotations

import torch

from autofit.config import Config
from autofit.models import PRESETS
from autofit.trial import apply


def small_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(PRESETS["llama-debug"].to_hf_config())


def train(model: torch.nn.Module, steps: int = 4) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    batch = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_apply_lora_freezes_a_bf16_base_and_trains_fp32_adapters() -> None:
    model = apply(small_model(), Config(lora_rank=8, checkpointing="full"))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    losses = train(model)
    assert losses[-1] < losses[0]


def test_apply_qlora_stores_projections_in_nf4() -> None:
    from torchao.quantization import NF4Tensor

    model = apply(small_model(), Config(lora_rank=8, quant="nf4"))
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q_proj.weight.data, NF4Tensor)
    losses = train(model)
    assert losses[-1] < losses[0]


def test_apply_full_finetune_in_pure_bf16_keeps_everything_bf16() -> None:
    model = apply(small_model(), Config(precision="bf16", checkpointing="selective"))
    assert all(p.dtype == torch.bfloat16 and p.requires_grad for p in model.parameters())
    losses = train(model, steps=3)
    assert losses[-1] < losses[0]
