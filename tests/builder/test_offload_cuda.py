"""`offload: params` built for a CUDA target, on a machine without one.

On the first GPU run (H200, 2026-11-27) every `offload: params` trial failed as FSDP2 first ran:
"FSDP parameters should be materialized on CPU when enabling CPU offloading". `fully_shard` runs
while the parameters are on meta, and FSDP2's `CPUOffloadPolicy` moves to the host only those that
were real then; the builder gave the rest real storage on the GPU. A CPU trial cannot see this (its
target device is the host), so here the build targets `cuda` with FakeTensors: the mesh is a
one-rank CPU mesh on the fake process group, and every `materialize` of the build runs under a
`FakeTensorMode`, which gives "cuda" tensors no storage. FSDP2's own check
(`FSDPParamGroup._validate_cpu_offload_params`, what its lazy init runs) then says whether the
first forward would start, and every buffer must be on the GPU (torchtitan's `buffer_device`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from autofit.builder.model import build_meta_model
from autofit.config import Config
from autofit.layout import Sharding
from autofit.models import PRESETS

apply_module = importlib.import_module("autofit.builder.apply")
model_module = importlib.import_module("autofit.builder.model")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank fake process group, a CPU mesh for FSDP2, and the builder's `materialize` under
    FakeTensorMode (no initialisation: random values of a fake tensor are not what is tested)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    monkeypatch.setattr(
        apply_module, "make_mesh",
        lambda _type, _layout: init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",)),
    )  # fmt: skip
    real = model_module.materialize

    def fake_materialize(*args: Any, **kwargs: Any) -> Any:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return real(*args, **kwargs)

    monkeypatch.setattr(apply_module, "materialize", fake_materialize)
    monkeypatch.setattr(model_module, "_init_module", lambda _name, _mod: None)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("knobs", [{}, {"lora_rank": 8}], ids=["full", "lora"])
@pytest.mark.usefixtures("fake_cuda")
def test_offloaded_params_are_on_the_host_and_buffers_on_the_gpu(knobs: dict[str, Any]) -> None:
    config = Config(offload="params", seq_len=64, **knobs).resolved(1)
    model = build_meta_model(PRESETS["llama-debug"])
    built, layout = apply_module.prepare(model, config, torch.device("cuda", 0), 1)
    assert layout.sharding is Sharding.FSDP2
    groups = [
        mod._get_fsdp_state()._fsdp_param_group
        for mod in built.modules()
        if isinstance(mod, FSDPModule)
    ]
    groups = [g for g in groups if g is not None]
    assert len(groups) == PRESETS["llama-debug"].layers + 3  # embed, layers, [norm, head], root
    for group in groups:
        for param in group.fsdp_params:
            param.reset_sharded_param()  # as FSDP2's lazy init does first
        group._validate_cpu_offload_params()  # raises on the code of the first GPU run
    on = {name: p.device.type for name, p in built.named_parameters()}
    assert set(on.values()) == {"cpu"}, on
    buffers = {name: b.device for name, b in built.named_buffers()}
    assert buffers and all(d == torch.device("cuda", 0) for d in buffers.values()), buffers
