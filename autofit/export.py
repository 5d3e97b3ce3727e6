"""The winner as files other tools read: an `autofit` YAML plan, an Accelerate config, or
`transformers.TrainingArguments` JSON, each for the path the trials measured: the plain module on
one GPU (`distributed_type: NO`), DDP replicas (`MULTI_GPU`) or FSDP2 laid out as torchtitan
(`FSDP`, `fsdp_version: 2`), as `autofit.config.sharding_for(wrap, n_gpus)` decides; across nodes
with `shard: node`, HSDP on the mesh of `autofit.config.mesh_shape` (Accelerate's
`parallelism_config`). `launch_lines` is the one rule for the commands that start training: one
line on one node; on several, torchrun with c10d rendezvous on each node and the `srun` line that
starts it on every node of a SLURM job.

Every format is rendered in full and parsed back before anything touches the disk; the file is
then written to a temporary name in the same folder and moved into place (`os.replace`), so a
crash never leaves half a file. An existing file is replaced only when autofit wrote it. What a
format cannot say (quantization, LoRA, the allocator setting) goes into comments, and the
`accelerate` and `trainer` exports come with a side file `<name>.autofit.yaml`: the full plan,
which `autofit.load_plan` reads so the training script can `autofit.apply` the rest.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autofit._version import __version__
from autofit.config import (
    ALL_LINEAR,
    Config,
    Sharding,
    fp32_trainable,
    mesh_shape,
    sharding_for,
    trained_token_count,
    wrap_group_size,
)
from autofit.errors import AutofitError
from autofit.models import ModelSpec
from autofit.recipe import embedding_peft_options, trained_embedding_modules, trained_token_ids

FORMATS = ("autofit", "accelerate", "trainer")
SCHEMA = 1
MARKER = "written by autofit"
ALLOC_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
TORCHAO_OPTIM = {"adamw8bit": "adamw_torch_8bit", "adamw4bit": "adamw_torch_4bit"}


# ----- the plan document (the `autofit` format) ---------------------------------------------------
def plan_document(plan: Any) -> dict[str, Any]:
    """Everything an export needs, as plain data: the `autofit` YAML is this document."""
    if isinstance(plan, LoadedPlan):
        return plan.document
    best = plan.best
    if best is None:
        raise AutofitError(
            "This plan has no winner, so there is nothing to export. "
            + (plan.advice or "Widen the space, add GPUs or shorten --seq-len.")
        )
    cfg = best.config
    trial = best.trial
    return {
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
    }


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
    if cfg.train_embeddings != "none" and model is not None:
        section.update(
            embedding_peft_options(cfg.train_embeddings, model.vocab, model.tied_embeddings)
        )
    return section


@dataclass
class LoadedBest:
    config: Config
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    step_time_s: float | None = None
    measured: bool = False
    verified: bool = False


@dataclass
class LoadedPlan:
    """A plan read back from an `autofit` YAML: `.best.config` is what to `autofit.apply`."""

    best: LoadedBest
    model: str
    seq_len: int
    global_batch: int | None
    n_gpus: int
    env: dict[str, str]
    reason: str
    path: Path
    document: dict[str, Any] = field(repr=False, default_factory=dict)

    def export(self, format: str, path: str | Path) -> list[Path]:
        return export_plan(self, format, path)


def load_plan(path: str | Path) -> LoadedPlan:
    """Read an `autofit` plan YAML (from `--export PATH --format autofit`, or the side file
    `<name>.autofit.yaml` of the other formats)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise AutofitError(
            f"No plan file at {str(p)!r}. Write one with `autofit plan ... --export plan.yaml` "
            "or `autofit export --storage URL --study NAME --format autofit --output plan.yaml`."
        )
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise AutofitError(f"{p}: not a readable YAML plan ({exc}).") from None
    if not isinstance(data, dict) or "autofit_plan" not in data:
        raise AutofitError(
            f"{p} is not an autofit plan (no `autofit_plan:` key). Pass the file written by "
            "`--format autofit`, or the `.autofit.yaml` file next to an accelerate/trainer export."
        )
    if not isinstance(data.get("config"), dict):
        raise AutofitError(f"{p}: the plan has no `config:` mapping with the winner's knobs.")
    config = Config.from_dict(data["config"], where=str(p))  # ConfigError names the bad knob
    best = LoadedBest(
        config=config,
        tokens_per_s=data.get("tokens_per_s"),
        peak_bytes=data.get("peak_bytes"),
        step_time_s=data.get("step_time_s"),
        measured=bool(data.get("measured")),
        verified=bool(data.get("verified")),
    )
    hw = data.get("hardware") or {}
    return LoadedPlan(
        best=best,
        model=str(data.get("model", "")),
        seq_len=int(data.get("seq_len") or config.seq_len),
        global_batch=data.get("global_batch"),
        n_gpus=int(hw.get("n_gpus") or 1),
        env=dict(data["env"] if data.get("env") is not None else ALLOC_ENV),
        reason=str(data.get("reason", "")),
        path=p,
        document=data,
    )


