"""What sharding and autocast add: FSDP2's all-gathered units and their gradients at each moment
of a step, autocast's bf16 copies, the optimizer step's temporaries.
"""

from __future__ import annotations

from autofit import recipe
from autofit.estimate.memory.embeddings import (
    trained_embedding_params,
    trained_largest_tensor,
    trained_module_params,
)
from autofit.estimate.memory.widths import (
    BF16,
    FP32,
    Targets,
    base_bytes_per_param,
    grad_bytes,
    master_bytes,
)
from autofit.layout import Sharding, wrap_group_size
from autofit.settings import HF_LAUNCHES
from autofit.structure import Structure
from autofit.values import Launch, Offload, OptimizerImpl, Quant, TrainEmbeddings, Wrap


# ----- all-gather buffers -----------------------------------------------------------------------
def gathered_layer_bytes(
    s: Structure, quant: str, lora_rank: int, targets: Targets = None
) -> float:
    """One decoder layer's parameters as FSDP2 all-gathers them: in bf16 (MixedPrecisionPolicy
    param_dtype, or bf16 storage); NF4 gathers its packed codes and scales (torchao NF4Tensor
    implements fsdp_pre_all_gather); int8 is not sharded so never gathered."""
    if lora_rank == 0:
        return s.layer_params * BF16
    lora = s.lora_params(lora_rank, targets) / s.layers * BF16
    others = s.layer_frozen_other_params * BF16
    if quant == Quant.INT8:
        return lora + others
    return s.layer_linear_params * base_bytes_per_param(quant) + lora + others


def embed_unit_bytes(s: Structure) -> float:
    """The token-embedding unit gathered in bf16 (its own FSDP2 unit, as torchtitan shards it)."""
    return s.embedding_params * BF16


def head_unit_bytes(s: Structure) -> float:
    """The `[final norm, LM head]` unit gathered in bf16 (a tied head is the embedding's weight,
    which then stays in the root unit with the embedding)."""
    return (s.head_params + s.final_norm_params) * BF16


def gathered_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """Peak bytes of unsharded (all-gathered) parameters held at once on a GPU, at the end of
    forward, for FSDP2 laid out as torchtitan does (autofit/builder/fsdp.py):

    - `[norm, head]` is not resharded after forward (backward needs it first): gathered;
    - the embedding unit is resharded after forward when `reshard` (else kept);
    - with layer units and reshard_after_forward=True, at most the current unit and the
      prefetched next one are gathered (FSDP2 implicit prefetching); with reshard=False every
      unit stays gathered from its forward to its backward; `model` puts every layer in the root
      unit, which FSDP2 never reshards after forward.

    The plain module and DDP gather nothing (their bf16 working copies under autocast are
    `autocast_copy_bytes`).
    """
    if sharding is not Sharding.FSDP2:
        return 0.0
    layer = gathered_layer_bytes(s, quant, lora_rank, targets)
    k = wrap_group_size(wrap, s.layers)
    if wrap == Wrap.MODEL or k >= s.layers or not reshard:
        layers = s.layers * layer
    else:
        layers = 2 * k * layer
    if s.tied_embeddings:  # embedding, norm and the tied head live in the root unit
        return embed_unit_bytes(s) + s.final_norm_params * BF16 + layers
    embed = 0.0 if reshard else embed_unit_bytes(s)
    return head_unit_bytes(s) + embed + layers


def root_all_gather_buffer_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """With `wrap: model` the root unit is every layer, and its first all-gather in forward holds
    the all-gather output buffer beside the unsharded params until the copy-out is done (FSDP2
    `AllGatherState`, `_fsdp_param_group.py`): a second whole-model copy at that moment, while
    activations are still few (FSDPMemTracker at 7B: 12.38 + 12.14 GiB). Smaller units make this
    one unit's worth, inside the prefetch allowance of `gathered_bytes`."""
    if sharding is not Sharding.FSDP2 or wrap != Wrap.MODEL:
        return 0.0
    return s.layers * gathered_layer_bytes(s, quant, lora_rank, targets)


def gathered_at_loss_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """Unsharded parameters from the end of forward through the loss's backward. With layer
    units and reshard_after_forward=True each unit was resharded after its own forward and is
    gathered again only for its backward, once the loss's tensors are freed: what remains is
    `[norm, head]` and the root (`gathered_bytes` without its two layer units, which belong to
    the layers' backward). Without resharding, or with `model`, every layer stays gathered.
    CPU trials measured the difference (bench/accuracy.py --families: two units of Mixtral's
    experts counted at the loss over-estimated its LoRA runs by 16-18%)."""
    total = gathered_bytes(s, quant, lora_rank, wrap, reshard, sharding, targets)
    k = wrap_group_size(wrap, s.layers)
    if sharding is not Sharding.FSDP2 or wrap == Wrap.MODEL or k >= s.layers or not reshard:
        return total
    return total - 2 * k * gathered_layer_bytes(s, quant, lora_rank, targets)


