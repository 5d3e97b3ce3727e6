"""Knobs, their allowed values, and the rules between them."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from autofit.config import KNOBS, LORA_SETTINGS, Config, coerce_knob
from autofit.errors import ConfigError
from autofit.layout import wrap_units
from autofit.rules import broken_rule, derive_grad_accum


def test_knob_names_are_the_design_contract():
    assert list(KNOBS) == [
        "quant",
        "lora_rank",
        "micro_batch",
        "grad_accum",
        "wrap",
        "shard",
        "reshard",
        "checkpointing",
        "offload",
        "optimizer",
        "precision",
        "loss",
        "compile",
        "batching",
        "seq_len",
    ]
    assert KNOBS["quant"] == ("none", "int8", "nf4")
    assert KNOBS["loss"] == ("standard", "chunked", "fused")
    assert KNOBS["compile"] == (False, True)
    assert KNOBS["checkpointing"] == ("none", "full", "every-2", "selective")


def test_defaults_are_a_plain_full_fine_tune():
    cfg = Config()
    assert (cfg.quant, cfg.lora_rank, cfg.optimizer, cfg.precision) == (
        "none",
        0,
        "adamw",
        "bf16-mixed",
    )
    assert not cfg.is_lora


def test_bad_choice_names_the_knob_and_the_allowed_values():
    with pytest.raises(ConfigError) as info:
        coerce_knob("quant", "fp3")
    text = str(info.value)
    assert "'quant'" in text and "'fp3'" in text and "none, int8, nf4" in text


def test_near_miss_choice_gets_did_you_mean():
    with pytest.raises(ConfigError, match=r"Did you mean 'selective'"):
        coerce_knob("checkpointing", "selectiv")


def test_unknown_knob_gets_did_you_mean_and_the_knob_list():
    with pytest.raises(ConfigError, match=r"Unknown knob 'micro_batches'.*'micro_batch'"):
        coerce_knob("micro_batches", 4)


@pytest.mark.parametrize("value", [-1, 1.5, "abc", True, None, float("nan"), float("inf")])
def test_lora_rank_must_be_a_whole_number_at_least_zero(value):
    with pytest.raises(ConfigError, match=r"'lora_rank'.*whole number from 0 to 4,096"):
        coerce_knob("lora_rank", value)


def test_micro_batch_must_be_positive():
    with pytest.raises(ConfigError, match=r"from 1 to 65,536; got 0"):
        coerce_knob("micro_batch", 0)


def test_integer_knobs_accept_integral_strings_and_floats():
    assert coerce_knob("micro_batch", "8") == 8
    assert coerce_knob("seq_len", 2048.0) == 2048


@pytest.mark.parametrize(("text", "value"), [("true", True), ("No", False), ("1", True)])
def test_reshard_reads_booleans_from_text(text, value):
    assert coerce_knob("reshard", text) is value


def test_reshard_rejects_other_text():
    with pytest.raises(ConfigError, match="true or false"):
        coerce_knob("reshard", "maybe")


def test_choices_are_case_insensitive():
    assert Config(quant="NF4", lora_rank=16).quant == "nf4"


def test_quantization_needs_lora():
    with pytest.raises(ConfigError, match=r"quant=nf4 needs LoRA.*lora_rank > 0"):
        Config(quant="nf4", lora_rank=0)


def test_offload_params_with_int8_is_rejected():
    with pytest.raises(ConfigError, match="offload=params cannot be combined with quant=int8"):
        Config(quant="int8", lora_rank=16, offload="params")


def test_offload_params_needs_sharding():
    with pytest.raises(ConfigError, match="offload=params needs FSDP2"):
        Config(wrap="none", offload="params")


def test_round_trip_through_dict():
    cfg = Config(quant="nf4", lora_rank=64, micro_batch=8, checkpointing="full", lora_alpha=32)
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.alpha == 32
    assert Config(lora_rank=16).alpha == 32  # 2 x rank by default


def test_from_dict_rejects_unknown_keys_naming_the_place():
    with pytest.raises(ConfigError, match=r"Unknown knob 'qaunt' in plan.yaml"):
        Config.from_dict({"qaunt": "nf4"}, where="plan.yaml")


def test_short_label_names_the_departures_from_defaults():
    cfg = Config(quant="nf4", lora_rank=64, micro_batch=8, grad_accum=4, checkpointing="full")
    assert cfg.short() == "nf4 r64 mb8x4 wrap=auto ckpt=full"
    assert cfg.resolved(1).short() == "nf4 r64 mb8x4 wrap=none ckpt=full"
    assert cfg.resolved(2).short() == "nf4 r64 mb8x4 wrap=layer ckpt=full"
    assert Config().short() == "full mb1x1 wrap=auto"


def test_wrap_auto_is_the_plain_module_on_one_gpu_and_fsdp2_on_several():
    from autofit.layout import Sharding, sharding_for

    assert Config().wrap == "auto"
    # torchtune's single-device recipes and HF Trainer on one GPU hold the plain module;
    # torchtitan shards per decoder layer on several
    assert Config().resolved(1).wrap == "none"
    assert Config().resolved(8).wrap == "layer"
    # param offload and HSDP need FSDP2, also on one GPU (answer.ai's one-rank FSDP offload)
    assert Config(offload="params").resolved(1).wrap == "layer"
    assert Config(shard="node").resolved(1).wrap == "layer"
    # an explicit wrap is kept as it is, on any count
    assert Config(wrap="every-2").resolved(1).wrap == "every-2"
    assert Config(wrap="none").resolved(4).wrap == "none"
    # nothing that reads the wrap may see `auto` unresolved
    with pytest.raises(ValueError, match="unresolved"):
        sharding_for("auto", 1)
    assert sharding_for(Config().resolved(1).wrap, 1) is Sharding.NONE


def test_global_batch_divides_into_grad_accum_or_not_at_all():
    assert derive_grad_accum(32, micro_batch=4, dp_size=2) == 4
    assert derive_grad_accum(32, micro_batch=3, dp_size=2) is None
    assert derive_grad_accum(8, micro_batch=16, dp_size=1) is None


def test_wrap_units_group_decoder_layers():
    assert wrap_units("layer", 4) == ((0,), (1,), (2,), (3,))
    assert wrap_units("every-2", 5) == ((0, 1), (2, 3), (4,))
    assert wrap_units("every-4", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert wrap_units("model", 4) == ()
    assert wrap_units("none", 4) == ()


# ----- the LoRA settings: the user's choice, not searched ---------------------------------------
def test_lora_settings_follow_lora_alpha_in_the_config():
    names = [f.name for f in dataclasses.fields(Config)]
    assert LORA_SETTINGS == (
        "lora_alpha", "lora_targets", "lora_dropout", "train_embeddings", "optimizer_impl",
        "quant_backend", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage",
        "launch",
    )  # fmt: skip
    assert names[len(KNOBS) :] == list(LORA_SETTINGS)
    cfg = Config()
    assert cfg.lora_targets is None and cfg.lora_dropout == 0.0  # every projection, no dropout
    assert cfg.train_embeddings == "none"  # embeddings and head frozen


@pytest.mark.parametrize(
    ("given", "targets"),
    [
        (["q_proj", "v_proj"], ("q_proj", "v_proj")),
        ((" q_proj ", "v_proj", "q_proj", ""), ("q_proj", "v_proj")),  # stripped, once, in order
        ("v_proj, q_proj,v_proj", ("v_proj", "q_proj")),  # text is split on commas
        ("qkv_proj", ("qkv_proj",)),
        (["self_attn.q_proj", "mlp.gate_up_proj"], ("self_attn.q_proj", "mlp.gate_up_proj")),
        ("all-linear", None),
        ("ALL", None),
        ([" All-Linear "], None),
        ([], None),
        (None, None),
    ],
)
def test_lora_targets_are_normalised(given, targets):
    assert Config(lora_rank=8, lora_targets=given).lora_targets == targets


@pytest.mark.parametrize(
    "given",
    ["", " , ", ["q_proj", 3], "q proj", "q_proj;v_proj", ["all-linear", "q_proj"], 7, {"q_proj"}],
)
def test_bad_lora_targets_name_the_setting_the_value_and_what_is_allowed(given):
    with pytest.raises(ConfigError) as info:
        Config(lora_rank=8, lora_targets=given)
    text = str(info.value)
    assert "'lora_targets'" in text and repr(given) in text
    assert "q_proj,v_proj" in text and "all-linear" in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("given", "dropout"), [(0, 0.0), (0.05, 0.05), ("0.1", 0.1), (0.999, 0.999)]
)
def test_lora_dropout_is_a_float(given, dropout):
    value = Config(lora_rank=8, lora_dropout=given).lora_dropout
    assert value == dropout and type(value) is float


@pytest.mark.parametrize("given", [1, 1.0, -0.01, "much", True, float("nan"), [0.1]])
def test_bad_lora_dropout_names_the_setting_and_its_range(given):
    with pytest.raises(ConfigError, match=r"'lora_dropout' must be a number >= 0 and < 1"):
        Config(lora_rank=8, lora_dropout=given)


def test_a_bad_lora_alpha_is_a_config_error_not_a_crash():
    with pytest.raises(ConfigError, match=r"'lora_alpha' must be a whole number >= 1; got 'x'"):
        Config(lora_rank=8, lora_alpha="x")
    assert Config(lora_rank=8, lora_alpha="16").lora_alpha == 16


def test_settings_round_trip_through_dict_and_json():
    cfg = Config(lora_rank=16, lora_targets="q_proj,v_proj", lora_dropout=0.05, lora_alpha=8)
    data = cfg.to_dict()
    assert data["lora_targets"] == ["q_proj", "v_proj"] and data["lora_dropout"] == 0.05
    assert Config.from_dict(json.loads(json.dumps(data))) == cfg
    assert Config.from_dict(data) != Config(lora_rank=16, lora_alpha=8)  # settings tell apart
    assert hash(Config.from_dict(data)) == hash(cfg)


def test_default_settings_stay_out_of_the_dict():
    data = Config(lora_rank=16, lora_targets="all-linear", lora_dropout=0).to_dict()
    assert set(data) == set(KNOBS)
    assert Config.from_dict({**data, "lora_targets": None, "lora_dropout": None}).to_dict() == data


def test_from_dict_checks_settings_naming_the_place():
    with pytest.raises(ConfigError, match=r"Setting 'lora_dropout' in plan.yaml must be"):
        Config.from_dict({"lora_rank": 8, "lora_dropout": 1.5}, where="plan.yaml")
    with pytest.raises(ConfigError, match=r"Did you mean 'lora_targets'"):
        Config.from_dict({"lora_target": ["q_proj"]})


def test_short_label_shows_settings_only_when_not_the_default():
    cfg = Config(lora_rank=16, lora_targets=["q_proj", "v_proj"], lora_dropout=0.05)
    assert cfg.short() == "lora r16 mb1x1 wrap=auto targets=q_proj,v_proj drop=0.05"
    assert Config(lora_rank=16).short() == "lora r16 mb1x1 wrap=auto"


# ----- train_embeddings: the embeddings and LM head beside a LoRA base --------------------------
@pytest.mark.parametrize(
    ("given", "value"),
    [
        (None, "none"),
        ("none", "none"),
        (" FULL ", "full"),
        ("tokens:8", "tokens:8"),
        ("Tokens: 08", "tokens:8"),
        ("tokens:1", "tokens:1"),
    ],
)
def test_train_embeddings_is_normalised(given, value):
    assert Config(lora_rank=8, train_embeddings=given).train_embeddings == value


@pytest.mark.parametrize(
    "given",
    ["all", "tokens", "tokens:", "tokens:0", "tokens:-3", "tokens:2.5", "tokens:x", 8, True],
)
def test_bad_train_embeddings_name_the_setting_and_what_is_allowed(given):
    with pytest.raises(ConfigError) as info:
        Config(lora_rank=8, train_embeddings=given)
    text = str(info.value)
    assert "'train_embeddings'" in text and repr(given) in text
    assert "none" in text and "full" in text and "tokens:N" in text
    assert "\n" not in text


@pytest.mark.parametrize("value", ["full", "tokens:4"])
def test_train_embeddings_needs_lora(value):
    with pytest.raises(ConfigError) as info:
        Config(lora_rank=0, train_embeddings=value)
    text = str(info.value)
    assert f"train_embeddings={value}" in text and "lora_rank > 0" in text
    assert "full fine-tune" in text and "train_embeddings=none" in text
    assert broken_rule(Config(lora_rank=8).replace(train_embeddings="none")) is None


def test_train_embeddings_round_trips_and_shows_in_the_label():
    cfg = Config(lora_rank=16, train_embeddings="tokens:3")
    data = cfg.to_dict()
    assert data["train_embeddings"] == "tokens:3"
    assert Config.from_dict(json.loads(json.dumps(data))) == cfg
    assert "train_embeddings" not in Config(lora_rank=16).to_dict()  # the default stays out
    assert cfg.short() == "lora r16 mb1x1 wrap=auto emb=tokens:3"


def _readme_rows(first_header: str) -> list[list[str]]:
    """The rows of README.md's table whose header starts with `| {first_header} |`."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_readmes_knob_and_setting_tables_are_the_declarations():
    # The README's tables are for people, but their names, order and values are the ones
    # declared on `Config` (`autofit.config.DECLARED`): a knob added, renamed or given a new
    # value without its row (or the other way round) fails here.
    from autofit.config import DECLARED

    knobs = _readme_rows("knob")
    assert [row[0].strip("`") for row in knobs] == list(KNOBS)
    for name, values, _ in knobs:
        declared = DECLARED[name.strip("`")]
        if declared.choices is None:
            assert values in ("int", "`0` or r"), (name, values)
        else:
            shown = [v.strip().strip("`") for v in values.split(",")]
            assert shown == [str(v).lower() for v in declared.choices], (name, values)
    settings = _readme_rows("setting")
    assert sorted(row[0].strip("`") for row in settings) == sorted(LORA_SETTINGS)


