"""The training loss of a causal LM, as the `loss` knob picks it.

- `standard`: the model's own forward (`lm_head`, then `loss_function` over the whole batch's
  logits: bf16 logits, their fp32 copy, log-softmax and their gradients, ~12 B per logit).
- `chunked`: the LM head and cross-entropy over chunks of tokens, pure torch: one chunk's fp32
  logits are live at a time, and the gradients of the hidden states (and of the head weight, when
  it trains) are produced chunk by chunk in forward, the fused-linear-cross-entropy idea of Liger
  (Hsu et al. 2024, arXiv 2410.10989) and torchtune. What stays from forward to backward is one
  hidden-state gradient (`tokens x hidden`), not `tokens x vocab`.
- `fused`: Liger's Triton kernel for the same computation (`liger_kernel`, CUDA only;
  `pip install 'autofit[liger]'`).

`apply_loss` sets this up on the model itself: the causal LM's `forward` runs the decoder and
hands the final hidden states to the LM head module, whose `forward` returns the loss when given
labels. The head is still called as a module, so FSDP2's hooks on its `[norm, head]` unit gather,
reshard and reduce as they do for the standard loss. Without labels (generation, evaluation of
logits) both are the model's own.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autofit.builder.dtypes import compute_dtype
from autofit.rules import liger_installed
from autofit.values import Loss, values

IGNORE_INDEX = -100
"""The label of a position without loss (HF's, torch's `cross_entropy` default)."""

LOSS_KINDS = values(Loss)


def loss_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: Liger's rule (`fused_linear_cross_entropy_forward`), a power of two so
    that a chunk's logits (`chunk x vocab`) hold no more values than the hidden states of the
    whole batch (`tokens x hidden`): e.g. 4096 tokens of Llama 3 8B (hidden 4096, vocab 128256)
    run in chunks of 128."""
    inc_factor = -(-vocab // hidden)
    per_chunk = max(-(-tokens // inc_factor), 1)
    return 1 << (per_chunk - 1).bit_length()


def logit_transform(config: Any) -> tuple[float, float | None]:
    """(scale, soft-cap) a family applies to `hidden @ head.T` before its loss: Cohere's
    `logit_scale` multiplies, Granite's `logits_scaling` divides, Gemma 2's
    `final_logit_softcapping` caps (`cap * tanh(z / cap)`)."""
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    divide = getattr(config, "logits_scaling", None)
    if divide:
        scale /= float(divide)
    cap = getattr(config, "final_logit_softcapping", None)
    return scale, (float(cap) if cap else None)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T` over chunks of rows, gradients computed in forward.

    Numerics follow the model's own path: the head's matmul in the compute dtype (bf16), the
    logits upcast to fp32 for the loss (HF `ForCausalLMLoss`), and the logits' gradient cast back
    to bf16 for the two matmuls of backward; the head weight's gradient sums over chunks in fp32.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        divisor: torch.Tensor | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        n, width = hidden.shape
        dtype = compute_dtype()
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            valid = labels != IGNORE_INDEX
            if divisor is None:
                divisor = valid.sum()
            safe = labels.masked_fill(~valid, 0)
            per_token = valid.to(torch.float32) / divisor
            wants_h, wants_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(hidden) if wants_h else None
            grad_w = None
            if wants_w:
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            chunk = loss_chunk_tokens(n, width, weight.shape[0])
            for start in range(0, n, chunk):
                rows = slice(start, min(start + chunk, n))
                h = hidden[rows].to(dtype)
                z = (h @ w.t()).float()  # the chunk's logits, fp32 as the model's loss reads them
                if scale != 1.0:
                    z.mul_(scale)
                capped = None
                if softcap is not None:
                    capped = z.div_(softcap).tanh_()  # tanh(z / cap), kept for its derivative
                    z = capped * softcap
                lse = torch.logsumexp(z, dim=-1)
                target = z.gather(1, safe[rows, None]).squeeze(1)
                total += ((lse - target) * per_token[rows]).sum()
                if grad_h is None and grad_w is None:
                    continue
                # d loss / d z = (softmax - one-hot) per token, over the divisor; z becomes it
                g = z.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, safe[rows, None], torch.full_like(target[:, None], -1.0))
                g.mul_(per_token[rows, None])
                if capped is not None:
                    g.mul_(capped.mul_(capped).neg_().add_(1.0))  # d cap*tanh(z/cap) = 1 - tanh²
                    del capped
                if scale != 1.0:
                    g.mul_(scale)
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[rows] = g @ w
                if grad_w is not None:
                    _accumulate(grad_w, g, h)
                del g, z
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))  # its own buffer: scaled in place
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def per_step_loss_tensors(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the chunked loss in `loss`'s autograd graph keeps once per micro-step whatever
    its number of tokens: the fp32 sum of the LM head weight's gradient (`vocab x hidden`, when
    the head trains), where the rest it keeps (the hidden states' gradient) has a row per token.
    The layer trace reads them (`autofit.builder.trace.traced_step`), so that the allocator
    replay does not scale them with the micro-batch."""
    found: list[torch.Tensor] = []
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "_forward_cls", None) is _ChunkedLinearCrossEntropy:
            _grad_h, grad_w = node.saved_tensors  # `forward`'s `save_for_backward`
            if grad_w is not None:
                found.append(grad_w)
        stack.extend(following for following, _ in node.next_functions)
    return found


def _accumulate(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """`grad_w += g.T @ h` into the fp32 sum without a `vocab x hidden` temporary: CUDA's bf16
    matmul with an fp32 output (as Liger does), elsewhere an fp32 matmul of the chunk."""
    if grad_w.is_cuda:
        torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w.addmm_(g.t().float(), h.float())


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    kind: str = Loss.CHUNKED,
    divisor: torch.Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` (rows x vocab) against `labels` (rows; positions
    labelled `IGNORE_INDEX` have none), or its sum over `divisor` when one is given (HF's
    `num_items_in_batch`), without the logits of more than one chunk ever existing. `kind`:
    `chunked` (pure torch) or `fused`, the same loss with Liger's fused linear cross-entropy
    kernel (CUDA; on CPU only under Triton's interpreter, `TRITON_INTERPRET=1`, which the tests
    use to check it without a GPU)."""
    if kind == Loss.CHUNKED:
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, divisor, scale, softcap)
    if hidden.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"loss=fused runs Liger's Triton kernel, which needs a CUDA GPU; this model is on "
            f"{hidden.device.type}. Use loss=chunked (the same computation in pure torch)."
        )
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if scale != 1.0:
        hidden = hidden * scale  # (h * s) @ W.T == s * (h @ W.T)
    reduction = "mean" if divisor is None else "sum"
    loss = liger_fused_linear_cross_entropy(
        hidden.to(compute_dtype()),
        weight.to(compute_dtype()),
        labels,
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
        softcap=softcap,
    )
    return loss if divisor is None else loss / divisor


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside `model` (under a peft wrapper, its base model)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if inner.get_output_embeddings() is None or not hasattr(inner, "get_decoder"):
        raise ValueError(
            f"{type(inner).__name__} has no LM head: loss=chunked and loss=fused need a HF "
            "causal LM (a decoder and an output embedding). Use loss=standard."
        )
    return inner


def apply_loss(model: nn.Module, kind: str) -> nn.Module:
    """Make `model(input_ids=..., labels=...)` compute its loss as `kind` says (in place; the
    parameters and their names are untouched). `standard` leaves the model as it is."""
    if kind == Loss.STANDARD:
        return model
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss={kind!r}; allowed: {', '.join(LOSS_KINDS)}")
    if kind == Loss.FUSED and not liger_installed():
        raise ValueError(
            "loss=fused needs Liger's kernels, which are not installed: pip install "
            "'autofit[liger]' (liger-kernel, CUDA), or use loss=chunked (pure torch)."
        )
    lm = causal_lm(model)
    if getattr(lm.config, "output_router_logits", False) and _router_loss(lm) is None:
        raise ValueError(
            f"loss={kind} cannot add this {type(lm).__name__}'s router load-balancing loss "
            "(output_router_logits=True): its module has no load_balancing_loss_func as HF's MoE "
            "families do. Set config.output_router_logits=False or use loss=standard."
        )
    head = lm.get_output_embeddings()
    scale, softcap = logit_transform(lm.config)
    head.forward = types.MethodType(_head_forward(kind, scale, softcap), head)
    lm.forward = types.MethodType(_lm_forward(type(lm).forward), lm)
    return model


def _router_loss(lm: nn.Module) -> Any:
    """The family's MoE load-balancing loss (`load_balancing_loss_func` of its modeling module),
    or None when the model lacks it or the attributes its forward passes to it."""
    import sys

    func = getattr(sys.modules.get(type(lm).__module__), "load_balancing_loss_func", None)
    needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    return func if func is not None and all(hasattr(lm, a) for a in needed) else None


def _head_forward(kind: str, scale: float, softcap: float | None) -> Any:
    def forward(
        head: nn.Linear,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        divisor: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bias = _head_bias(head)
        if labels is None:
            return F.linear(hidden, head.weight, bias)
        if bias is not None:
            raise ValueError("loss=chunked/fused: an LM head with a bias is not supported")
        return linear_cross_entropy(
            hidden, head.weight, labels, kind=kind, divisor=divisor, scale=scale, softcap=softcap
        )

    return forward


def _head_bias(head: nn.Module) -> torch.Tensor | None:
    """The LM head's bias (none in the supported families). peft's `TrainableTokensWrapper`
    (`train_embeddings: tokens:N`) passes on `weight` alone: its frozen base layer's bias."""
    try:
        return head.bias
    except AttributeError:
        return getattr(head, "original_module", head).bias


def _lm_forward(own_forward: Any) -> Any:
    def forward(
        lm: nn.Module,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if labels is None:
            return own_forward(lm, input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        divisor = kwargs.pop("num_items_in_batch", None)
        if divisor is not None and not torch.is_tensor(divisor):
            divisor = torch.tensor(float(divisor))
        kwargs.pop("logits_to_keep", None)
        routed = kwargs.get("output_router_logits")
        routed = getattr(lm.config, "output_router_logits", False) if routed is None else routed
        if routed:
            kwargs["output_router_logits"] = True
        out = lm.get_decoder()(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state
        # HF's causal-LM loss: position t predicts label t + 1; the last position predicts none
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        head = lm.get_output_embeddings()
        if divisor is not None:
            divisor = divisor.to(hidden.device)
        loss = head(hidden.reshape(-1, hidden.shape[-1]), labels=shifted.reshape(-1).to(
            hidden.device), divisor=divisor)  # fmt: skip
        if routed:  # as the family's own forward adds it (Mixtral: `load_balancing_loss_func`)
            aux = _router_loss(lm)(
                out.router_logits, lm.num_experts, lm.num_experts_per_tok,
                kwargs.get("attention_mask"),
            )  # fmt: skip
            loss = loss + lm.router_aux_loss_coef * aux.to(loss.device)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=getattr(out, "past_key_values", None),
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
        )

    return forward
