"""The recipe: facts the builder applies and the estimator counts, each written once.

Plain data and arithmetic, no torch. `autofit.estimate` reads these to count bytes;
`autofit.builder` reads the same names to cast, quantize, checkpoint and build the optimizer, so a
measured trial and its estimate cannot drift apart. A run's values of these rules are resolved
once into `autofit.layout.Layout` (its dtypes, AdamW step, checkpointed layers), which the
builder and the exports read; how a `wrap` holds the model is `autofit.layout`'s own rule
(`sharding_for`). The projections LoRA targets and
quantization touches are read from the model itself (`autofit.builder.model.decoder_projections`,
which `autofit.arch` counts by).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autofit.settings import BNB_QUANT_STORAGES, trained_token_count
from autofit.values import (
    Checkpointing,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    QuantBackend,
    TrainEmbeddings,
)


def fp32_trainable(precision: str, optimizer: str) -> bool:
    """Trainable (master) params in fp32: under bf16-mixed, and always with torchao's low-bit AdamW
    (its compiled step fails on bf16 params under FSDP2: `lerp`/`view(dtype)` on the quantized
    state), whose compute is still bf16. Otherwise bf16. The builder and the estimator read this."""
    return precision == Precision.BF16_MIXED or optimizer != Optimizer.ADAMW


# ----- dtypes -----------------------------------------------------------------------------------
# Named by string so this module needs no torch; `autofit.builder.dtypes` maps them to torch dtypes.
BF16 = "bf16"
FP32 = "fp32"
DTYPE_BYTES: dict[str, int] = {BF16: 2, FP32: 4}

FROZEN_DTYPE = BF16
"""A LoRA run's frozen weights (the base before quantization, embeddings, norms, LM head): bf16
whatever `precision` says, as QLoRA recipes (torchtune, answer.ai) keep them."""

COMPUTE_DTYPE = BF16
"""Matmuls run in bf16: autocast's dtype for the plain module and DDP, FSDP2's `param_dtype`."""


def trainable_dtype(precision: str, optimizer: str) -> str:
    """Trainable (master) params and their sharded gradients: fp32 where
    `fp32_trainable` says so (bf16-mixed, or a torchao low-bit AdamW), else bf16."""
    return FP32 if fp32_trainable(precision, optimizer) else BF16


def reduce_dtype(precision: str) -> str:
    """Gradients are reduced (and, under FSDP2 with `grad_accum > 1`, accumulated unsharded) in
    fp32 under bf16-mixed (`MixedPrecisionPolicy(reduce_dtype=fp32)`), in bf16 under pure bf16."""
    return FP32 if precision == Precision.BF16_MIXED else BF16


# ----- optimizer state --------------------------------------------------------------------------
ADAM_MOMENTS = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter (Loshchilov & Hutter; torch.optim)."""


@dataclass(frozen=True)
class LowBitState:
    """How a torchao low-bit AdamW stores each moment (torchao 0.18 `torchao/optim/adam.py`,
    `subclass_8bit.py`, `subclass_4bit.py`): `value_bytes` per value and one fp32 scale per
    `block` values."""

    torchao_class: str  # the class in `torchao.optim`
    value_bytes: float
    block: int
    hf_optim: str  # HF `TrainingArguments.optim` that builds this class (transformers 5)


LOW_BIT_STATES: dict[str, LowBitState] = {
    Optimizer.ADAMW8BIT: LowBitState(
        "AdamW8bit", value_bytes=1, block=256, hf_optim="adamw_torch_8bit"
    ),
    Optimizer.ADAMW4BIT: LowBitState(
        "AdamW4bit", value_bytes=0.5, block=128, hf_optim="adamw_torch_4bit"
    ),
}
"""Optimizer knob value -> its quantized state. The block sizes are torchao's defaults, and the
builder passes them to torchao explicitly (`block_size`), so a torchao default change cannot make
the estimate stale. The builder reads `torchao_class`, the exports `hf_optim`."""

LOW_BIT_SCALE_BYTES = 4
"""Each block's scale is fp32 (`torch.zeros(n // block_size)` in torchao's `OptimState*.zeros`)."""