# ----- renderers ---------------------------------------------------------------------------------
def plan_sharding(doc: dict[str, Any]) -> Sharding:
    """How the measured run held the model: the plain module, DDP or FSDP2 (`sharding_for`)."""
    return sharding_for(doc["config"]["wrap"], int(doc["hardware"]["n_gpus"]))


def plan_nodes(doc: dict[str, Any]) -> tuple[int, int]:
    """(nodes, GPUs per node) of the plan's hardware (one node for a plan written before nodes)."""
    hw = doc["hardware"]
    n = int(hw["n_gpus"])
    nodes = max(int(hw.get("nodes") or 1), 1)
    return nodes, int(hw.get("gpus_per_node") or n // nodes)


def plan_mesh(doc: dict[str, Any]) -> tuple[int, int] | None:
    """The FSDP2 mesh the run builds, (replicas, shard degree) by `mesh_shape`; None when the
    plan is not FSDP2."""
    if plan_sharding(doc) is not Sharding.FSDP2:
        return None
    nodes, per_node = plan_nodes(doc)
    return mesh_shape(doc["config"].get("shard", "all"), int(doc["hardware"]["n_gpus"]), per_node)


def path_title(doc: dict[str, Any]) -> str:
    mesh = plan_mesh(doc)
    if mesh is not None and mesh[0] > 1:
        return "HSDP"
    return {Sharding.NONE: "one GPU, plain module", Sharding.DDP: "DDP", Sharding.FSDP2: "FSDP2"}[
        plan_sharding(doc)
    ]


def measured_path(doc: dict[str, Any]) -> list[str]:
    """Comment lines naming the path the trials measured, which `autofit.apply` builds."""
    cfg = doc["config"]
    n = int(doc["hardware"]["n_gpus"])
    nodes, per_node = plan_nodes(doc)
    gpus = f"{n} GPUs ({nodes} nodes x {per_node})" if nodes > 1 else f"{n} GPUs"
    sharding = plan_sharding(doc)
    mixed = fp32_trainable(cfg["precision"], cfg.get("optimizer", "adamw"))
    if sharding is Sharding.NONE:
        lines = [
            "# Measured path: the plain module on one GPU (no DDP, no FSDP), "
            + ("fp32 trainable params under bf16 autocast." if mixed else "all in bf16.")
        ]
    elif sharding is Sharding.DDP:
        lines = [
            f"# Measured path: PyTorch DDP replicas on {gpus}, gradients all-reduced from DDP's "
            "buckets (gradient_as_bucket_view)."
        ]
        if cfg.get("lora_rank", 0):
            lines.append(
                "# The frozen (quantized) base is held whole on each GPU, left out of DDP."
            )
        if mixed:
            lines.append("# fp32 trainable params under bf16 autocast.")
    else:
        spec = doc.get("model_spec") or {}
        k = wrap_group_size(cfg["wrap"], int(spec.get("layers") or 0))
        layers = "each decoder layer" if k == 1 else f"each group of {k} decoder layers"
        if spec.get("tied_embeddings"):
            units = (
                "one root unit holds everything (tied embeddings and LM head included)"
                if cfg["wrap"] == "model"
                else f"units of {layers}; the tied embeddings and LM head stay in the root unit"
            )
        elif cfg["wrap"] == "model":
            units = "units of the token embeddings and [final norm, LM head]; the root unit holds "
            units += "the decoder layers"
        else:
            units = f"units of the token embeddings, {layers} and [final norm, LM head]; the root "
            units += "unit holds the rest"
        replicas, shards = plan_mesh(doc) or (1, n)
        if replicas > 1:
            lines = [
                f"# Measured path: HSDP, FSDP2 on a 2-D (dp_replicate, dp_shard) mesh of {gpus}: "
                f"each parameter sharded over the {shards} GPU{'s' if shards > 1 else ''} of a "
                f"node and replicated on each of the {replicas} nodes (gradients reduce-scattered "
                f"in a node, then all-reduced across nodes), laid out as torchtitan: {units}."
            ]
        else:
            where = f"{n} GPU{'s' if n > 1 else ''}" if nodes == 1 else gpus
            lines = [f"# Measured path: FSDP2 on {where} laid out as torchtitan: {units}."]
        extra = []
        if cfg.get("train_embeddings", "none") == "full":
            extra.append(
                "The frozen originals beside the trainable embedding and head copies are a unit "
                "of their own, never gathered"
            )
        if cfg["offload"] == "params":
            extra.append("Params offloaded to CPU (CPUOffloadPolicy)")
        if mixed:
            extra.append("fp32 trainable params, gathered in bf16 (MixedPrecisionPolicy)")
        if extra:
            lines.append(f"# {'; '.join(extra)}.")
    lines.append(
        "# autofit.apply(model, plan.best.config) builds exactly this layout, with the "
        "quantization, LoRA, checkpointing and optimizer measured."
    )
    return lines


def _header(doc: dict[str, Any], what: str) -> list[str]:
    cfg = doc["config"]
    lines = [
        f"# {what}, {MARKER} {doc.get('autofit_version', __version__)} for {doc['model']} on "
        f"{doc['hardware']['description']}.",
        f"# Winner: {doc.get('label', '')}; {doc.get('reason', '')}".rstrip(),
        *measured_path(doc),
    ]
    if _env_text(doc):  # CUDA allocator settings; none for a CPU plan
        lines.append(f"# Trials ran with {_env_text(doc)}: set it for your run too.")
    if cfg.get("quant", "none") != "none":
        lines.append(f"# Base weights quantized to {cfg['quant']} (torchao), frozen.")
    if cfg.get("lora_rank", 0):
        lora = doc.get("lora") or {}
        targets = lora.get("target_modules", cfg.get("lora_targets") or ALL_LINEAR)
        where = (
            "every linear projection of the decoder blocks (all-linear)"
            if targets == ALL_LINEAR
            else ", ".join(targets)
        )
        dropout = lora.get("dropout", cfg.get("lora_dropout", 0.0))
        lines.append(
            f"# LoRA rank {cfg['lora_rank']}, alpha {lora.get('alpha', 2 * cfg['lora_rank'])}"
            + (f", dropout {dropout:g}" if dropout else "")
            + f" on {where}."
        )
        lines += _embedding_notes(doc)
    lines += _loss_and_compile_notes(cfg)
    return lines


def _embedding_notes(doc: dict[str, Any]) -> list[str]:
    """What `train_embeddings` trains, in words and in peft's terms (the `lora:` section of the
    autofit plan holds the options themselves)."""
    value = doc["config"].get("train_embeddings", "none")
    if value == "none":
        return []
    spec = doc.get("model_spec") or {}
    tied = bool(spec.get("tied_embeddings"))
    head = "the LM head tied to it (one trained weight)" if tied else "the LM head"
    count = trained_token_count(value)
    if count is None:
        modules = ", ".join(trained_embedding_modules(value, tied))
        tying = ", ensure_weight_tying=True" if tied else ""
        return [
            f"# Trains the input embeddings and {head} too: a trainable copy beside each frozen "
            f"original (peft modules_to_save: {modules}{tying})."
        ]
    vocab = int(spec.get("vocab") or 0)
    rows = trained_token_ids(value, vocab)
    where = f"ids {rows.start}-{rows.stop - 1}" if vocab else f"the last {count} ids"
    return [
        f"# Trains the rows of the last {count} token ids ({where}, e.g. a chat template's "
        f"added tokens) of the input embeddings and {head} (peft trainable_token_indices)."
    ]


def _env_text(doc: dict[str, Any]) -> str:
    """The environment the trials ran with, as `K=V ...`; empty for a CPU plan (the CUDA
    allocator setting means nothing there)."""
    if (doc.get("hardware") or {}).get("device") == "cpu":
        return ""
    env = doc.get("env") or ALLOC_ENV
    return " ".join(f"{k}={v}" for k, v in env.items())


def render_autofit(doc: dict[str, Any], path: Path | None = None) -> str:
    head = _header(doc, "autofit plan")
    head.append("# Read it back with autofit.load_plan(path); apply with autofit.apply(model, "
                "plan.best.config).")  # fmt: skip
    if path is not None and plan_nodes(doc)[0] > 1:
        head += _launch_comments(doc, "autofit", path)
    return "\n".join(head) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=100)


