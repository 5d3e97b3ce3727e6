"""A model as the numbers of its HF `config.json` (`ModelSpec`), read from the file's keys, and the
families autofit supports (`FAMILIES`). The presets are `autofit.models.presets`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from autofit.errors import ModelError


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer of a supported family, as the numbers of its HF `config.json`.

    The fields are the config keys every family shares (read for the plan's table and checks);
    `extra` holds the family's other config keys verbatim (JSON: sliding windows, soft-capping,
    experts, biases, ...). Parameter counts, roles and activations are not computed here: they
    are read from the model itself, built from this config on the meta device
    (`autofit.arch.structure_of`), so no family needs formulas of its own.
    """

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
    model_type: str = "llama"  # HF `model_type`: the family, a key of FAMILIES
    extra: str = ""  # the family's other config.json keys, as sorted JSON

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def decoder_layer_class(self) -> str:
        """The HF class of this model's decoder layers (what FSDP wraps in an export), read from
        its family (`model_type`), never from its name or path."""
        return self.family.layer_class

    @property
    def extra_config(self) -> dict[str, Any]:
        return json.loads(self.extra) if self.extra else {}

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def experts(self) -> int:
        """Experts per MoE layer (0 for a dense model)."""
        cfg = self.extra_config
        return int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)

    @property
    def experts_per_token(self) -> int:
        return int(self.extra_config.get("num_experts_per_tok") or 0) if self.experts else 0

    # ----- conversions -----------------------------------------------------------------------
    def hf_config_dict(self) -> dict[str, Any]:
        """The HF `config.json` keys of this architecture (family keys from `extra` included)."""
        data: dict[str, Any] = {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tied_embeddings,
        }
        if self.head_dim_override is not None:
            data["head_dim"] = self.head_dim_override
        data.update(self.extra_config)
        return data

    def to_hf_config(self, **overrides: Any) -> Any:
        """The `transformers` config of this architecture (`AutoConfig.for_model`: random init,
        no download). `overrides` replace keys (the one-layer trace builds fewer layers)."""
        from transformers import AutoConfig

        # token ids do not shape the model (and a family's defaults can lie past a tiny
        # debug vocabulary)
        ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        config = AutoConfig.for_model(self.model_type, **{**ids, **self.hf_config_dict(),
                                                          **overrides})  # fmt: skip
        config.use_cache = False  # a KV cache changes state between forward and recompute
        return config

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """The inverse of `to_dict` (or of `asdict`); derived counts such as `n_params` are
        recomputed, not read. A record older than `model_type` is read by
        `autofit.models.spec_from_dict`, which knows the presets' families."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelSpec:
        """Read a HF `config.json` dict of a supported decoder family."""
        model_type = cfg.get("model_type", "llama")
        if model_type in _TEXT_OF and isinstance(cfg.get("text_config"), dict):
            # a multimodal checkpoint (Gemma 3): its language model is the text config
            cfg = {"model_type": _TEXT_OF[model_type], **cfg["text_config"]}
            model_type = cfg["model_type"]
        if model_type not in FAMILIES:
            raise ModelError(
                f"{name}: model_type {model_type!r} is not a decoder family autofit can train "
                "(encoder-decoder, vision-only and unknown architectures are not). Supported "
                f"model_type values: {supported_families()}. Point --model at the config.json "
                "of one of these, or use a preset (`autofit models` lists them)."
            )
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in cfg
        ]
        if missing:
            raise ModelError(
                f"{name}: the config lacks {', '.join(missing)}. autofit reads decoder configs "
                "with hidden_size, num_hidden_layers, num_attention_heads, intermediate_size and "
                "vocab_size."
            )
        hidden = _count(cfg, "hidden_size", name)
        heads = _count(cfg, "num_attention_heads", name)
        extra = {k: v for k, v in cfg.items() if k not in _READ_KEYS and k not in _METADATA_KEYS}
        spec = cls(
            name=name,
            hidden=hidden,
            layers=_count(cfg, "num_hidden_layers", name),
            heads=heads,
            kv_heads=_count(cfg, "num_key_value_heads", name, heads),
            intermediate=_count(cfg, "intermediate_size", name, 4 * hidden),
            vocab=_count(cfg, "vocab_size", name),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", FAMILIES[model_type].tied)),
            max_position=_count(cfg, "max_position_embeddings", name, 4096),
            rope_theta=_number(cfg, "rope_theta", name, 10000.0),
            norm_eps=_number(cfg, "rms_norm_eps", name, 1e-5),
            head_dim_override=_count(cfg, "head_dim", name, None),
            description=f"from {name}",
            model_type=model_type,
            extra=extra_json(extra),
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


@dataclass(frozen=True)
class Family:
    """A decoder family autofit builds, estimates and exports: its HF classes."""

    label: str
    causal_lm_class: str
    layer_class: str
    tied: bool = False  # `tie_word_embeddings` when a config.json leaves it out (HF default)


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 2/3", "LlamaForCausalLM", "LlamaDecoderLayer"),
    "mistral": Family("Mistral", "MistralForCausalLM", "MistralDecoderLayer"),
    "mixtral": Family("Mixtral (MoE)", "MixtralForCausalLM", "MixtralDecoderLayer"),
    "qwen2": Family("Qwen 2/2.5", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
    "qwen3": Family("Qwen 3", "Qwen3ForCausalLM", "Qwen3DecoderLayer"),
    "gemma": Family("Gemma", "GemmaForCausalLM", "GemmaDecoderLayer", tied=True),
    "gemma2": Family("Gemma 2", "Gemma2ForCausalLM", "Gemma2DecoderLayer", tied=True),
    "gemma3_text": Family("Gemma 3 (text)", "Gemma3ForCausalLM", "Gemma3DecoderLayer", tied=True),
    "phi3": Family("Phi-3", "Phi3ForCausalLM", "Phi3DecoderLayer"),
}
"""HF `model_type` -> its family: the decoder architectures autofit trains. A new family is one
line here (its classes, checked against the meta model by tests/test_models.py) and a preset:
parameter counts, roles and activations are read from the model itself (`autofit.arch`)."""

DECODER_LAYER_CLASSES = {t: f.layer_class for t, f in FAMILIES.items()}

_TEXT_OF = {"gemma3": "gemma3_text"}  # multimodal model_type -> its text model's

# config.json keys read into ModelSpec's own fields, and keys that describe a checkpoint rather
# than an architecture (left out of `extra`).
_READ_KEYS = {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings",
              "max_position_embeddings", "rope_theta", "rms_norm_eps", "head_dim"}  # fmt: skip
_METADATA_KEYS = {"architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
                  "_name_or_path", "quantization_config", "use_cache", "bos_token_id",
                  "eos_token_id", "pad_token_id", "initializer_range", "_attn_implementation",
                  "attn_implementation"}  # fmt: skip


def supported_families() -> str:
    return ", ".join(f"{t} ({f.label})" for t, f in FAMILIES.items())


def extra_json(extra: dict[str, Any]) -> str:
    return json.dumps(extra, sort_keys=True) if extra else ""
