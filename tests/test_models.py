"""Model presets with exact parameter counts, and local HF config.json files."""

from __future__ import annotations

import json

import pytest

from autofit.arch import structure_of
from autofit.errors import ModelError
from autofit.models import FAMILIES, PRESETS, resolve_model

LLAMA2_7B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}


def n_params(spec_or_name):  # type: ignore[no-untyped-def]
    spec = PRESETS[spec_or_name] if isinstance(spec_or_name, str) else spec_or_name
    return structure_of(spec).n_params


# Published parameter counts: the model cards' totals, checked by building each HF model on
# the meta device (issue 10's table) and by hand for Llama-2-7B below.
PUBLISHED = {
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize(("name", "count"), sorted(PUBLISHED.items()))
def test_preset_parameter_counts_are_exact(name, count):
    assert n_params(name) == count


def test_every_family_has_a_tiny_debug_preset_and_its_classes_are_hfs():
    """FAMILIES names the HF classes; the meta model built from each debug preset is of them."""
    from autofit.builder.model import build_meta_model, decoder_layers

    debug = {"llama": "llama-debug", "qwen2": "qwen2-debug", "qwen3": "qwen3-debug",
             "gemma2": "gemma2-debug", "gemma3_text": "gemma3-debug", "phi3": "phi3-debug",
             "mixtral": "mixtral-debug", "mistral": None, "gemma": None}  # fmt: skip
    for model_type, name in debug.items():
        if name is None:
            continue
        spec = PRESETS[name]
        assert spec.model_type == model_type
        model = build_meta_model(spec)
        assert type(model).__name__ == FAMILIES[model_type].causal_lm_class
        assert type(decoder_layers(model)[0]).__name__ == FAMILIES[model_type].layer_class
        assert n_params(spec) < 5_000_000


def test_roles_of_each_family_are_read_from_its_structure():
    """What differs between families is read, not assumed: Qwen2's q/k/v biases, Qwen3's q/k
    norms, Gemma 2's four norms per layer, Phi-3's fused projections, Mixtral's router and
    experts (counted by hand from the published configs)."""
    qwen = structure_of(PRESETS["qwen2.5-7b"])
    assert qwen.layer_bias_params == 3584 + 2 * 512  # q, k, v biases
    qwen3 = structure_of(PRESETS["qwen3-8b"])
    assert qwen3.layer_norm_params == 2 * 4096 + 2 * 128  # two RMSNorms + q_norm, k_norm
    gemma = structure_of(PRESETS["gemma-2-9b"])
    assert gemma.layer_norm_params == 4 * 3584 and gemma.tied_embeddings
    phi = structure_of(PRESETS["phi-3-mini"])
    assert [p.leaf for p in phi.projections] == ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"]
    assert phi.projections[1].out_features == 3 * 3072
    mixtral = structure_of(PRESETS["mixtral-8x7b"])
    assert mixtral.layer_expert_params == 8 * 3 * 4096 * 14336  # every expert resident
    assert mixtral.layer_router_params == 8 * 4096
    assert [p.leaf for p in mixtral.projections] == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_the_model_names_the_readme_lists_are_presets():
    for name in (
        "llama-7b", "llama-13b", "llama-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-8b",
        "llama-3.2-1b", "qwen2.5-7b", "qwen3-8b", "gemma-2-9b", "phi-3-mini", "mistral-7b",
        "mixtral-8x7b", "tinyllama-1.1b", "llama-debug",
    ):  # fmt: skip
        assert resolve_model(name) is PRESETS[name]


def test_llama_debug_is_cpu_sized():
    assert n_params("llama-debug") < 10_000_000


def test_gqa_shrinks_k_and_v_projections():
    shapes = {p.leaf: (p.in_features, p.out_features)
              for p in structure_of(PRESETS["llama-3-8b"]).projections}  # fmt: skip
    assert shapes["q_proj"] == (4096, 4096)
    assert shapes["k_proj"] == (4096, 1024)  # 8 kv heads x 128
    assert shapes["down_proj"] == (14336, 4096)


def test_parameter_count_by_hand_for_llama_7b():
    h, i, v, n = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    assert n_params("llama-7b") == n * per_layer + 2 * v * h + h


def test_names_are_case_and_underscore_insensitive():
    assert resolve_model("Llama_7B") is PRESETS["llama-7b"]


def test_unknown_model_lists_the_closest_names():
    with pytest.raises(ModelError) as info:
        resolve_model("llama-7")
    text = str(info.value)
    assert "Unknown model 'llama-7'" in text
    assert "Closest: llama-7b" in text
    assert "autofit models" in text


def test_local_config_json_loads_with_exact_counts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B_CONFIG))
    spec = resolve_model(str(path))
    assert n_params(spec) == 6_738_415_616
    assert spec.name == str(path)


