"""Read a model's parameters by role from the model itself, built on the meta device.

The model is the one trials build (`build_meta_model`: the family's `AutoModelForCausalLM` from its
config, here with a sample of its layers, the others counted), so the counts are exact for any
architecture: Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma's four norms per
layer, Phi-3's fused `qkv_proj` and `gate_up_proj`, Mixtral's router and experts, tied heads.
Roles, inside a decoder layer:

- projection: an `nn.Linear` of the block (`decoder_projections`, peft's `all-linear`): what LoRA
  targets and quantization touches; its bias (if any) is a bias;
- router: a MoE gate's weight (`num_local_experts` rows, not an `nn.Linear` in HF's MoE layers);
- expert: the MoE experts' weights (3-D tensors, every expert resident);
- norm: any other 1-D scale; other: anything else.
Outside the layers: the token embedding, the LM head (none when tied to the embedding), the final
norm, and anything else.
"""

from __future__ import annotations

from torch import nn

from autofit.builder.model import build_layers_model, decoder_projections, layer_types, model_parts
from autofit.models import ModelSpec
from autofit.structure import Projection, Structure


def read_structure(spec: ModelSpec) -> Structure:
    """`spec`'s parameters by role, read from its model built with a sample of its layers (two,
    or one of each layer type the model has): the layers are alike, so the other layers are
    counted, not built, and reading a model of a million layers takes as long as one of two."""
    types = layer_types(spec)
    kinds = tuple(dict.fromkeys(types)) if types else (None,) * min(spec.layers, 2)
    model = build_layers_model(spec, kinds)
    parts = model_parts(model)
    layers = list(parts.layers)
    roles = [_layer_roles(layer, spec.experts) for layer in layers]
    if any(r != roles[0] for r in roles[1:]):
        raise ValueError(
            f"{spec.name}: its decoder layers differ in their parameters; autofit estimates "
            "models whose layers are alike (every supported family's are)."
        )
    projections, norm, bias, router, expert, other = roles[0]
    seen: set[int] = set()
    built = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            built += p.numel()
    embedding = parts.embed.weight.numel()
    head = 0 if parts.tied or parts.head is None else parts.head.weight.numel()
    final_norm = sum(p.numel() for p in parts.norm.parameters()) if parts.norm else 0
    layer_total = sum(p.numel() for p in layers[0].parameters())
    root_other = built - len(layers) * layer_total - embedding - head - final_norm
    return Structure(
        model_type=spec.model_type,
        layer_class=type(layers[0]).__name__,
        layers=spec.layers,
        hidden=spec.hidden,
        vocab=parts.embed.weight.shape[0],
        heads=spec.heads,
        q_dim=spec.q_dim,
        tied_embeddings=parts.tied,
        projections=projections,
        layer_norm_params=norm,
        layer_bias_params=bias,
        layer_router_params=router,
        layer_expert_params=expert,
        layer_other_params=other,
        embedding_params=embedding,
        head_params=head,
        final_norm_params=final_norm,
        root_other_params=root_other,
        largest_param=max(p.numel() for p in model.parameters()),
        experts=spec.experts,
        experts_per_token=spec.experts_per_token,
    )


def _layer_roles(
    layer: nn.Module, experts: int
) -> tuple[tuple[Projection, ...], int, int, int, int, int]:
    projections = []
    owned: set[int] = set()
    bias = 0
    for name, linear in decoder_projections(layer):
        has_bias = linear.bias is not None
        projections.append(Projection(name, linear.in_features, linear.out_features, has_bias))
        owned.add(id(linear.weight))
        if has_bias:
            owned.add(id(linear.bias))
            bias += linear.bias.numel()
    norm = router = expert = other = 0
    for _, p in layer.named_parameters():
        if id(p) in owned:
            continue
        if experts and p.dim() == 3:
            expert += p.numel()
        elif experts and p.dim() == 2 and p.shape[0] == experts:
            router += p.numel()
        elif p.dim() == 1:
            norm += p.numel()
        else:
            other += p.numel()
    return tuple(projections), norm, bias, router, expert, other
