"""`loss: chunked` against the model's own loss (`standard`), the truth it must reproduce: the same
loss and gradients for the same weights and batch, in every family (Gemma 2's soft-capped logits
included), with ignored labels, and with the head's weight trained (a full fine-tune under
autocast). Measured tolerances: losses agree to 3e-7 relative (fp32 sums in a different order);
gradients to 0.8% in norm (bf16 rounding of the logits' gradient, computed per chunk)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from autofit.builder.loss import apply_loss, linear_cross_entropy, loss_chunk_tokens
from autofit.builder.model import build_meta_model, materialize
from autofit.models import PRESETS

FAMILIES = ["llama-debug", "qwen2-debug", "qwen3-debug", "gemma2-debug", "gemma3-debug",
            "phi3-debug", "mixtral-debug"]  # fmt: skip
LOSS_REL = 1e-5
GRAD_REL = 0.02


def _model(name: str, dtype: torch.dtype, loss: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_meta_model(PRESETS[name])
    materialize(model, torch.device("cpu"))
    return apply_loss(model.to(dtype), loss)


def _run(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(standard, chunked) -> None:
    (out_s, grads_s), (out_c, grads_c) = standard, chunked
    assert out_c.loss.item() == pytest.approx(out_s.loss.item(), rel=LOSS_REL)
    assert out_c.logits is None  # never materialised
    assert grads_c.keys() == grads_s.keys()
    for name, grad in grads_s.items():
        err = (grads_c[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert err < GRAD_REL, (name, err.item())


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_loss_and_gradients_equal_the_models_own(name: str) -> None:
    ids = torch.randint(0, PRESETS[name].vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :10] = -100  # a prompt without loss, as instruction tuning masks it
    standard = _run(_model(name, torch.bfloat16, "standard"), ids, labels)
    chunked = _run(_model(name, torch.bfloat16, "chunked"), ids, labels)
    _assert_same(standard, chunked)


def test_chunked_loss_trains_the_head_under_autocast() -> None:
    """A full fine-tune of the plain module under bf16-mixed: fp32 weights (the head's gradient
    summed over chunks) and autocast, as HF Trainer's `bf16=True` runs it."""
    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(2))
    standard = _run(_model("llama-debug", torch.float32, "standard"), ids, ids, autocast=True)
    chunked = _run(_model("llama-debug", torch.float32, "chunked"), ids, ids, autocast=True)
    _assert_same(standard, chunked)
    assert "lm_head.weight" in chunked[1]


def test_sum_over_num_items_in_batch_as_hf_trainer_asks() -> None:
    """HF Trainer passes `num_items_in_batch` (tokens with labels across the accumulated
    micro-batches): the loss is then the sum over it, as the model's own `ForCausalLMLoss`."""
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(3))
    items = torch.tensor(100)
    losses = []
    for kind in ("standard", "chunked"):
        model = _model("llama-debug", torch.bfloat16, kind)
        out = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=items)
        losses.append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=LOSS_REL)


def test_without_labels_the_model_returns_its_logits() -> None:
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        own = _model("llama-debug", torch.float32, "standard")(input_ids=ids).logits
        chunked = _model("llama-debug", torch.float32, "chunked")(input_ids=ids).logits
    assert torch.equal(own, chunked)


def test_chunks_follow_ligers_rule() -> None:
    """Liger's own example (`fused_linear_cross_entropy_forward`): 4 x 4096 tokens, hidden 4096,
    vocabulary 32000 -> chunks of 2048 tokens; Llama 3 8B's vocabulary (128256) -> 512."""
    assert loss_chunk_tokens(4 * 4096, 4096, 32000) == 2048
    assert loss_chunk_tokens(4 * 4096, 4096, 128256) == 512
    assert loss_chunk_tokens(1, 64, 128256) == 1


def test_only_one_chunk_of_logits_is_ever_live() -> None:
    """128K vocabulary, 512 tokens: the standard path holds ~12 B per logit (768 MiB here); the
    chunked one a few chunk-sized tensors beside the hidden states' gradient."""
    from autofit.trials.memory import TensorTracker

    n, hidden, vocab = 512, 64, 128256
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    peaks, losses = {}, {}
    for kind in ("standard", "chunked"):
        tracker = TensorTracker()
        tracker.track([h, w, labels])
        tracker.reset_peak()
        base = tracker.current
        with tracker:
            if kind == "standard":
                loss = torch.nn.functional.cross_entropy((h @ w.t()).float(), labels)
            else:
                loss = linear_cross_entropy(h, w, labels)
            loss.backward()
        peaks[kind], losses[kind] = tracker.peak - base, loss.item()
        h.grad = None
    assert losses["chunked"] == pytest.approx(losses["standard"], rel=LOSS_REL)
    assert peaks["standard"] > 10 * n * vocab
    assert peaks["chunked"] < n * vocab  # under 1 B per logit: no full-vocabulary tensor


