"""The activations the estimate reads from a one-layer FakeTensorMode trace
(`autofit.arch.activations_of`), held to a real CPU forward of the same model, built by the
trial's own builder (`autofit.apply`).

Measured: every tensor storage an op creates during a real forward with the loss (parameters,
buffers, the token ids and autocast's bf16 copies of weights aside: the estimate counts those from
the weights), alive when forward has returned (what backward will use), and the peak of those
bytes during forward. Two models that differ by two decoder layers give one layer's bytes; the
peak less the layers is what lives outside them (logits and loss at their widest).

The trace runs one sequence and the estimate multiplies by the micro-batch; a real micro-batch of
two shares a few tensors between its sequences (rotary tables, a sliding-window mask), so the
trace is up to 2% above the real forward outside the layers and 0.2% inside sliding-window layers
(Gemma), and exact elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autofit.arch import ActivationKey, activations_of, structure_of
from autofit.build import apply
from autofit.build.model import build_meta_model
from autofit.config import Config, Sharding, uses_autocast
from autofit.estimate import memory as mem
from autofit.models import PRESETS

SEQ, BATCH = 64, 2


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create (each once), leaving out `skip` (parameters, buffers,
    inputs) and casts of them; `live()` counts those still alive, `peak` the most at once."""

    def __init__(self, skip: set[StorageWeakRef]) -> None:
        super().__init__()
        self.skip = skip
        self.born: dict[StorageWeakRef, int] = {}
        self.casts: set[StorageWeakRef] = set()
        self.peak = 0

    def live(self) -> int:
        return sum(
            n
            for ref, n in self.born.items()
            if not ref.expired() and ref not in self.skip and ref not in self.casts
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        cast = (
            func is torch.ops.aten._to_copy.default
            and isinstance(args[0], torch.Tensor)
            and StorageWeakRef(args[0].untyped_storage()) in self.skip
        )
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.born.setdefault(ref, t.untyped_storage().nbytes())
                if cast:
                    self.casts.add(ref)
        self.born = {ref: n for ref, n in self.born.items() if not ref.expired()}
        self.peak = max(self.peak, self.live())
        return out


def real_forward(spec, config: Config) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Activation bytes alive after a real CPU forward of `BATCH` sequences, and their peak."""
    torch.manual_seed(0)
    run = apply(build_meta_model(spec), config, device="cpu")
    ids = torch.randint(0, spec.vocab, (BATCH, config.seq_len))
    own = (*run.model.parameters(), *run.model.buffers(), ids)
    live = LiveBytes({StorageWeakRef(t.untyped_storage()) for t in own})
    with live, run.autocast():
        loss = run.model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad  # `loss` holds the graph: what is alive is what backward needs
    return live.live(), live.peak


CASES = [
    # (preset, Config knobs): pure bf16 is how FSDP2 computes, bf16-mixed on one device is the
    # plain module under autocast (fp32 trainable weights, fp32 residual stream when full)
    ("llama-debug", {"precision": "bf16"}),
    ("llama-debug", {"precision": "bf16", "checkpointing": "full"}),
    ("llama-debug", {"precision": "bf16", "checkpointing": "selective"}),
    ("llama-debug", {"precision": "bf16-mixed"}),
    ("llama-debug", {"precision": "bf16-mixed", "lora_rank": 16, "checkpointing": "selective"}),
    ("llama-debug", {"precision": "bf16", "lora_rank": 16, "lora_dropout": 0.1}),
    ("llama-debug", {"precision": "bf16", "lora_rank": 16, "lora_targets": ("q_proj", "v_proj")}),
    ("qwen2-debug", {"precision": "bf16"}),
    ("qwen3-debug", {"precision": "bf16", "checkpointing": "selective"}),
    ("gemma2-debug", {"precision": "bf16"}),
    ("gemma3-debug", {"precision": "bf16-mixed", "lora_rank": 16, "checkpointing": "full"}),
    ("phi3-debug", {"precision": "bf16"}),
    ("mixtral-debug", {"precision": "bf16"}),
    ("mixtral-debug", {"precision": "bf16", "checkpointing": "selective"}),
]


def _id(case: tuple[str, dict]) -> str:
    name, knobs = case
    return "-".join([name, *(f"{k}={v}" for k, v in knobs.items())]).replace(" ", "")


@pytest.mark.parametrize(("name", "knobs"), CASES, ids=[_id(c) for c in CASES])
def test_a_traced_layer_keeps_what_a_real_forward_keeps(name: str, knobs: dict) -> None:
    config = Config(wrap="none", seq_len=SEQ, micro_batch=BATCH, **knobs)
    two, four = (dataclasses.replace(PRESETS[name], layers=n) for n in (2, 4))
    end_two, _ = real_forward(two, config)
    end_four, peak_four = real_forward(four, config)
    layer = (end_four - end_two) / 2 / BATCH  # per layer, per sequence
    outside = (peak_four - 4 * BATCH * layer) / BATCH

    autocast = uses_autocast(config.precision, config.optimizer, Sharding.NONE)
    key = ActivationKey(SEQ, config.lora_rank, config.lora_targets, config.lora_dropout,
                        config.checkpointing, autocast)  # fmt: skip
    traced = activations_of(four, key)
    assert traced.layer == pytest.approx(layer, rel=0.003)
    assert outside <= traced.root == pytest.approx(outside, rel=0.02)

    if config.checkpointing == "none":
        # the estimate's activation term is the real forward's peak: every layer's saved tensors
        # and the logits and loss at once
        layers, root = mem.activation_bytes(four, structure_of(four), BATCH, SEQ,
                                            config.lora_rank, "none", autocast,
                                            config.lora_targets, config.lora_dropout)  # fmt: skip
        assert layers + root == pytest.approx(peak_four, rel=0.01)
