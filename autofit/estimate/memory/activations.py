"""Activations: what the traced decoder layers keep for backward (`autofit.arch.activations_of`),
the loss's tensors over the vocabulary, the last layer's backward, compiled fusions.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import autofit.recipe as recipe
from autofit.arch import activations_of
from autofit.estimate.memory.sharded import gathered_layer_bytes, head_unit_bytes
from autofit.estimate.memory.widths import BF16, FP32, Targets, traced_loss
from autofit.layout import Sharding, wrap_group_size
from autofit.models import ModelSpec
from autofit.settings import HF_LAUNCHES
from autofit.structure import ActivationKey, LayerActivations, Structure
from autofit.values import Checkpointing, Launch, Loss, Quant, Wrap


# ----- activations ------------------------------------------------------------------------------
def activation_bytes(
    model: ModelSpec, s: Structure, micro_batch: int, seq_len: int, lora_rank: int,
    checkpointing: str, autocast: bool, targets: Targets = None, dropout: float = 0.0,
    loss: str = Loss.STANDARD, launch: str = Launch.AUTOFIT, kbit: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(decoder layers, outside the layers) activation bytes of one micro-batch at the peak of
    forward, from one layer of the real architecture traced at real width
    (`autofit.arch.activations_of`: what it keeps for backward, per checkpointing policy, LoRA
    rank, targets and dropout, and whether it runs under autocast). Per layer:

    - none: what the layer keeps;
    - full: its checkpointed input;
    - every-2: `autofit.recipe.checkpointed_layers` (the builder's list) checkpointed, the rest
      kept;
    - selective: what op-level checkpointing saves (matmul and attention outputs).
    Outside the layers: embedding side, shared rotary tables and masks, final norm, and the
    logits and loss at their peak over the vocabulary (forward, and the start of backward), as
    the `loss` knob computes them (`traced_loss`: the whole batch's logits, or one chunk's beside
    the hidden states' gradient).
    Under `launch: trainer` a LoRA layer under autocast is traced with peft's casts of each
    adapter's input (`adapter_casts`): the bf16 copy autocast makes of each fp32 cast is saved;
    `kbit`: the model is bitsandbytes QLoRA after `prepare_model_for_kbit_training`
    (`kbit_prepared`), traced so (`ActivationKey.kbit`: an fp32 residual stream).
    The last layer's backward is `layer_backward_bytes`: it is never alive together with
    the loss's tensors (CPU trials of every family: counting both over-estimated checkpointed
    runs by 10-44%, bench/accuracy.py --families)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout, loss, launch, kbit)  # fmt: skip
    n = s.layers
    fixed = head_grad_sum_bytes(model, lora_rank, loss)
    if ckpt is None:
        return micro_batch * n * kept.layer, _outside(kept.root, micro_batch, fixed)
    k = recipe.checkpointed_count(checkpointing, n)
    per_seq = k * ckpt.layer + (n - k) * kept.layer
    return micro_batch * per_seq, _outside(ckpt.root, micro_batch, fixed)


def head_grad_sum_bytes(model: ModelSpec, lora_rank: int, loss: str) -> float:
    """The chunked loss's fp32 sum of the LM head's gradient in a full fine-tune (4 B x vocab x
    hidden, `autofit.builder.loss`), allocated once per micro-step whatever the micro-batch: the
    part of the traced root (one sequence) that does not scale with it (at Llama 3 8B's width,
    2 GiB that micro-batch 8 would otherwise count eight times). Liger's kernel sums it in the
    weight's dtype (an upper bound)."""
    if lora_rank or traced_loss(loss) != Loss.CHUNKED:
        return 0.0
    return FP32 * model.vocab * model.hidden


def _outside(root: float, micro_batch: int, fixed: float) -> float:
    """Bytes outside the layers for `micro_batch` sequences from the one-sequence trace."""
    return micro_batch * (root - fixed) + fixed