def test_optimizer_impl_is_a_setting_of_torch_adamw_only():
    # not searched: fused is faster on a GPU and holds no intermediate, so a search could only
    # pick it; foreach and the for-loop describe another launch (HF Trainer's adamw_torch)
    assert "optimizer_impl" not in KNOBS
    cfg = Config(optimizer_impl=" Foreach ")
    assert cfg.optimizer_impl == "foreach"
    assert cfg.short() == "full mb1x1 wrap=auto adamw=foreach"
    assert cfg.to_dict()["optimizer_impl"] == "foreach"
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "optimizer_impl" not in Config().to_dict()  # the default stays out
    with pytest.raises(ConfigError, match="optimizer_impl=for-loop chooses how torch's AdamW"):
        Config(optimizer="adamw8bit", optimizer_impl="for-loop")
    assert Config(optimizer="adamw4bit").optimizer_impl == "auto"
    allowed = "Allowed: auto .* = fused where .*; fused; foreach = .*; for-loop = "
    with pytest.raises(ConfigError, match=allowed):
        Config(optimizer_impl="apex")


def test_quant_backend_and_its_bnb_settings_are_settings_with_rules():
    assert {"quant_backend", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage"} <= set(
        LORA_SETTINGS
    )
    cfg = Config(
        quant="nf4", lora_rank=8, quant_backend=" BitsAndBytes ",
        bnb_4bit_use_double_quant="true", bnb_4bit_quant_storage="BF16",
    )  # fmt: skip
    assert (cfg.quant_backend, cfg.bnb_4bit_use_double_quant) == ("bitsandbytes", True)
    assert cfg.bnb_4bit_quant_storage == "bf16"
    assert cfg.short() == "nf4 r8 mb1x1 wrap=auto bnb dq storage=bf16"
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "quant_backend" not in Config(quant="nf4", lora_rank=8).to_dict()  # default left out
    with pytest.raises(ConfigError, match="stores NF4 weights, but quant=int8"):
        Config(quant="int8", lora_rank=8, quant_backend="bitsandbytes")
    with pytest.raises(ConfigError, match="bnb_4bit_use_double_quant configures bitsandbytes"):
        Config(quant="nf4", lora_rank=8, bnb_4bit_use_double_quant=True)
    with pytest.raises(ConfigError, match="needs wrap=none"):
        Config(quant="nf4", lora_rank=8, quant_backend="bitsandbytes", wrap="layer")
    with pytest.raises(ConfigError, match="compile=true is not measured"):
        Config(quant="nf4", lora_rank=8, quant_backend="bitsandbytes", compile=True)
    with pytest.raises(ConfigError, match="Allowed: torchao .*; bitsandbytes = "):
        Config(quant="nf4", lora_rank=8, quant_backend="bnb")
    with pytest.raises(ConfigError, match=r"Allowed: uint8 \(default\); bf16; fp16; fp32"):
        Config(
            quant="nf4", lora_rank=8, quant_backend="bitsandbytes", bnb_4bit_quant_storage="int4"
        )
    with pytest.raises(ConfigError, match="must be true or false"):
        Config(quant="nf4", lora_rank=8, quant_backend="bitsandbytes", bnb_4bit_use_double_quant=2)


