"""The three formats, each rendered in full from the plan document: the `autofit` YAML plan, an
Accelerate config, and `transformers.TrainingArguments` as JSON (of a `launch: trl` plan, TRL's
`SFTConfig`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from autofit.config import Config
from autofit.export.launch import RDZV_PORT, launch_comments
from autofit.export.layout import (
    accelerate_hsdp,
    path_title,
    plan_config,
    plan_layout,
    plan_nodes,
)
from autofit.export.prose import accelerate_notes, header
from autofit.layout import Layout, Sharding
from autofit.recipe import TORCH_NAMES, bits_and_bytes_config, hf_optim
from autofit.values import Batching, Checkpointing, Launch, Loss, Offload, Wrap


def render_autofit(doc: dict[str, Any], path: Path | None = None) -> str:
    head = header(doc, "autofit plan")
    head.append("# Read it back with autofit.load_plan(path); apply with autofit.apply(model, "
                "plan.best.config).")  # fmt: skip
    if path is not None and plan_nodes(doc)[0] > 1:
        head += launch_comments(doc, "autofit", path)
    return "\n".join(head) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=100)


def accelerate_config(doc: dict[str, Any]) -> dict[str, Any]:
    """The Accelerate config of the measured path: `NO` (one GPU, plain module), `MULTI_GPU`
    (DDP) or `FSDP` with `fsdp_version: 2` (FSDP2, also a one-GPU FSDP2 plan with param offload).
    """
    cfg = plan_config(doc)
    n = int(doc["hardware"]["n_gpus"])
    nodes, _ = plan_nodes(doc)
    wrap = cfg.wrap
    layout = plan_layout(doc)
    sharding, mixed = layout.sharding, layout.fp32_trainable
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
    if cfg.compile:
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
        "fsdp_auto_wrap_policy": "NO_WRAP" if wrap == Wrap.MODEL else "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": doc.get("decoder_layer", "LlamaDecoderLayer"),
        "fsdp_reshard_after_forward": bool(cfg.reshard),
        "fsdp_offload_params": cfg.offload == Offload.PARAMS,
        "fsdp_activation_checkpointing": cfg.checkpointing != Checkpointing.NONE,
        # Off: with it on, transformers' `from_pretrained` under `accelerate launch` loads real
        # weights on rank 0 only (meta elsewhere) for `accelerator.prepare` to broadcast, and
        # `autofit.apply` (which shards the model itself) would train the other ranks' weights
        # from a random init. Every rank loads the checkpoint instead.
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    if wrap == Wrap.MODEL:
        del base["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    hsdp = accelerate_hsdp(doc)
    if hsdp:
        base["parallelism_config"] = hsdp
    return base


def render_accelerate(doc: dict[str, Any], side: Path, target: Path | None = None) -> str:
    head = header(doc, f"Accelerate config ({path_title(doc)})")
    head += accelerate_notes(doc, side)
    head.append(f"# Quantization/LoRA and everything above: {side.name} "
                "(autofit.load_plan + autofit.apply).")  # fmt: skip
    target = target if target is not None else side.with_name(side.name.replace(".autofit", ""))
    head += launch_comments(doc, "accelerate", target)
    return "\n".join(head) + "\n" + yaml.safe_dump(accelerate_config(doc), sort_keys=False)


def trainer_arguments(doc: dict[str, Any]) -> dict[str, Any]:
    """The trainer export: `transformers.TrainingArguments` of the plan (as keyword arguments),
    or for a `launch: trl` plan TRL's `SFTConfig` (`sft_arguments`)."""
    cfg = plan_config(doc)
    layout = plan_layout(doc)
    optim = hf_optim(cfg.optimizer, layout.adamw, cfg.offload)
    args: dict[str, Any] = {
        "output_dir": "autofit-output",
        "per_device_train_batch_size": int(cfg.micro_batch),
        "gradient_accumulation_steps": int(cfg.grad_accum),
        "bf16": True,
        "optim": optim,
    }
    if cfg.compile:
        args["torch_compile"] = True
    if cfg.batching == Batching.GROUPED:  # transformers 5's name of `group_by_length`
        args["train_sampling_strategy"] = "group_by_length"
    if cfg.loss == Loss.FUSED:
        # Liger's fused linear cross-entropy alone, as measured (not its other kernels)
        args["use_liger_kernel"] = True
        args["liger_kernel_config"] = {
            "fused_linear_cross_entropy": True,
            "cross_entropy": False,
            "rope": False,
            "rms_norm": False,
            "swiglu": False,
        }
    ckpt = cfg.checkpointing != Checkpointing.NONE
    if cfg.launch == Launch.TRL:
        args.update(sft_arguments(cfg, layout))
    sharding = layout.sharding
    if sharding is not Sharding.FSDP2:  # the plain module, or DDP replicas on several GPUs
        if ckpt:
            args["activation_checkpointing"] = True
        if sharding is Sharding.DDP:
            args["ddp_find_unused_parameters"] = False  # as autofit's DDP
        return args
    fsdp_config: dict[str, Any] = {
        "version": 2,
        "reshard_after_forward": bool(cfg.reshard),
        "cpu_offload": cfg.offload == Offload.PARAMS,
        "activation_checkpointing": ckpt,
    }
    if cfg.wrap == Wrap.MODEL:
        fsdp_config["auto_wrap_policy"] = "NO_WRAP"
    else:
        fsdp_config["transformer_layer_cls_to_wrap"] = [
            doc.get("decoder_layer", "LlamaDecoderLayer")
        ]
    args["fsdp"] = True
    args["fsdp_config"] = fsdp_config
    return args


def sft_arguments(cfg: Config, layout: Layout) -> dict[str, Any]:
    """What TRL 1.16's `SFTConfig` adds to a `launch: trl` plan's `TrainingArguments`, written out
    where its defaults differ from what was measured: `activation_checkpointing` either way (its
    `gradient_checkpointing` defaults to true), `max_length` the plan's `seq_len` (default 1024),
    `packing` for `batching: packed` with TRL's default best-fit-decreasing strategy (which
    SFTTrainer runs padding-free: a micro-batch flattened into one row), and
    `model_init_kwargs`' `dtype`, the dtype the trials loaded the model in (a model SFTTrainer
    loads from a path is float32 unless told), and for QLoRA its `quantization_config`, the
    `BitsAndBytesConfig` as a dict (`recipe.bits_and_bytes_config`)."""
    args: dict[str, Any] = {
        "activation_checkpointing": cfg.checkpointing != Checkpointing.NONE,
        "max_length": int(cfg.seq_len),
        "packing": cfg.batching == Batching.PACKED,
    }
    if args["packing"]:
        args["packing_strategy"] = "bfd"
    args["model_init_kwargs"] = {"dtype": TORCH_NAMES[layout.base_dtype]}
    if layout.bnb is not None:
        args["model_init_kwargs"]["quantization_config"] = bits_and_bytes_config(layout.bnb)
    return args
