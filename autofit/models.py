"""Model architectures as numbers: a registry of presets and local HF `config.json` files.

Nothing here downloads anything. A preset is the handful of numbers that define a Llama-family
decoder; the trial builds the real model from them with random weights (`to_hf_config`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from autofit.errors import ModelError, closest

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear projections of a decoder layer (HF Llama names): what LoRA targets and quantization
touches. The builder (LoRA, quantize), the estimator (`projection_shapes`) and the exports
(`target_modules`) all read this one tuple."""


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder-only transformer (Llama, Mistral, TinyLlama and relatives)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    max_position: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    head_dim_override: int | None = None
    description: str = ""
    model_type: str = "llama"  # HF `model_type`: the family, a key of DECODER_LAYER_CLASSES

    @property
    def decoder_layer_class(self) -> str:
        """The HF class of this model's decoder layers (what FSDP wraps in an export), read from
        its family (`model_type`), never from its name or path."""
        return DECODER_LAYER_CLASSES[self.model_type]

    # ----- shapes ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        shapes = {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return {name: shapes[name] for name in PROJECTIONS}

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear in one decoder layer (HF Llama names)."""
        return self._shapes

    @cached_property
    def _lora_per_rank(self) -> int:
        return self.layers * sum(a + b for a, b in self._shapes.values())

    # ----- exact parameter counts (HF LlamaForCausalLM, no biases) ---------------------------
    @cached_property
    def layer_linear_params(self) -> int:
        """Weights of the seven projections of one decoder layer: what LoRA and quant touch."""
        return sum(a * b for a, b in self.projection_shapes().values())

    @property
    def layer_norm_params(self) -> int:
        return 2 * self.hidden  # input_layernorm + post_attention_layernorm

    @property
    def layer_params(self) -> int:
        return self.layer_linear_params + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, LM head."""
        return self.embedding_params + self.hidden + self.lm_head_params

    @property
    def linear_params(self) -> int:
        """All projection weights of all layers (the quantizable base)."""
        return self.layers * self.layer_linear_params

    @property
    def n_params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def lora_params(self, rank: int) -> int:
        """LoRA A (r x in) and B (out x r) on all seven projections of every layer."""
        return rank * self._lora_per_rank if rank > 0 else 0

    # ----- conversions -----------------------------------------------------------------------
    def to_hf_config(self) -> Any:
        """A `transformers.LlamaConfig` for this architecture (random init, no download)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.norm_eps,
            tie_word_embeddings=self.tied_embeddings,
            attention_bias=False,
            mlp_bias=False,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["n_params"] = self.n_params
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """The inverse of `to_dict` (or of `asdict`); derived counts such as `n_params` are
        recomputed, not read."""
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        if "model_type" not in known and known.get("name") in PRESETS:
            # recorded before specs named their family: a preset's family is its preset's
            known["model_type"] = PRESETS[known["name"]].model_type
        return cls(**known)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelSpec:
        """Read a HF `config.json` dict of a Llama-family model."""
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in cfg
        ]
        if missing:
            raise ModelError(
                f"{name}: the config lacks {', '.join(missing)}. autofit reads Llama-family "
                "decoder configs (model_type llama or mistral) with hidden_size, "
                "num_hidden_layers, num_attention_heads, intermediate_size and vocab_size."
            )
        model_type = cfg.get("model_type", "llama")
        if model_type not in DECODER_LAYER_CLASSES:
            raise ModelError(
                f"{name}: model_type {model_type!r} is not supported yet. Supported: "
                f"{', '.join(sorted(DECODER_LAYER_CLASSES))}."
            )
        hidden = _count(cfg, "hidden_size", name)
        heads = _count(cfg, "num_attention_heads", name)
        spec = cls(
            name=name,
            hidden=hidden,
            layers=_count(cfg, "num_hidden_layers", name),
            heads=heads,
            kv_heads=_count(cfg, "num_key_value_heads", name, heads),
            intermediate=_count(cfg, "intermediate_size", name, 4 * hidden),
            vocab=_count(cfg, "vocab_size", name),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position=_count(cfg, "max_position_embeddings", name, 4096),
            rope_theta=_number(cfg, "rope_theta", name, 10000.0),
            norm_eps=_number(cfg, "rms_norm_eps", name, 1e-5),
            head_dim_override=_count(cfg, "head_dim", name, None),
            description=f"from {name}",
            model_type=model_type,
        )
        spec.check()
        return spec

    def check(self) -> None:
        """Refuse an architecture no model can have (named by its HF config keys), so a bad
        config.json fails here with one paragraph, not with negative sizes or inside a trial."""
        where = f"{self.name}:"
        for field_name, key in _HF_KEYS.items():
            value = getattr(self, field_name)
            if value is None and field_name == "head_dim_override":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(
                    f"{where} {key} is {value!r}; it must be a whole number of at least 1."
                )
        if self.heads % self.kv_heads:
            raise ModelError(
                f"{where} num_attention_heads ({self.heads}) is not a multiple of "
                f"num_key_value_heads ({self.kv_heads}); grouped-query attention shares each "
                "key/value head among the same number of query heads, so the first must be a "
                "multiple of the second."
            )
        if self.head_dim_override is None and self.hidden % self.heads:
            raise ModelError(
                f"{where} hidden_size ({self.hidden}) is not divisible by num_attention_heads "
                f"({self.heads}), so the heads cannot split it. Use a head count that divides "
                "hidden_size, or set head_dim explicitly as the model does."
            )
        for key, value in (("rope_theta", self.rope_theta), ("rms_norm_eps", self.norm_eps)):
            if not (value > 0 and math.isfinite(value)):
                raise ModelError(f"{where} {key} is {value!r}; it must be a positive number.")


# ModelSpec field -> the HF config.json key it is read from (what a user edits).
_HF_KEYS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "max_position": "max_position_embeddings",
    "head_dim_override": "head_dim",
}


_REQUIRED: Any = object()


def _count(cfg: dict[str, Any], key: str, name: str, default: Any = _REQUIRED) -> Any:
    """A whole-number field of a config.json (4096 or 4096.0; `default` when it is missing or
    null), or one paragraph naming it."""
    value = cfg.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(
            f"{name}: {key} is {value!r}; it must be a whole number of at least 1 "
            f'(for example "{key}": {_EXAMPLES.get(key, 8)}).'
        )
    return value


def _number(cfg: dict[str, Any], key: str, name: str, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelError(f"{name}: {key} is {value!r}; it must be a positive number.")
    return float(value)


_EXAMPLES = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 4096,
             "head_dim": 128, "num_key_value_heads": 8}  # fmt: skip


def check_seq_len(spec: ModelSpec, seq_len: int | None) -> None:
    """Warn (an `AutofitWarning`) when `seq_len` is beyond the positions the model was made
    for: the numbers still hold, but the model has not learnt those positions."""
    if seq_len is None or seq_len <= spec.max_position:
        return
    import warnings

    from autofit.checks import AutofitWarning

    warnings.warn(
        f"--seq-len {seq_len} is above {spec.name}'s maximum of {spec.max_position} positions "
        "(max_position_embeddings). autofit plans and measures it anyway (memory and speed do "
        "not depend on it), but the model has not learnt positions beyond its maximum: train at "
        f"most {spec.max_position} tokens per sequence, or extend the context (RoPE scaling) "
        "yourself.",
        AutofitWarning,
        stacklevel=3,
    )


DECODER_LAYER_CLASSES = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer"}
"""HF `model_type` -> its decoder-layer class: the architectures whose parameters and activations
the formulas count exactly. Qwen2 (q/k/v biases) and Qwen3 (q/k norms) differ slightly and are
refused rather than miscounted."""


def _preset(name: str, description: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, description=description, **kw)


# Architecture numbers from each model's published config.json.
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
            "llama-3-8b", "Meta-Llama-3-8B", hidden=4096, layers=32, heads=32, kv_heads=8,
            intermediate=14336, vocab=128256, max_position=8192, rope_theta=500000.0,
        ),
        _preset(
            "llama-3-70b", "Meta-Llama-3-70B", hidden=8192, layers=80, heads=64, kv_heads=8,
            intermediate=28672, vocab=128256, max_position=8192, rope_theta=500000.0,
        ),
        _preset(
            "mistral-7b", "Mistral-7B-v0.1", hidden=4096, layers=32, heads=32, kv_heads=8,
            intermediate=14336, vocab=32000, max_position=32768, model_type="mistral",
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
    )
}  # fmt: skip


def resolve_model(name_or_path: str | ModelSpec) -> ModelSpec:
    """A preset name (case-insensitive), a path to a `config.json`, or a local HF model folder."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    text = str(name_or_path).strip()
    key = text.lower().replace("_", "-")
    if key in PRESETS:
        return PRESETS[key]
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelError(
                f"The folder {text!r} has no config.json. Point --model at a HF model folder "
                "with a config.json, at the config.json itself, or use a preset "
                f"({', '.join(PRESETS)})."
            )
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"Cannot read {path} as a JSON model config: {exc}.") from None
        if not isinstance(data, dict):
            raise ModelError(f"{path} is not a JSON object, so it is not a HF model config.")
        return ModelSpec.from_hf_config(data, name=str(path))
    hits = closest(key, PRESETS)
    hint = f" Closest: {', '.join(hits)}." if hits else ""
    raise ModelError(
        f"Unknown model {text!r}: it is neither a preset nor a path to a config.json or model "
        f"folder.{hint} Presets: {', '.join(PRESETS)} (`autofit models` lists them)."
    )