def test_bitsandbytes_on_several_gpus_is_refused_where_auto_becomes_fsdp2():
    from autofit.arguments import config_of
    from autofit.hardware import cpu_hardware
    from autofit.models import resolve_model

    knobs = {"quant": "nf4", "lora_rank": 8, "quant_backend": "bitsandbytes"}
    assert config_of(knobs, resolve_model("llama-debug"), cpu_hardware(1)).wrap == "auto"
    with pytest.raises(ConfigError, match="needs wrap=none"):
        config_of(knobs, resolve_model("llama-debug"), cpu_hardware(2))


def test_launch_is_a_setting_whose_default_stays_out_of_every_config():
    # the launch is the user's (their training script), the same for every candidate: a
    # setting, so plans and estimates of launch=autofit read exactly as before it existed
    assert "launch" not in KNOBS
    assert "launch" not in Config().to_dict()
    cfg = Config(lora_rank=8, launch=" Trainer ")
    assert cfg.launch == "trainer"
    assert cfg.short() == "lora r8 mb1x1 wrap=auto launch=trainer"
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="Setting 'launch' cannot be 'dpo'.*; trl = "):
        Config(launch="dpo")


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"lora_rank": 8, "quant": "nf4"}, "quant=nf4"),
        ({"loss": "chunked"}, "loss=chunked"),
        ({"checkpointing": "selective"}, "checkpointing=selective"),
        ({"offload": "optimizer"}, "offload=optimizer"),
        ({"compile": True}, "compile=true"),
        ({"optimizer": "adamw8bit"}, "optimizer=adamw8bit"),
        ({"optimizer_impl": "for-loop"}, "optimizer_impl=for-loop"),
        ({"wrap": "layer"}, "wrap=layer"),
    ],
)
def test_launch_trainer_refuses_what_trainer_cannot_run(knobs, named) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=f"launch=trainer cannot run {named}"):
        Config(launch="trainer", **knobs)
    Config(launch="autofit", **knobs)  # autofit's own launch runs it


