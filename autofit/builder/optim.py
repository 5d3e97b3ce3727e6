"""The optimizer: torch AdamW (fused, foreach or its for-loop: `optimizer_impl`) or torchao
AdamW8bit / AdamW4bit, optionally with its state and step on the CPU (torchao
`CPUOffloadOptimizer`)."""

from __future__ import annotations

import torch
from torch import nn

from autofit.config import Config
from autofit.recipe import ADAMW_IMPLS, LOW_BIT_STATES
from autofit.values import Offload, Optimizer

LR = 1e-3  # high enough that a few steps visibly memorise the fixed synthetic batch


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """torch AdamW, or the torchao class `autofit.recipe.LOW_BIT_STATES` names."""
    if name == Optimizer.ADAMW:
        return torch.optim.AdamW
    import torchao.optim

    return getattr(torchao.optim, LOW_BIT_STATES[name].torchao_class)


def build_optimizer(
    model: nn.Module,
    config: Config,
    impl: str | None,
    device_type: str,
    *,
    keep_gradients: bool = False,
    lr: float = LR,
) -> torch.optim.Optimizer:
    """Optimizer over the trainable parameters: torch AdamW stepping with `impl`
    (`Layout.adamw`, of `autofit.recipe.adamw_impl`), or torchao's low-bit AdamW (`impl` None).

    `offload=optimizer` on CUDA uses torchao's `CPUOffloadOptimizer`, freeing device gradients
    once copied to the host (`offload_gradients`) unless gradients accumulate (`grad_accum > 1`,
    which torchao says that option does not support) or must stay (`keep_gradients`: DDP's
    gradients are views into its all-reduce buckets). On CPU trials (where that
    class refuses to run: it needs CUDA/XPU) the plain optimizer is used and the worker runs its
    step outside the device-memory tracker, so its state counts as host memory, as it would be.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    cls = optimizer_class(config.optimizer)
    kwargs: dict[str, object] = {"lr": lr, "weight_decay": 0.0}
    if config.optimizer in LOW_BIT_STATES:  # the block size the estimator counts, not a default
        kwargs["block_size"] = LOW_BIT_STATES[config.optimizer].block
    if impl is not None:
        kwargs.update(ADAMW_IMPLS[impl].kwargs)
    if config.offload == Offload.OPTIMIZER and device_type == "cuda":
        from torchao.optim import CPUOffloadOptimizer

        free_grads = config.grad_accum == 1 and not keep_gradients
        return CPUOffloadOptimizer(
            params, optimizer_class=cls, offload_gradients=free_grads, **kwargs
        )
    return cls(params, **kwargs)


def is_compiled_step(name: str) -> bool:
    """torchao's low-bit optimizers `torch.compile` their step: no dispatch mode may be active."""
    return name in LOW_BIT_STATES
