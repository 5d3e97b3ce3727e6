"""The rules between knobs, and between a config and where it runs: each a user-facing sentence
(one paragraph) naming what was asked and what is allowed. `Config` refuses a config that breaks
one (`rule_violation`); a space skips such configs and counts why (`broken_rule`'s short reason).
Plain data, no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autofit.settings import ADAPTER_SETTINGS, BNB_SETTINGS, HF_LAUNCHES, trained_token_count
from autofit.values import (
    Batching,
    Checkpointing,
    Launch,
    Loss,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    QuantBackend,
    Shard,
    TrainEmbeddings,
    Wrap,
)

if TYPE_CHECKING:
    from autofit.config import Config


def shard_unavailable(shard: str, nodes: int) -> str | None:
    """Why one config (an estimate, a trial) cannot take `shard` on `nodes` nodes, or None:
    `shard: node` replicates across nodes, so on one it would be `shard: all` labelled HSDP. (A
    space keeps only `all` there instead: `Space.knobs_on`.)"""
    if shard != Shard.NODE or nodes > 1:
        return None
    return (
        "shard=node (HSDP: shard within each node, replicate across nodes) needs several nodes; "
        "on one node it is the same mesh as shard=all. Use shard=all (the default), or name "
        "several nodes with --gpus NxKxNAME (e.g. 2x8xh100-80gb) or --device cpu --gpus NxK."
    )


def lora_settings_unused(settings: dict[str, Any], lora_ranks: Any) -> str | None:
    """Why the adapters' settings (`Config.settings()`' `ADAPTER_SETTINGS`: alpha, targets,
    dropout) cannot be given where every rank in `lora_ranks` is 0, or None: a full fine-tune has
    no adapter to carry them. (`train_embeddings` has a rule of its own, `broken_rule`;
    `optimizer_impl` is every run's.)"""
    given = {k: v for k, v in settings.items() if k in ADAPTER_SETTINGS}
    if not given or any(rank > 0 for rank in lora_ranks):
        return None
    shown = ", ".join(
        f"{k}={','.join(v) if isinstance(v, list | tuple) else v}" for k, v in given.items()
    )
    return (
        f"{shown} configure{'s' if len(given) == 1 else ''} LoRA adapters, but lora_rank=0 is a "
        "full fine-tune, which has none. Set lora_rank > 0 (e.g. 16 or 64) for LoRA, or leave "
        "the LoRA settings out for a full fine-tune."
    )


LIGER_MODULE = "liger_kernel"
"""The import name of Liger's kernels (`pip install 'autofit[liger]'`), which `loss: fused` runs."""


def liger_installed() -> bool:
    """Whether Liger's kernels are importable here (found without importing them, or torch)."""
    import importlib.util

    return importlib.util.find_spec(LIGER_MODULE) is not None


def loss_unavailable(loss: str, device: str) -> str | None:
    """Why `loss` cannot run on `device` here (a short reason the space's skip count shows), or
    None: `fused` is Liger's Triton kernel, CUDA only, and an optional install."""
    if loss != Loss.FUSED:
        return None
    if device != "cuda":
        return "loss=fused needs CUDA (Liger's Triton kernel); chunked is its pure-torch twin"
    if not liger_installed():
        return "loss=fused needs Liger: pip install 'autofit[liger]'"
    return None


FSDP2_WRAPS = tuple(w.value for w in Wrap if w not in (Wrap.AUTO, Wrap.NONE))
"""The wraps that shard with FSDP2 (`auto` is one of them or `none`, `autofit.layout.resolve_wrap`),
which `launch: trainer` and `trl`, and bitsandbytes' weights, do not run yet."""

TRL_MODULE = "trl"
"""The import name of TRL (`pip install 'autofit[trl]'`), whose `SFTTrainer` `launch: trl` runs."""
TRL_VERSION = "1.16.0"
"""The TRL release `launch: trl` is read from and measured with (`autofit[trl]` pins it)."""


def trl_installed() -> bool:
    """Whether TRL is importable here (found without importing it, or torch)."""
    import importlib.util

    return importlib.util.find_spec(TRL_MODULE) is not None


def launch_missing(launch: str) -> str | None:
    """The sentence for a `launch` whose library is not installed here, or None: `launch: trl`
    runs TRL's `SFTTrainer` (its estimate traces TRL's fused LM head too)."""
    if launch != Launch.TRL or trl_installed():
        return None
    return (
        "launch=trl runs TRL's SFTTrainer, and TRL is not installed here: pip install "
        f"'autofit[trl]' (trl {TRL_VERSION}, the release autofit reads and measures), or plan "
        "for launch=trainer (HF Trainer) or launch=autofit."
    )


def launch_unavailable(launch: str) -> str | None:
    """Why `launch` cannot run here (a short reason a space's skip count shows, and the sentence
    an estimate or trial raises), or None: `launch: trl` needs TRL installed (`launch_missing`).
    `launch: trainer` and `trl` run on any number of GPUs: one process with the plain module on
    one, as `python train.py` runs a Trainer or SFTTrainer script, and DDP replicas on several,
    as `torchrun --nproc_per_node N train.py` runs it (FSDP2 through Accelerate is refused by
    `rule_violation`: not measured under Trainer yet)."""
    missing = launch_missing(launch)
    return missing.rstrip(".") if missing else None


def _trainer_unsupported(cfg: Config) -> str | None:
    """The first knob of `cfg` that `launch: trainer` (or `trl`, whose `SFTTrainer` is a
    `Trainer`) cannot run as autofit counts it, or None: HF Trainer (transformers 5.24) on a model
    loaded by `from_config` and wrapped by peft has no torchao quantization of autofit's kind (its
    QLoRA is bitsandbytes': `quant: nf4` with `quant_backend: bitsandbytes`, `launch: trainer`
    only), no chunked loss (its loss is the model's own; Liger's fused one, `use_liger_kernel`,
    is not measured under Trainer yet), checkpoints every decoder layer or none
    (`activation_checkpointing`; no op-level policy), has no CPU offload of the optimizer,
    compiles the whole model rather than each layer (`torch_compile`), and its `optim` names no
    for-loop AdamW on a GPU (`adamw_torch` is torch's default: foreach there). Low-bit AdamW is
    not measured under Trainer yet. TRL's own: `_trl_unsupported`."""
    if cfg.launch == Launch.TRL:
        own = _trl_unsupported(cfg)
        if own:
            return own
    if cfg.quant != Quant.NONE and cfg.quant_backend != QuantBackend.BITSANDBYTES:
        return (
            f"quant={cfg.quant} with quant_backend={cfg.quant_backend} (torchao storage that "
            "autofit's builder applies)"
        )
    if cfg.loss != Loss.STANDARD:
        return f"loss={cfg.loss} (Trainer computes the model's own cross-entropy)"
    if cfg.checkpointing not in (Checkpointing.NONE, Checkpointing.FULL):
        return (
            f"checkpointing={cfg.checkpointing} (Trainer's activation_checkpointing checkpoints "
            "every decoder layer)"
        )
    if cfg.offload != Offload.NONE:
        return (
            f"offload={cfg.offload} (the plain module or DDP without FSDP2: Trainer keeps "
            "everything on the GPU)"
        )
    if cfg.compile:
        return "compile=true (Trainer's torch_compile compiles the whole model, not each layer)"
    if cfg.optimizer != Optimizer.ADAMW:
        return f"optimizer={cfg.optimizer} (torchao's low-bit AdamW under Trainer: not measured)"
    if cfg.optimizer_impl == OptimizerImpl.FOR_LOOP:
        return (
            f"optimizer_impl={cfg.optimizer_impl} (Trainer's optim runs torch AdamW fused, "
            "adamw_torch_fused, or with torch's default, adamw_torch: foreach on a GPU)"
        )
    if cfg.batching == Batching.PACKED and cfg.launch == Launch.TRAINER:
        return "batching=packed (Trainer's collators pad; packing is TRL's SFTTrainer: launch=trl)"
    if cfg.wrap in FSDP2_WRAPS:
        return f"wrap={cfg.wrap} (FSDP2 through Accelerate: not measured under Trainer yet)"
    return None


def _trl_unsupported(cfg: Config) -> str | None:
    """What `launch: trl` refuses beyond Trainer's (TRL 1.16's `SFTTrainer`): any `loss` but
    `standard`, which stands for SFTTrainer's own (a fused LM head over vocabulary tiles, which
    the estimate counts), `train_embeddings: tokens:N` (that head cannot run on peft's
    trainable-token wrapper of the LM head), and LoRA under pure `bf16`, whose adapters
    SFTTrainer's peft wrapping keeps in fp32 (peft's `autocast_adapter_dtype`): that is
    `bf16-mixed`."""
    if cfg.loss != Loss.STANDARD:
        return (
            f"loss={cfg.loss} (SFTTrainer computes its own loss, a fused LM head over tiles of "
            "the vocabulary, which loss=standard stands for under launch=trl)"
        )
    if trained_token_count(cfg.train_embeddings) is not None:
        return (
            f"train_embeddings={cfg.train_embeddings} (SFTTrainer's fused LM head reads the head's "
            "bias, which peft's trainable-token wrapper of the head does not have: TRL 1.16 "
            "fails; train_embeddings=full trains under launch=trl)"
        )
    quantized = cfg.quant != Quant.NONE and cfg.quant_backend == QuantBackend.BITSANDBYTES
    if cfg.is_lora and not quantized and cfg.precision == Precision.BF16:
        return (
            "precision=bf16 with LoRA (SFTTrainer wraps the model with peft itself, whose "
            "adapters stay fp32 beside the bf16 base: precision=bf16-mixed)"
        )
    if quantized and cfg.precision == Precision.BF16_MIXED:
        return (
            "precision=bf16-mixed with QLoRA (SFTTrainer converts the LoRA adapters of a "
            "quantized model to bf16, as the QLoRA paper trains them: precision=bf16)"
        )
    return None


FSDP2_ONLY: dict[str, str] = {"shard": Shard.NODE, "offload": Offload.PARAMS}
"""The knob values only FSDP2 runs (HSDP is a 2-D FSDP2 mesh; CPUOffloadPolicy moves FSDP2's
shards): with one, `wrap: auto` is `layer` even on one GPU (`autofit.layout.resolve_wrap`),
`wrap: none` is refused (`broken_rule`), and a one-GPU space or calibration sweep keeps it
sharded (`autofit.space`, `autofit.calibration.sweep`)."""
_FSDP2_ONLY_WHY = {
    "shard": "shard=node (HSDP: shard within a node, replicate across nodes) needs FSDP2 "
    "(wrap=layer, every-2, every-4 or model): wrap=none runs DDP replicas, which hold "
    "everything on every GPU. Use shard=all with wrap=none.",
    "offload": "offload=params needs FSDP2 (wrap=layer, every-2, every-4 or model; on one GPU a "
    "one-rank FSDP2 mesh, as answer.ai offloads): wrap=none runs the plain module or DDP "
    "replicas, which keep the weights on the GPU.",
}


def fsdp2_only_knob(offload: str, shard: str) -> str | None:
    """The first knob (`FSDP2_ONLY`) whose value here only FSDP2 runs, or None."""
    given = {"offload": offload, "shard": shard}
    return next((knob for knob, value in FSDP2_ONLY.items() if given[knob] == value), None)


QUANT_NEEDS_LORA = "quant needs LoRA"
"""The short reason of the first rule, which a space also applies to whole blocks of configs."""


def quant_without_lora(quant: str, lora_rank: int) -> bool:
    """A quantized base cannot be fully fine-tuned: `quant` needs `lora_rank > 0`."""
    return quant != Quant.NONE and lora_rank == 0


def rule_violation(cfg: Config) -> str | None:
    """The first rule between knobs that `cfg` breaks, as a user-facing sentence, or None."""
    broken = broken_rule(cfg)
    return broken[1] if broken else None


def broken_rule(cfg: Config) -> tuple[str, str] | None:
    """(short reason, full sentence) of the first rule `cfg` breaks, or None."""
    if quant_without_lora(cfg.quant, cfg.lora_rank):
        return (
            QUANT_NEEDS_LORA,
            f"quant={cfg.quant} needs LoRA: a quantized base cannot be fully fine-tuned. "
            "Set lora_rank > 0 (e.g. 16 or 64), or use quant=none for a full fine-tune.",
        )
    bnb = _bnb_rule(cfg)
    if bnb:
        return bnb
    if cfg.train_embeddings != TrainEmbeddings.NONE and cfg.lora_rank == 0:
        return (
            "train_embeddings needs LoRA",
            f"train_embeddings={cfg.train_embeddings} trains the input embeddings and LM head "
            "beside a frozen LoRA base, so it needs lora_rank > 0: a full fine-tune (lora_rank "
            "0) trains the embeddings and head already. Set lora_rank > 0 (e.g. 16 or 64), or "
            "train_embeddings=none for a full fine-tune.",
        )
    if cfg.offload == Offload.PARAMS and cfg.quant == Quant.INT8:
        return (
            "offload=params with int8",
            "offload=params cannot be combined with quant=int8: torchao's int8 weights stay out "
            "of FSDP2 sharding, so FSDP2's CPUOffloadPolicy cannot move them. Use quant=nf4, or "
            "offload=optimizer/none.",
        )
    fsdp2_only = fsdp2_only_knob(cfg.offload, cfg.shard)
    if fsdp2_only and cfg.wrap == Wrap.NONE:
        value = getattr(cfg, fsdp2_only)
        return f"{fsdp2_only}={value} without sharding", _FSDP2_ONLY_WHY[fsdp2_only]
    if cfg.optimizer_impl != OptimizerImpl.AUTO and cfg.optimizer != Optimizer.ADAMW:
        return (
            "optimizer_impl without torch AdamW",
            f"optimizer_impl={cfg.optimizer_impl} chooses how torch's AdamW runs its step, and "
            f"optimizer={cfg.optimizer} is torchao's low-bit AdamW, which has one step of its "
            "own (compiled, one parameter at a time). Use optimizer=adamw, or optimizer_impl=auto.",
        )
    if cfg.launch in HF_LAUNCHES:
        unsupported = _trainer_unsupported(cfg)
        if unsupported:
            knob = unsupported.split("=", 1)[0]
            loop = "TRL's SFTTrainer" if cfg.launch == Launch.TRL else "HF Trainer"
            lora = " (bf16-mixed for LoRA, bf16 for QLoRA)" if cfg.launch == Launch.TRL else ""
            return (
                f"launch={cfg.launch} with {knob}",
                f"launch={cfg.launch} cannot run {unsupported}. Under {loop} autofit measures "
                "LoRA or a full fine-tune of the plain module on one GPU or DDP replicas on "
                "several (wrap=none), with quant=none "
                "(or QLoRA, quant=nf4 with quant_backend=bitsandbytes), "
                "loss=standard, checkpointing none or full, offload=none, compile=false and "
                f"torch AdamW{lora}; use launch=autofit for the rest.",
            )
    return None


def _bnb_rule(cfg: Config) -> tuple[str, str] | None:
    """The rules of `quant_backend: bitsandbytes` and its settings (short reason, sentence)."""
    bnb = cfg.quant_backend == QuantBackend.BITSANDBYTES
    if not bnb:
        given = cfg.changed(BNB_SETTINGS)
        if given:
            return (
                "bnb settings without bitsandbytes",
                f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} bitsandbytes' "
                f"NF4 storage, but quant_backend={cfg.quant_backend}. Set "
                "quant_backend=bitsandbytes (with quant=nf4), or leave the bnb_4bit settings out.",
            )
        return None
    if cfg.quant != Quant.NF4:
        return (
            "quant_backend=bitsandbytes without nf4",
            f"quant_backend=bitsandbytes stores NF4 weights, but quant={cfg.quant}. Use "
            "quant=nf4 with it (and lora_rank > 0), or quant_backend=torchao (the default).",
        )
    if cfg.wrap in FSDP2_WRAPS or cfg.offload == Offload.PARAMS:
        return (
            "bitsandbytes with FSDP2",
            f"quant_backend=bitsandbytes needs wrap=none (the plain module on one GPU, as HF "
            f"Trainer runs QLoRA there; DDP replicas on several): autofit does not build "
            f"bitsandbytes weights under FSDP2 (wrap={cfg.wrap}, offload={cfg.offload}). Use "
            "wrap=none with offload=none or optimizer, or quant_backend=torchao, whose NF4 "
            "shards.",
        )
    if cfg.compile:
        return (
            "bitsandbytes compiled",
            "quant_backend=bitsandbytes with compile=true is not measured yet (torch.compile "
            "of bitsandbytes' Linear4bit layers). Use compile=false, or quant_backend=torchao.",
        )
    return None


def derive_grad_accum(global_batch: int, micro_batch: int, dp_size: int) -> int | None:
    """Micro-steps per optimizer step so micro_batch x grad_accum x dp_size == global_batch.

    Returns None when the division is not exact (that micro-batch cannot reach the global batch).
    """
    per_step = micro_batch * dp_size
    if global_batch <= 0 or global_batch % per_step:
        return None
    return global_batch // per_step