def loss_forward_bytes(
    model: ModelSpec, micro_batch: int, seq_len: int, lora_rank: int, checkpointing: str,
    autocast: bool, targets: Targets = None, dropout: float = 0.0, loss: str = Loss.STANDARD,
    launch: str = Launch.AUTOFIT, kbit: bool = False,
) -> float:  # fmt: skip
    """What lives outside the layers at the peak of forward alone, the loss computed but its
    backward not begun (`LayerActivations.root_forward`): for `standard` the bf16 logits, their
    fp32 copy and log-softmax's output (less than at the start of its backward); for `chunked`
    and `fused` the whole loss, whose gradients are computed in forward. FSDP2 still holds its
    last all-gather output then (`forward_gather_buffer_bytes`)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout, loss, launch, kbit)  # fmt: skip
    fixed = head_grad_sum_bytes(model, lora_rank, loss)
    return _outside((ckpt or kept).root_forward, micro_batch, fixed)


def forward_gather_buffer_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """The all-gather output of the last unit FSDP2 gathered in forward, which it keeps beside
    that unit's unsharded parameters until the next all-gather in forward or the root's
    post-forward (`AllGatherState`, "free the last all-gather result", torch 2.13
    `_fsdp_param_group.wait_for_unshard`, `_fsdp_state._post_forward`). A HF causal LM computes
    its loss inside the root's forward, so through the loss's forward this is a second copy of
    `[norm, head]` (untied), or of the last unit of decoder layers (a tied head lives in the
    root). Measured on CPU trials (two gloo ranks, 128K vocabulary): without it, `loss: chunked`,
    whose whole working set is in forward, was under-estimated by 29%. `model` (the root's own
    buffer, alive through forward) is the `gather` phase's (`root_all_gather_buffer_bytes`)."""
    if sharding is not Sharding.FSDP2 or wrap == Wrap.MODEL:
        return 0.0
    if not s.tied_embeddings:
        return head_unit_bytes(s)
    k = max(1, min(wrap_group_size(wrap, s.layers), s.layers))
    return k * gathered_layer_bytes(s, quant, lora_rank, targets)


