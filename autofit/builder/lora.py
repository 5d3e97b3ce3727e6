"""LoRA (peft) on the decoder layers' linear projections; the base stays frozen. With
`train_embeddings`, peft also trains the input embedding and the LM head: a trainable copy of each
beside the frozen original (`modules_to_save`), or only some token rows of each
(`trainable_token_indices`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from autofit.builder.model import decoder_layers, decoder_projections, model_parts
from autofit.recipe import EMBEDDING_MODULE, HEAD_MODULE, embedding_peft_options
from autofit.settings import trained_tokens_error
from autofit.values import TrainEmbeddings


def lora_target_modules(model: nn.Module, adapted: Collection[str]) -> list[str]:
    """The full module names LoRA adapts: in each decoder layer, the projections `adapted` names
    by their path inside the layer (`Layout.adapted`: those of `decoder_projections`, the rule
    the estimator counts by, that `lora_targets` names, `autofit.settings.targeted`)."""
    prefix = next(name for name, mod in model.named_modules() if mod is decoder_layers(model))
    names, seen = [], set()
    for i, layer in enumerate(decoder_layers(model)):
        for name, _ in decoder_projections(layer):
            seen.add(name.rsplit(".", 1)[-1])
            if name in adapted:
                names.append(f"{prefix}.{i}.{name}")
    if not names:
        raise ValueError(
            f"lora_targets names none of this model's projections; its decoder layers have: "
            f"{', '.join(sorted(seen))}."
        )
    return names


def embedding_options(model: nn.Module, train_embeddings: str) -> dict[str, Any]:
    """peft `LoraConfig` options that train what `train_embeddings` says
    (`autofit.recipe.embedding_peft_options`, of `trained_embedding_modules` and
    `trained_token_ids`), by the model's own module names (`get_input_embeddings`,
    `get_output_embeddings`):

    - `full`: `modules_to_save` of the embedding and the head (peft deep-copies each into a
      trainable module beside the frozen original, which stays for peft's adapter switching and
      unloading). A tied head stays tied (`ensure_weight_tying`: its copy is the embedding's);
      without it peft 0.21 copies the shared weight twice and unties them;
    - `tokens:N`: `trainable_token_indices` of the last N ids in the embedding and the head (peft
      `TrainableTokensWrapper`: the rows' trainable values, merged into the frozen weight at each
      forward); with a tied head, the embedding's rows, which peft ties the head's to.
    """
    if train_embeddings == TrainEmbeddings.NONE:
        return {}
    parts = model_parts(model)
    if parts.head is None:
        raise ValueError(
            f"train_embeddings={train_embeddings} trains the input embeddings and the LM head; "
            f"{type(model).__name__} has no LM head (get_output_embeddings() is None)."
        )
    names = {mod: name for name, mod in model.named_modules() if mod in (parts.embed, parts.head)}
    vocab = parts.embed.weight.shape[0]
    problem = trained_tokens_error(train_embeddings, vocab)
    if problem is not None:
        raise ValueError(problem)
    own = {EMBEDDING_MODULE: names[parts.embed], HEAD_MODULE: names[parts.head]}
    return embedding_peft_options(train_embeddings, vocab, parts.tied, own)


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: int,
    adapted: Collection[str],
    dropout: float = 0.0,
    train_embeddings: str = TrainEmbeddings.NONE,
) -> nn.Module:
    """Wrap `model` with peft LoRA of `rank` and `alpha` on the projections `adapted` (paths
    inside each decoder layer: `Layout.adapted`, of `lora_targets`), with `dropout` on each
    adapter's input (peft keeps the dropped-out copy for backward), and the embeddings and head
    `train_embeddings` trains (`embedding_options`).

    Runs before quantization and before any weight exists (on the meta model of a trial):
    peft puts the adapters on the base weight's device, the builder materialises and initialises
    them layer by layer (A kaiming-uniform, B zero, as peft does), and quantization then replaces
    each wrapped projection's `base_layer.weight`, as QLoRA recipes (torchtune, answer.ai) do.
    """
    if rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    tied = model_parts(model).tied
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=lora_target_modules(model, adapted),
        bias="none",
        task_type="CAUSAL_LM",
        **embedding_options(model, train_embeddings),
    )
    model = get_peft_model(model, lora_config)
    if tied and not model_parts(model).tied:  # pragma: no cover - peft changed its tying
        raise ValueError(
            f"peft untied the LM head from the input embeddings for train_embeddings="
            f"{train_embeddings}; autofit counts one trained weight for a tied head."
        )
    return model
