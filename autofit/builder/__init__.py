"""The builder: a config applied to a model, as trials measure it and as `autofit.apply` sets up a
user's run. In order (`apply.py`): build on meta (`model.py`), LoRA (`lora.py`), activation
checkpointing (`checkpoint.py`), `torch.compile` of each layer (`compile.py`), quantize the frozen
base (`quantize.py`, `nf4.py`), hold the model as a plain module, DDP (`ddp.py`) or FSDP2
(`fsdp.py`), then the optimizer (`optim.py`).
Everything here imports torch.
"""

from autofit.builder.apply import Applied, apply

__all__ = ["Applied", "apply"]