def test_launch_trainer_foreach_is_adamw_torch_torchs_default_step():
    # Trainer's `adamw_torch` passes no `foreach`: torch steps GPU params with its foreach step
    # and CPU params (a CPU trial) with the for-loop; autofit's own builder passes foreach=True
    from autofit.layout import layout_of
    from autofit.recipe import hf_optim

    cfg = Config(launch="trainer", lora_rank=8, optimizer_impl="foreach")
    on_gpu, on_cpu = layout_of(cfg, 1, device="cuda"), layout_of(cfg, 1, device="cpu")
    assert (on_gpu.adamw, on_cpu.adamw) == ("foreach", "for-loop")
    assert layout_of(cfg.replace(launch="autofit"), 1, device="cpu").adamw == "foreach"
    for layout in (on_gpu, on_cpu):  # the export names the same optim for both
        assert hf_optim(cfg.optimizer, layout.adamw, cfg.offload) == "adamw_torch"


def test_launch_trainer_runs_bitsandbytes_qlora_and_refuses_torchaos():
    # a Trainer script's QLoRA: BitsAndBytesConfig NF4, prepare_model_for_kbit_training, peft
    cfg = Config(launch="trainer", lora_rank=8, quant="nf4", quant_backend="bitsandbytes",
                 bnb_4bit_use_double_quant=True, checkpointing="full")  # fmt: skip
    assert cfg.quant == "nf4" and cfg.quant_backend == "bitsandbytes"
    with pytest.raises(ConfigError, match="quant=nf4 with quant_backend=torchao"):
        Config(launch="trainer", lora_rank=8, quant="nf4")
    # a TRL QLoRA script: SFTTrainer turns a quantized model's adapters to bf16 (precision=bf16)
    qlora = {"launch": "trl", "lora_rank": 8, "quant": "nf4", "quant_backend": "bitsandbytes"}
    assert Config(**qlora, precision="bf16").launch == "trl"
    with pytest.raises(ConfigError, match="launch=trl cannot run precision=bf16-mixed with QLoRA"):
        Config(**qlora)


