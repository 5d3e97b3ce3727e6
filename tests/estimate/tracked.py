"""FSDPMemTracker cases the CUDA estimate is held to, and the check the test and the mutation bench
share (the counterpart of `measured.py`, whose CPU trials never reach these terms).

Each case runs autofit's own FSDP2 step under FakeTensorMode (`fake_tracker.trace`, the machinery
of `bench/fake_yardstick.py`) on a model of two layers made wide where it matters, and compares
the tracker's peak of rank 0 with `estimate(..., device="cuda").peak_allocated_bytes`. They hold
the two terms of `autofit/estimate/memory/` that only the CUDA path counts:

- `root_all_gather_buffer_bytes`: LoRA with `wrap: model` and a short sequence peaks at the
  root's first all-gather (napkin phase `gather`; the tracker's peak is in forward, at the
  embedding's copy-out, with the whole-model all-gather buffer beside the unsharded layers);
- `gathered_at_reduce_bytes`: a full fine-tune with a 128k vocabulary on 8 GPUs peaks at the end
  of backward (napkin phase `optimizer`; the tracker's peak is in the `[norm, head]` unit's
  backward, with that vocabulary-sized unit gathered beside its unsharded gradients).

Tolerance: docs/accuracy.md section 2, "Held by the test suite", records each case's tracker peak
and the estimate's error on it. The tracker counts the same bytes on every run (no memory and no
timing enter a fake-tensor trace), so a case passes when the error is the recorded one within
`SLACK`, which only allows for drift across torch/transformers/peft versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autofit.config import Config
from autofit.estimate import Estimate, estimate
from autofit.hardware import preset_hardware
from autofit.models import ModelSpec

from .fake_tracker import trace

SLACK = 0.015
GPU = "h100-80gb"

# Two layers with a 128k vocabulary: the embedding and LM head are 94% of the parameters.
WIDE_VOCAB = ModelSpec(name="tracker-wide-vocab", hidden=1024, layers=2, heads=8, kv_heads=8,
                       intermediate=2816, vocab=128256)  # fmt: skip
# Two wide layers with a small vocabulary: the decoder layers are 97% of the parameters.
WIDE_LAYERS = ModelSpec(name="tracker-wide-layers", hidden=2048, layers=2, heads=16, kv_heads=8,
                        intermediate=8192, vocab=4096)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One traced config: `expected` is the estimate's error (estimate / tracker - 1) recorded in
    docs/accuracy.md; `phase` the napkin's peak phase the case is chosen for; `terms` what it
    holds (for readers)."""

    name: str
    model: ModelSpec
    gpus: int
    knobs: dict[str, Any]
    expected: float
    phase: str
    terms: str

    @property
    def config(self) -> Config:
        return Config(**self.knobs)


CASES = [
    Case("tracker-lora-model-gather", WIDE_LAYERS, 2,
         {"wrap": "model", "lora_rank": 16, "seq_len": 128, "micro_batch": 1}, -0.024, "gather",
         "the root's whole-model all-gather buffer beside its unsharded params"),
    Case("tracker-full-wide-vocab-reduce", WIDE_VOCAB, 8,
         {"seq_len": 128, "micro_batch": 1}, 0.042, "optimizer",
         "a vocabulary-sized unit gathered at the end of backward, beside its unsharded grads"),
]  # fmt: skip


@dataclass(frozen=True)
class Traced:
    """What the tracker reported for one case: rank 0's peak bytes by category and where."""

    peak_bytes: int
    by_category: dict[str, int]
    where: str


def measure(case: Case) -> Traced:
    by_category, where, _, _ = trace(case.model, case.gpus, case.knobs)
    return Traced(by_category["Total"], by_category, where)


def estimated(case: Case) -> Estimate:
    return estimate(case.model, preset_hardware(case.gpus, GPU), case.config, device="cuda")


def error(case: Case, tracked_bytes: int) -> float:
    return estimated(case).peak_tensor_bytes / tracked_bytes - 1


def problem(case: Case, traced: Traced) -> str | None:
    """Why the estimate misses this tracker peak beyond the tolerance, or None."""
    est = estimated(case)
    err = est.peak_tensor_bytes / traced.peak_bytes - 1
    if abs(err - case.expected) <= SLACK and est.peak_phase == case.phase:
        return None
    return (
        f"{case.name}: estimate {est.peak_tensor_bytes / 2**20:.1f} MiB ({est.peak_phase}, "
        f"chosen for {case.phase}) vs FSDPMemTracker {traced.peak_bytes / 2**20:.1f} MiB "
        f"({traced.where}): error {err:+.1%}, docs/accuracy.md records {case.expected:+.1%} "
        f"(+-{SLACK:.1%}); holds {case.terms}"
    )