def accelerate_config(doc: dict[str, Any]) -> dict[str, Any]:
    """The Accelerate config of the measured path: `NO` (one GPU, plain module), `MULTI_GPU`
    (DDP) or `FSDP` with `fsdp_version: 2` (FSDP2, also a one-GPU FSDP2 plan with param offload).
    """
    cfg = doc["config"]
    n = int(doc["hardware"]["n_gpus"])
    nodes, _ = plan_nodes(doc)
    wrap = cfg["wrap"]
    sharding = plan_sharding(doc)
    mixed = fp32_trainable(cfg["precision"], cfg.get("optimizer", "adamw"))
    base: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "bf16" if mixed else "no",
        "num_machines": 1,
        "num_processes": n,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if nodes > 1 and sharding is not Sharding.NONE:
        # `num_processes` counts every node's; each node's `accelerate launch` names its own
        # `--machine_rank` and node 0's `--main_process_ip` (launch_lines), torchrun's static
        # rendezvous (Accelerate 1.15 takes `rdzv_backend` from its command line, not this file)
        base.update(num_machines=nodes, main_process_port=RDZV_PORT)
    if cfg.get("compile"):
        # Accelerate's own compile of repeated blocks (each decoder layer), as autofit measured
        base["dynamo_config"] = {
            "dynamo_backend": "INDUCTOR",
            "dynamo_use_regional_compilation": True,
        }
    if sharding is Sharding.NONE:
        base["distributed_type"] = "NO"
        base["num_processes"] = 1
        return base
    if sharding is Sharding.DDP:
        base["distributed_type"] = "MULTI_GPU"
        return base
    base["distributed_type"] = "FSDP"
    base["fsdp_config"] = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "NO_WRAP" if wrap == "model" else "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": doc.get("decoder_layer", "LlamaDecoderLayer"),
        "fsdp_reshard_after_forward": bool(cfg["reshard"]),
        "fsdp_offload_params": cfg["offload"] == "params",
        "fsdp_activation_checkpointing": cfg["checkpointing"] != "none",
        # Off: with it on, transformers' `from_pretrained` under `accelerate launch` loads real
        # weights on rank 0 only (meta elsewhere) for `accelerator.prepare` to broadcast, and
        # `autofit.apply` (which shards the model itself) would train the other ranks' weights
        # from a random init. Every rank loads the checkpoint instead.
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    if wrap == "model":
        del base["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    hsdp = accelerate_hsdp(doc)
    if hsdp:
        base["parallelism_config"] = hsdp
    return base


def accelerate_hsdp(doc: dict[str, Any]) -> dict[str, int]:
    """Accelerate's `parallelism_config` section for HSDP (its config file's keys, which
    `accelerate launch` hands to `ParallelismConfig` as PARALLELISM_CONFIG_* variables): the
    replicas and shard degree of `plan_mesh`. Empty for a 1-D mesh, and for one GPU per node,
    which Accelerate refuses (`dp_shard_size == 1` with replicas: "pure DP")."""
    mesh = plan_mesh(doc)
    if mesh is None or mesh[0] == 1 or mesh[1] == 1:
        return {}
    return {
        "parallelism_config_dp_replicate_size": mesh[0],
        "parallelism_config_dp_shard_size": mesh[1],
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
    }


def hsdp_env(doc: dict[str, Any]) -> dict[str, str]:
    """The environment `accelerate launch` sets from `accelerate_hsdp`, which an `Accelerator`
    made without a `parallelism_config` (HF Trainer's, from TrainingArguments JSON, which cannot
    hold a `ParallelismConfig` object) reads instead."""
    hsdp = accelerate_hsdp(doc)
    if not hsdp:
        return {}
    return {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        **{k.upper(): str(v) for k, v in hsdp.items()},
    }


def _accelerate_notes(doc: dict[str, Any], side: Path) -> list[str]:
    cfg = doc["config"]
    sharding = plan_sharding(doc)
    notes = [
        f"# Per GPU: micro-batch {cfg['micro_batch']} x {cfg['grad_accum']} accumulation steps, "
        f"seq_len {cfg['seq_len']} (set these in your script/dataloader).",
        f"# In the script `accelerate launch` runs: run = autofit.apply(model, autofit.load_plan("
        f"'{side.name}').best.config, device=accelerator.device), then train run.model with "
        "run.optimizer, run.autocast() and run.gradient_sync() (examples/accelerate_train.py).",
    ]
    if sharding is Sharding.NONE:
        notes.append(
            "# Do not accelerator.prepare() the model or optimizer: there is nothing to wrap, and "
            "run.autocast() is the measured autocast. The Accelerator launches and logs."
        )
    elif sharding is Sharding.DDP:
        notes.append(
            "# Do not accelerator.prepare() the model: Accelerate's prepare_model would wrap "
            "autofit's DDP model in a second DistributedDataParallel. The Accelerator only "
            "launches, sets up the process group autofit.apply uses, and logs."
        )
    else:
        notes.append(
            "# Do not accelerator.prepare() the model: Accelerate's fsdp2_prepare_model returns an "
            "FSDPModule as it is"
            + (
                ", but prepare() still puts a second activation-checkpoint wrapper on each layer "
                "(fsdp_activation_checkpointing) over autofit's."
                if cfg["checkpointing"] != "none"
                else " (nothing to gain)."
            )
            + " The Accelerator only launches, sets up the process group autofit.apply uses, "
            "and logs."
        )
    mesh = plan_mesh(doc)
    if mesh is not None and mesh[0] > 1:
        notes.append(
            "# HSDP: autofit.apply builds the measured (dp_replicate, dp_shard) mesh itself from "
            "torchrun's LOCAL_WORLD_SIZE (accelerate launch runs torchrun)"
            + (
                "; parallelism_config gives the Accelerator's own mesh the same shape."
                if accelerate_hsdp(doc)
                else "; Accelerate has no HSDP with one GPU per node, so no parallelism_config."
            )
        )
    if cfg["wrap"].startswith("every-"):
        notes.append(
            f"# autofit measured FSDP2 units of {cfg['wrap'][6:]} decoder layers; "
            "Accelerate's own wrapping would wrap each layer (autofit.apply groups them)."
        )
    if cfg["checkpointing"] != "none" and (
        sharding is not Sharding.FSDP2 or cfg["checkpointing"] != "full"
    ):
        notes.append(
            f"# Checkpointing measured: {cfg['checkpointing']} (autofit.apply sets it; "
            + (
                "Accelerate's FSDP flag is all-layer)."
                if sharding is Sharding.FSDP2
                else "this config has no field for it)."
            )
        )
    if cfg["offload"] == "optimizer":
        notes.append(
            "# Optimizer state and step on the CPU (torchao CPUOffloadOptimizer): "
            "Accelerate cannot say this; run.optimizer is that optimizer."
        )
    if cfg["optimizer"] != "adamw":
        notes.append(f"# Optimizer: torchao {cfg['optimizer']} (torchao.optim; run.optimizer).")
    if not fp32_trainable(cfg["precision"], cfg["optimizer"]):
        notes.append("# Precision bf16: load the model in torch.bfloat16 (no fp32 master copy).")
    if cfg.get("compile"):
        notes.append(
            "# dynamo_config is the same compile for Accelerate's prepare(), which this recipe "
            "does not call on the model: autofit.apply compiles the layers."
        )
    return notes


def _loss_and_compile_notes(cfg: dict[str, Any]) -> list[str]:
    """What the `loss` and `compile` knobs measured, and who sets them up."""
    notes = []
    loss = cfg.get("loss", "standard")
    if loss == "chunked":
        notes.append(
            "# Loss: LM head + cross-entropy over chunks of tokens (autofit.builder.loss; "
            "autofit.apply sets it on the model: model(input_ids=..., labels=...).loss)."
        )
    elif loss == "fused":
        notes.append(
            "# Loss: Liger's fused linear cross-entropy (pip install 'autofit[liger]'); "
            "autofit.apply sets it on the model."
        )
    if cfg.get("compile"):
        notes.append(
            "# Compile: each decoder layer torch.compile'd after checkpointing, before sharding "
            "(autofit.apply does it as measured; compile time is not in the measured tokens/s)."
        )
    return notes


def render_accelerate(doc: dict[str, Any], side: Path, target: Path | None = None) -> str:
    head = _header(doc, f"Accelerate config ({path_title(doc)})")
    head += _accelerate_notes(doc, side)
    head.append(f"# Quantization/LoRA and everything above: {side.name} "
                "(autofit.load_plan + autofit.apply).")  # fmt: skip
    target = target if target is not None else side.with_name(side.name.replace(".autofit", ""))
    head += _launch_comments(doc, "accelerate", target)
    return "\n".join(head) + "\n" + yaml.safe_dump(accelerate_config(doc), sort_keys=False)


def trainer_arguments(doc: dict[str, Any]) -> dict[str, Any]:
    cfg = doc["config"]
    optim = TORCHAO_OPTIM.get(cfg["optimizer"], "adamw_torch_fused")
    if cfg["offload"] != "none" and optim == "adamw_torch_fused":
        optim = "adamw_torch"  # fused AdamW needs params on the GPU
    args: dict[str, Any] = {
        "output_dir": "autofit-output",
        "per_device_train_batch_size": int(cfg["micro_batch"]),
        "gradient_accumulation_steps": int(cfg["grad_accum"]),
        "bf16": True,
        "optim": optim,
    }
    if cfg.get("compile"):
        args["torch_compile"] = True
    if cfg.get("loss") == "fused":
        # Liger's fused linear cross-entropy alone, as measured (not its other kernels)
        args["use_liger_kernel"] = True
        args["liger_kernel_config"] = {
            "fused_linear_cross_entropy": True,
            "cross_entropy": False,
            "rope": False,
            "rms_norm": False,
            "swiglu": False,
        }
    ckpt = cfg["checkpointing"] != "none"
    sharding = plan_sharding(doc)
    if sharding is not Sharding.FSDP2:  # the plain module, or DDP replicas on several GPUs
        if ckpt:
            args["activation_checkpointing"] = True
        if sharding is Sharding.DDP:
            args["ddp_find_unused_parameters"] = False  # as autofit's DDP
        return args
    fsdp_config: dict[str, Any] = {
        "version": 2,
        "reshard_after_forward": bool(cfg["reshard"]),
        "cpu_offload": cfg["offload"] == "params",
        "activation_checkpointing": ckpt,
    }
    if cfg["wrap"] == "model":
        fsdp_config["auto_wrap_policy"] = "NO_WRAP"
    else:
        fsdp_config["transformer_layer_cls_to_wrap"] = [
            doc.get("decoder_layer", "LlamaDecoderLayer")
        ]
    args["fsdp"] = True
    args["fsdp_config"] = fsdp_config
    return args


# autofit cannot know the user's training script: launch commands name this placeholder, and
# `launch_note` says what it stands for and runs the plan with an example shipped in the sources.
TRAIN_SCRIPT = "<your_train.py>"
EXAMPLE_SCRIPTS = {"accelerate": "accelerate_train.py"}  # other formats: train_with_plan.py


RDZV_PORT = 29500
"""The rendezvous port of a multi-node launch (torchrun's and Accelerate's default)."""
SLURM_FIRST_NODE = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"
"""The first node of a SLURM job, expanded by the batch script's shell: the rendezvous host."""
SLURM_NODE_RANK = r"\$SLURM_NODEID"
"""The node's rank inside `srun ... bash -c "..."`: escaped so each task's shell expands it."""


@dataclass(frozen=True)
class LaunchLine:
    command: str
    where: str = ""  # "" on one node; else which nodes run it and what its variables stand for


def launch_lines(
    plan: Any, format: str, path: str | Path, script: str = TRAIN_SCRIPT
) -> list[LaunchLine]:
    """The commands that launch training with this export (the one rule the exports and the CLI
    print). One node: `python` for a one-GPU plain-module plan (no process group needed),
    `torchrun`/`accelerate launch` for DDP and FSDP2. Several nodes: the command each node runs
    (torchrun with c10d rendezvous at node 0, or `accelerate launch` with its machine rank), then
    the `srun` line that runs it once on every node of a SLURM job. `script` is the training
    script (the placeholder `<your_train.py>` unless named); the CUDA allocator setting is set
    only for a CUDA plan; a trainer export of an HSDP plan sets the `PARALLELISM_CONFIG_*`
    variables its Accelerator reads (`hsdp_env`)."""
    doc = plan if isinstance(plan, dict) else plan_document(plan)
    n = int(doc["hardware"]["n_gpus"])
    nodes, per_node = plan_nodes(doc)
    env_vars = " ".join(f"{k}={v}" for k, v in hsdp_env(doc).items()) if format == "trainer" else ""
    env = " ".join(t for t in (_env_text(doc), env_vars) if t)
    env = f"{env} " if env else ""
    p = Path(path)
    if format == "accelerate":
        tail = f"{script} --plan {side_path(p)}"
    elif format == "trainer":
        tail = (f"{script}  # TrainingArguments(**json.load(open('{p}'))); "
                f"autofit.load_plan('{side_path(p)}') for quant/LoRA")  # fmt: skip
    else:
        tail = f"{script} --plan {p}"
    if nodes <= 1:
        if format == "accelerate":
            return [LaunchLine(f"{env}accelerate launch --config_file {p} {tail}")]
        single = plan_sharding(doc) is Sharding.NONE
        runner = "python" if single else f"torchrun --nproc-per-node {n}"
        return [LaunchLine(f"{env}{runner} {tail}")]
    srun = f"srun --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node}"
    if format == "accelerate":

        def accelerate(rank: str, host: str) -> str:
            return (
                f"accelerate launch --config_file {p} --num_machines {nodes} --machine_rank {rank}"
                f" --main_process_ip {host} --main_process_port {RDZV_PORT} {tail}"
            )

        node = accelerate("$NODE_RANK", "$MASTER_ADDR")
        slurm = f'bash -c "{accelerate(SLURM_NODE_RANK, SLURM_FIRST_NODE)}"'
        names = f"NODE_RANK: 0 to {nodes - 1}, MASTER_ADDR: node 0's address"
    else:

        def torchrun(host: str, job: str) -> str:
            return (
                f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
                f"--rdzv-endpoint={host}:{RDZV_PORT} --rdzv-id={job} {tail}"
            )

        node, slurm = (
            torchrun("$MASTER_ADDR", "$JOB_ID"),
            torchrun(SLURM_FIRST_NODE, "$SLURM_JOB_ID"),
        )
        names = "MASTER_ADDR: node 0's address, JOB_ID: any id the nodes share"
    return [
        LaunchLine(f"{env}{node}", f"on each of the {nodes} nodes; {names}"),
        LaunchLine(f"{env}{srun} {slurm}", "under SLURM, from the batch script: one task per node"),
    ]


def launch_command(plan: Any, format: str, path: str | Path, script: str = TRAIN_SCRIPT) -> str:
    """The first of `launch_lines`: the whole command on one node, each node's on several."""
    return launch_lines(plan, format, path, script)[0].command


def _launch_comments(doc: dict[str, Any], format: str, path: Path) -> list[str]:
    return [
        f"# Launch{f' ({line.where})' if line.where else ''}: {line.command}"
        for line in launch_lines(doc, format, path)
    ]


def example_script(format: str) -> Path | None:
    """The example training script for `format` (examples/ of autofit's sources), when autofit
    runs from its source tree (a checkout, an editable install); None for an installed wheel."""
    name = EXAMPLE_SCRIPTS.get(format, "train_with_plan.py")
    path = Path(__file__).resolve().parent.parent / "examples" / name
    return path if path.is_file() else None


def launch_note(plan: Any, format: str, path: str | Path) -> str:
    """What `<your_train.py>` in `launch_command` stands for, and a command that runs the plan
    for a few steps with the example script shipped in autofit's sources (random weights)."""
    import os
    import shlex

    doc = plan if isinstance(plan, dict) else plan_document(plan)
    name = EXAMPLE_SCRIPTS.get(format, "train_with_plan.py")
    text = (
        f"{TRAIN_SCRIPT} is your training script: autofit.load_plan(...) then "
        "autofit.apply(model, plan.best.config) builds the measured layout."
    )
    example = example_script(format)
    if example is None:
        return f"{text} examples/{name} in autofit's source repository is a complete one."
    rel = os.path.relpath(example)
    shown = rel if not rel.startswith("..") else str(example)
    p = Path(path)
    plan_file = p if format == "autofit" else side_path(p)
    if format == "accelerate":
        cmd = launch_command(doc, format, p, script=shlex.quote(shown))
    else:
        cmd = launch_command(doc, "autofit", plan_file, script=shlex.quote(shown))
        if doc["hardware"].get("device") == "cuda":
            cmd += " --device cuda"
    cmd += f" --model {shlex.quote(str(doc['model']))}"
    return f"{text} To try the plan with the example {shown} (random weights): {cmd}"


def side_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.autofit.yaml")


# ----- writing -----------------------------------------------------------------------------------
def check_format(format: str) -> str:
    fmt = str(format).strip().lower()
    if fmt not in FORMATS:
        from autofit.errors import did_you_mean

        raise AutofitError(
            f"Unknown export format {format!r}.{did_you_mean(fmt, FORMATS)} Allowed formats: "
            f"{', '.join(FORMATS)} (autofit: YAML plan for autofit.load_plan; accelerate: an "
            "Accelerate config file (plain, DDP or FSDP2); trainer: TrainingArguments JSON)."
        )
    return fmt


WRITE_HINT = "Choose a file path in a folder you can write in."


def check_export_target(format: str, path: str | Path, flag: str = "--export") -> str:
    """Before anything runs: `format` is known and every file its export writes (the side file
    too) can be written: its folder is writable, and no folder or foreign file is in the way.
    Returns the normalised format."""
    from autofit.checks import check_file_writable

    fmt = check_format(format)
    target = Path(path).expanduser()
    for out_path in [target] if fmt == "autofit" else [target, side_path(target)]:
        what = f"{flag} {target}" if out_path == target else f"{out_path} (the side file)"
        check_file_writable(out_path, what, WRITE_HINT)
        _check_replaceable(out_path)
    return fmt


def export_plan(plan: Any, format: str, path: str | Path) -> list[Path]:
    """Write the winner of `plan` as `format` to `path`; returns every file written."""
    fmt = check_format(format)
    doc = plan_document(plan)
    target = Path(path).expanduser()
    outputs: list[tuple[Path, str]] = []
    if fmt == "autofit":
        outputs.append((target, render_autofit(doc, target)))
    else:
        side = side_path(target)
        if fmt == "accelerate":
            text = render_accelerate(doc, side, target)
        else:
            text = json.dumps(trainer_arguments(doc), indent=2) + "\n"
        outputs += [(target, text), (side, render_autofit(doc, side))]
    from autofit.checks import check_file_writable

    for out_path, text in outputs:
        _parse_back(out_path, text)
        check_file_writable(out_path, str(out_path), WRITE_HINT)
        _check_replaceable(out_path)
    for out_path, text in outputs:
        try:
            atomic_write(out_path, text)
        except OSError as exc:
            raise AutofitError(
                f"Cannot write {out_path} ({exc.strerror or exc}). {WRITE_HINT}"
            ) from None
    return [p for p, _ in outputs]


def _parse_back(path: Path, text: str) -> None:
    """Never write what cannot be read back."""
    try:
        json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # pragma: no cover - a renderer bug
        raise AutofitError(
            f"internal error: the export for {path} does not parse ({exc})."
        ) from exc


def _check_replaceable(path: Path) -> None:
    if path.is_dir():
        raise AutofitError(f"{path} is a folder; pass a file path to export to.")
    if not path.exists():
        return
    try:
        head = path.read_text(errors="replace")[:4000]
    except OSError as exc:
        raise AutofitError(f"Cannot read {path} to check it before replacing it: {exc}.") from None
    side = side_path(path)
    mine = MARKER in head or (
        path.suffix == ".json"
        and side.exists()
        and MARKER in side.read_text(errors="replace")[:4000]
    )
    if not mine:
        raise AutofitError(
            f"{path} exists and was not written by autofit; it is left as it is. Choose another "
            "path, or move that file away first."
        )


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            with contextlib.suppress(OSError):
                os.chmod(tmp, path.stat().st_mode & 0o777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