def test_local_model_folder_loads_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                **LLAMA2_7B_CONFIG,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "model_type": "mistral",
            }
        )
    )
    assert n_params(resolve_model(str(tmp_path))) == n_params("mistral-7b")


def test_tied_embeddings_have_no_separate_lm_head(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B_CONFIG, "tie_word_embeddings": True}))
    assert n_params(resolve_model(str(path))) == 6_738_415_616 - 32000 * 4096


def test_missing_kv_heads_default_to_heads(tmp_path):
    cfg = {k: v for k, v in LLAMA2_7B_CONFIG.items() if k != "num_key_value_heads"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert resolve_model(str(path)).kv_heads == 32


def test_malformed_json_is_a_clear_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,')
    with pytest.raises(ModelError, match=r"Cannot read .*config.json as a JSON model config"):
        resolve_model(str(path))


def test_json_that_is_not_an_object_is_rejected(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(ModelError, match="not a JSON object"):
        resolve_model(str(path))


def test_config_missing_required_keys_names_them(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(ModelError, match=r"lacks num_hidden_layers, num_attention_heads"):
        resolve_model(str(path))


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B_CONFIG, "model_type": "gpt2"}))
    with pytest.raises(ModelError, match=r"model_type 'gpt2' is not a decoder family.*llama"):
        resolve_model(str(path))


def test_folder_without_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_hf_config_round_trip_keeps_the_architecture():
    spec = PRESETS["llama-debug"]
    cfg = spec.to_hf_config()
    assert cfg.num_key_value_heads == spec.kv_heads
    assert cfg.intermediate_size == spec.intermediate
    assert cfg.vocab_size == spec.vocab


def test_encoder_decoder_and_vision_configs_are_refused_naming_the_families(tmp_path):
    for model_type in ("t5", "vit", "bert"):
        path = tmp_path / f"{model_type}.json"
        cfg = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 100}  # fmt: skip
        path.write_text(json.dumps(cfg))
        with pytest.raises(ModelError) as info:
            resolve_model(str(path))
        text = str(info.value)
        assert f"model_type {model_type!r}" in text
        for family in ("qwen2", "qwen3", "gemma2", "phi3", "mixtral"):
            assert family in text


def test_a_local_config_of_each_new_family_is_read_and_counted_exactly(tmp_path):
    """A Qwen2.5-0.5B config.json (as published, metadata included) reads to the same count."""
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
           "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
           "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
           "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
           "sliding_window": 32768, "use_sliding_window": False, "torch_dtype": "bfloat16",
           "bos_token_id": 151643, "eos_token_id": 151643}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(path))
    assert spec.model_type == "qwen2"
    assert n_params(spec) == PUBLISHED["qwen2.5-0.5b"]


def test_a_gemma3_multimodal_config_reads_its_text_model(tmp_path):
    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "vocab_size": 512}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    spec = resolve_model(str(path))
    assert spec.model_type == "gemma3_text" and spec.hidden == 64