LOW_BIT_MIN_NUMEL = 4096
"""torchao quantizes a state only for a (local, per-rank) tensor of at least 4096 values that is a
whole number of blocks ("follow bitsandbytes", `_AdamBase._new_buffer`); smaller ones keep plain
state in the param's dtype."""


def low_bit_quantizes(optimizer: str, local_numel: int) -> bool:
    """Whether torchao keeps this (local shard of a) parameter's moments quantized."""
    state = LOW_BIT_STATES.get(optimizer)
    if state is None:
        return False
    return local_numel >= LOW_BIT_MIN_NUMEL and local_numel % state.block == 0


def state_value_bytes(optimizer: str, param_bytes: int) -> float:
    """Bytes of one moment value: the quantized width of a low-bit AdamW, else the param's."""
    state = LOW_BIT_STATES.get(optimizer)
    return float(state.value_bytes) if state is not None else float(param_bytes)


def optimizer_state_bytes_per_param(optimizer: str, param_bytes: int) -> float:
    """Both moments per parameter. AdamW: 2 x the param's bytes (with fp32 masters the classic
    4 + 4 + 8 = 16 B/param of mixed precision, ZeRO paper, Rajbhandari et al. 2020: 1.5B params ->
    24 GB). Low-bit AdamW: 2 x (value + fp32 scale per block): 8-bit 2.03 B, 4-bit 1.06 B.
    Counted for every trainable param: the tensors under `LOW_BIT_MIN_NUMEL` that torchao keeps
    unquantized are norms and tiny-model adapters, a negligible share at real model sizes."""
    state = LOW_BIT_STATES.get(optimizer)
    if state is None:
        return ADAM_MOMENTS * param_bytes
    return ADAM_MOMENTS * (state.value_bytes + LOW_BIT_SCALE_BYTES / state.block)


@dataclass(frozen=True)
class AdamWImpl:
    """How one implementation of torch's AdamW (`optimizer_impl`, `adamw_impl`) runs its step:
    what the estimator counts, what the builder passes and what the exports name."""

    intermediates: int
    """Tensors its step (`torch/optim/adam.py`, torch 2.13, weight decay off or decoupled, no
    amsgrad, not capturable) allocates and holds at its peak: `fused` (`_fused_adamw_`, one
    kernel per (device, dtype) group on CUDA and, since torch 2.4, on CPU) none; `foreach`
    (`_multi_tensor_adam`) one the size of every parameter of a (device, dtype) group at once,
    `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, updated in place and freed after
    `_foreach_addcdiv_` (torch 2.0 held a second, `denom`: pytorch#97712, cut by #104898 for
    2.1); `for-loop` (`_single_tensor_adam`) two the size of one parameter, in turn,
    `exp_avg_sq.sqrt()` and its quotient by `bias_correction2_sqrt`, so the largest parameter
    sizes them. Each in the parameter's own dtype."""
    kwargs: Mapping[str, bool]
    """`torch.optim.AdamW`'s arguments for it: the builder passes them, the exports' comments
    name them."""
    hf_optim: str | None
    """HF `TrainingArguments.optim` that runs it (transformers 5's `OptimizerNames`:
    `adamw_torch_fused` passes `fused=True`, `adamw_torch` leaves torch its default, foreach on a
    GPU). None: Trainer has no such choice (the for-loop)."""


ADAMW_IMPLS: dict[str, AdamWImpl] = {
    OptimizerImpl.FUSED: AdamWImpl(0, {"fused": True}, "adamw_torch_fused"),
    OptimizerImpl.FOREACH: AdamWImpl(1, {"foreach": True}, "adamw_torch"),
    OptimizerImpl.FOR_LOOP: AdamWImpl(2, {"foreach": False}, None),
}
"""Each implementation `adamw_impl` resolves (the `optimizer_impl` values but `auto`)."""

HF_ADAMW_DEFAULT = "adamw_torch"
"""Trainer's plain torch AdamW: what an export names where fused cannot run (params off the GPU)
or the for-loop was measured (Trainer has none)."""


