"""The comment lines an export starts with: the path the trials measured and what a format
cannot say (quantization, LoRA, embeddings, loss, compile), so the file explains itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autofit._version import __version__
from autofit.config import Config
from autofit.export.layout import (
    accelerate_hsdp,
    plan_config,
    plan_device,
    plan_layout,
    plan_nodes,
)
from autofit.export.schema import MARKER, env_text
from autofit.layout import Layout, Sharding, wrap_group_size
from autofit.recipe import (
    ADAMW_IMPLS,
    HF_ADAMW_DEFAULT,
    HF_TRAINER_LOW_BIT_BLOCK,
    LOW_BIT_STATES,
    Bnb4bit,
    bits_and_bytes_config,
    trained_embedding_modules,
    trained_token_ids,
)
from autofit.settings import ALL_LINEAR, trained_token_count
from autofit.units import all_together, device_noun, fmt_size
from autofit.values import (
    Batching,
    Checkpointing,
    Launch,
    Loss,
    Offload,
    Optimizer,
    OptimizerImpl,
    TrainEmbeddings,
    Wrap,
)


def measured_path(doc: dict[str, Any], layout: Layout) -> list[str]:
    """Comment lines naming the path the trials measured (`layout`: `plan_layout(doc)`), which
    `autofit.apply` builds."""
    cfg = plan_config(doc)
    n = int(doc["hardware"]["n_gpus"])
    nodes, per_node = plan_nodes(doc)
    device = plan_device(doc)
    unit = device_noun(device, n)
    gpus = f"{n} {unit} ({nodes} nodes x {per_node})" if nodes > 1 else f"{n} {unit}"
    if device == "cpu":
        gpus += " (gloo)"
    sharding, mixed = layout.sharding, layout.fp32_trainable
    if sharding is Sharding.NONE:
        lines = [
            f"# Measured path: the plain module on one {device_noun(device)} (no "
            "DDP, no FSDP), "
            + ("fp32 trainable params under bf16 autocast." if mixed else "all in bf16.")
        ]
    elif sharding is Sharding.DDP:
        lines = [
            f"# Measured path: PyTorch DDP replicas on {gpus}, gradients all-reduced from DDP's "
            "buckets (gradient_as_bucket_view)."
        ]
        if not layout.trains_all:
            lines.append(
                f"# The frozen (quantized) base is held whole on each {device_noun(device)}, "
                "left out of DDP."
            )
        if mixed:
            lines.append("# fp32 trainable params under bf16 autocast.")
    else:
        spec = doc.get("model_spec") or {}
        k = wrap_group_size(cfg.wrap, int(spec.get("layers") or 0))
        layers = "each decoder layer" if k == 1 else f"each group of {k} decoder layers"
        if spec.get("tied_embeddings"):
            units = (
                "one root unit holds everything (tied embeddings and LM head included)"
                if cfg.wrap == Wrap.MODEL
                else f"units of {layers}; the tied embeddings and LM head stay in the root unit"
            )
        elif cfg.wrap == Wrap.MODEL:
            units = "units of the token embeddings and [final norm, LM head]; the root unit holds "
            units += "the decoder layers"
        else:
            units = f"units of the token embeddings, {layers} and [final norm, LM head]; the root "
            units += "unit holds the rest"
        replicas, shards = layout.mesh
        if replicas > 1:
            lines = [
                f"# Measured path: HSDP, FSDP2 on a 2-D (dp_replicate, dp_shard) mesh of {gpus}: "
                f"each parameter sharded over the {shards} {device_noun(device, shards)} of a "
                f"node and replicated on each of the {replicas} nodes (gradients reduce-scattered "
                f"in a node, then all-reduced across nodes), laid out as torchtitan: {units}."
            ]
        else:
            lines = [f"# Measured path: FSDP2 on {gpus} laid out as torchtitan: {units}."]
        extra = []
        if cfg.train_embeddings == TrainEmbeddings.FULL:
            extra.append(
                "The frozen originals beside the trainable embedding and head copies are a unit "
                "of their own, never gathered"
            )
        if cfg.offload == Offload.PARAMS:
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


def memory_and_speed(doc: dict[str, Any]) -> list[str]:
    """The winner's peak against the one capacity its plan held it to, and what its tokens/s
    (`tokens_per_s` below) count: the whole run, every GPU together."""
    hw, device = doc["hardware"], plan_device(doc)
    n = int(hw["n_gpus"])
    usable = hw.get("usable_bytes")
    of = f" of {fmt_size(usable)} usable" if usable else ""
    speed = all_together(n, device) if n > 1 else f"its one {device_noun(device)}"
    return [
        f"# Peak {fmt_size(doc.get('peak_bytes'))} reserved per {device_noun(device)}{of}; "
        f"tokens_per_s is the whole run's, {speed}."
    ]


def header(doc: dict[str, Any], what: str) -> list[str]:
    cfg, layout = plan_config(doc), plan_layout(doc)
    lines = [
        f"# {what}, {MARKER} {doc.get('autofit_version', __version__)} for {doc['model']} on "
        f"{doc['hardware']['description']}.",
        f"# Winner: {doc.get('label', '')}; {doc.get('reason', '')}".rstrip(),
        *memory_and_speed(doc),
        *measured_path(doc, layout),
    ]
    if env_text(doc):  # CUDA allocator settings; none for a CPU plan
        lines.append(f"# Trials ran with {env_text(doc)}: set it for your run too.")
    if layout.bnb is not None:
        lines.append(
            "# Base weights quantized to nf4 by bitsandbytes, frozen: "
            f"{bits_and_bytes_text(layout.bnb)}."
        )
        lines += kbit_notes(cfg)
    elif layout.quant is not None:
        lines.append(f"# Base weights quantized to {layout.quant} (torchao), frozen.")
    if not layout.trains_all:
        lora = doc.get("lora") or {}
        targets = lora.get("target_modules", cfg.lora_targets or ALL_LINEAR)
        where = (
            "every linear projection of the decoder blocks (all-linear)"
            if targets == ALL_LINEAR
            else ", ".join(targets)
        )
        dropout = lora.get("dropout", cfg.lora_dropout)
        lines.append(
            f"# LoRA rank {cfg.lora_rank}, alpha {lora.get('alpha', 2 * cfg.lora_rank)}"
            + (f", dropout {dropout:g}" if dropout else "")
            + f" on {where}."
        )
        lines += embedding_notes(doc)
    lines += loss_and_compile_notes(cfg)
    lines += adamw_notes(doc, layout)
    lines += batching_notes(cfg)
    return lines


def bits_and_bytes_text(bnb: Bnb4bit) -> str:
    """The run's `BitsAndBytesConfig(...)` as Python (`recipe.bits_and_bytes_config`, the dtypes
    as `torch.<name>`)."""
    kwargs = bits_and_bytes_config(bnb)
    del kwargs["quant_method"]  # the class says it
    shown = [
        f"{key}=torch.{value}" if key.endswith(("_dtype", "_storage")) else f"{key}={value!r}"
        for key, value in kwargs.items()
    ]
    return f"BitsAndBytesConfig({', '.join(shown)})"


def kbit_notes(cfg: Config) -> list[str]:
    """How a `launch: trainer` plan's bitsandbytes QLoRA was loaded and measured: a QLoRA
    script's `from_pretrained` with that `BitsAndBytesConfig` (the LM head left in bf16), then
    peft's `prepare_model_for_kbit_training` (`autofit.builder.trainer.trainer_model`); under
    `launch: trl` SFTTrainer's own loading (no `prepare_model_for_kbit_training`)."""
    if cfg.launch == Launch.TRL:
        return [
            "# Loaded as a TRL QLoRA script loads it: SFTTrainer(model=path, args=SFTConfig of "
            "the JSON, whose model_init_kwargs hold that BitsAndBytesConfig as a dict, "
            "peft_config=the lora section's LoraConfig); no prepare_model_for_kbit_training "
            "(nothing upcast), and SFTTrainer turns a quantized model's adapters to bf16."
        ]
    if cfg.launch != Launch.TRAINER:
        return []
    ckpt = cfg.checkpointing == Checkpointing.FULL
    return [
        "# Loaded as a QLoRA script loads it: AutoModelForCausalLM.from_pretrained(path, "
        "quantization_config=that BitsAndBytesConfig, dtype=torch.bfloat16) (the LM head stays "
        "bf16), then peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing="
        f"{ckpt}) (every non-NF4 parameter upcast to fp32: embeddings, norms, LM head), then "
        "get_peft_model with the lora section's LoraConfig."
    ]