def test_launch_trainer_is_the_plain_module_on_one_gpu_and_ddp_on_several():
    # a Trainer script runs as `python train.py` on one GPU and as `torchrun --nproc-per-node N
    # train.py` on several: DDP replicas (Accelerate's), unless its arguments name FSDP, which
    # autofit does not measure under Trainer yet
    from autofit.layout import Sharding, layout_of
    from autofit.rules import launch_unavailable
    from autofit.space_file import load_space

    assert launch_unavailable("trainer") is None and launch_unavailable("autofit") is None
    assert Config(launch="trainer").resolved(8).wrap == "none"
    assert Config(launch="autofit").resolved(8).wrap == "layer"
    assert layout_of(Config(launch="trainer", lora_rank=8), 2).sharding is Sharding.DDP
    # Trainer's DDP copies each gradient into a bucket; autofit's makes `.grad` a bucket view
    assert not layout_of(Config(launch="trainer"), 2).grad_views
    assert layout_of(Config(wrap="none"), 2).grad_views
    with pytest.raises(ConfigError, match="FSDP2 through Accelerate"):
        Config(launch="trainer", wrap="layer")
    space = load_space("default").with_settings(launch="trainer")
    one, skipped_one = space.candidates(1, seq_len=512)
    assert one and all(c.launch == "trainer" and c.quant == "none" for c in one)
    assert any(reason.startswith("launch=trainer with") for reason in skipped_one)
    two, _ = space.candidates(2, seq_len=512)
    assert two and all(c.resolved(2).wrap == "none" for c in two)