def hf_optim(optimizer: str, impl: str | None, offload: str) -> str:
    """HF `TrainingArguments.optim` for a run of `optimizer` stepping with `impl`
    (`adamw_impl`): torchao's class for a low-bit AdamW (`LowBitState.hf_optim`), the fused
    torch AdamW where the measured step was fused on GPU params, else Trainer's plain one."""
    state = LOW_BIT_STATES.get(optimizer)
    if state is not None:
        return state.hf_optim
    if offload != Offload.NONE or impl is None:
        return HF_ADAMW_DEFAULT
    return ADAMW_IMPLS[impl].hf_optim or HF_ADAMW_DEFAULT


HF_TRAINER_LOW_BIT_BLOCK = 256
"""The `block_size` HF Trainer (transformers 5, `trainer_optimizer._get_torchao_optimizer`) passes
to both torchao low-bit AdamWs. Its `optim_args` cannot change it: they reach torchao as strings,
which its step refuses (`numel % block_size`). Where a `LowBitState.block` differs (4-bit: 128),
a Trainer run of the export holds other optimizer state than was measured (`export.prose`)."""


def adamw_impl(
    setting: str, optimizer: str, device: str, offload: str, hf_optim_only: bool = False
) -> str | None:
    """The implementation of torch's AdamW a run's step uses (a key of `ADAMW_IMPLS`), or
    None for torchao's low-bit AdamW, which has its own step. `auto` is fused where the
    parameters the step updates are on the GPU (torchao's `CPUOffloadOptimizer` too, which runs it
    on host copies), and torch's own choice where they are CPU tensors (a CPU trial, FSDP2's
    `offload=params`): its for-loop, as torch has no foreach kernels on CPU. `hf_optim_only`: the
    step is made by HF Trainer from `TrainingArguments.optim` alone (`launch: trainer`, `trl`),
    whose `adamw_torch` passes no `foreach`, so `foreach` is torch's default: foreach on GPU
    tensors, the for-loop on CPU ones (a CPU trial). The builder builds this and the estimator
    counts it."""
    if optimizer != Optimizer.ADAMW:
        return None
    on_gpu = device == "cuda" and offload != Offload.PARAMS
    if setting == OptimizerImpl.FOREACH and hf_optim_only and not on_gpu:
        return OptimizerImpl.FOR_LOOP.value
    if setting != OptimizerImpl.AUTO:
        return setting
    return (OptimizerImpl.FUSED if on_gpu else OptimizerImpl.FOR_LOOP).value


# ----- trainable embeddings and LM head (`train_embeddings`) -------------------------------------
EMBEDDING_MODULE = "embed_tokens"
"""The input embedding's name in every supported HF family; the builder finds the module itself
(`get_input_embeddings`) and exports name it in peft's terms (`modules_to_save`)."""

HEAD_MODULE = "lm_head"
"""The LM head's name in every supported HF family (`get_output_embeddings`)."""


def trained_embedding_modules(train_embeddings: str, tied: bool) -> tuple[str, ...]:
    """The modules `train_embeddings` trains (beside a frozen LoRA base): none, or the input
    embedding and the LM head. A tied head shares the embedding's weight, and stays tied: one
    trained weight, the embedding's (peft `ensure_weight_tying`: the head's trainable copy, or
    its token rows, are the embedding's). The builder wraps exactly these (peft's
    `modules_to_save` or `trainable_token_indices`) and the estimator counts their weights."""
    if train_embeddings == TrainEmbeddings.NONE:
        return ()
    return (EMBEDDING_MODULE,) if tied else (EMBEDDING_MODULE, HEAD_MODULE)


def trained_token_ids(train_embeddings: str, vocab: int) -> range:
    """The token ids (rows of each trained module's weight) that train: every id with `full`
    (peft `modules_to_save`: a trainable copy of the whole weight), the last N with `tokens:N`
    (peft `trainable_token_indices`: the ids a tokenizer appends for a chat template's new
    tokens), none with `none`. N beyond the vocabulary is the caller's error to report."""
    if train_embeddings == TrainEmbeddings.NONE:
        return range(0)
    count = trained_token_count(train_embeddings)
    if count is None:
        return range(vocab)
    return range(max(vocab - count, 0), vocab)