def test_a_head_with_a_bias_is_refused_clearly() -> None:
    model = _model("llama-debug", torch.float32, "chunked")
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    ids = torch.randint(0, 1024, (1, 8))
    with pytest.raises(ValueError, match="bias"):
        model(input_ids=ids, labels=ids)


def test_fused_without_liger_or_cuda_says_what_to_install() -> None:
    from autofit.rules import liger_installed

    model = _model("llama-debug", torch.float32, "standard")
    if liger_installed():
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ValueError, match=r"autofit\[liger\]"):
        apply_loss(model, "fused")


def test_moe_router_loss_is_added_as_the_family_adds_it() -> None:
    """Mixtral with `output_router_logits=True`: the model's own loss adds the router's
    load-balancing loss x `router_aux_loss_coef`; so does the chunked one (same total, same
    gradients, the router's included)."""
    spec = dataclasses.replace(PRESETS["mixtral-debug"], extra='{"num_experts_per_tok": 2, '
                               '"num_local_experts": 4, "output_router_logits": true, '
                               '"router_aux_loss_coef": 0.5}')  # fmt: skip
    results = []
    for kind in ("standard", "chunked"):
        torch.manual_seed(0)
        model = build_meta_model(spec)
        materialize(model, torch.device("cpu"))
        model = apply_loss(model.to(torch.bfloat16), kind)
        ids = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(6))
        results.append(_run(model, ids, ids))
    _assert_same(*results)
    assert any("router" in name or "gate" in name for name in results[1][1])


def test_a_router_loss_it_cannot_compute_is_refused_rather_than_dropped() -> None:
    model = _model("llama-debug", torch.float32, "standard")
    model.config.output_router_logits = True  # a family without a load-balancing loss
    with pytest.raises(ValueError, match="output_router_logits"):
        apply_loss(model, "chunked")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-debug", "qwen2-debug"])
def test_fused_loss_equals_the_models_own_under_tritons_interpreter(name: str) -> None:
    """`loss: fused` runs Liger's kernel; without a GPU, Triton's interpreter runs it on CPU
    (`TRITON_INTERPRET=1`, set before Triton is imported: a fresh process). Skipped where Liger is
    not installed (`pip install 'autofit[liger]'`). Gemma 2's soft-capping is not checked here:
    Liger's kernel casts the cap with `softcap.to(tl.float32)`, which the interpreter (a Python
    float) refuses; on CUDA Triton passes it as a scalar."""
    import subprocess
    import sys

    from autofit.rules import liger_installed

    if not liger_installed():
        pytest.skip("liger-kernel is not installed (pip install 'autofit[liger]')")
    code = f"""
import torch
from tests.build.test_loss import _model, _run, _assert_same
from autofit.models import PRESETS
ids = torch.randint(0, PRESETS[{name!r}].vocab, (2, 24), generator=torch.Generator().manual_seed(1))
labels = ids.clone()
labels[0, :5] = -100
standard = _run(_model({name!r}, torch.bfloat16, "standard"), ids, labels)
fused = _run(_model({name!r}, torch.bfloat16, "fused"), ids, labels)
_assert_same(standard, fused)
print("ok", standard[0].loss.item(), fused[0].loss.item())
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama-debug", "gemma2-debug"])
def test_fused_loss_equals_the_models_own_on_cuda(name: str) -> None:
    """On a GPU, Liger's kernel itself (Gemma 2's soft-capped logits included)."""
    from autofit.rules import liger_installed

    if not liger_installed():
        pytest.skip("liger-kernel is not installed (pip install 'autofit[liger]')")
    ids = torch.randint(0, PRESETS[name].vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    results = []
    for kind in ("standard", "fused"):
        model = _model(name, torch.bfloat16, "standard").cuda()
        results.append(_run(apply_loss(model, kind), ids, ids))
    _assert_same(*results)
