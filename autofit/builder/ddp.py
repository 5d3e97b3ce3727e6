"""Replicas: PyTorch DDP over the trainable parameters, the frozen base held once per GPU.

`gradient_as_bucket_view=True` makes each gradient a view into DDP's all-reduce bucket, so the
gradients exist once (the PyTorch DDP notes). Frozen and quantized parameters (a LoRA base in
bf16, NF4 or int8) are left out of DDP's bookkeeping (`_set_params_and_buffers_to_ignore_for_model`,
the hook FSDP1/TorchRec use), so they are neither broadcast at start nor synced: every rank built
or loaded the same base.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