def embedding_peft_options(
    train_embeddings: str, vocab: int, tied: bool, names: dict[str, str] | None = None
) -> dict[str, object]:
    """The peft `LoraConfig` options that train what `train_embeddings` says: `full` is
    `modules_to_save` of `trained_embedding_modules` (peft deep-copies each into a trainable
    module beside the frozen original), with `ensure_weight_tying` for a tied head (else peft
    0.21 copies the shared weight twice and unties them); `tokens:N` is
    `trainable_token_indices` of `trained_token_ids` in each trained module (a tied head's rows
    follow the embedding's: peft's list form). `names` maps `EMBEDDING_MODULE`/`HEAD_MODULE` to
    the model's own module paths (the builder's); by default peft matches the leaf names (the
    exports'). The builder and the exports both write these."""
    modules = [(names or {}).get(m, m) for m in trained_embedding_modules(train_embeddings, tied)]
    if not modules:
        return {}
    if trained_token_count(train_embeddings) is None:
        if tied:
            return {"modules_to_save": modules, "ensure_weight_tying": True}
        return {"modules_to_save": modules}
    ids = list(trained_token_ids(train_embeddings, vocab))
    if tied:
        return {"trainable_token_indices": ids}
    return {"trainable_token_indices": {name: ids for name in modules}}


EMBEDDING_PEFT_OPTIONS = ("modules_to_save", "ensure_weight_tying", "trainable_token_indices")
"""Every key `embedding_peft_options` can return, each a `LoraConfig` argument of that name: what
a reader of an export's `lora` section passes on to peft beside the rank, alpha, dropout and
targets (`autofit.builder.trainer.lora_config`)."""


# ----- activation checkpointing ------------------------------------------------------------------
@lru_cache(maxsize=256)
def checkpointed_layers(checkpointing: str, n_layers: int) -> tuple[int, ...]:
    """Indices of the decoder layers wrapped in activation checkpointing: every layer (`full`,
    and op-level `selective`), layers 0, 2, 4, ... (`every-2`), or none. A run's list is
    `Layout.checkpointed`, which the builder wraps; the estimator's terms, memoised per knob
    value, count their saved inputs and recomputed forwards from this same rule."""
    return tuple(_checkpointed_range(checkpointing, n_layers))


def recompute_policy(checkpointing: str) -> str:
    """How a layer that `checkpointing` wraps recomputes (a layer trace's `policy`): op by op
    under `selective`, the whole layer under `full` and `every-2` (its wrapped layers)."""
    selective = checkpointing == Checkpointing.SELECTIVE
    return (Checkpointing.SELECTIVE if selective else Checkpointing.FULL).value


def checkpointed_count(checkpointing: str, n_layers: int) -> int:
    """How many decoder layers `checkpointed_layers` wraps, counted, not listed: what the
    estimator reads, in a time that does not grow with the layers."""
    return len(_checkpointed_range(checkpointing, n_layers))


def _checkpointed_range(checkpointing: str, n_layers: int) -> range:
    if checkpointing in (Checkpointing.FULL, Checkpointing.SELECTIVE):
        return range(n_layers)
    if checkpointing == Checkpointing.EVERY_2:
        return range(0, n_layers, 2)
    return range(0)


# ----- LoRA under selective checkpointing ---------------------------------------------------------
LORA_LOW_RANK_RATIO = 8
"""A matmul whose contraction dim is at least this many times smaller than its output width is a
low-rank expansion (LoRA's B: rank r -> width d): cheap to recompute and as costly to store as the
base projection's output, so selective checkpointing recomputes it."""


def is_low_rank_expansion(inner: int, out_features: int) -> bool:
    """Selective checkpointing recomputes (does not save) a matmul `inner -> out_features` when
    `inner x LORA_LOW_RANK_RATIO <= out_features`: LoRA's B for d >= 8r."""
    return inner * LORA_LOW_RANK_RATIO <= out_features


# ----- quantized base weights under FSDP2 ---------------------------------------------------------
QUANT_TENSOR_CLASS: dict[str, str] = {Quant.INT8: "Int8Tensor", Quant.NF4: "NF4Tensor"}
"""The torchao tensor subclass each `quant` stores a base weight as."""


