"""`materialize` initialises every family's tiny model as HF's own init does: the same buffers
(rotary frequencies, Gemma's embedding scale) and the same norm scales, so a debug model trains;
and a tied LM head stays tied (`to_empty` module by module gave the head a weight of its own).

Gemma 2/3 keep their embedding scale, sqrt(hidden), in a non-persistent buffer: left as the
uninitialised memory `to_empty` gives, the embeddings came out ~1e-9 and gemma2-debug's loss did
not move in a trial.
"""

from __future__ import annotations

import pytest
import torch

from autofit.arch import structure_of
from autofit.builder.model import build_meta_model, materialize, model_parts
from autofit.models import PRESETS

DEBUG = [name for name in PRESETS if name.endswith("-debug")]


@pytest.mark.parametrize("name", DEBUG)
def test_buffers_and_norms_match_hf_init(name: str) -> None:
    from transformers import AutoModelForCausalLM

    spec = PRESETS[name]
    ours = materialize(build_meta_model(spec), torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_config(spec.to_hf_config())
    hf_buffers = dict(theirs.named_buffers())
    buffers = dict(ours.named_buffers())
    assert buffers.keys() == hf_buffers.keys()
    for key, buf in buffers.items():
        torch.testing.assert_close(buf, hf_buffers[key], msg=f"{name}: buffer {key}")
    hf_params = dict(theirs.named_parameters())
    for key, param in ours.named_parameters():
        if param.dim() == 1 and not key.endswith("bias"):  # norm scales: a constant each
            torch.testing.assert_close(param, hf_params[key], msg=f"{name}: norm {key}")


@pytest.mark.parametrize("name", DEBUG)
def test_a_tied_head_stays_tied(name: str) -> None:
    spec = PRESETS[name]
    model = materialize(build_meta_model(spec), torch.device("cpu"))
    assert model_parts(model).tied == spec.tied_embeddings
    assert sum(p.numel() for p in model.parameters()) == structure_of(spec).n_params


def test_a_fake_build_first_does_not_change_the_real_init() -> None:
    """The trace materialises under FakeTensorMode; a real model built later in the same process
    (a trial, `autofit.apply` after a plan) still gets Gemma's zero-centred norm scales."""
    from autofit.builder import model as build_model
    from autofit.builder.trace import trace_activations
    from autofit.structure import ActivationKey

    build_model._norm_neutral.cache_clear()
    spec = PRESETS["gemma2-debug"]
    trace_activations(spec, ActivationKey(16))
    real = materialize(build_meta_model(spec), torch.device("cpu"))
    norms = [p for n, p in real.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 0).all()) for p in norms)


class ConfigNorm(torch.nn.Module):
    """A norm built from a config object, as some families' are: `_norm_neutral` cannot build a
    fresh one from its width alone."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(config.hidden_size))  # type: ignore[attr-defined]


class BrokenNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim:  # the meta original is built with 0, a fresh one with its real width
            raise RuntimeError("out of memory")
        self.weight = torch.nn.Parameter(torch.ones(4))


def test_a_norm_built_from_a_config_gets_scale_one_and_other_failures_surface() -> None:
    config = type("Config", (), {"hidden_size": 4})()
    with torch.device("meta"):
        norm = ConfigNorm(config)
    assert materialize(norm, torch.device("cpu")).weight.tolist() == [1.0] * 4
    with torch.device("meta"):
        broken = BrokenNorm(0)
    with pytest.raises(RuntimeError, match="out of memory"):
        materialize(broken, torch.device("cpu"))