def gathered_at_layer_backward_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """Unsharded parameters during the last decoder layer's backward: `gathered_bytes` (its unit
    and the prefetched one, or every layer without resharding) less an untied `[norm, head]`
    unit, which FSDP2 reshards after its own backward, just before."""
    total = gathered_bytes(s, quant, lora_rank, wrap, reshard, sharding, targets)
    if sharding is not Sharding.FSDP2 or s.tied_embeddings:
        return total
    return total - head_unit_bytes(s)


def gathered_at_reduce_bytes(s: Structure, wrap: str, sharding: Sharding, device: str,
                             gathered: float) -> float:  # fmt: skip
    """Gathered params while the last gradients are reduced (end of backward). The embedding unit
    is unsharded for its backward, the last to run; every other unit was resharded after its own
    backward. With `model` on CUDA the root reshards before it reduces (FSDPMemTracker at 7B); on
    CPU trials gloo's reduce-scatter path keeps the forward's buffers (measured)."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    if wrap == Wrap.MODEL and device == "cpu":
        return gathered
    return embed_unit_bytes(s)


def unit_grad_bytes(s: Structure, lora_rank: int, wrap: str, sharding: Sharding,
                    targets: Targets = None) -> float:  # fmt: skip
    """Unsharded gradients of the unit being reduced at the end of its backward: bf16 from
    autograd plus the fp32 copy FSDP2 makes for `reduce_dtype=fp32` (6 B per trainable parameter
    of the unit; the largest unit sets the peak). `model` is one unit of every layer; the
    embedding and `[norm, head]` are units of their own. The plain module and DDP accumulate
    straight into `.grad` (DDP's bucket views): nothing extra.
    Calibrated on CPU trials (docs/accuracy.md)."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    if lora_rank:
        per_layer = s.lora_params(lora_rank, targets) / s.layers
        edges = 0.0
    else:
        per_layer = s.layer_params
        edges = max(s.embedding_params, s.head_params + s.final_norm_params)
    k = max(1, min(wrap_group_size(wrap, s.layers), s.layers))  # `model`: every layer
    return max(k * per_layer, edges) * (BF16 + FP32)


def layer_unit_grad_bytes(s: Structure, lora_rank: int, wrap: str, sharding: Sharding,
                          targets: Targets = None) -> float:  # fmt: skip
    """The unsharded gradients of one unit of decoder layers in its backward (bf16 from autograd
    and FSDP2's fp32 copy for the reduce-scatter), the part of `unit_grad_bytes` alive while the
    other layers' activations still are (the last layer's backward). `model` has no layer unit
    of its own (its gradients come at the end of backward)."""
    if sharding is not Sharding.FSDP2 or wrap == Wrap.MODEL:
        return 0.0
    per_layer = s.lora_params(lora_rank, targets) / s.layers if lora_rank else s.layer_params
    k = max(1, min(wrap_group_size(wrap, s.layers), s.layers))
    return k * per_layer * (BF16 + FP32)


def autocast_copy_bytes(s: Structure, lora_rank: int, autocast: bool,
                        targets: Targets = None, head: bool = True) -> float:  # fmt: skip
    """bf16 copies autocast makes of fp32 trainable weights for its matmuls, cached for the whole
    autocast region and then kept by autograd for backward (torch.amp autocast weight cache):
    every matrix a token multiplies by in a full fine-tune (projections, router, experts, the LM
    head, tied or not; the embedding lookup is not autocast), or the LoRA adapters. Only the
    plain module and DDP autocast (`autofit.layout.uses_autocast`). `head=False`: the head's
    matmul is not autocast's (TRL's fused head, `launch: trl`, casts one vocabulary chunk at a
    time and keeps none: `autofit.estimate.memory.trl`)."""
    if not autocast:
        return 0.0
    if lora_rank:
        return s.lora_params(lora_rank, targets) * BF16
    matrices = s.linear_params + s.layers * (s.layer_router_params + s.layer_expert_params)
    return (matrices + (s.vocab * s.hidden if head else 0)) * BF16


def kbit_head_copy_bytes(s: Structure, kbit: bool, autocast: bool) -> float:
    """The bf16 copy autocast makes of the LM head's weight once `prepare_model_for_kbit_training`
    has upcast it to fp32 (`kbit_prepared`): the head is frozen, so autocast does not cache the
    copy, but its matmul saves it for the input's gradient, from the head's forward to its
    backward (gone by a decoder layer's backward). llama-debug: 0.5 MB that the real QLoRA
    model held at the loss's backward (tests/trials/test_trainer_qlora.py)."""
    return s.vocab * s.hidden * BF16 if kbit and autocast else 0.0


def optimizer_temp_bytes(
    s: Structure, lora_rank: int, precision: str, optimizer: str, device: str, shard: int,
    targets: Targets = None, *, impl: str | None = None, offload: str = Offload.NONE,
    trainable: float = 0.0, embeddings: str = TrainEmbeddings.NONE,
    foreach_intermediates: int | None = None, launch: str = Launch.AUTOFIT,
    embedding_precision: str | None = None,
) -> float:  # fmt: skip
    """Intermediates of the optimizer step on the device, by the implementation of torch's AdamW
    the run uses (`impl`, `autofit.recipe.adamw_impl`; None: torchao's low-bit AdamW), each in
    the trainable dtype (`recipe.AdamWImpl.intermediates`): `fused` none; `foreach` one the size of
    the (local) `trainable` parameters (`foreach_intermediates`: another torch's count, e.g. 2
    for torch 2.0's); `for-loop` two the size of the largest trainable tensor's shard (measured:
    2 x the fp32 embedding of llama-mini on the plain module), as torchao's low-bit step on CPU.
    On a GPU nothing of a step that runs on the host (`offload`), nor of torchao's compiled one.
    Under `launch: trainer` (and `trl`, whose SFTTrainer makes Trainer's optimizer) a full
    fine-tune's for-loop steps in Trainer's order (`trainer_for_loop_elements`). The trained
    embedding copies' intermediates are in their own `embedding_precision`'s dtype
    (`autofit.layout.embedding_precision`; None: the run's)."""
    if impl == OptimizerImpl.FUSED or (
        device != "cpu" and (impl is None or offload != Offload.NONE)
    ):
        return 0.0
    pb = master_bytes(precision, optimizer)
    epb = master_bytes(embedding_precision or precision, optimizer)
    copies = trained_embedding_params(s, embeddings)
    if impl == OptimizerImpl.FOREACH:
        if foreach_intermediates is None:
            foreach_intermediates = recipe.ADAMW_IMPLS[OptimizerImpl.FOREACH].intermediates
        return foreach_intermediates * ((trainable - copies) * pb + copies * epb) / shard
    per_param = recipe.ADAMW_IMPLS["for-loop"].intermediates
    if launch in HF_LAUNCHES and not lora_rank:
        return trainer_for_loop_elements(s) * pb / shard
    largest = s.largest_lora_matrix(targets) * lora_rank if lora_rank else s.largest_param
    trained = trained_largest_tensor(s, embeddings)
    return max(per_param * largest * pb / shard, per_param * trained * epb / shard)


def trainer_for_loop_elements(s: Structure) -> int:
    """Elements the for-loop AdamW step (`_single_tensor_adam`, torch 2.13) holds at its peak in
    a full fine-tune under HF Trainer: its quotient `denom` of one parameter is still bound while
    the next parameter's `sqrt` and quotient are made, so the peak is the largest `previous +
    2 x current` over consecutive parameters of one group. Trainer (`get_decay_parameter_names`)
    steps the weight-decay group first, in module order without the norms and biases: the
    embedding, each layer's projections, then an untied head, right after the last layer's last
    projection (on llama-debug: 2 x the head + down_proj, 2.80 MB measured, where autofit's one
    group in module order holds 3 x the MLP projection, 2.11 MB). The no-decay group (norms,
    biases) is vectors."""
    order = [s.vocab * s.hidden] + [p.weight_params for p in s.projections] * 2
    if s.head_params:
        order.append(s.head_params)
    return max(prev + 2 * cur for prev, cur in zip([0, *order], order, strict=False))


def head_grad_bytes(
    s: Structure, lora_rank: int, train_embeddings: str, precision: str, optimizer: str,
    sharding: Sharding, offload: str = Offload.NONE,
) -> float:  # fmt: skip
    """A trained LM head's weight gradient, born in the head's backward beside its output's
    bf16 gradient (the loss's fp32 tensors over the vocabulary freed by then): the plain
    module's and DDP's `.grad` of the head (a full fine-tune, or `train_embeddings`; tied, the
    shared weight's), in the trainable dtype. With gradient accumulation the earlier
    micro-steps' `.grad` is there already and autograd's `AccumulateGrad` adds the new one into
    it, so it is a transient beside it. The loss's trace stops at the logits' gradient, before
    any weight gradient; FSDP2's unit gradients are counted per unit (`unit_grad_bytes`)."""
    if sharding is Sharding.FSDP2 or offload == Offload.PARAMS:
        return 0.0
    if lora_rank == 0:
        params = s.head_params or s.embedding_params
    elif train_embeddings != TrainEmbeddings.NONE:
        params = trained_module_params(s, train_embeddings)
    else:
        return 0.0
    return params * grad_bytes(precision, optimizer)