def base_stays_whole(quant: str, shard: int) -> bool:
    """Whether FSDP2 must leave a quantized base weight unsharded (`ignored_params`), whole on
    every GPU: torchao `Int8Tensor` always (no `aten.split`); `NF4Tensor` on a one-rank mesh
    (torch 2.13's one-rank shortcut in `FSDPParamGroup.wait_for_unshard` assumes one all-gather
    input per parameter, and NF4's `fsdp_pre_all_gather` has three; on one rank there is nothing to
    shard anyway). The builder's `unshardable_params` and the estimator's base bytes read this."""
    return quant == Quant.INT8 or (quant == Quant.NF4 and shard == 1)


# ----- NF4 (QLoRA) storage ----------------------------------------------------------------------
NF4_BLOCK = 64
"""Weights per absmax scale: QLoRA's block of 64 (Dettmers et al. 2023; torchao `to_nf4`;
bitsandbytes' `blocksize`, which autofit passes to it rather than rely on its default)."""

NF4_SCALER_BLOCK = 256
"""int8 scales per double-quantization block (torchao `to_nf4` default)."""


def nf4_bytes_per_param(block: int = NF4_BLOCK, scaler_block: int = NF4_SCALER_BLOCK) -> float:
    """torchao `NF4Tensor`: 4-bit codes (0.5 B), one int8 scale per `block` weights, and one
    quantization factor in the weight's dtype (bf16, 2 B) per `block x scaler_block` weights."""
    return 0.5 + 1 / block + 2 / (block * scaler_block)


# ----- NF4 (QLoRA) storage by bitsandbytes --------------------------------------------------------
# bitsandbytes 0.50 (`functional.quantize_4bit`, `Params4bit._quantize`) stores a weight of n
# elements as: the packed 4-bit codes, ceil(n / 2) bytes viewed as `quant_storage` (a flat
# `(bytes / itemsize, 1)` tensor: the dtype changes the element count, never the bytes); one fp32
# absmax per block of `NF4_BLOCK` weights, the last block short; and the 16 fp32 NF4 levels
# (`QuantState.code`, a fresh tensor per weight). With double quantization
# (`compress_statistics`, transformers' `bnb_4bit_use_double_quant`) the absmax are stored as
# uint8 codes of their difference from their mean (`offset`, a 0-d fp32), blocks of
# `BNB_ABSMAX_BLOCK` of them sharing one fp32 absmax, with the 256-entry fp32 dynamic map of
# those codes (`state2.code`, copied per weight) beside them.
BNB_ABSMAX_BLOCK = 256
"""absmax per second-level block under double quantization: bitsandbytes' fixed `blocksize=256`
in `quantize_4bit` (`compress_statistics`); no argument changes it."""

BNB_NF4_LEVELS = 16
"""fp32 entries of `QuantState.code` for NF4 (`get_4bit_type("nf4")`)."""

BNB_DYNAMIC_MAP_ENTRIES = 256
"""fp32 entries of the double-quantized absmax's code (`create_dynamic_map()`, 8-bit)."""

BNB_QUANT_STORAGE: dict[str, int] = dict(zip(BNB_QUANT_STORAGES, (1, 2, 2, 4), strict=True))
"""`bnb_4bit_quant_storage` names (`autofit.settings.BNB_QUANT_STORAGES`) -> bytes per element:
the dtype the packed codes are viewed as (uint8 by default; FSDP needs it equal to the other
parameters' dtype, e.g. bf16)."""

TORCH_NAMES: dict[str, str] = dict(
    zip(BNB_QUANT_STORAGES, ("uint8", "bfloat16", "float16", "float32"), strict=True)
)
"""autofit's dtype names (`BF16`, `FP32` and the other `bnb_4bit_quant_storage` names) as torch's
dtypes (`torch.<name>`): what the builder passes to bitsandbytes, and the export writes into
`BitsAndBytesConfig` and TRL's `model_init_kwargs`."""