def test_every_word_a_config_takes_is_a_member_of_its_declared_enum():
    """A knob's choices and a word setting's values are their `autofit.values` enum's words, in
    order, and a word setting defaults to the first (what `coerce_setting` gives for None); the
    config keeps plain strings, so its JSON and labels read as users typed them."""
    import autofit.values as v
    from autofit.config import DECLARED
    from autofit.settings import WORD_SETTINGS, coerce_setting

    words = {
        "quant": v.Quant, "wrap": v.Wrap, "shard": v.Shard, "checkpointing": v.Checkpointing,
        "offload": v.Offload, "optimizer": v.Optimizer, "precision": v.Precision,
        "loss": v.Loss, "batching": v.Batching,
    }  # fmt: skip
    for name, enum in words.items():
        assert KNOBS[name] == tuple(m.value for m in enum), name
        assert DECLARED[name].default == KNOBS[name][0], name
    assert set(WORD_SETTINGS) == {"optimizer_impl", "quant_backend", "bnb_4bit_quant_storage",
                                  "launch"}  # fmt: skip
    for name, words in WORD_SETTINGS.items():
        first = next(iter(words.enum))
        assert set(words.meanings) == set(words.enum), name  # a meaning for every word
        assert DECLARED[name].default == first.value == coerce_setting(name, None), name
        assert type(Config().to_dict().get(name, DECLARED[name].default)) is str
    cfg = Config(offload="PARAMS", wrap="layer", optimizer_impl="For-Loop")
    assert cfg.offload == v.Offload.PARAMS and type(cfg.offload) is str
    assert json.loads(json.dumps(cfg.to_dict()))["optimizer_impl"] == "for-loop"


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"lora_rank": 8, "quant": "nf4"}, "quant=nf4"),  # Trainer's rules hold for SFTTrainer
        ({"checkpointing": "every-2"}, "checkpointing=every-2"),
        ({"wrap": "layer"}, "wrap=layer"),
        ({"loss": "chunked"}, "loss=chunked (SFTTrainer computes its own loss"),
        ({"lora_rank": 8, "precision": "bf16"}, "precision=bf16 with LoRA"),
        ({"lora_rank": 8, "train_embeddings": "tokens:4"}, "train_embeddings=tokens:4"),
    ],
)
def test_launch_trl_refuses_what_sfttrainer_cannot_run_as_counted(knobs, named) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=re.escape(f"launch=trl cannot run {named}")):
        Config(launch="trl", **knobs)


