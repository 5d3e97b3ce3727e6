"""What the estimator knows of a model, as plain data: its parameters by role (`Structure`, its
`Projection`s) and what one decoder layer keeps for backward (`LayerActivations`, `StepEvents`,
each for an `ActivationKey`). `autofit.builder` reads them from the real model (its meta build and
its layer traces); `autofit.arch` keeps them, in memory and on disk; the estimator reads them.
This module imports no torch and nothing of the builder's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property, lru_cache
from typing import Any

from autofit.errors import ConfigError
from autofit.settings import targeted
from autofit.values import Checkpointing, Loss, Quant

__all__ = ["ActivationKey", "LayerActivations", "Projection", "StepEvents", "Structure"]


@dataclass(frozen=True)
class Projection:
    """One linear projection of a decoder layer: its path inside the layer and its shape."""

    name: str  # e.g. "self_attn.q_proj", "mlp.gate_up_proj"
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class Structure:
    """Parameters of a causal LM by role, read from the model (every decoder layer alike)."""

    model_type: str
    layer_class: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    q_dim: int  # query width (heads x head_dim): attention FLOPs
    tied_embeddings: bool
    projections: tuple[Projection, ...]  # one layer's, in module order
    layer_norm_params: int  # norm scales inside one layer (q/k norms included)
    layer_bias_params: int  # projection biases of one layer (Qwen2's q/k/v)
    layer_router_params: int  # MoE router of one layer
    layer_expert_params: int  # MoE experts of one layer (all resident)
    layer_other_params: int  # anything else inside one layer
    embedding_params: int
    head_params: int  # 0 when the head is the embedding (tied)
    final_norm_params: int
    root_other_params: int  # anything else outside the layers
    largest_param: int = 0  # elements of the largest parameter tensor
    experts: int = 0
    experts_per_token: int = 0

    # ----- derived counts -----------------------------------------------------------------------
    @cached_property
    def layer_linear_params(self) -> int:
        """Weights of one layer's projections: what LoRA adapts and quantization stores."""
        return sum(p.weight_params for p in self.projections)

    @cached_property
    def layer_frozen_other_params(self) -> int:
        """Everything in one layer besides the projection weights (norms, biases, router,
        experts): frozen in bf16 under LoRA, never quantized."""
        return (
            self.layer_norm_params
            + self.layer_bias_params
            + self.layer_router_params
            + self.layer_expert_params
            + self.layer_other_params
        )

    @cached_property
    def layer_params(self) -> int:
        return self.layer_linear_params + self.layer_frozen_other_params

    @property
    def linear_params(self) -> int:
        """Projection weights of all layers (the quantizable base)."""
        return self.layers * self.layer_linear_params

    @property
    def lm_head_params(self) -> int:
        return self.head_params

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, final norm, head, the rest."""
        return (
            self.embedding_params + self.final_norm_params + self.head_params
            + self.root_other_params
        )  # fmt: skip

    @cached_property
    def n_params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @cached_property
    def active_layer_matmul_params(self) -> float:
        """Weights one token multiplies by in one layer: the projections, the router, and the
        `experts_per_token` of the experts it is routed to."""
        experts = 0.0
        if self.experts:
            experts = self.layer_expert_params * self.experts_per_token / self.experts
        return self.layer_linear_params + self.layer_router_params + experts

    @cached_property
    def kv_dim(self) -> int:
        """Key (= value) width: the output of the k projection (a fused qkv projection counts its
        q share as q_dim and splits the rest evenly); RoPE rotates q and k."""
        for p in self.projections:
            if p.leaf in ("k_proj", "wk", "key"):
                return p.out_features
        for p in self.projections:
            if "qkv" in p.leaf:
                return (p.out_features - self.q_dim) // 2
        return self.q_dim

    @cached_property
    def expert_ffn(self) -> int:
        """Intermediate width of one MoE expert, assuming SwiGLU experts of three hidden x ffn
        matrices (gate, up, down: Mixtral's and Qwen-MoE's `experts`); 0 for a dense model."""
        if not self.experts:
            return 0
        return self.layer_expert_params // (self.experts * 3 * self.hidden)

    @cached_property
    def mlp_width(self) -> int:
        """Width of the activation one token computes per layer (SwiGLU's gate x up product, a
        GeLU MLP's hidden): the input of the MLP's last projection (`down_proj`, `fc2`), or
        `experts_per_token` experts' widths in a MoE layer."""
        if self.experts:
            return self.expert_ffn * self.experts_per_token
        downs = [
            p for p in self.projections if p.leaf in ("down_proj", "fc2", "w2", "dense_4h_to_h")
        ]
        return downs[-1].in_features if downs else 4 * self.hidden

    # ----- LoRA targets ---------------------------------------------------------------------------
    def targets(self, names: tuple[str, ...] | None) -> tuple[Projection, ...]:
        """The projections `lora_targets` names (None: every one), matched by leaf name
        (`q_proj`) or by path inside the layer (`self_attn.q_proj`); a name that matches none is
        a `ConfigError` listing what this model has."""
        if names is None:
            return self.projections
        chosen = [p for p in self.projections if targeted(p.name, names)]
        known = {p.leaf for p in self.projections} | {p.name for p in self.projections}
        unknown = [n for n in names if n not in known]
        if unknown:
            leaves = list(dict.fromkeys(p.leaf for p in self.projections))
            raise ConfigError(
                f"lora_targets names {', '.join(map(repr, unknown))}, which this model "
                f"({self.layer_class}) does not have. Its decoder layers' linear projections are: "
                f"{', '.join(leaves)}. Name some of them (e.g. --lora-targets "
                f"{','.join(leaves[:2])}), or leave lora_targets out to adapt all of them."
            )
        return tuple(chosen)

    def lora_params(self, rank: int, targets: tuple[str, ...] | None = None) -> int:
        """LoRA A (r x in) and B (out x r) on each targeted projection of every layer."""
        if rank <= 0:
            return 0
        return rank * self.lora_per_rank(targets)

    def lora_per_rank(self, targets: tuple[str, ...] | None = None) -> int:
        """LoRA parameters per unit of rank (memoised: the estimator asks per candidate)."""
        return _lora_per_rank(self, targets)

    def largest_lora_matrix(self, targets: tuple[str, ...] | None = None) -> int:
        """Width of the largest adapter matrix per unit of rank (max of in and out)."""
        return max(max(p.in_features, p.out_features) for p in self.targets(targets))

    # ----- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        data["projections"] = [asdict(p) for p in self.projections]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Structure:
        values = dict(data)
        values["projections"] = tuple(Projection(**p) for p in data["projections"])
        return cls(**values)


@lru_cache(maxsize=1024)
def _lora_per_rank(s: Structure, targets: tuple[str, ...] | None) -> int:
    """`Structure.lora_per_rank`, memoised by value: an equal structure has the same projections,
    so an entry cannot answer for another model; the cache holds at most `maxsize` structures."""
    return s.layers * sum(p.in_features + p.out_features for p in s.targets(targets))


TRL_LOSS = "trl"
"""The traced loss of `launch: trl`: TRL's fused LM head around a stand-in for its kernel
(`autofit.builder.trl`). Its trace's `root` is what lives outside the layers when the head's
backward begins and its `root_forward` when forward has returned: the head's own buffers sit on
top of them (`autofit.estimate.memory.trl`)."""


@dataclass(frozen=True)
class ActivationKey:
    """What a layer trace depends on besides the architecture: the plan's sequence length, the
    LoRA settings, the checkpointing of the layer, whether the run autocasts fp32 weights
    (the plain module and DDP under bf16-mixed) or computes in bf16 (FSDP2, pure bf16), the
    loss (`standard` or `chunked`; `fused` is traced as `chunked`, `trace_loss`; `trl`: TRL's
    fused LM head under `launch: trl`, `TRL_LOSS`), and whether
    peft casts each adapter's input to the adapters' fp32 under autocast (`adapter_casts`: the
    model of `launch: trainer`, which autofit's builder does not set up, `keep_lora_inputs`), and
    whether the model is bitsandbytes QLoRA as peft's `prepare_model_for_kbit_training` leaves
    it (`kbit`: `launch: trainer` with `quant_backend: bitsandbytes`)."""

    seq_len: int
    lora_rank: int = 0
    lora_targets: tuple[str, ...] | None = None
    lora_dropout: float = 0.0
    # none | full | selective: the checkpointing of every traced layer
    policy: str = Checkpointing.NONE
    autocast: bool = False
    loss: str = Loss.STANDARD  # standard | chunked | trl: how the traced model computes its loss
    adapter_casts: bool = False  # LoRA under autocast with peft's input casts (launch: trainer)
    # bitsandbytes QLoRA as `prepare_model_for_kbit_training` leaves it (launch: trainer): every
    # non-projection parameter fp32, each projection computing in bf16 and returning its
    # input's dtype (`Linear4bit.forward`), so the residual stream runs in fp32
    kbit: bool = False

    def text(self) -> str:
        targets = ",".join(self.lora_targets) if self.lora_targets else "all"
        # the standard loss adds nothing: entries cached before the loss knob stay valid
        loss = "" if self.loss == Loss.STANDARD else f"|{self.loss}"
        casts = "|casts" if self.adapter_casts else ""  # likewise: autofit's model has none
        kbit = "|kbit" if self.kbit else ""  # likewise
        return (
            f"s{self.seq_len}|r{self.lora_rank}|t{targets}|d{self.lora_dropout}|{self.policy}"
            f"|{'amp' if self.autocast else 'bf16'}{loss}{casts}{kbit}"
        )


@dataclass(frozen=True)
class LayerActivations:
    """Bytes kept alive for backward at the end of forward, per sequence of `seq_len` tokens
    (micro-batch 1; they scale with the micro-batch): `layer` per decoder layer (the mean over
    the layer types of the model, weighted by their counts) and `root` outside the layers
    (embedding side, final norm, logits and loss, rotary tables and masks shared by the layers)."""

    layer: float
    root: float
    root_forward: float = 0.0  # `root` at the peak of forward alone (the loss computed, before
    # its backward): the moment FSDP2 still holds its last all-gather output
    backward: float = 0.0  # at the peak of a layer's backward, what is alive besides what the
    # layers kept: the gradient flowing in, the backward's transients, under checkpointing the
    # layer recomputed (parameters' gradients apart)


@dataclass(frozen=True)
class StepEvents:
    """One micro-step of the one-layer model, per sequence, as the caching allocator sees it:
    every tensor storage's birth `(id, bytes)` and death `(id, 0)` in order (parameters, buffers
    and the token ids, which exist before, left out). `marks` are the indices in `log` where the
    layer's forward begins, where it ends (the head and the loss follow), where its backward
    begins and where it ends (the embedding's backward follows). `fixed` ids do not scale with
    the micro-batch (autocast's weight copies, parameters' gradients, the chunked loss's sum of a
    trained head's gradient); `grads` are the parameters' gradients, alive until the optimizer
    step."""

    log: tuple[tuple[int, int], ...]
    marks: tuple[int, int, int, int]
    fixed: frozenset[int] = frozenset()
    grads: frozenset[int] = frozenset()

    def to_list(self) -> list[Any]:
        return [[list(e) for e in self.log], list(self.marks), sorted(self.fixed),
                sorted(self.grads)]  # fmt: skip

    @classmethod
    def from_list(cls, data: list[Any]) -> StepEvents:
        log, marks, fixed, grads = data
        return cls(tuple((int(i), int(n)) for i, n in log), tuple(marks), frozenset(fixed),
                   frozenset(grads))  # fmt: skip


@dataclass(frozen=True)
class OpsKey:
    """What the number of ops a micro-step dispatches depends on besides the architecture: the
    base weights' `quant`, whether LoRA adapts the layers (`lora`: the rank changes the shapes,
    not the ops) and which projections, whether LoRA's dropout runs (`dropout`), the checkpointing
    of every counted layer (`policy`: none | full | selective), autocast, and the loss (the chunked
    loss runs its ops once per chunk). Not the width, the sequence length nor the micro-batch: an
    op of a dense layer is one op whatever its shapes (`autofit.builder.ops`)."""

    quant: str = Quant.NONE  # none | nf4 | int8
    lora: bool = False
    lora_targets: tuple[str, ...] | None = None
    dropout: bool = False
    policy: str = Checkpointing.NONE
    autocast: bool = False
    loss: str = Loss.STANDARD

    def text(self) -> str:
        targets = ",".join(self.lora_targets) if self.lora_targets else "all"
        lora = f"lora:{targets}" if self.lora else "full"
        amp = "amp" if self.autocast else "bf16"
        drop = "|dropout" if self.dropout else ""
        return f"{self.quant}|{lora}{drop}|{self.policy}|{amp}|{self.loss}"


@dataclass(frozen=True)
class StepOps:
    """The ops one micro-step dispatches (aten ops, as a `TorchDispatchMode` sees them), forward
    and backward, recomputation included: `layer` per decoder layer (the mean over the model's
    layer types, weighted by their counts) and `root` outside the layers (embedding, final norm,
    head, loss, rotary tables and masks)."""

    layer: float
    root: float
