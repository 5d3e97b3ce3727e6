"""The space file's JSON schema: written out in docs/, and every space autofit ships obeys it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from autofit.config import KNOBS
from autofit.space_file import SpaceFile, load_space, space_schema

REPO = Path(__file__).resolve().parent.parent
SPACES = sorted(
    [
        *REPO.glob("search_spaces/*.yaml"),
        *REPO.glob("examples/*.yaml"),
        *REPO.glob("tests/**/*space*.yaml"),
    ]
)


def test_docs_schema_is_current():
    written = json.loads((REPO / "docs" / "space.schema.json").read_text())
    assert written == space_schema(), (
        'docs/space.schema.json is stale; rewrite it with: python -c "import json, '
        'autofit.space_file as s; print(json.dumps(s.space_schema(), indent=2))" '
        "> docs/space.schema.json"
    )


def test_schema_lists_every_knob_with_its_choices():
    knobs = space_schema()["$defs"]["SpaceKnobs"]["properties"]
    assert set(knobs) == set(KNOBS) - {"seq_len"}
    for name, allowed in KNOBS.items():
        if name == "seq_len":
            continue
        one = knobs[name]["anyOf"][1]
        if allowed is None:
            assert one["type"] == "integer" and one["minimum"] == (0 if name == "lora_rank" else 1)
        elif all(isinstance(v, bool) for v in allowed):
            assert one["type"] == "boolean"
        else:
            assert one["enum"] == list(allowed)


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.name)
def test_shipped_spaces_obey_the_schema(path):
    data = yaml.safe_load(path.read_text())
    SpaceFile.model_validate(data)  # strict reading: no unknown key, every value allowed
    knobs = space_schema()["$defs"]["SpaceKnobs"]["properties"]
    for name, values in data["knobs"].items():
        item = knobs[name]["anyOf"][0]["items"]
        for v in values if isinstance(values, list) else [values]:
            assert v in item["enum"] if "enum" in item else isinstance(v, int | bool)
    load_space(path)


def test_schema_lists_the_lora_settings_as_single_values():
    from autofit.config import LORA_SETTINGS

    props = space_schema()["properties"]
    assert set(LORA_SETTINGS) <= set(props)
    dropout = props["lora_dropout"]
    assert (dropout["type"], dropout["minimum"], dropout["exclusiveMaximum"]) == ("number", 0, 1)
    targets = [branch.get("type") for branch in props["lora_targets"]["anyOf"]]
    assert targets == ["array", "string", "null"]
    assert props["lora_alpha"]["anyOf"][0] == {"type": "integer", "minimum": 1}