def adamw_notes(doc: dict[str, Any], layout: Layout) -> list[str]:
    """The AdamW implementation a plan measured (`layout.adamw`), where it chose one
    (`optimizer_impl` not `auto`): autofit.apply builds it; HF Trainer's `optim` can say fused and
    foreach only. For a low-bit AdamW whose block size HF Trainer cannot build, what its run holds
    instead."""
    state = LOW_BIT_STATES.get(plan_config(doc).optimizer)
    if state is not None and state.block != HF_TRAINER_LOW_BIT_BLOCK:
        return [
            f"# Optimizer state: torchao {state.torchao_class}(block_size={state.block}) as "
            f"measured; HF Trainer's {state.hf_optim} builds it with block_size="
            f"{HF_TRAINER_LOW_BIT_BLOCK} (its optim_args cannot change that), fewer fp32 scales "
            "than measured. To run what was measured, pass Trainer(optimizers=(run.optimizer, "
            "None)) from autofit.apply."
        ]
    impl = layout.adamw
    if plan_config(doc).optimizer_impl == OptimizerImpl.AUTO or impl is None:
        return []
    trainer = ADAMW_IMPLS[impl].hf_optim
    torch_call = ", ".join(f"{k}={v}" for k, v in ADAMW_IMPLS[impl].kwargs.items())
    hf = (
        f"HF Trainer optim {trainer}"
        if trainer is not None
        else f"HF Trainer has no such optim: its {HF_ADAMW_DEFAULT} is foreach on a GPU"
    )
    what = f"{impl} (torch.optim.AdamW({torch_call}); {hf})"
    return [f"# AdamW step: {what}; autofit.apply builds it (run.optimizer)."]


