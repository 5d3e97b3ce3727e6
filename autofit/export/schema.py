"""The plan file (the `autofit` export format): the document an export is rendered from (read back
by `autofit.export.loaded.load_plan`, so a training script can `autofit.apply` the winner)."""

from __future__ import annotations

import datetime
from dataclasses import asdict
from pathlib import Path
from typing import Any

from autofit._version import __version__
from autofit.config import Config
from autofit.errors import AutofitError
from autofit.export.plan_file import PlanFile
from autofit.models import ModelSpec
from autofit.recipe import embedding_peft_options
from autofit.settings import ALL_LINEAR
from autofit.values import TrainEmbeddings

FORMATS = ("autofit", "accelerate", "trainer")


def check_format(format: str) -> str:
    """`format` as the exports name it (case and spaces aside), or an error naming the allowed
    ones."""
    fmt = str(format).strip().lower()
    if fmt not in FORMATS:
        from autofit.errors import did_you_mean

        raise AutofitError(
            f"Unknown export format {format!r}.{did_you_mean(fmt, FORMATS)} Allowed formats: "
            f"{', '.join(FORMATS)} (autofit: YAML plan for autofit.load_plan; accelerate: an "
            "Accelerate config file (plain, DDP or FSDP2); trainer: TrainingArguments JSON)."
        )
    return fmt


SCHEMA = 1
MARKER = "written by autofit"
ALLOC_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def plan_document(plan: Any) -> dict[str, Any]:
    """Everything an export needs, as plain data: the `autofit` YAML is this document. A plan read
    back from its file (`autofit.export.loaded.LoadedPlan`) carries the document as written."""
    loaded = getattr(plan, "document", None)
    if isinstance(loaded, dict) and loaded:
        return loaded
    best = plan.best
    if best is None:
        raise AutofitError(
            "This plan has no winner, so there is nothing to export. "
            + (plan.advice or "Widen the space, add GPUs or shorten --seq-len.")
        )
    cfg = best.config
    trial = best.trial
    return PlanFile.written({
        "autofit_plan": SCHEMA,
        "autofit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": plan.model.name,
        "model_spec": asdict(plan.model),
        "decoder_layer": plan.model.decoder_layer_class,
        "hardware": {
            "description": plan.hardware.describe(),
            "n_gpus": plan.hardware.n_gpus,
            "nodes": plan.hardware.nodes,
            "gpus_per_node": plan.hardware.gpus_per_node,
            "capacity_bytes": plan.hardware.capacity_bytes,
            "usable_bytes": int(plan.usable_bytes),
            "device": plan.device,
        },
        "seq_len": plan.seq_len,
        "global_batch": plan.global_batch,
        "margin": plan.margin,
        "config": cfg.to_dict(),
        "label": cfg.short(),
        "measured": best.measured,
        "verified": best.verified,
        "tokens_per_s": best.tokens_per_s,
        "peak_bytes": best.peak_bytes,
        "step_time_s": best.step_time_s,
        "estimate": {
            "peak_bytes": best.estimate.peak_bytes,
            "tokens_per_s": best.estimate.tokens_per_s,
        },
        "trial": trial.to_dict() if trial is not None else None,
        "reason": plan.reason,
        "lora": lora_section(cfg, plan.model) if cfg.is_lora else None,
        "env": dict(ALLOC_ENV) if plan.device != "cpu" else {},  # a CUDA setting: none on CPU
        "study": {"storage": plan.storage, "name": plan.study_name},
        "trials": [
            {
                "label": c.config.short(),
                "status": c.trial.status if c.trial is not None else None,
                "peak_bytes": c.trial.peak_bytes if c.trial is not None else None,
                "tokens_per_s": c.trial.tokens_per_s if c.trial is not None else None,
                "estimated_peak_bytes": c.estimate.peak_bytes,
            }
            for c in plan.trials
        ],
    })  # fmt: skip


def lora_section(cfg: Config, model: ModelSpec | None = None) -> dict[str, Any]:
    """The LoRA part of an export, in peft's `LoraConfig` terms: `target_modules` is the list of
    module names the user chose, or peft's "all-linear" (every linear layer but the output head:
    autofit's default, every linear projection of the decoder blocks). With `train_embeddings`,
    also `modules_to_save` (and `ensure_weight_tying` for a tied head) or
    `trainable_token_indices` of `model`'s vocabulary, as the builder passes them to peft
    (`autofit.recipe.embedding_peft_options`, by the leaf names peft matches)."""
    section: dict[str, Any] = {
        "rank": cfg.lora_rank,
        "alpha": cfg.alpha,
        "dropout": cfg.lora_dropout,
        "target_modules": list(cfg.lora_targets) if cfg.lora_targets is not None else ALL_LINEAR,
    }
    if cfg.train_embeddings != TrainEmbeddings.NONE and model is not None:
        section.update(
            embedding_peft_options(cfg.train_embeddings, model.vocab, model.tied_embeddings)
        )
    return section


def env_text(doc: dict[str, Any]) -> str:
    """The environment the trials ran with, as `K=V ...`; empty for a CPU plan (the CUDA
    allocator setting means nothing there)."""
    if (doc.get("hardware") or {}).get("device") == "cpu":
        return ""
    env = doc.get("env") or ALLOC_ENV
    return " ".join(f"{k}={v}" for k, v in env.items())


def side_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.autofit.yaml")
