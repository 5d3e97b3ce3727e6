"""`compile: true` compiles each decoder layer in place, after checkpointing and before sharding:
every layer and nothing else, parameter names kept; NF4 + LoRA compiles whole (one graph per
distinct layer, no graph break) and trains as the eager run does."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torchao.quantization import NF4Tensor

from autofit.builder import apply
from autofit.builder.apply import Applied, adapt, model_layout
from autofit.builder.compile import CompileStats, apply_compile, is_compiled
from autofit.builder.model import build_meta_model, decoder_layers
from autofit.config import Config
from autofit.models import PRESETS

SPEC = dataclasses.replace(PRESETS["llama-debug"], layers=2)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Compiled code and dynamo's caches stay with the test that made them."""
    yield
    torch._dynamo.reset()


def small_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(SPEC.to_hf_config())


def names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def test_every_decoder_layer_is_compiled_in_place_and_names_stay() -> None:
    # every-2: layer 0 is a checkpoint wrapper, layer 1 the plain decoder layer
    cfg = Config(lora_rank=8, checkpointing="every-2")
    meta = build_meta_model(SPEC)
    model = adapt(meta, cfg, model_layout(meta, cfg))
    before, keys = names(model), list(model.state_dict())
    apply_compile(model, cfg)
    assert not any(is_compiled(m) for m in model.modules())
    apply_compile(model, cfg.replace(compile=True))
    layers = list(decoder_layers(model))
    assert all(is_compiled(layer) for layer in layers)
    assert not [m for m in model.modules() if is_compiled(m) and all(m is not x for x in layers)]
    assert names(model) == before and list(model.state_dict()) == keys
    assert not any("_orig_mod" in key for key in keys)


def test_apply_compiles_only_when_asked() -> None:
    eager = apply(small_model(), Config(lora_rank=8, wrap="none"))
    assert not any(is_compiled(m) for m in eager.model.modules())
    compiled = apply(small_model(), Config(lora_rank=8, wrap="none", compile=True))
    assert all(is_compiled(layer) for layer in decoder_layers(compiled.model))
    assert names(compiled.model) == names(eager.model)


def train(run: Applied, steps: int = 3) -> list[float]:
    batch = torch.randint(0, SPEC.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    return [run.train_step([batch]).item() for _ in range(steps)]


def saved_for_backward(run: Applied) -> int:
    """Bytes of the tensors one forward keeps for backward, parameters' own storage aside."""
    params = {
        t.untyped_storage().data_ptr()
        for p in run.model.parameters()
        for t in ([p] if type(p.data) is torch.Tensor else [getattr(p, n) for n in _inner(p)])
    }
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = torch.randint(0, SPEC.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.loss(batch)
    return sum(storages.values())


def _inner(p: torch.Tensor) -> list[str]:
    return p.data.__tensor_flatten__()[0]


@pytest.mark.slow  # inductor compiles in a pool of worker processes
def test_qlora_compiles_whole_keeps_nf4_packed_and_trains_as_eager() -> None:
    """NF4 base weights (torchao `NF4Tensor`, dequantized in the layer) with fp32 LoRA adapters
    under bf16 autocast, the plain module: dynamo captures each layer whole (`fullgraph=True`
    would fail on a break), the first layer apart (its input needs no grad); the losses are the
    eager run's to within 2e-3 (measured: 4e-4, fused bf16 kernels round differently), and
    backward keeps no more than eager does: not the dequantized bf16 weights, which joint-graph
    CSE made the partitioner keep (2.4x eager's bytes here; `keep_nf4_packed`)."""
    cfg = Config(lora_rank=8, quant="nf4", wrap="none")
    eager = apply(small_model(), cfg)
    expected = train(eager)
    run = apply(small_model(), cfg.replace(compile=True))
    q_proj = decoder_layers(run.model)[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer.weight.data, NF4Tensor)
    before = CompileStats.now()
    losses = train(run)
    made = CompileStats.now() - before
    assert made.graphs == 2 and made.graph_breaks == 0 and made.seconds > 0
    assert losses == pytest.approx(expected, abs=2e-3)
    assert losses[-1] < losses[0]
    assert saved_for_backward(run) <= saved_for_backward(eager)


def test_compiled_int8_layers_keep_cublas_matmuls_not_the_decoding_kernel() -> None:
    """A compiled int8 layer must not become `aten._weight_int8pack_mm`: inductor's weight-only
    pattern rewrites torchao's `mm(x, w_int8.t().to(bf16)) * scale` into it on CPU and CUDA alike,
    and on CUDA it is a decoding kernel (a few rows): on the H200 it took 98% of a compiled int8
    training step, 3.3 s against 0.11 s eager (bench/gpu_check.py's int8 rows). Here the same
    rewrite is seen on CPU by inductor's own match counter; the layer compiled as `apply_compile`
    does must leave it at zero, and the layer compiled with inductor's defaults shows the counter
    reads what it should (the rewrite fires)."""
    from torch._dynamo.utils import counters

    def matches(options: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        cfg = Config(quant="int8", lora_rank=8, seq_len=32, micro_batch=2, compile=True,
                     wrap="none")  # fmt: skip
        run = apply(small_model(), cfg)
        if not options:  # inductor's defaults: the layers compiled as before the fix
            for layer in decoder_layers(run.model):
                layer._compiled_call_impl = None
                layer.compile(fullgraph=True)
        tokens = torch.randint(0, SPEC.vocab, (2, 32))
        run.train_step([tokens])
        assert CompileStats.now().graphs > 0
        return int(counters["inductor"]["woq_matcher_count"])

    assert matches(options=False) > 0
    assert matches(options=True) == 0
