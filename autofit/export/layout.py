"""How the measured run held the model, read from the plan document: its `autofit.layout.Layout`
(the plain module, DDP, FSDP2 or HSDP, the mesh, the AdamW step), on how many nodes, and the
`Accelerate` settings that describe the same mesh."""

from __future__ import annotations

from typing import Any

from autofit.config import Config
from autofit.layout import Layout, Sharding, layout_of


def plan_layout(doc: dict[str, Any]) -> Layout:
    """The layout the measured run had (`layout_of` the plan's config on its GPUs, nodes and
    `plan_device`, of its model's decoder layers where the plan names them: `model_spec`): the
    plan's `config` read back as a `Config`, whose declarations give what the plan leaves out."""
    return layout_of(
        plan_config(doc), int(doc["hardware"]["n_gpus"]), gpus_per_node=plan_nodes(doc)[1],
        n_layers=int((doc.get("model_spec") or {}).get("layers") or 0), device=plan_device(doc),
    )  # fmt: skip


def plan_config(doc: dict[str, Any]) -> Config:
    """The plan's measured config (its `config`: every knob, the settings that differ from their
    defaults), checked as any config is."""
    return Config.from_dict(dict(doc["config"]), where="the plan's config")


def plan_device(doc: dict[str, Any]) -> str:
    """The device the plan's trials ran on: cuda, or cpu (gloo); cuda for a plan written before
    `device`."""
    return doc["hardware"].get("device") or "cuda"


def plan_sharding(doc: dict[str, Any]) -> Sharding:
    """How the measured run held the model: the plain module, DDP or FSDP2."""
    return plan_layout(doc).sharding


def plan_nodes(doc: dict[str, Any]) -> tuple[int, int]:
    """(nodes, GPUs per node) of the plan's hardware (one node for a plan written before nodes)."""
    hw = doc["hardware"]
    n = int(hw["n_gpus"])
    nodes = max(int(hw.get("nodes") or 1), 1)
    return nodes, int(hw.get("gpus_per_node") or n // nodes)


def plan_mesh(doc: dict[str, Any]) -> tuple[int, int] | None:
    """The FSDP2 mesh the run builds, (replicas, shard degree) (`Layout.mesh`); None when the
    plan is not FSDP2."""
    layout = plan_layout(doc)
    return layout.mesh if layout.fsdp else None


def path_title(doc: dict[str, Any]) -> str:
    mesh = plan_mesh(doc)
    if mesh is not None and mesh[0] > 1:
        return "HSDP"
    return {Sharding.NONE: "one GPU, plain module", Sharding.DDP: "DDP", Sharding.FSDP2: "FSDP2"}[
        plan_sharding(doc)
    ]


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
