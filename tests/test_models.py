"""Model presets with exact parameter counts, and local HF config.json files."""

from __future__ import annotations

import json

import pytest

from autofit.errors import ModelError
from autofit.models import PRESETS, resolve_model

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


@pytest.mark.parametrize(
    ("name", "n_params"),
    [
        ("llama-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("mistral-7b", 7_241_732_096),
        ("tinyllama-1.1b", 1_100_048_384),
        ("llama-13b", 13_015_864_320),
        ("llama-70b", 68_976_648_192),
        ("llama-3-70b", 70_553_706_496),
    ],
)
def test_preset_parameter_counts_are_exact(name, n_params):
    assert PRESETS[name].n_params == n_params


def test_design_md_model_names_are_presets():
    for name in (
        "llama-7b",
        "llama-13b",
        "llama-70b",
        "llama-3-8b",
        "llama-3-70b",
        "mistral-7b",
        "tinyllama-1.1b",
        "llama-debug",
    ):
        assert resolve_model(name) is PRESETS[name]


def test_llama_debug_is_cpu_sized():
    assert PRESETS["llama-debug"].n_params < 10_000_000


def test_gqa_shrinks_k_and_v_projections():
    shapes = PRESETS["llama-3-8b"].projection_shapes()
    assert shapes["q_proj"] == (4096, 4096)
    assert shapes["k_proj"] == (4096, 1024)  # 8 kv heads x 128
    assert shapes["down_proj"] == (14336, 4096)


def test_parameter_count_by_hand_for_llama_7b():
    h, i, v, n = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    assert PRESETS["llama-7b"].n_params == n * per_layer + 2 * v * h + h


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
    assert spec.n_params == 6_738_415_616
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
    assert resolve_model(str(tmp_path)).n_params == PRESETS["mistral-7b"].n_params


def test_tied_embeddings_have_no_separate_lm_head(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B_CONFIG, "tie_word_embeddings": True}))
    assert resolve_model(str(path)).n_params == 6_738_415_616 - 32000 * 4096


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
    with pytest.raises(ModelError, match=r"model_type 'gpt2' is not supported.*llama, mistral"):
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


def test_unsupported_architectures_are_refused_with_the_supported_list(tmp_path):
    import json

    from autofit.errors import ModelError
    from autofit.models import resolve_model

    path = tmp_path / "config.json"
    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100}  # fmt: skip
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="llama, mistral"):
        resolve_model(str(path))
