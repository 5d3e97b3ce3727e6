"""The CPU trials the estimate is held to, and the one check the tests and the mutation bench share.

Each case is a real trial (`autofit.trials.run_trial`, `device="cpu"`, 1 warm-up + 1 measured
step; the tests run those of one model and rank count in one launch, `measure_all`) chosen so
that some memory term of the estimate is a large part of its peak: together they make every term
of `autofit/estimate/memory/` count (`bench/mutate_memory_terms.py` shows that scaling any of
them by 0.7 or 1.3 fails a case).

Tolerance: docs/accuracy.md section 1, "Held by the test suite", records each case's measured
peak and the estimate's error on it. A case passes when the estimate's error is that recorded
error within `slack`: 1.5 points for runs whose peak is the same bytes on every run (the plain
module, LoRA under FSDP2), 5 points for full fine-tunes under FSDP2, whose peak moves by up to
+-5% from run to run with the timing of gloo's all-gathers (same section).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.config import Config
from autofit.estimate import Estimate, estimate
from autofit.hardware import cpu_hardware
from autofit.models import ModelSpec, resolve_model
from autofit.trials import TrialResult, run_trial
from tests.batch import run_grouped

DEBUG = resolve_model("llama-debug")
# llama-debug with a 16k vocabulary and a narrow MLP: embeddings, LM head and logits dominate.
WIDE_VOCAB = ModelSpec(name="wide-vocab", hidden=256, layers=2, heads=4, kv_heads=2,
                       intermediate=256, vocab=16384, max_position=1024)  # fmt: skip
DETERMINISTIC = 0.015
FSDP2_FULL = 0.05


@dataclass(frozen=True)
class Case:
    """One trial: `expected` is the estimate's error (estimate / measured - 1) recorded in
    docs/accuracy.md; `terms` names what the case is there to hold (for readers)."""

    name: str
    model: ModelSpec
    ranks: int
    knobs: dict[str, Any]
    expected: float
    slack: float
    terms: str
    seq_len: int = 128
    micro_batch: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> Config:
        return Config(seq_len=self.seq_len, micro_batch=self.micro_batch, **self.knobs)


CASES = [
    Case("plain-full", DEBUG, 1, {"wrap": "none"}, 0.001, DETERMINISTIC,
         "fp32 masters, AdamW states, autocast's bf16 weight copies"),
    Case("plain-full-long", DEBUG, 1, {"wrap": "none"}, 0.004, DETERMINISTIC,
         "traced activations (an fp32 residual stream under autocast), logits and loss",
         seq_len=512, micro_batch=4),
    Case("plain-full-accum", DEBUG, 1, {"wrap": "none", "grad_accum": 2}, -0.001, DETERMINISTIC,
         "accumulated gradients counted once: in a later micro-step's forward, not again at "
         "the optimizer step", seq_len=32, micro_batch=1),
    Case("plain-full-wide-vocab", WIDE_VOCAB, 1, {"wrap": "none"}, 0.0, DETERMINISTIC,
         "gradients and CPU AdamW temporaries at the optimizer step", seq_len=64, micro_batch=1),
    Case("plain-full-wide-vocab-foreach", WIDE_VOCAB, 1, {"wrap": "none",
         "optimizer_impl": "foreach"}, 0.0, DETERMINISTIC,
         "foreach AdamW's intermediate the size of every trainable parameter", seq_len=64,
         micro_batch=1),
    Case("plain-full-wide-vocab-fused", WIDE_VOCAB, 1, {"wrap": "none",
         "optimizer_impl": "fused"}, 0.0, DETERMINISTIC,
         "fused AdamW (torch's CPU kernel): no intermediate at the step", seq_len=64,
         micro_batch=1),
    Case("fsdp2-nf4-selective", DEBUG, 2, {"lora_rank": 16, "quant": "nf4",
         "checkpointing": "selective"}, 0.057, DETERMINISTIC,
         "NF4 base, selective checkpointing"),
    Case("fsdp2-int8", DEBUG, 2, {"lora_rank": 16, "quant": "int8"}, 0.009, DETERMINISTIC,
         "int8 base and its saved bf16 weights"),
    Case("fsdp2-model", DEBUG, 2, {"wrap": "model"}, 0.020, FSDP2_FULL,
         "whole-model unit: unsharded gradients, gathered params at the reduce"),
    Case("fsdp2-lora-accum", DEBUG, 2, {"lora_rank": 64, "quant": "nf4", "grad_accum": 2}, 0.091,
         DETERMINISTIC, "unsharded fp32 gradients kept across micro-steps"),
    Case("fsdp2-lora-wide-vocab-kept", WIDE_VOCAB, 2, {"lora_rank": 16, "reshard": False}, 0.0,
         DETERMINISTIC, "frozen embeddings and head gathered and kept, logits beside the head "
         "unit's all-gather output FSDP2 holds through the loss's forward",
         seq_len=64, micro_batch=1),
    Case("plain-lora-full-ckpt", DEBUG, 1, {"lora_rank": 16, "checkpointing": "full",
         "wrap": "none"}, 0.023, DETERMINISTIC,
         "the last layer's backward: the layer checkpointing recomputes", seq_len=256,
         micro_batch=4),
    Case("fsdp2-lora-full-ckpt", DEBUG, 2, {"lora_rank": 16, "checkpointing": "full"}, 0.025,
         DETERMINISTIC, "the last layer's backward under FSDP2: its unit gathered, its unsharded "
         "gradients, the traced backward working set (activation gradients in flight)",
         seq_len=256, micro_batch=4),
    Case("plain-bnb-nf4", DEBUG, 1, {"lora_rank": 16, "quant": "nf4",
         "quant_backend": "bitsandbytes", "wrap": "none"}, 0.002, DETERMINISTIC,
         "bitsandbytes NF4 base (Linear4bit: codes, fp32 absmax, NF4 levels), its dequantized "
         "weight", seq_len=64, micro_batch=1),
    Case("plain-bnb-nf4-dq", DEBUG, 1, {"lora_rank": 16, "quant": "nf4",
         "quant_backend": "bitsandbytes", "bnb_4bit_use_double_quant": True, "wrap": "none"},
         0.002, DETERMINISTIC, "bitsandbytes double quantization: uint8 absmax, their fp32 "
         "absmax, offset and code map", seq_len=64, micro_batch=1),
]  # fmt: skip


TRIAL = {"device": "cpu", "steps": 1, "warmup": 1, "timeout_s": 240}


def measure(case: Case) -> TrialResult:
    return run_trial(case.model, case.config, nprocs=case.ranks, **TRIAL)


def measure_all(cases: list[Case]) -> dict[str, TrialResult]:
    """Each case's trial by name, the cases of one model and rank count in one launch."""
    return run_grouped({c.name: (c.model, c.ranks, c.config) for c in cases}, **TRIAL)


def estimated(case: Case) -> Estimate:
    return estimate(case.model, cpu_hardware(case.ranks), case.config, device="cpu")


def error(case: Case, measured_bytes: int) -> float:
    return estimated(case).peak_allocated_bytes / measured_bytes - 1


def problem(case: Case, result: TrialResult) -> str | None:
    """Why the estimate misses this measurement beyond the tolerance, or None."""
    if result.status != "ok" or not result.peak_bytes:
        return f"{case.name}: the trial did not run: {result.status} {result.message[-300:]}"
    err = error(case, result.peak_bytes)
    if abs(err - case.expected) <= case.slack:
        return None
    est = estimated(case)
    return (
        f"{case.name}: estimate {est.peak_allocated_bytes / 2**20:.2f} MiB "
        f"({est.peak_phase}) vs measured {result.peak_bytes / 2**20:.2f} MiB: error {err:+.1%}, "
        f"docs/accuracy.md records {case.expected:+.1%} (+-{case.slack:.1%}); holds {case.terms}"
    )