def bnb_nf4_bytes(numel: int, double_quant: bool, quant_storage: str = "uint8") -> int:
    """Bytes bitsandbytes stores for one NF4 weight of `numel` elements (`Params4bit` data plus
    every tensor of its `QuantState`, the nested one included), `NF4_BLOCK` weights per absmax.
    A `quant_storage` wider than a byte must divide the packed bytes (bitsandbytes' `view`
    fails otherwise): ValueError."""
    codes = -(-numel // 2)
    width = BNB_QUANT_STORAGE[quant_storage]
    if codes % width:
        raise ValueError(
            f"bitsandbytes cannot store the {codes} bytes of a {numel}-element NF4 weight as "
            f"{quant_storage} ({width} B each): use bnb_4bit_quant_storage=uint8"
        )
    fp32 = DTYPE_BYTES[FP32]
    blocks = -(-numel // NF4_BLOCK)
    levels = BNB_NF4_LEVELS * fp32
    if not double_quant:
        return codes + blocks * fp32 + levels
    second = -(-blocks // BNB_ABSMAX_BLOCK)  # uint8 absmax codes, fp32 offset, absmax2, map
    return codes + blocks + fp32 + second * fp32 + BNB_DYNAMIC_MAP_ENTRIES * fp32 + levels


@dataclass(frozen=True)
class Bnb4bit:
    """How bitsandbytes stores a run's NF4 base projections (`quant_backend: bitsandbytes`): the
    builder passes these to `Linear4bit` / `Params4bit` (with `NF4_BLOCK`), the estimator counts
    `bnb_nf4_bytes` of them."""

    double_quant: bool = False  # `compress_statistics`, `bnb_4bit_use_double_quant`
    quant_storage: str = "uint8"  # a `BNB_QUANT_STORAGE` name

    def weight_bytes(self, numel: int) -> int:
        return bnb_nf4_bytes(numel, self.double_quant, self.quant_storage)


def bits_and_bytes_config(bnb: Bnb4bit) -> dict[str, Any]:
    """`transformers.BitsAndBytesConfig` of a bitsandbytes NF4 run as plain data: its keyword
    arguments, and with `quant_method` the dict `from_pretrained` (and TRL's `SFTConfig.
    model_init_kwargs`) takes as `quantization_config` (`AutoQuantizationConfig.from_dict`):
    4-bit NF4 computing in `COMPUTE_DTYPE`, with the run's double quantization and storage."""
    return {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": TORCH_NAMES[COMPUTE_DTYPE],
        "bnb_4bit_use_double_quant": bnb.double_quant,
        "bnb_4bit_quant_storage": TORCH_NAMES[bnb.quant_storage],
    }


def bnb_storage(
    quant: str, quant_backend: str, double_quant: bool = False, quant_storage: str = "uint8"
) -> Bnb4bit | None:
    """bitsandbytes' storage of a run's base (`quant: nf4` with `quant_backend: bitsandbytes`),
    or None (torchao's, or no quantization)."""
    if quant != Quant.NF4 or quant_backend != QuantBackend.BITSANDBYTES:
        return None
    return Bnb4bit(double_quant, quant_storage)


def bnb_of(knobs: Any) -> Bnb4bit | None:
    """`bnb_storage` of a config, or of the knobs a term reads (anything with `quant`,
    `quant_backend` and the `bnb_4bit_*` settings): what the layout and the estimate both read."""
    return bnb_storage(
        knobs.quant, knobs.quant_backend, knobs.bnb_4bit_use_double_quant,
        knobs.bnb_4bit_quant_storage,
    )  # fmt: skip


def optional_libraries(knobs: Any) -> frozenset[str]:
    """The optional libraries that building and stepping a config import (anything with the
    knobs `bnb_of` reads, `optimizer` and `offload`): bitsandbytes for its NF4 base (`bnb_of`);
    torchao for its own NF4 or int8 base (`autofit.builder.nf4`, `quantize`), its low-bit AdamW
    (`LOW_BIT_STATES`) or its CPU-offloaded optimizer state (`offload: optimizer`:
    `CPUOffloadOptimizer`). A trial's rank keeps the others out (`autofit.trials.worker`)."""
    used = set()
    if bnb_of(knobs) is not None:
        used.add("bitsandbytes")
    elif knobs.quant in (Quant.NF4, Quant.INT8):
        used.add("torchao")
    if knobs.optimizer in LOW_BIT_STATES or knobs.offload == Offload.OPTIMIZER:
        used.add("torchao")
    return frozenset(used)


NF4_QUANTIZE_CHUNK = 1024**2
"""torchao quantizes to NF4 in chunks of this many weights (`nf4_tensor.CHUNK_SIZE`); each chunk
briefly holds its distance to all 16 NF4 levels in the weight's dtype (~32 B per weight)."""
