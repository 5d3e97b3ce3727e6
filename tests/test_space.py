"""Search spaces: the shipped YAML files, validation of user files, enumeration, packaging."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from autofit.config import KNOBS, Config
from autofit.errors import SpaceError
from autofit.space import Space
from autofit.space_file import available_spaces, load_space, parse_space, spaces_dir

REPO = Path(__file__).resolve().parents[1]


def test_shipped_spaces_are_available():
    assert {"default", "qlora", "lora", "full"} <= set(available_spaces())


@pytest.mark.parametrize("name", ["default", "qlora", "lora", "full"])
def test_every_shipped_space_loads_and_enumerates(name):
    space = load_space(name)
    assert space.name == name
    assert set(space.knobs) == set(KNOBS) - {"seq_len"}
    assert space.seq_len == 2048
    configs, skipped = space.candidates(2)
    assert configs
    assert all(isinstance(c, Config) and c.seq_len == 2048 for c in configs)
    assert len(configs) + sum(skipped.values()) == space.size_on(1)


def test_qlora_space_is_all_nf4_lora():
    configs, _ = load_space("qlora").candidates(1)
    assert {c.quant for c in configs} == {"nf4"} and all(c.is_lora for c in configs)


def test_full_space_is_all_full_fine_tunes():
    configs, _ = load_space("full").candidates(1)
    assert all(c.lora_rank == 0 and c.quant == "none" for c in configs)


def test_enumeration_skips_rule_breakers_and_counts_why():
    configs, skipped = load_space("default").candidates(8)
    assert skipped["quant needs LoRA"] > 0
    assert skipped["offload=params with int8"] > 0
    assert skipped["offload=params without sharding"] > 0
    assert not any(c.quant != "none" and c.lora_rank == 0 for c in configs)
    assert len(set(configs)) == len(configs)


def test_enumerated_configs_equal_validated_ones():
    configs, _ = load_space("qlora").candidates(2)
    for cfg in configs[:50]:
        assert Config.from_dict(cfg.to_dict()) == cfg


def test_global_batch_derives_grad_accum():
    configs, skipped = load_space("default").candidates(2, global_batch=32)
    assert configs
    assert all(c.micro_batch * c.grad_accum * 2 == 32 for c in configs)
    configs, skipped = load_space("default").candidates(2, global_batch=6)
    assert all(c.micro_batch in (1,) for c in configs)  # 2 and 4 and 8 do not divide 6 / 2 = 3
    assert skipped["micro_batch x GPUs does not divide global batch"] > 0


def test_seq_len_override_reaches_every_candidate():
    configs, _ = load_space("lora").candidates(1, seq_len=512)
    assert {c.seq_len for c in configs} == {512}


def test_space_from_a_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "seq_len: 1024\nknobs:\n  quant: [nf4]\n  lora_rank: [16, 32]\n  micro_batch: [1, 2]\n"
    )
    space = load_space(str(path))
    assert space.name == "mine" and space.seq_len == 1024
    assert space.knobs["lora_rank"] == (16, 32)
    assert space.knobs["wrap"] == ("auto",)  # unlisted knobs take the Config default
    configs, _ = space.candidates(1)
    assert len(configs) == 4
    assert {c.wrap for c in configs} == {"none"}  # `auto` on one GPU: the plain module
    assert {c.wrap for c in space.candidates(2)[0]} == {"layer"}  # FSDP2 on several


def test_wrap_auto_beside_what_it_resolves_to_makes_no_config_twice():
    """`wrap: [auto, none, layer]` is `[none, layer]`: auto is resolved in each combination of
    the space, so each config comes once and the counts add up."""
    both = parse_space({"knobs": {"wrap": ["auto", "none", "layer"], "offload": ["none", "params"],
                                  "micro_batch": [1, 2]}}, "x")  # fmt: skip
    plain = parse_space({"knobs": {"wrap": ["none", "layer"], "offload": ["none", "params"],
                                   "micro_batch": [1, 2]}}, "x")  # fmt: skip
    for n_gpus in (1, 2):
        configs, skipped = both.candidates(n_gpus)
        assert len(configs) == len(set(configs))
        assert "auto" not in {c.wrap for c in configs}
        expected, expected_skipped = plain.candidates(n_gpus)
        assert set(configs) == set(expected) and len(configs) == len(expected)
        assert skipped == expected_skipped
    # on one GPU: the plain module, and FSDP2 only where param offload needs it (2 x 1 each)
    one = both.candidates(1)[0]
    assert (
        sorted((c.wrap, c.offload) for c in one)
        == [("layer", "params")] * 2 + [("none", "none")] * 2
    )


def test_wrap_auto_counts_only_the_combinations_the_space_lists():
    # the file leaves wrap at its default (auto) and lists two runs: LoRA with and without param
    # offload. On one GPU they are the plain module and FSDP2 (param offload needs it): both
    # valid, nothing skipped, and considered + skipped is the space's size.
    space = parse_space({"knobs": {"lora_rank": [16], "offload": ["none", "params"]}}, "x")
    for n_gpus, wraps in ((1, ["none", "layer"]), (2, ["layer", "layer"])):
        configs, skipped = space.candidates(n_gpus)
        held = [(c.wrap, c.offload) for c in configs]
        assert held == list(zip(wraps, ["none", "params"], strict=True))
        assert not skipped and len(configs) == space.size_on(1) == 2


def test_scalar_knob_values_are_one_element_lists(tmp_path):
    space = parse_space({"knobs": {"quant": "nf4", "lora_rank": 8}}, "inline")
    assert space.knobs["quant"] == ("nf4",) and space.knobs["lora_rank"] == (8,)


def test_malformed_yaml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("knobs:\n  quant: [none, nf4\n  lora_rank: [0]\n")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    text = str(info.value)
    assert str(path) in text and "not valid YAML" in text and "line" in text


def test_unknown_knob_names_the_file_the_key_and_the_knobs(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("knobs:\n  quantization: [nf4]\n")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    text = str(info.value)
    assert str(path) in text and "'quantization'" in text
    assert "Did you mean 'quant'" in text and "lora_rank" in text


def test_bad_value_names_the_file_the_key_and_the_allowed_values(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("knobs:\n  quant: [none, fp3]\n")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    text = str(info.value)
    assert str(path) in text and "'quant'" in text and "'fp3'" in text
    assert "none, int8, nf4" in text


def test_bad_integer_value_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("knobs:\n  micro_batch: [1, two]\n")
    with pytest.raises(SpaceError, match=r"'micro_batch' in .*bad.yaml must be a whole number"):
        load_space(str(path))


def test_infinite_integer_value_is_rejected_not_a_crash(tmp_path):
    path = tmp_path / "inf.yaml"
    path.write_text("knobs:\n  micro_batch: [.inf]\n")
    with pytest.raises(SpaceError, match="whole number"):
        load_space(str(path))


def test_empty_value_list_is_rejected(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("knobs:\n  wrap: []\n")
    with pytest.raises(SpaceError, match=r"empty.yaml: knob 'wrap' has an empty list"):
        load_space(str(path))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("- just\n- a list\n", "expected a mapping with a `knobs:`"),
        ("knobs: [quant]\n", "expected a mapping with a `knobs:`"),
        ("knobs: {quant: [none]}\nextras: 1\n", "unknown top-level key 'extras'"),
        ("knobs: {quant: [none]}\nseq_len: 0\n", "'seq_len'.*from 1 to 16,777,216"),
        ("knobs: {seq_len: [1024]}\n", "seq_len is a top-level key"),
    ],
)
def test_structural_mistakes_are_explained(tmp_path, text, pattern):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpaceError, match=pattern):
        load_space(str(path))


# ----- the LoRA settings: top-level keys, one value each, carried by every candidate -------------
LORA_SPACE = "knobs:\n  lora_rank: [0, 8, 16]\n  micro_batch: [1, 2]\n"


def test_space_file_lora_targets_reach_every_candidate(tmp_path):
    path = tmp_path / "targets.yaml"
    path.write_text(LORA_SPACE + "lora_targets: [q_proj, v_proj]\nlora_dropout: 0.05\n")
    space = load_space(str(path))
    assert space.settings == {"lora_targets": ("q_proj", "v_proj"), "lora_dropout": 0.05}
    configs, _ = space.candidates(1)
    assert len(configs) == 6
    assert {(c.lora_targets, c.lora_dropout, c.lora_alpha) for c in configs} == {
        (("q_proj", "v_proj"), 0.05, None)
    }
    for cfg in configs:  # as a validated Config reads them
        assert Config.from_dict(cfg.to_dict()) == cfg
    assert configs[-1].short() == "lora r16 mb2x1 wrap=none targets=q_proj,v_proj drop=0.05"


def test_space_file_train_embeddings_reach_the_lora_candidates(tmp_path):
    path = tmp_path / "embeddings.yaml"
    path.write_text(LORA_SPACE + "train_embeddings: Tokens:8\n")
    space = load_space(str(path))
    assert space.settings == {"train_embeddings": "tokens:8"}
    configs, skipped = space.candidates(1)
    # the full fine-tunes (lora_rank 0) train the embeddings already: skipped, saying why
    assert skipped["train_embeddings needs LoRA"] == 2
    assert len(configs) == 4 and {c.lora_rank for c in configs} == {8, 16}
    assert {c.train_embeddings for c in configs} == {"tokens:8"}
    for cfg in configs:  # as a validated Config reads them
        assert Config.from_dict(cfg.to_dict()) == cfg
    data = json.loads(json.dumps(space.to_dict()))  # as a study stores it
    assert data["settings"] == {"train_embeddings": "tokens:8"}
    assert Space.from_dict(data).settings == space.settings
    assert space.with_settings(train_embeddings="none").settings == {}


def test_space_file_optimizer_impl_reaches_torch_adamw_and_skips_torchaos(tmp_path):
    path = tmp_path / "foreach.yaml"
    path.write_text("knobs:\n  optimizer: [adamw, adamw8bit]\n  micro_batch: [1, 2]\n"
                    "optimizer_impl: Foreach\n")  # fmt: skip
    space = load_space(str(path))
    assert space.settings == {"optimizer_impl": "foreach"}
    configs, skipped = space.candidates(1)
    # torchao's low-bit AdamW has one step of its own: those candidates are skipped, saying why
    assert skipped["optimizer_impl without torch AdamW"] == 2
    assert {(c.optimizer, c.optimizer_impl) for c in configs} == {("adamw", "foreach")}
    data = json.loads(json.dumps(space.to_dict()))  # as a study stores it
    assert Space.from_dict(data).settings == {"optimizer_impl": "foreach"}
    with pytest.raises(SpaceError, match="'optimizer_impl'.*'apex'"):
        parse_space({"knobs": {}, "optimizer_impl": "apex"}, "bad.yaml")


def test_space_file_settings_may_be_text_and_name_alpha(tmp_path):
    text = LORA_SPACE + "lora_targets: self_attn.q_proj, self_attn.v_proj\nlora_alpha: 32\n"
    space = parse_space(yaml.safe_load(text), "inline")
    configs, _ = space.candidates(1)
    assert {(c.lora_targets, c.lora_alpha) for c in configs} == {
        (("self_attn.q_proj", "self_attn.v_proj"), 32)
    }


def test_space_without_settings_has_the_defaults(tmp_path):
    space = parse_space(yaml.safe_load(LORA_SPACE + "lora_targets: all-linear\n"), "inline")
    assert space.settings == {} and "settings" not in space.to_dict()
    configs, _ = space.candidates(1)
    assert all(c.lora_targets is None and c.lora_dropout == 0.0 for c in configs)


def test_space_settings_round_trip_through_its_dict():
    space = parse_space(yaml.safe_load(LORA_SPACE + "lora_targets: [v_proj]\n"), "inline")
    data = json.loads(json.dumps(space.to_dict()))  # as a study stores it
    assert data["settings"] == {"lora_targets": ["v_proj"]}
    again = Space.from_dict(data)
    assert again == space and again.candidates(1) == space.candidates(1)


def test_given_settings_replace_the_space_files():
    space = parse_space(
        yaml.safe_load(LORA_SPACE + "lora_targets: [v_proj]\nlora_dropout: 0.1\n"), "inline"
    )
    assert space.with_settings(lora_targets="q_proj").settings == {
        "lora_targets": ("q_proj",),
        "lora_dropout": 0.1,
    }
    assert space.with_settings(lora_targets="all-linear", lora_dropout=0).settings == {}
    assert space.settings == {"lora_targets": ("v_proj",), "lora_dropout": 0.1}  # unchanged


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("lora_dropout: 1.5\n", ["Setting 'lora_dropout' in", ">= 0 and < 1", "got 1.5"]),
        ("lora_dropout: lots\n", ["Setting 'lora_dropout' in", "got 'lots'"]),
        ("train_embeddings: tokens:0\n", ["'train_embeddings' in", "'tokens:0'", "tokens:N"]),
        ("train_embeddings: 8\n", ["'train_embeddings' in", "cannot be 8", "full"]),
        ("lora_targets: [q proj]\n", ["'lora_targets' in", "'q proj'", "q_proj,v_proj"]),
        ("lora_targets: {q: 1}\n", ["'lora_targets' in", "all-linear"]),
        ("lora_alpha: 0\n", ["Setting 'lora_alpha' in", "whole number >= 1"]),
        ("lora_dropuot: 0.1\n", ["unknown top-level key 'lora_dropuot'", "'lora_dropout'"]),
    ],
)
def test_bad_settings_in_a_space_file_name_the_file_and_the_setting(tmp_path, text, fragments):
    path = tmp_path / "s.yaml"
    path.write_text(LORA_SPACE + text)
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_a_setting_under_knobs_is_pointed_to_the_top_level(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("knobs:\n  lora_rank: [8]\n  lora_targets: [q_proj]\n")
    with pytest.raises(SpaceError, match=r"lora_targets is a top-level key, not a knob"):
        load_space(str(path))


def test_unknown_space_name_lists_the_shipped_ones():
    with pytest.raises(SpaceError, match=r"Unknown search space 'qlroa'.*Did you mean 'qlora'"):
        load_space("qlroa")


def test_missing_yaml_path_is_explained(tmp_path):
    with pytest.raises(SpaceError, match="does not exist"):
        load_space(str(tmp_path / "nope.yaml"))


def test_source_tree_uses_the_repository_spaces():
    assert spaces_dir() in (REPO / "search_spaces", REPO / "autofit" / "_search_spaces")


def _build_wheel(out: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)]
    try:
        import hatchling  # noqa: F401

        pip.insert(5, "--no-build-isolation")  # no network needed
    except ImportError:
        pass
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    wheels = list(out.glob("autofit-*.whl"))
    if proc.returncode != 0 or not wheels:
        if "hatchling" in proc.stdout + proc.stderr:
            pytest.skip("cannot build a wheel here: hatchling is not available offline")
        raise AssertionError(proc.stdout + proc.stderr)
    return wheels[0]


@pytest.mark.slow
def test_spaces_load_from_a_non_editable_install(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for space in ("default", "qlora", "lora", "full"):
            assert f"autofit/_search_spaces/{space}.yaml" in names
        site = tmp_path / "site"
        zf.extractall(site)
    assert not (site / "search_spaces").exists()
    # import the unpacked wheel (not the editable checkout) in a fresh interpreter
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import autofit, autofit.space_file as s;"
        "assert autofit.__file__.startswith(sys.argv[1]), autofit.__file__;"
        "print(s.spaces_dir()); print(','.join(s.available_spaces()));"
        "print(len(s.load_space('default').candidates(2)[0]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    where, names, count = proc.stdout.split()
    assert Path(where) == site / "autofit" / "_search_spaces"
    assert set(names.split(",")) >= {"default", "qlora", "lora", "full"}
    assert int(count) > 0
    shutil.rmtree(site)