def test_launch_trl_packs_where_trainer_cannot():
    # packing is TRL's (SFTTrainer's packing=True): launch=trl runs batching=packed, trainer not
    assert Config(launch="trl", batching="packed", lora_rank=8).batching == "packed"
    Config(launch="trl", precision="bf16")  # a full fine-tune in pure bf16 is Trainer's too
    with pytest.raises(ConfigError, match="launch=trainer cannot run batching=packed"):
        Config(launch="trainer", batching="packed")


def test_launch_trl_needs_trl_installed(monkeypatch):
    import autofit.rules as rules
    from autofit.arguments import check_launch_installed

    assert rules.launch_unavailable("trl") is None  # installed with the dev extra
    monkeypatch.setattr(rules, "trl_installed", lambda: False)
    missing = rules.launch_missing("trl")
    assert missing is not None and "pip install 'autofit[trl]'" in missing
    assert rules.launch_unavailable("trl") == missing.rstrip(".")
    assert rules.launch_missing("trainer") is None
    with pytest.raises(ConfigError, match=r"TRL is not installed here: pip install"):
        check_launch_installed("trl")


def test_every_setting_has_one_check_and_one_sentence():
    """Each declared setting is read and refused through one record (`SETTING_CHECKS`), whose
    sentence names the setting and the value given."""
    from autofit.settings import SETTING_CHECKS, setting_error

    assert set(SETTING_CHECKS) == set(LORA_SETTINGS)
    for name in LORA_SETTINGS:
        bad = 7.5 if name in ("lora_alpha", "bnb_4bit_use_double_quant") else "??"
        sentence = setting_error(name, bad, where="x.yaml")
        assert sentence and f"Setting '{name}' in x.yaml" in sentence and repr(bad) in sentence
