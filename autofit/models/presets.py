"""The preset models: each a supported family's published `config.json`, as a `ModelSpec`."""

from __future__ import annotations

from typing import Any

from autofit.models.spec import ModelSpec, extra_json

__all__ = ["PRESETS"]


def _preset(name: str, description: str, *, extra: dict[str, Any] | None = None,
            **kw: Any) -> ModelSpec:  # fmt: skip
    return ModelSpec(name=name, description=description, extra=extra_json(extra or {}), **kw)


_GEMMA2 = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
# Every Llama 3 (3, 3.1, 3.2): the 128K tokenizer, RoPE base 500,000 and 8 KV heads (GQA).
_LLAMA3 = dict(kv_heads=8, vocab=128256, rope_theta=500000.0)
_TINY = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=1024,
             max_position=1024)  # fmt: skip

# Architecture numbers from each model's published config.json; the parameter counts in the
# descriptions are what the meta model counts (tests/test_models.py holds them).
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _preset(
            "llama-7b", "Llama-2-7B", hidden=4096, layers=32, heads=32, kv_heads=32,
            intermediate=11008, vocab=32000, max_position=4096,
        ),
        _preset(
            "llama-13b", "Llama-2-13B", hidden=5120, layers=40, heads=40, kv_heads=40,
            intermediate=13824, vocab=32000, max_position=4096,
        ),
        _preset(
            "llama-70b", "Llama-2-70B", hidden=8192, layers=80, heads=64, kv_heads=8,
            intermediate=28672, vocab=32000, max_position=4096,
        ),
        _preset(
            "llama-3-8b", "Meta-Llama-3-8B", hidden=4096, layers=32, heads=32,
            intermediate=14336, max_position=8192, **_LLAMA3,
        ),
        _preset(
            "llama-3-70b", "Meta-Llama-3-70B", hidden=8192, layers=80, heads=64,
            intermediate=28672, max_position=8192, **_LLAMA3,
        ),
        _preset(
            "llama-3.1-8b", "Llama-3.1-8B", hidden=4096, layers=32, heads=32,
            intermediate=14336, max_position=131072, **_LLAMA3,
        ),
        _preset(
            "llama-3.2-1b", "Llama-3.2-1B", hidden=2048, layers=16, heads=32,
            intermediate=8192, max_position=131072, head_dim_override=64, tied_embeddings=True,
            **_LLAMA3,
        ),
        _preset(
            "llama-3.2-3b", "Llama-3.2-3B", hidden=3072, layers=28, heads=24,
            intermediate=8192, max_position=131072, head_dim_override=128, tied_embeddings=True,
            **_LLAMA3,
        ),
        _preset(
            "qwen2.5-0.5b", "Qwen2.5-0.5B", hidden=896, layers=24, heads=14, kv_heads=2,
            intermediate=4864, vocab=151936, max_position=32768, rope_theta=1000000.0,
            norm_eps=1e-6, tied_embeddings=True, model_type="qwen2",
        ),
        _preset(
            "qwen2.5-7b", "Qwen2.5-7B", hidden=3584, layers=28, heads=28, kv_heads=4,
            intermediate=18944, vocab=152064, max_position=131072, rope_theta=1000000.0,
            norm_eps=1e-6, model_type="qwen2",
        ),
        _preset(
            "qwen3-8b", "Qwen3-8B", hidden=4096, layers=36, heads=32, kv_heads=8,
            intermediate=12288, vocab=151936, max_position=40960, rope_theta=1000000.0,
            norm_eps=1e-6, head_dim_override=128, model_type="qwen3",
        ),
        _preset(
            "gemma-2-2b", "gemma-2-2b", hidden=2304, layers=26, heads=8, kv_heads=4,
            intermediate=9216, vocab=256000, max_position=8192, norm_eps=1e-6,
            head_dim_override=256, tied_embeddings=True, model_type="gemma2", extra=_GEMMA2,
        ),
        _preset(
            "gemma-2-9b", "gemma-2-9b", hidden=3584, layers=42, heads=16, kv_heads=8,
            intermediate=14336, vocab=256000, max_position=8192, norm_eps=1e-6,
            head_dim_override=256, tied_embeddings=True, model_type="gemma2", extra=_GEMMA2,
        ),
        _preset(
            "phi-3-mini", "Phi-3-mini-4k-instruct", hidden=3072, layers=32, heads=32,
            kv_heads=32, intermediate=8192, vocab=32064, max_position=4096, model_type="phi3",
        ),
        _preset(
            "mistral-7b", "Mistral-7B-v0.1", hidden=4096, layers=32, heads=32, kv_heads=8,
            intermediate=14336, vocab=32000, max_position=32768, model_type="mistral",
        ),
        _preset(
            "mixtral-8x7b", "Mixtral-8x7B-v0.1", hidden=4096, layers=32, heads=32, kv_heads=8,
            intermediate=14336, vocab=32000, max_position=32768, rope_theta=1000000.0,
            model_type="mixtral", extra={"num_local_experts": 8, "num_experts_per_tok": 2},
        ),
        _preset(
            "tinyllama-1.1b", "TinyLlama-1.1B", hidden=2048, layers=22, heads=32, kv_heads=4,
            intermediate=5632, vocab=32000, max_position=2048,
        ),
        _preset(
            "llama-mini", "Llama architecture, ~40M parameters: CPU-sized benchmarks",
            hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536, vocab=8192,
            max_position=2048,
        ),
        _preset(
            "llama-debug", "Llama architecture, ~3M parameters: CPU tests and demos",
            hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=1024,
            max_position=1024,
        ),
        _preset("qwen2-debug", "Qwen2 architecture (q/k/v biases), tiny: CPU tests",
                model_type="qwen2", tied_embeddings=True, **_TINY),
        _preset("qwen3-debug", "Qwen3 architecture (q/k norms), tiny: CPU tests",
                model_type="qwen3", head_dim_override=32, **_TINY),
        _preset("gemma2-debug", "Gemma 2 architecture (soft-capping, sliding window), tiny: "
                "CPU tests", model_type="gemma2", head_dim_override=32, tied_embeddings=True,
                extra={**_GEMMA2, "query_pre_attn_scalar": 32, "sliding_window": 64}, **_TINY),
        _preset("gemma3-debug", "Gemma 3 text architecture, tiny: CPU tests",
                model_type="gemma3_text", head_dim_override=32, tied_embeddings=True,
                extra={"sliding_window": 64, "query_pre_attn_scalar": 32}, **_TINY),
        _preset("phi3-debug", "Phi-3 architecture (fused qkv and gate_up), tiny: CPU tests",
                model_type="phi3", **_TINY),
        _preset("mixtral-debug", "Mixtral architecture (4 experts, top-2), tiny: CPU tests",
                model_type="mixtral", extra={"num_local_experts": 4, "num_experts_per_tok": 2},
                **_TINY),
    )
}  # fmt: skip