def layer_backward_bytes(
    model: ModelSpec, micro_batch: int, seq_len: int, lora_rank: int, checkpointing: str,
    autocast: bool, targets: Targets = None, dropout: float = 0.0, launch: str = Launch.AUTOFIT,
    kbit: bool = False,
) -> float:  # fmt: skip
    """What the last decoder layer's backward holds at its peak besides the activations the
    layers kept (`LayerActivations.backward`, traced as its own moment: the one-layer model's
    whole backward): the gradient flowing in, the gradients of the layer's activations in flight
    and its backward's temporaries (SwiGLU's, attention's), and under checkpointing the layer
    recomputed with all its activations. Parameters' gradients are counted from the parameters.
    By then the loss's tensors over the vocabulary have been freed (`estimate` takes the larger
    moment). With `every-2` the larger of a checkpointed and a kept layer's (the peak is at
    whichever backward holds more)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout, Loss.STANDARD, launch, kbit)  # fmt: skip
    if ckpt is None:
        return micro_batch * kept.backward
    if checkpointing == Checkpointing.EVERY_2:
        return micro_batch * max(kept.backward, ckpt.backward)
    return micro_batch * ckpt.backward


def compiled_fusion_applies(lora_rank: int, checkpointing: str) -> bool:
    """Whether `compile` makes a config hold more than its eager twin (`compiled_mlp_fusion_bytes`):
    LoRA with whole-layer recomputation."""
    return bool(lora_rank) and checkpointing in (Checkpointing.FULL, Checkpointing.EVERY_2)


def compiled_mlp_fusion_bytes(
    s: Structure, micro_batch: int, seq_len: int, targets: Targets = None
) -> float:
    """What a compiled, recomputed LoRA layer's MLP backward holds beyond the eager one's: Inductor
    fuses the recomputed SwiGLU with its backward into one kernel whose inputs keep the base and
    LoRA partial products of gate and up apart (`base + scale x LoRA` is never materialised) and
    of down's input gradient, beside its outputs once per branch: a token-width tensor per adapted
    MLP output and per adapted MLP input more than eager holds. Measured on CPU trials
    (`bench/compile_memory.py`, llama-debug and llama-mini LoRA r16 `ckpt=full`, seq 128): the
    compiled peak 11-13% above eager, +4.5 x micro_batch x seq x intermediate x 2 B in one layer
    (this counts 5 for Llama's all-linear targets); without recomputation compiling keeps less
    (the partitioner recomputes element-wise results), which the estimate does not count."""
    width = sum(
        2 * p.out_features if p.in_features == s.hidden else p.in_features
        for p in s.targets(targets)
        if p.name.startswith("mlp.")
    )
    return micro_batch * seq_len * BF16 * width


def compiled_recomputed_bytes(
    s: Structure, micro_batch: int, seq_len: int, checkpointing: str
) -> float:
    """What a compiled decoder layer that keeps its activations (not recomputed) saves less than
    the eager one: the MLP's activation output, `act(gate)`, which eager saves for the product's
    backward and AOTAutograd's min-cut partitioner recomputes in backward from `gate` (saved
    anyway, for the activation's own backward). Read off the partitioned graph of a LoRA r16
    Llama layer on CPU (torch 2.13: the backward graph's saved inputs,
    `tests/estimate/test_compiled_memory.py`): eager saves 21,640 B a token, compiled 16,840, one
    intermediate-width bf16 tensor and one hidden-width fp32 tensor (RMSNorm's fp32 copy) less.
    Only the first is counted: the README's main job on the H200 (llama-7b LoRA r16 mb8 bf16
    compiled, no recomputation) peaked at 90.4 GiB reserved against 103.6 estimated with eager
    activations, 92.9 without the MLP's outputs and 84.9 without the fp32 copies too, so
    Triton's partition keeps what the CPU's drops there. Dense MLPs only (the width
    `down_proj` reads); none for MoE experts."""
    width = sum(p.in_features for p in s.projections if p.name.endswith("down_proj"))
    kept = s.layers - recipe.checkpointed_count(checkpointing, s.layers)
    return kept * micro_batch * seq_len * width * BF16


NF4_DEQUANT_TRANSIENT_BYTES = 14.0
"""Bytes per weight alive while torchao 0.18 dequantizes an NF4 weight for a matmul
(`NF4Tensor.get_original_weight` in `linear_nf4`'s forward, and again in its backward): the
unpacked codes, their looked-up values, the scales and the bf16 weight, freed after the matmul.
Measured with the trials' tensor tracker on a 4096 x 1024 and an 11008 x 4096 weight: 14.02-14.05
B per weight in forward and in backward (the same aten ops run on CUDA)."""


def bnb_dequant_transient_bytes(double_quant: bool) -> float:
    """Bytes per weight alive while bitsandbytes 0.50 dequantizes an NF4 weight for a matmul
    (`MatMul4Bit`: `gemm_4bit` in forward, `dequantize_4bit` in backward): the weight in the
    compute dtype, and with double quantization its fp32 absmax, dequantized first. Measured with
    the trials' tensor tracker on CPU (688x256, 1024x4096, 4096x1024): 2.0 B per weight in
    backward, 2.04-2.06 with double quantization; forward's `gemm_4bit` is one custom op on CPU,
    whose inside the tracker does not see, counted the same."""
    absmax = FP32 / recipe.NF4_BLOCK if double_quant else 0.0
    return recipe.DTYPE_BYTES[recipe.COMPUTE_DTYPE] + absmax


def dequant_transient_bytes(s: Structure, quant: str, bnb: recipe.Bnb4bit | None = None) -> float:
    """The working memory of dequantizing the largest NF4 projection (one matmul at a time, in a
    layer's forward and again in its backward): torchao's, or bitsandbytes' with `bnb`. int8
    keeps its bf16 copy for backward instead (`int8_saved_weight_bytes`) and holds nothing more
    (measured: 2.0 B per weight kept, 0.03 B more in backward)."""
    if quant != Quant.NF4:
        return 0.0
    per = (
        NF4_DEQUANT_TRANSIENT_BYTES
        if bnb is None
        else bnb_dequant_transient_bytes(bnb.double_quant)
    )
    return per * max(p.weight_params for p in s.projections)


@lru_cache(maxsize=4096)
def _layer_traces(
    model: ModelSpec, seq_len: int, lora_rank: int, checkpointing: str, autocast: bool,
    targets: Targets, dropout: float, loss: str = Loss.STANDARD, launch: str = Launch.AUTOFIT,
    kbit: bool = False,
) -> tuple[LayerActivations, LayerActivations | None]:  # fmt: skip
    """The traced layer without checkpointing, and checkpointed as `checkpointing` does it
    (op-level for `selective`, the whole layer otherwise; None without checkpointing): the two
    traces `activation_bytes`, `loss_forward_bytes` and `layer_backward_bytes` read (memoised:
    a space asks for the same few thousands of times). `launch`: under `trainer` a LoRA layer
    under autocast keeps peft's casts of its adapters' inputs (`adapter_casts`); `kbit`: traced
    as bitsandbytes QLoRA after `prepare_model_for_kbit_training` (`ActivationKey.kbit`)."""
    casts = adapter_casts(launch, lora_rank, autocast)
    key = ActivationKey(
        seq_len, lora_rank, targets, dropout, Checkpointing.NONE, autocast,
        traced_loss(loss, launch), casts, kbit,
    )  # fmt: skip
    kept = activations_of(model, key)
    if checkpointing == Checkpointing.NONE:
        return kept, None
    return kept, activations_of(model, replace(key, policy=recipe.recompute_policy(checkpointing)))


def adapter_casts(launch: str, lora_rank: int, autocast: bool) -> bool:
    """Whether the traced layer keeps peft's cast of each adapter's input to the adapters' dtype
    (`ActivationKey.adapter_casts`): a LoRA model under autocast that autofit's builder did not
    set up (`launch: trainer`, and `trl`, whose SFTTrainer wraps the model with peft itself;
    `autofit.builder.apply.keep_lora_inputs` turns the casts off). Elsewhere the casts are
    no-ops (the input is already in the adapters' dtype) or absent."""
    return launch in HF_LAUNCHES and lora_rank > 0 and autocast


def int8_saved_weight_bytes(s: Structure, checkpointing: str) -> float:
    """torchao's int8 weight-only linear computes `mm(x, qdata.t().to(bf16)) * scale`
    (torchao `Int8Tensor` linear, per-row path), so autograd saves the bf16 copy of every
    projection weight for the input gradient: 2 B per base weight of every layer whose
    activations are kept (one layer at a time inside checkpointed layers). Measured on CPU trials
    (docs/accuracy.md): without this term int8 runs were under-estimated by 20-28%."""
    return layers_keeping_activations(s, checkpointing) * s.layer_linear_params * BF16


def layers_keeping_activations(s: Structure, checkpointing: str) -> int:
    """Decoder layers whose every saved tensor is alive at once: all without checkpointing, the
    uncheckpointed half plus the one being recomputed with `every-2`, only the one being
    recomputed with `full` or op-level `selective` (which recomputes the pointwise ops). The
    checkpointed layers are `autofit.recipe.checkpointed_layers`, the builder's list."""
    checkpointed = recipe.checkpointed_count(checkpointing, s.layers)
    kept = s.layers - checkpointed + (1 if checkpointed else 0)
    return min(kept, s.layers)


def packed_mask_bytes(
    model: ModelSpec, s: Structure, micro_batch: int, seq_len: int, checkpointing: str
) -> float:
    """`batching: packed` under SDPA, beyond the same rows unpacked: the block-diagonal causal
    mask transformers builds from the position ids once per forward (bool, `rows x seq_len²`,
    alive to the end of backward); in each layer that keeps its activations
    (`layers_keeping_activations`) the bf16 copy SDPA makes of it (`convert_boolean_attn_mask`)
    and saves for backward, and k and v repeated per query head (with a mask transformers'
    SDPA path repeats them instead of SDPA's own grouped-query attention). Against llama-debug
    on CPU (plain module, 4 layers, 4 heads over 2 kv heads), measured -> counted: one row of
    1,024 10.0 -> 11.0 MiB without checkpointing, 3.5 -> 3.5 with `full`; one row of 512 3.0
    -> 3.25 and 1.0 -> 1.0; two rows of 512 6.25 -> 6.5 and 2.25 -> 2.0."""
    kept = layers_keeping_activations(s, checkpointing)
    square = micro_batch * seq_len * seq_len
    repeated = 2 * micro_batch * seq_len * (model.heads - model.kv_heads) * model.head_dim
    return square * (1 + BF16 * kept) + kept * repeated * BF16