def batching_notes(cfg: Config) -> list[str]:
    """How the measured micro-batches were made, when not padded (`batching`), and who makes
    them in a run of yours."""
    batching = cfg.batching
    if batching == Batching.GROUPED:
        return [
            "# Batching: length-grouped micro-batches, each padded to its longest (HF Trainer "
            "train_sampling_strategy='group_by_length', LengthGroupedSampler); "
            "run.collate(examples) pads them as measured."
        ]
    if batching == Batching.PACKED:
        return [
            f"# Batching: packed rows of seq_len={cfg.seq_len} tokens, position ids reset per "
            "document, no loss across documents: run.collate(examples) from autofit.apply makes "
            "them as measured; with the HF Trainer, transformers.DataCollatorWithFlattening "
            "(the same position-id packing, one row per micro-batch) over examples packed to "
            "seq_len, or TRL SFTConfig(packing=True, packing_strategy='wrapped', "
            f"max_length={cfg.seq_len})."
        ]
    return []


def embedding_notes(doc: dict[str, Any]) -> list[str]:
    """What `train_embeddings` trains, in words and in peft's terms (the `lora:` section of the
    autofit plan holds the options themselves)."""
    value = plan_config(doc).train_embeddings
    if value == TrainEmbeddings.NONE:
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


def accelerate_notes(doc: dict[str, Any], side: Path) -> list[str]:
    cfg, layout = plan_config(doc), plan_layout(doc)
    sharding = layout.sharding
    notes = [
        f"# Per {device_noun(plan_device(doc))}: micro-batch {cfg.micro_batch} x "
        f"{cfg.grad_accum} accumulation steps, seq_len {cfg.seq_len} (set these in your "
        "script/dataloader).",
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
                if cfg.checkpointing != Checkpointing.NONE
                else " (nothing to gain)."
            )
            + " The Accelerator only launches, sets up the process group autofit.apply uses, "
            "and logs."
        )
    if layout.mesh[0] > 1:
        notes.append(
            "# HSDP: autofit.apply builds the measured (dp_replicate, dp_shard) mesh itself from "
            "torchrun's LOCAL_WORLD_SIZE (accelerate launch runs torchrun)"
            + (
                "; parallelism_config gives the Accelerator's own mesh the same shape."
                if accelerate_hsdp(doc)
                else "; Accelerate has no HSDP with one GPU per node, so no parallelism_config."
            )
        )
    if cfg.wrap.startswith("every-"):
        notes.append(
            f"# autofit measured FSDP2 units of {cfg.wrap[6:]} decoder layers; "
            "Accelerate's own wrapping would wrap each layer (autofit.apply groups them)."
        )
    if cfg.checkpointing != Checkpointing.NONE and (
        sharding is not Sharding.FSDP2 or cfg.checkpointing != Checkpointing.FULL
    ):
        notes.append(
            f"# Checkpointing measured: {cfg.checkpointing} (autofit.apply sets it; "
            + (
                "Accelerate's FSDP flag is all-layer)."
                if sharding is Sharding.FSDP2
                else "this config has no field for it)."
            )
        )
    if cfg.offload == Offload.OPTIMIZER:
        notes.append(
            "# Optimizer state and step on the CPU (torchao CPUOffloadOptimizer): "
            "Accelerate cannot say this; run.optimizer is that optimizer."
        )
    if cfg.optimizer != Optimizer.ADAMW:
        notes.append(f"# Optimizer: torchao {cfg.optimizer} (torchao.optim; run.optimizer).")
    if not layout.fp32_trainable:
        notes.append("# Precision bf16: load the model in torch.bfloat16 (no fp32 master copy).")
    if cfg.compile:
        notes.append(
            "# dynamo_config is the same compile for Accelerate's prepare(), which this recipe "
            "does not call on the model: autofit.apply compiles the layers."
        )
    return notes


def loss_and_compile_notes(cfg: Config) -> list[str]:
    """What the `loss` and `compile` knobs measured, and who sets them up."""
    notes = []
    loss = cfg.loss
    if loss == Loss.CHUNKED:
        notes.append(
            "# Loss: LM head + cross-entropy over chunks of tokens (autofit.builder.loss; "
            "autofit.apply sets it on the model: model(input_ids=..., labels=...).loss)."
        )
    elif loss == Loss.FUSED:
        notes.append(
            "# Loss: Liger's fused linear cross-entropy (pip install 'autofit[liger]'); "
            "autofit.apply sets it on the model."
        )
    if cfg.compile:
        notes.append(
            "# Compile: each decoder layer torch.compile'd after checkpointing, before sharding "
            "(autofit.apply does it as measured; compile time is not in the measured tokens/s)."
        )
    return notes
