"""Model architectures as numbers: a registry of presets and local HF `config.json` files.

Nothing here downloads anything or imports torch. A preset is the config of a decoder of a
supported family (`FAMILIES`); the trial builds the real model from it with random weights
(`to_hf_config`), and `autofit.arch` reads parameter counts and activations from that same model
built on the meta device. `spec.py` reads a config, `presets.py` holds the presets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autofit.errors import ModelError, closest
from autofit.models.presets import PRESETS
from autofit.models.spec import (
    DECODER_LAYER_CLASSES,
    FAMILIES,
    Family,
    ModelSpec,
    check_seq_len,
    supported_families,
)

__all__ = [
    "DECODER_LAYER_CLASSES", "FAMILIES", "PRESETS", "Family", "ModelSpec", "check_seq_len",
    "resolve_model", "spec_from_dict", "supported_families",
]  # fmt: skip


def spec_from_dict(data: dict[str, Any]) -> ModelSpec:
    """`ModelSpec.from_dict`, also for a record made before specs named their family (a study's
    request of an earlier version): a preset's family is its preset's."""
    if "model_type" not in data and data.get("name") in PRESETS:
        data = {**data, "model_type": PRESETS[data["name"]].model_type}
    return ModelSpec.from_dict(data)


def resolve_model(name_or_path: str | ModelSpec) -> ModelSpec:
    """A preset name (case-insensitive), a path to a `config.json`, or a local HF model folder."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    text = str(name_or_path).strip()
    if not text:  # Path("") is the working folder: never what an empty name meant
        raise ModelError(
            f"The model name is empty ({str(name_or_path)!r}). --model takes a preset name "
            f"(e.g. {next(iter(PRESETS))}; `autofit models` lists them all) or the path of a HF "
            "config.json or model folder."
        )
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
        from autofit.files import too_large

        if why := too_large(path):
            raise ModelError(f"{path} cannot be a HF model config: {why}.")
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
