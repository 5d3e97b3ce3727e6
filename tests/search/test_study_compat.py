"""Studies written before `PlanRequest` (metadata schema 1) still export and resume.

`study_meta_v1.json` is the metadata the search stored until then (written by that code for the
tiny search of `conftest.py`); a study carrying it must give the same plan as today's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from autofit.cli import app
from autofit.request import PlanRequest
from autofit.search import load_study_plan, search
from autofit.search import study as st

V1 = json.loads(Path(__file__).with_name("study_meta_v1.json").read_text())


def test_request_round_trips_through_its_dict(search_kwargs):
    kw = {k: v for k, v in search_kwargs.items() if k != "seed"}
    request = PlanRequest.of(**kw, global_batch=8, margin=0.1, study="s", storage="sqlite://")
    data = json.loads(json.dumps(request.to_dict()))  # as a study stores it
    assert PlanRequest.from_dict(data) == request


def test_schema_1_metadata_reads_as_a_request(search_kwargs):
    request = PlanRequest.from_dict(V1)
    assert request.model == search_kwargs["model"]
    assert request.space.knobs == search_kwargs["space"].knobs
    assert (request.seq_len, request.global_batch, request.device, request.margin) == (
        64, None, "cpu", 0.05,
    )  # fmt: skip
    assert request.hardware.n_gpus == 2 and request.hardware.smallest_gpu.bf16
    assert request.prune and request.budget.trials == 20  # the defaults: v1 did not store them


def test_a_schema_1_study_exports_and_resumes(fake, search_kwargs, tmp_path):
    plan = search(run_trial=fake, **search_kwargs)
    study = st.load_study(plan.storage, plan.study_name)
    assert study.user_attrs[st.META_KEY]["schema"] == st.SCHEMA
    study.set_user_attr(st.META_KEY, V1)  # as the earlier code left it

    loaded = load_study_plan(plan.storage, plan.study_name)
    assert loaded.best.config == plan.best.config and loaded.best.verified
    assert [c.config for c in loaded.trials] == [c.config for c in plan.trials]

    out = tmp_path / "plan.yaml"
    args = ["export", "--storage", plan.storage, "--study", plan.study_name, "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert out.is_file()

    calls = len(fake.calls)
    again = search(run_trial=fake, **search_kwargs)  # resuming accepts the old metadata
    assert again.best.config == plan.best.config and len(fake.calls) == calls


OLD_DEFAULT_SPACE = """\
seq_len: 2048
knobs:
  quant: [none, int8, nf4]
  lora_rank: [0, 16, 64]
  micro_batch: [1, 2, 4, 8, 16]
  grad_accum: [1]
  wrap: [layer, every-2, model, none]
  reshard: [true, false]
  checkpointing: [none, full, every-2, selective]
  offload: [none, optimizer, params]
  optimizer: [adamw, adamw8bit, adamw4bit]
  precision: [bf16-mixed, bf16]
"""


def test_default_study_names_are_those_the_earlier_release_gave(tmp_path):
    """The same search must find the study it made before: these names are the ones autofit 0.1
    (commit a2f7c96, before specs recorded their family) computed for its default space, which a
    space file of the same knobs still gets (the knobs added since, `loss` and `compile`, left at
    their defaults; the default space now searches them, so its studies have new names)."""
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model
    from autofit.space_file import load_space

    path = tmp_path / "default.yaml"
    path.write_text(OLD_DEFAULT_SPACE)
    hw, space = resolve_hardware("2xrtx3090"), load_space(path)
    names = [
        st.default_study_name(resolve_model(m), hw, space, 2048, 32, "cuda")
        for m in ("llama-7b", "mistral-7b")
    ]
    assert names == [
        "llama-7b-2xnvidia-geforce-rtx-3090-default-s2048-gb32-18889c9f",
        "mistral-7b-2xnvidia-geforce-rtx-3090-default-s2048-gb32-be868c31",
    ]


def test_a_preset_recorded_without_its_family_reads_as_that_family():
    from dataclasses import asdict

    from autofit.models import PRESETS, spec_from_dict

    old = {k: v for k, v in asdict(PRESETS["mistral-7b"]).items() if k != "model_type"}
    assert spec_from_dict(old) == PRESETS["mistral-7b"]
    assert spec_from_dict(old).decoder_layer_class == "MistralDecoderLayer"
