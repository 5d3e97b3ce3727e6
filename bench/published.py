"""The napkin estimate against published GPU measurements (the outside truth from real GPUs).

    .venv/bin/python bench/published.py [--source NAME] [--json PATH] [--csv PATH]

Reads every row of `bench/data/gpu-measurements/measurements.csv` (242 published peaks of
full fine-tuning, LoRA and QLoRA runs on A100/A10G/T4 GPUs, each with its `source_url` pinned to
the commit that was read; the folder's README.md describes the columns), decides whether
autofit can express the row, and if so estimates it with `autofit.estimate(...)` under the row's
OWN settings and compares the row's memory metric with the matching part of the estimate:

    allocated (torch.cuda.max_memory_allocated)  -> est.peak_allocated_bytes
    reserved  (torch.cuda.max_memory_reserved)   -> est.peak_bytes
    nvidia-smi / device-level                    -> est.device_bytes (reserved + everything
        outside PyTorch's allocator; until `Estimate.device_bytes` exists: peak_bytes + the
        overheads but the allocator's, i.e. + the CUDA context)

It prints a table per compared row, then median |error|, p90 |error|, the worst error and the
count under by more than 10% per source, per metric, per path and overall (error = estimate /
measured - 1; negative = under-estimate), then the tokens/s comparison as a second table, then
every row it did not compare with the reason. `--source qwen|fms|litgpt|unsloth|llama-factory|
axolotl` keeps one source; `--json` saves compared, tokens/s and excluded rows; `--csv` the
compared rows. `tests/estimate/test_published.py` loads this file (importlib) and holds the
estimator to a few of these rows through `load_rows`, `map_row` and `compare_row`.

"Overall" is one comparison per row, its own metric, over the fixed-length rows autofit can
express; the fms rows' nvidia-smi peak (in `notes`) is a second, device-level comparison of the
same run, counted under "device" (and its source and path) but not in "overall". Each row is
read as the launch its source ran (Qwen: HF Trainer, `launch="trainer"`). Where autofit refuses
that launch (fms: TRL's SFTTrainer under Accelerate's FSDP1), autofit's own launch of the same
knobs stands in (marked S), and "overall" gives the rows read as their launch, the stand-ins and
all rows apart.

Mapping choices, each with the source it comes from
====================================================

Rows autofit cannot express are listed with the reason, not fitted (first reason that applies):
no figure (OOM, failed run: blank `peak_mem_gib`); variable-length data (`seq_len` "<=N": litgpt
pads each batch to its longest sample, litgpt@00af8b0d litgpt/data/base.py `_sft_collate_fn`
"Pad right based on the longest sequence", so the peak follows the longest batch, not N); config
not stated (Unsloth README@08c330b7: rank, sequence length and targets not given; the LLaMA-Factory
table quoted there: targets, checkpointing and precision not stated and "1024 (max length)" is a
cut-off; axolotl PR #1428: the YAML at PR time was not verified); GPTQ int4 kernels (auto_gptq
QuantLinear, fp16: Qwen Q-LoRA and fms accelerated-peft-autogptq); DeepSpeed ZeRO-2/3 (Qwen
finetune_ds.sh, finetune_lora_ds.sh, Q-LoRA: autofit launches the plain module, DDP and FSDP2,
not DeepSpeed's partitioned optimizer and buckets); a model family autofit does not build
(gpt_bigcode); a setting that does not exist yet (Qwen "LoRA (emb)": `train_embeddings`, tried
as a keyword of `autofit.estimate`, listed when it raises TypeError/ConfigError); and rows autofit
could express whose gap is the framework's own code, not what autofit launches (listed as
"framework code differs", the fms bullets below give the code and the measured evidence).

Qwen (QwenLM/Qwen@2df8e8ac README.md "Profiling of Memory and Speed", finetune.py,
finetune/finetune_lora_single_gpu.sh; modeling_qwen.py of the HF repo Qwen/Qwen-7B, read from its
mirror zhangningboo/Qwen-7B@1ff20863):
- Model: Qwen v1 is not a family autofit builds. It is Llama-shaped (RMSNorm, rotary, SwiGLU,
  untied `lm_head`) with biases on the fused q/k/v projection `c_attn` only (`c_proj` and the MLP
  have `bias=not config.no_bias`, no_bias=true): that is HF qwen2 (q/k/v biases, none on o_proj or
  the MLP). A qwen2 config.json with the SAME sizes is written from `configs/qwen-*.json` (a temp
  folder) and passed as `model=`. Qwen v1's own config.json says `intermediate_size` 22016 for 7B
  but `QWenMLP` builds `w1`, `w2` as `nn.Linear(hidden, intermediate_size // 2)` and
  `c_proj` from `intermediate_size // 2` (modeling_qwen.py `class QWenMLP`): each projection is
  half of it. configs/*.json already hold the halved width (7B: 11008); `qwen_config` checks the
  parameter count against `params_b` (within 3%) so a doubled width cannot slip through.
- Precision: finetune.py:307 `from_pretrained` passes no torch_dtype, but `QWenLMHeadModel.__init__`
  sets `config.bf16 = True` when bf16/fp16/fp32 are all false (the released config.json) and the
  GPU supports bf16, then `self.transformer.bfloat16(); self.lm_head.bfloat16()`: the weights are
  bf16. The adapters are fp32: the table was measured on 2023-10-07 (commit b5fad3d, "add
  profiling", README: `pip install peft deepspeed`, unpinned) and re-measured with the 1.8B
  model on 2023-11-30 (e8e1596; its "LoRA (emb)" figures within 0.2 G of October's). Every peft
  release up to then (0.5.0; 0.6.0-0.6.2, 2023-11-13) built a LoRA layer's adapters in fp32:
  0.6.2 tuners/lora/layer.py `update_layer` casts them to the weight's dtype only when the layer
  already has a weight, which a new `Linear` (`super(nn.Linear, self).__init__()`) does not, and
  model.py `_replace_module` moves them to the weight's device only. 0.7.0 (2023-12-06) first
  casts them to the base weight's bf16 (`get_base_layer().weight`); the README's `peft<0.8.0`
  pin came on 2024-02-01 for a tokenizer bug. The "LoRA (emb)" copies are `copy.deepcopy` of the
  bf16 modules and stay bf16. fp32 adapters beside bf16 copies is what HF Trainer with today's
  peft holds too (peft 0.21 upcasts adapter layers only, `autocast_adapter_dtype`), so the rows
  are read as their launch: `launch="trainer"`, `precision="bf16-mixed"` (the adapters, their
  gradients and AdamW moments fp32; `autofit.layout.embedding_precision`: the copies bf16).
  tests/estimate/test_published.py holds the reading to the rows (bf16 adapters put the 256-token
  rows 5-11 points lower, row 24 at -12.0%). Optimizer: torch 2.0's foreach
  AdamW step (`optimizer_impl="foreach", foreach_intermediates=2`): `_multi_tensor_adamw` kept
  `exp_avg_sq_sqrt` and `denom = torch._foreach_add(exp_avg_sq_sqrt, eps)` alive together, two
  parameter-sized intermediates (pytorch/pytorch#97712, one since #104898 in 2.1); the README's
  "LoRA (emb)" minus "LoRA" figures are 12 B per trained embedding parameter, as that step
  holds. `--bf16 True` (finetune_lora_single_gpu.sh:42) adds HF Trainer's bf16 autocast over the
  fp32 adapters (peft casts each adapter's input to fp32 first, as `launch="trainer"` counts);
  the loss (`CrossEntropyLoss` on `shift_logits`) runs in fp32 as Trainer's does.
- LoRA: finetune.py:55-59 r 64, alpha 16, dropout 0.05, targets c_attn, c_proj, w1, w2. By peft's
  suffix match `c_proj` is both the attention output and the MLP down projection, so the targets
  are every projection: q/k/v (c_attn), o (attn.c_proj), gate/up (w1, w2), down (mlp.c_proj) =
  `lora_targets="all-linear"`. Known difference: Qwen adapts the fused c_attn with ONE adapter
  (A: r x h, B: 3h x r, 4rh params) where qwen2's separate q/k/v take 6rh; autofit counts 2rh per
  layer more (7B r64: 16.8M params, ~0.13 GB of bf16 weight, grad and moments: an over-estimate).
- "LoRA (emb)": finetune.py:334 `modules_to_save = ["wte", "lm_head"]` when the model is a base
  model and not Q-LoRA (peft 0.7.1 utils/other.py:190 `copy.deepcopy(self.original_module)`: a
  trainable bf16 copy beside the frozen original) -> `train_embeddings="full"` (the setting's
  "a trainable copy of each beside the frozen original (peft modules_to_save)"). The README's "LoRA"
  rows are the chat models (no modules_to_save).
- Shapes: micro-batch 1, grad_accum 8 (README: "a batch size of 1 and gradient accumulation of
  8"), every sample padded to `model_max_length` (finetune.py:165 `input_id += [pad] * (max_len -
  len(input_id))`), so `seq_len` is fixed; `--gradient_checkpointing` (finetune_lora_single_gpu.sh
  :61; modeling_qwen.py checkpoints each `QWenBlock`) = `checkpointing="full"`; one GPU without
  DeepSpeed = the plain module, `wrap="none"`, `gpus="1xa100-80gb"`.
- Metric: the README's "GB" names no tool (`mem_metric` unknown). Compared device-level: the
  multi-GPU figures are sums over the GPUs (7B full-parameter: 139.2G on 2 GPUs, more than one
  80 GB card holds), what one reads off a per-GPU monitor (nvidia-smi) and adds up, not a
  per-process `max_memory_allocated`; and the 1.8B full-parameter figures sit flat at 43.5G from
  256 to 2048 tokens, a cached (reserved-level) figure. Unit: "G" with no unit named, and it
  cannot be GiB. Row 44 (7B full-parameter on 2 GPUs, 1024 tokens, "162.0G"; the README: only
  256-1024 tokens are shown "due to the limitation of GPU memory") is 81.0 G per GPU, and an
  A100-SXM4-80GB holds 81,920 MiB = 80 GiB, so one G is at most 0.9877 GiB (`qwen_g_bound`).
  The two units a reading of a GPU's memory is printed in that fit are nvidia-smi's MiB / 1000
  (0.9766 GiB: row 44 at 98.9% of the card) and SI gigabytes (0.9313 GiB: 94.2%). The report
  reads the larger, `QWEN_G = "1000-mib"`, so a Qwen figure is never made smaller than the data
  allow, and prints the overall statistics under each reading (`--qwen-g` picks another).

fms-acceleration (foundation-model-stack/fms-acceleration@876e2ed6 scripts/benchmarks/: refs/
a100_80gb.csv, accelerate.yaml, defaults.yaml, scenarios.yaml; refs/requirements.txt pins torch
2.4.1, transformers 4.48.1, accelerate 1.0.1, peft 0.13.2, trl 0.13.0, bitsandbytes 0.43.3):
- Sharding: accelerate.yaml:8 `distributed_type: FSDP`, :14 TRANSFORMER_BASED_WRAP (a unit per
  decoder layer), :30 FULL_SHARD, :28 no offload, :38-39 cpu_ram_efficient_loading and
  sync_module_states true, :17 BACKWARD_PRE. accelerate 1.0.1 commands/launch.py runs
  `multi_gpu_launcher` for `use_fsdp` whatever the process count, so the 1-GPU rows are FSDP on a
  one-rank mesh too: `wrap="layer"` on `Nxa100-80gb`. Defaults there: `--fsdp_use_orig_params`
  "true" (launch.py), `limit_all_gathers=True` (utils/dataclasses.py). What autofit cannot say:
  FSDP1 flat parameters (autofit models FSDP2's per-parameter sharding) and FSDP1's root unit
  holding the embedding and the LM head gathered from forward into backward. On one rank FSDP1
  switches FULL_SHARD to NO_SHARD (torch/distributed/fsdp/_init_utils.py `_init_core_state`:
  "FSDP is switching to use `NO_SHARD`"): no all-gather buffers, like autofit's one-rank FSDP2.
- Shapes: defaults.yaml:14 GA 1, :15 gradient_checkpointing (HF, per decoder layer: "full"), :7
  flash-attn; alpaca packed to 4096 tokens (fixed length); per_device_train_batch_size from the
  row. Loss: transformers 4.48 `ForCausalLMLoss` upcasts the logits to fp32 (`logits.float()`),
  autofit's `loss="standard"`. Optimizer: HF default adamw_torch = `optimizer="adamw"`.
- Full fine-tune (scenarios.yaml:39-50): torch_dtype bfloat16, no --bf16 and accelerate
  `mixed_precision: 'no'` (accelerate.yaml:48): HF Trainer keeps no fp32 copy, FSDP holds bf16
  flat params and AdamW bf16 moments: `precision="bf16"`. LISTED, not fitted: HF's adamw_torch
  is `torch.optim.AdamW` with its defaults, the foreach implementation on CUDA
  (`_default_to_fused_or_foreach`), whose step allocates `exp_avg_sq_sqrt =
  torch._foreach_sqrt(exp_avg_sqs)`, one temporary the size of every (local) parameter
  (torch/optim/adam.py `_multi_tensor_adam`); autofit's builder runs fused AdamW
  (autofit/builder/optim.py), which has none, so these rows are estimated with the launch's own
  `optimizer_impl="foreach"`. The rows show it: the peak does not move with the
  micro-batch (rows 173/175: 67.46 GiB at mb 4 and 8; 174/176: 33.74 at mb 2 and 4) and is
  10.0 bytes per parameter per GPU (7.24B x 10 B / 2^30 = 67.4 GiB; / 2 GPUs = 33.7): bf16
  param + grad + two moments (8 B) + the foreach temporary (2 B), at the optimizer step.
- LoRA (standard-peft, scenarios.yaml:52-63): r 16, alpha 16, dropout 0.1, q/k/v/o, torch_dtype
  bfloat16, no AMP. fms-hf-tuning v2.5.0 tuning/sft_trainer.py hands `peft_config` to TRL's
  SFTTrainer, whose v0.13.0 sft_trainer.py calls `get_peft_model(model, peft_config)` for a
  non-quantized model; peft 0.13.2 mapping.py:143 `autocast_adapter_dtype=True` upcasts bf16
  adapters to fp32 (tuners_utils.py:341). fp32 adapters, gradients and AdamW moments beside bf16
  frozen weights is autofit's `precision="bf16-mixed"` state (its LoRA compute is bf16 where fms
  computes the adapters in fp32; with checkpointing that is one recomputed layer's worth).
- QLoRA (baseline-peft-bnb, scenarios.yaml:69-80, --bf16 AMP): plugins/accelerated-peft
  framework_plugin_bnb.py:145 loads bnb NF4 WITH double quantization: 4-bit codes + an 8-bit
  absmax per 64 weights + an fp32 scale per 256 absmax blocks (~0.516 B/weight), the same
  layout torchao's `to_nf4` stores (int8 scale per 64, a bf16 factor per 64 x 256: ~0.516 B), so
  `quant="nf4"` (bnb without double quant stores an fp32 absmax per 64: 0.5625 B/weight).
  :123-126 sets `bnb_4bit_quant_storage=torch_dtype` only when world_size > 1 under FSDP; the
  baseline sample config (sample-configurations/baseline-peft-bnb-nf4-sample-configuration.yaml,
  `no_peft_model: true`) leaves PEFT to TRL, which for sharded QLoRA calls
  `get_peft_model(..., autocast_adapter_dtype=False)` (trl v0.13.0 sft_trainer.py:224): the
  adapters take the base weight's dtype, bf16 with the bf16 storage of 2 GPUs ->
  `precision="bf16"`. On 1 GPU the model is quantized onto the GPU at load (uint8 storage), TRL
  sees a non-sharded 4-bit model and runs peft's `prepare_model_for_kbit_training` (every
  non-4-bit param upcast to fp32, peft 0.13.2 utils/other.py:132), `get_peft_model` (fp32
  adapters: `precision="bf16-mixed"`) and `peft_module_casting_to_bf16` (trl utils.py:872:
  embedding and head back to bf16, norms kept fp32). LISTED, not fitted: fp32 RMSNorm weights
  make each norm's output fp32, bnb's Linear4bit casts its output back to the input's dtype, so
  the residual stream and every checkpointed layer input are fp32 (4 B per value, autofit's are
  bf16). The rows show it: rows 197 -> 199 (mb 4 -> 8) grow 3.80 GiB per 4096-token sequence
  against 2.80 for the bf16 LoRA rows 185 -> 187; the extra 1.0 GiB = 32 layers x 4096 tokens x
  4096 x 2 B. Mixtral QLoRA is LISTED too: transformers 4.48 builds each expert as nn.Linear
  (MixtralBlockSparseTop2MLP w1/w2/w3), which bitsandbytes quantizes with the attention, while
  autofit's NF4 covers the projections and holds MoE experts (3-D tensors in the transformers it
  builds) in bf16: the experts are 45.1B of Mixtral's 46.7B parameters, 45.1B x (2 - 0.516) B =
  62 GiB more per run that autofit would hold and fms did not (the estimate is +61.5 GiB over
  row 201 on 1 GPU, +33.7 over row 202 on 2).
- Metrics: `peak_mem_gib` is HF Trainer's `mem_peak_torch_mem_alloc_in_bytes` on rank 0
  (max_memory_allocated over `train()`, benchmark.py:85, README "Logging GPU Memory"):
  allocated. `notes` carry the nvidia-smi `memory.used` peak (mean over devices, the reading
  before the run subtracted: benchmark.py `get_peak_mem_usage_by_device_id`), compared
  device-level as a second comparison of the same run. tokens/s: HF `train_tokens_per_second`,
  per device (`tps_scope=per_gpu`): compared with the estimate's tokens/s / GPUs.

Tokens/s: where a row reports tokens/s (`tokens_per_s`, scope from `tps_scope=` in notes) it is
compared with `est.tokens_per_s` (a job total; divided by the GPUs for a per-GPU figure). Qwen's
s/it (one optimizer step of 8 micro-batches of `seq_len` padded tokens) gives a "derived:" tok/s
total in its notes, compared the same way and marked derived.
"""

from __future__ import annotations

import argparse
import atexit
import csv
import functools
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = ROOT / "bench" / "data" / "gpu-measurements"
CSV_PATH = DATA / "measurements.csv"
GiB = 1024**3
UNDER = -0.10  # "under by more than 10%": error below this

SOURCES = ("qwen", "fms", "litgpt", "unsloth", "llama-factory", "axolotl")
PATHS = ("plain", "ddp", "fsdp", "offload")
METRICS = ("allocated", "reserved", "device")

# HF names -> autofit presets (`autofit models`)
PRESET_OF = {
    "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",  # the v0.1 base's architecture
    "NousResearch/Llama-2-70b-hf": "llama-70b",
    "meta-llama/Llama-2-7b-hf": "llama-7b",
    "meta-llama/Llama-2-13b-hf": "llama-13b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
    "google/gemma-2-2b": "gemma-2-2b",
    "google/gemma-2-9b": "gemma-2-9b",
    "microsoft/Phi-3-mini-4k-instruct": "phi-3-mini",
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": "tinyllama-1.1b",
}
# Qwen v1 -> its config in configs/ (sizes; written as a qwen2 config by `qwen_config`)
QWEN_CONFIG = {
    "Qwen/Qwen-1_8B": "qwen-1.8b.json",
    "Qwen/Qwen-7B": "qwen-7b.json",
    "Qwen/Qwen-14B": "qwen-14b.json",
    "Qwen/Qwen-72B": "qwen-72b.json",
}
SHORT_MODEL = {
    "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral",
    "NousResearch/Llama-2-70b-hf": "llama2-70b",
    "Qwen/Qwen-1_8B": "qwen-1.8b",
    "Qwen/Qwen-7B": "qwen-7b",
    "Qwen/Qwen-14B": "qwen-14b",
    "Qwen/Qwen-72B": "qwen-72b",
}
GPU_PRESET = {"A100-SXM4-80G": "a100-80gb", "A100 80GB": "a100-80gb"}

# the LoRA settings a source's code sets where the CSV is silent (see the module docstring)
QWEN_LORA = {"lora_alpha": 16, "lora_dropout": 0.05}  # finetune.py:55-59

# What one of Qwen's "G" is in GiB, by reading (the module docstring, "Metric"; `qwen_g_bound`)
QWEN_G_GIB = {
    "1000-mib": 1000 * 2**20 / GiB,  # nvidia-smi's MiB / 1000: 0.9766 GiB
    "gb": 1e9 / GiB,  # SI gigabytes: 0.9313 GiB
    "gib": 1.0,  # the figure as printed: impossible for row 44 (`qwen_g_bound`)
}
QWEN_G = "1000-mib"
"""The reading the report uses: the largest `QWEN_G_GIB` that row 44 allows (`qwen_g_bound`)."""
QWEN_G_BOUND_ROW = 44  # Qwen-7B full-parameter, 2 GPUs, 1024 tokens: "162.0G" (the top)


# ----- rows -------------------------------------------------------------------------------------
def load_rows(path: Path | str = CSV_PATH) -> list[dict[str, str]]:
    """Every row of the CSV, in order (row `i` is the CSV's data row i, 0-based)."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def source_of(row: dict[str, str]) -> str:
    url, note = row["source_url"], row["source_note"]
    if "QwenLM/Qwen" in url:
        return "qwen"
    if "fms-acceleration" in url:
        return "fms"
    if "Lightning-AI/litgpt" in url:
        return "litgpt"
    if "axolotl" in url:
        return "axolotl"
    if note.startswith("LLaMA-Factory"):
        return "llama-factory"
    if "unsloth" in url:
        return "unsloth"
    return "other"


def model_label(row: dict[str, str]) -> str:
    name = row["model"]
    return SHORT_MODEL.get(name, name.split("/")[-1][:12])


@dataclass
class Mapped:
    """A row autofit can express: the `autofit.estimate` call and what to compare."""

    row: int
    source: str
    model_name: str  # the row's model
    label: str
    model: str  # preset name or config.json path
    n_gpus: int
    gpus: str
    path: str  # plain | ddp | fsdp | offload
    knobs: dict[str, Any]
    extra: dict[str, Any]  # keywords of settings that may not exist yet (train_embeddings)
    metric: str  # allocated | reserved | device: what the row's own figure is
    metric_note: str  # why, for an `unknown` metric
    measured_gib: float
    smi_gib: float | None = None  # a second, device-level figure of the same run (fms notes)
    tps: float | None = None  # measured tokens/s
    tps_scope: str = ""  # per_gpu | total
    tps_derived: bool = False
    # why the row is not read as its own launch ("": it is), and autofit's stands in instead
    stand_in: str = ""


@dataclass
class Excluded:
    row: int
    source: str
    label: str
    method: str
    reason: str  # a short key: the group the report lists it under
    detail: str


@dataclass
class Compared:
    row: int
    source: str
    label: str
    n_gpus: int
    path: str
    config: str
    metric: str
    primary: bool  # the row's own metric (False: the fms nvidia-smi figure of the same run)
    measured_gib: float
    estimate_gib: float
    error: float
    peak_phase: str = ""
    breakdown_gib: dict[str, float] = field(default_factory=dict)
    overhead_gib: dict[str, float] = field(default_factory=dict)
    within_capacity: bool = True
    named: str = ""  # the framework behaviour autofit does not launch that the gap comes from
    stand_in: str = ""  # why autofit's launch is estimated in place of the row's own (`Mapped`)


@dataclass
class Throughput:
    row: int
    source: str
    label: str
    n_gpus: int
    config: str
    scope: str
    derived: bool
    measured: float
    estimate: float
    error: float


def _excluded(i: int, row: dict[str, str], reason: str, detail: str) -> Excluded:
    return Excluded(i, source_of(row), model_label(row), row["method"], reason, detail)


def _int(text: str) -> int | None:
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else None


def _lora_settings(row: dict[str, str]) -> dict[str, Any]:
    """alpha and dropout written in the row's `lora_targets` text ("(alpha 16, dropout 0.1)")."""
    out: dict[str, Any] = {}
    text = row["lora_targets"]
    if m := re.search(r"alpha (\d+)", text):
        out["lora_alpha"] = int(m.group(1))
    if m := re.search(r"dropout ([\d.]+)", text):
        out["lora_dropout"] = float(m.group(1))
    return out


def _tps_scope(row: dict[str, str]) -> str:
    m = re.search(r"tps_scope=(\w+)", row["notes"])
    return m.group(1) if m else ""


def _smi_gib(row: dict[str, str]) -> float | None:
    m = re.search(r"nvidia-smi peak \([^)]*\) (\d+) MiB", row["notes"])
    return int(m.group(1)) / 1024 if m else None


def _reason(i: int, row: dict[str, str], strict: bool = True) -> Excluded | None:
    """Why autofit cannot express row `i` (the first reason that applies), or None. `strict`:
    also rows whose gap is the framework's own code (`_framework_reason`)."""
    src, quant = source_of(row), row["quant"].lower()
    sharding, seq = row["sharding"].lower(), row["seq_len"]
    if not row["peak_mem_gib"].strip():
        why = "OOM" if "OOM" in row["notes"] else "failed run or no figure"
        return _excluded(i, row, "no figure (OOM / failed run)", why)
    if seq.strip().startswith("<"):
        return _excluded(
            i, row, "variable-length sequences", f"seq_len {seq.split('(')[0].strip()}: padded "
            "per batch, the peak follows the longest batch",
        )  # fmt: skip
    if src in ("unsloth", "llama-factory", "axolotl"):
        what = {
            "unsloth": "rank, seq_len, targets not given",
            "llama-factory": "targets, checkpointing, precision not stated; seq a cut-off",
            "axolotl": "PR-time YAML not verified",
        }[src]
        return _excluded(i, row, "config not stated", what)
    if "gptq" in quant:
        extra = " + DeepSpeed ZeRO-2 fp16" if "zero" in sharding else ""
        return _excluded(i, row, "GPTQ int4 kernels", f"auto_gptq QuantLinear{extra}")
    if sharding.startswith("zero"):
        return _excluded(
            i, row, "DeepSpeed ZeRO (not launched by autofit)", row["sharding"].split(" (")[0]
        )
    if row["model"] not in PRESET_OF and row["model"] not in QWEN_CONFIG:
        return _excluded(i, row, "model family not supported", row["model"])
    if src not in ("qwen", "fms"):
        return _excluded(i, row, "config not stated", "no mapping for this source")
    return _framework_reason(i, row) if strict else None


FRAMEWORK = "framework code differs (estimate not fitted)"

FSDP1 = (
    "FSDP1 FULL_SHARD over 2+ ranks (fms: torch 2.4.1, accelerate FSDP): FlatParameters with "
    "use_orig_params (a unit's flat gradient covers its frozen parameters too), the root unit "
    "holding the embedding and head gathered from forward into backward, BACKWARD_PRE prefetch "
    "and record_stream'd all-gather outputs (torch/distributed/fsdp/_runtime_utils.py); autofit "
    "launches FSDP2 (per-parameter shards, torchtitan's units, event-based stream reuse). The "
    "same runs on one rank (FSDP1 switches to NO_SHARD there) are within 5% allocated"
)


def named_behaviour(m: Mapped) -> str:
    """The framework behaviour autofit does not launch that a compared row's gap comes from, or
    "" (the rows of such a behaviour are compared and counted, their gap named, not fitted)."""
    if m.source == "fms" and m.n_gpus > 1 and m.knobs.get("wrap") != "none":
        return FSDP1
    return ""


def _framework_reason(i: int, row: dict[str, str]) -> Excluded | None:
    """Rows autofit can express whose gap is the framework's own code, not what autofit launches
    (the module docstring gives the source lines and the measured evidence)."""
    if source_of(row) != "fms":
        return None
    nf4 = row["quant"].lower().startswith("nf4")
    if nf4 and "Mixtral" in row["model"]:
        return _excluded(
            i, row, FRAMEWORK, "bnb quantizes the experts' nn.Linear (transformers 4.48); "
            "autofit's nf4 leaves MoE experts bf16",
        )  # fmt: skip
    if nf4 and int(row["num_gpus"]) == 1:
        return _excluded(
            i, row, FRAMEWORK, "1 GPU: TRL prepares a non-sharded 4-bit model, fp32 norms -> "
            "fp32 residual stream (+1 GiB per sequence)",
        )  # fmt: skip
    return None


# ----- models -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _config_dir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="autofit-published-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.cache
def qwen_config(name: str, params_b: float) -> str:
    """A qwen2 config.json with the sizes of Qwen v1 model `name` (configs/), its path.

    Qwen v1 = qwen2's layout: biases on q/k/v only, untied head, RMSNorm eps 1e-6, rotary base
    10000 (modeling_qwen.py; configs/*.json). The parameter count of the result is checked
    against the published `params_b` within 3%: configs/ must hold each MLP projection's width
    (Qwen's own `intermediate_size` // 2)."""
    from autofit.arch import structure_of
    from autofit.models import ModelSpec

    src = json.loads((DATA / "configs" / QWEN_CONFIG[name]).read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings")  # fmt: skip
    cfg = {"model_type": "qwen2", **{k: src[k] for k in keys}, "rope_theta": 10000.0}
    path = _config_dir() / QWEN_CONFIG[name]
    path.write_text(json.dumps(cfg, indent=1, sort_keys=True))
    n = structure_of(ModelSpec.from_hf_config(cfg, name=str(path))).n_params
    if abs(n / (params_b * 1e9) - 1) > 0.03:
        raise ValueError(
            f"{name}: the qwen2 config built from configs/{QWEN_CONFIG[name]} has {n / 1e9:.2f}B "
            f"parameters, the published count is {params_b}B: check intermediate_size (each MLP "
            "projection's width, Qwen's own intermediate_size // 2)."
        )
    return str(path)


# ----- mapping ----------------------------------------------------------------------------------
def qwen_g_bound(rows: list[dict[str, str]]) -> float:
    """The most GiB one of Qwen's "G" can be: row 44's per-GPU figure (the README's 162.0G over
    two GPUs, where the README says 2048 tokens did not fit) cannot exceed the memory of the card
    it ran on (an A100-SXM4-80GB: 81,920 MiB, `autofit.hardware`)."""
    from autofit.hardware.presets import find_preset

    row = rows[QWEN_G_BOUND_ROW]
    card = find_preset(GPU_PRESET[row["hardware"]])
    assert card is not None
    return card.memory_bytes / GiB / float(row["peak_mem_gib"])


def map_row(
    i: int, row: dict[str, str], strict: bool = True, qwen_g: str = QWEN_G
) -> Mapped | Excluded:
    """Row `i` as an `autofit.estimate` call under its own settings, or why it cannot be.
    `strict=False` maps the rows listed for their framework's own code too (the tests check the
    arithmetic of those reasons); `qwen_g`: the reading of Qwen's "G" (`QWEN_G_GIB`)."""
    excluded = _reason(i, row, strict)
    if excluded is not None:
        return excluded
    src = source_of(row)
    n = int(row["num_gpus"])
    gpus = f"{n}x{GPU_PRESET[row['hardware']]}"
    seq = _int(row["seq_len"])
    lora = row["method"] != "full"
    knobs: dict[str, Any] = {
        "lora_rank": int(row["lora_rank"]) if lora else 0,
        "micro_batch": int(row["micro_batch"]),
        "grad_accum": int(row["grad_accum"]),
        "seq_len": seq,
        "checkpointing": "full" if row["activation_checkpointing"].startswith("full") else "none",
        "optimizer": "adamw",
        "loss": "standard",
    }
    # The launch's own settings autofit's would pin otherwise: HF Trainer's `adamw_torch` (Qwen
    # finetune.py:43; fms: HF's default) is torch AdamW with its defaults, foreach on CUDA, whose
    # step on torch 2.0 (Qwen's README: "Pytorch 2.0") held two parameter-sized intermediates and
    # from 2.1 on (fms: 2.4.1) one (`autofit.recipe.ADAMW_IMPLS`); both ran the caching
    # allocator with its default segments (neither launch sets PYTORCH_CUDA_ALLOC_CONF).
    extra: dict[str, Any] = {"optimizer_impl": "foreach", "expandable_segments": False}
    if src == "qwen":
        extra["foreach_intermediates"] = 2
    smi = tps = None
    scope, derived = "", False
    measured = float(row["peak_mem_gib"])
    if src == "qwen":
        measured *= QWEN_G_GIB[qwen_g]
        model = qwen_config(row["model"], float(row["params_b"]))
        # HF Trainer, peft <= 0.6.2: fp32 adapters, bf16 base and modules_to_save copies
        knobs.update(wrap="none", launch="trainer", precision="bf16-mixed")
        knobs.update(lora_targets="all-linear")
        knobs.update({**QWEN_LORA, **_lora_settings(row)})
        if "wte" in row["lora_targets"]:
            extra["train_embeddings"] = "full"  # modules_to_save: a trainable copy of each
        metric, note = "device", "unknown: sums over GPUs, flat plateaus -> device-level"
        if m := re.search(r"derived: (\d+) tok/s total", row["notes"]):
            tps, scope, derived = float(m.group(1)), "total", True
    else:  # fms
        model = PRESET_OF[row["model"]]
        quant = "nf4" if row["quant"].lower().startswith("nf4") else "none"
        knobs.update(wrap="layer", quant=quant)
        if lora:
            knobs.update(lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
            knobs.update(_lora_settings(row))
        if not lora:
            precision = "bf16"  # torch_dtype bf16, no AMP: bf16 params and moments
        elif quant == "nf4":
            # bf16 quant storage (2+ GPUs) -> bf16 adapters; uint8 (1 GPU) -> fp32 adapters
            precision = "bf16" if n > 1 else "bf16-mixed"
        else:
            precision = "bf16-mixed"  # peft 0.13.2 upcasts the adapters to fp32
        knobs["precision"] = precision
        metric, note = "allocated", ""
        smi = _smi_gib(row)
        if row["tokens_per_s"].strip():
            tps, scope = float(row["tokens_per_s"]), _tps_scope(row) or "per_gpu"
    path = "offload" if knobs.get("offload", "none") != "none" else (
        "fsdp" if knobs["wrap"] != "none" else ("ddp" if n > 1 else "plain")
    )  # fmt: skip
    return Mapped(
        i, src, row["model"], model_label(row), model, n, gpus, path, knobs, extra, metric, note,
        measured, smi, tps, scope, derived, FMS_STAND_IN if src == "fms" else "",
    )  # fmt: skip


FMS_STAND_IN = (
    "fms launched TRL's SFTTrainer under Accelerate's FSDP (FSDP1, accelerate 1.0.1), which "
    "launch=trl refuses (FSDP through Accelerate is not measured under Trainer yet): autofit's "
    "own FSDP2 launch of the same knobs is estimated in its place"
)


def device_bytes(est: Any) -> int:
    """Device-level bytes (what nvidia-smi shows): `Estimate.device_bytes` where it exists, else
    reserved + every overhead outside PyTorch's allocator (the CUDA context)."""
    fallback = est.peak_bytes + sum(v for k, v in est.overhead.items() if k != "allocator")
    return int(getattr(est, "device_bytes", fallback))


def metric_bytes(est: Any, metric: str) -> int:
    if metric == "allocated":
        return int(est.peak_allocated_bytes)
    if metric == "reserved":
        return int(est.peak_bytes)
    return device_bytes(est)


def estimate_of(m: Mapped) -> Any:
    """`autofit.estimate` of a mapped row. Raises TypeError/ConfigError when a keyword of
    `m.extra` (train_embeddings) does not exist yet."""
    import autofit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autofit.estimate(m.model, gpus=m.gpus, **m.knobs, **m.extra)


def short_config(knobs: dict[str, Any], extra: dict[str, Any]) -> str:
    """e.g. 'nf4 r16 mb4x1 s4096 ckpt bf16' (the path and GPUs have columns of their own)."""
    quant = knobs.get("quant", "none")
    parts = [quant if quant != "none" else ("lora" if knobs["lora_rank"] else "full")]
    if knobs["lora_rank"]:
        parts.append(f"r{knobs['lora_rank']}")
    parts.append(f"mb{knobs['micro_batch']}x{knobs['grad_accum']}")
    parts.append(f"s{knobs['seq_len']}")
    if knobs.get("checkpointing", "none") != "none":
        parts.append("ckpt")
    parts.append("mixed" if knobs["precision"] == "bf16-mixed" else knobs["precision"])
    if extra.get("train_embeddings"):
        parts.append("+emb")
    if extra.get("optimizer_impl", "auto") != "auto":
        two = extra.get("foreach_intermediates") == 2  # torch 2.0's step
        parts.append(extra["optimizer_impl"] + ("-2.0" if two else ""))
    return " ".join(parts)


def compare_row(m: Mapped) -> tuple[list[Compared], Throughput | None, Any]:
    """The comparisons of a mapped row (its own metric, then the fms nvidia-smi figure), its
    tokens/s comparison, and the estimate."""
    est = estimate_of(m)
    config = short_config(m.knobs, m.extra)
    gib = {k: round(v / GiB, 3) for k, v in est.breakdown.items()}
    over = {k: round(v / GiB, 3) for k, v in est.overhead.items()}
    out = []
    figures = [(m.metric, m.measured_gib, True)]
    if m.smi_gib is not None:
        figures.append(("device", m.smi_gib, False))
    for metric, measured, primary in figures:
        value = metric_bytes(est, metric) / GiB
        out.append(Compared(
            m.row, m.source, m.label, m.n_gpus, m.path, config, metric, primary, measured,
            round(value, 3), value / measured - 1, est.peak_phase, gib, over,
            bool(est.within_capacity), named_behaviour(m), m.stand_in,
        ))  # fmt: skip
    tps = None
    if m.tps:
        value = est.tokens_per_s / (m.n_gpus if m.tps_scope == "per_gpu" else 1)
        tps = Throughput(
            m.row, m.source, m.label, m.n_gpus, config, m.tps_scope, m.tps_derived, m.tps,
            round(value, 1), value / m.tps - 1,
        )  # fmt: skip
    return out, tps, est


def run(
    rows: list[dict[str, str]], source: str | None = None, qwen_g: str = QWEN_G
) -> tuple[list[Compared], list[Throughput], list[Excluded]]:
    """Map, estimate and compare every row (of `source`, when given; Qwen's "G" read as
    `qwen_g`)."""
    from autofit.errors import ConfigError

    compared: list[Compared] = []
    speeds: list[Throughput] = []
    excluded: list[Excluded] = []
    for i, row in enumerate(rows):
        if source and source_of(row) != source:
            continue
        m = map_row(i, row, qwen_g=qwen_g)
        if isinstance(m, Excluded):
            excluded.append(m)
            continue
        try:
            found, tps, _ = compare_row(m)
        except (TypeError, ConfigError) as exc:
            if "train_embeddings" not in m.extra:
                raise
            names = "train_embeddings"
            excluded.append(Excluded(
                i, m.source, m.label, row["method"], f"needs {names}",
                f"autofit.estimate does not take {names} yet ({type(exc).__name__})",
            ))  # fmt: skip
            continue
        compared.extend(found)
        if tps is not None:
            speeds.append(tps)
    return compared, speeds, excluded


# ----- report -----------------------------------------------------------------------------------
def stats(errors: list[float]) -> dict[str, Any]:
    """n, median |error|, p90 |error|, worst (signed, largest |error|), count under by > 10%."""
    if not errors:
        return {"n": 0}
    mags = sorted(abs(e) for e in errors)
    p90 = statistics.quantiles(mags, n=10, method="inclusive")[8] if len(mags) > 1 else mags[0]
    return {
        "n": len(errors),
        "median": statistics.median(mags),
        "p90": p90,
        "worst": max(errors, key=abs),
        "under10": sum(e < UNDER for e in errors),
    }


def summary(compared: list[Compared]) -> dict[str, dict[str, dict[str, Any]]]:
    """The statistics per source, metric and path (every comparison) and overall (one per row,
    its own metric)."""
    out: dict[str, dict[str, dict[str, Any]]] = {"source": {}, "metric": {}, "path": {}}
    for key, values in (("source", SOURCES), ("metric", METRICS), ("path", PATHS)):
        for value in values:
            errors = [c.error for c in compared if getattr(c, key) == value]
            out[key][value] = stats(errors)
    out["overall"] = {
        "rows": stats([c.error for c in compared if c.primary]),
        "own_launch": stats([c.error for c in compared if c.primary and not c.stand_in]),
        "stand_in": stats([c.error for c in compared if c.primary and c.stand_in]),
    }
    unnamed = sorted({c.row for c in compared if c.error < UNDER and not c.named})
    out["overall"]["under_unnamed"] = {"n": len(unnamed), "rows": unnamed}
    return out


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def print_report(
    compared: list[Compared], speeds: list[Throughput], excluded: list[Excluded]
) -> None:
    line = "-" * 99
    print("Estimate vs published GPU measurements (bench/data/gpu-measurements/measurements.csv)")
    print("error = estimate / measured - 1 (negative: under-estimate); GiB")
    print(line)
    head = (f"{'row':>3} {'source':<6} {'model':<10} {'gpu':>3} {'path':<5} {'config':<34} "
            f"{'metric':<7} {'meas':>6} {'est':>6} {'error':>7}")  # fmt: skip
    print(head)
    print(line)
    for c in compared:
        metric = ("alloc" if c.metric == "allocated" else c.metric) + ("" if c.primary else "+")
        print(
            f"{c.row:>3} {c.source:<6} {c.label[:10]:<10} {c.n_gpus:>3} {c.path:<5} "
            f"{c.config[:34]:<34} {metric:<7} {c.measured_gib:>6.2f} {c.estimate_gib:>6.2f} "
            f"{_pct(c.error):>7}{_marks(c)}"
        )
    print(line)
    print("alloc: max_memory_allocated; device: device-level (nvidia-smi, or Qwen's unknown 'G');")
    print("device+: the run's nvidia-smi peak from `notes` (fms), a second comparison of the row")
    notes = [f"S: {text}" for text in sorted({c.stand_in for c in compared if c.stand_in})]
    notes += [f"N: {text}" for text in sorted({c.named for c in compared if c.named})]
    for text in notes:
        for part in textwrap.wrap(text, 99, subsequent_indent="   "):
            print(part)
    print()
    _print_summary(summary(compared))
    print()
    _print_speeds(speeds)
    print()
    _print_excluded(excluded)


def _marks(c: Compared) -> str:
    """' S', ' N', ' SN' or '': a stand-in's and a named behaviour's marks of a table row."""
    marks = ("S" if c.stand_in else "") + ("N" if c.named else "")
    return f" {marks}" if marks else ""


def _stat_line(name: str, s: dict[str, Any]) -> str:
    if not s.get("n"):
        return f"  {name:<22} {0:>4}  (no rows)"
    return (
        f"  {name:<22} {s['n']:>4} {s['median'] * 100:>8.1f}% {s['p90'] * 100:>8.1f}% "
        f"{_pct(s['worst']):>9} {s['under10']:>10}"
    )


def _print_summary(summ: dict[str, dict[str, dict[str, Any]]]) -> None:
    print("Memory: |error| statistics (under>10%: rows whose estimate is > 10% below the figure)")
    print(f"  {'group':<22} {'n':>4} {'median':>9} {'p90':>9} {'worst':>9} {'under>10%':>10}")
    labels = {
        "plain": "one GPU, plain module",
        "ddp": "DDP",
        "fsdp": "FSDP (1 or more GPUs)",
        "offload": "offload",
    }
    print("  per source:")
    for name, s in summ["source"].items():
        print(_stat_line(name, s))
    print("  per metric:")
    for name, s in summ["metric"].items():
        print(_stat_line(name, s))
    print("  per path:")
    for name, s in summ["path"].items():
        print(_stat_line(labels[name], s))
    print("  overall (fixed-length rows autofit can express; each row's own metric):")
    print(_stat_line("read as their launch", summ["overall"]["own_launch"]))
    print(_stat_line("autofit's standing in", summ["overall"]["stand_in"]))
    print(_stat_line("all rows", summ["overall"]["rows"]))
    unnamed = summ["overall"]["under_unnamed"]
    rows = _ranges(unnamed["rows"]) if unnamed["rows"] else "none"
    print(f"  under by more than 10% with no framework behaviour named: {unnamed['n']} "
          f"(rows {rows})")  # fmt: skip


def _print_speeds(speeds: list[Throughput]) -> None:
    print("Tokens/s: estimate (est.tokens_per_s; / GPUs where the figure is per GPU) vs reported")
    line = "-" * 99
    print(line)
    print(f"{'row':>3} {'source':<6} {'model':<10} {'gpu':>3} {'config':<35} {'scope':<13} "
          f"{'meas':>7} {'est':>7} {'error':>7}")  # fmt: skip
    print(line)
    for t in speeds:
        scope = t.scope + (" derived" if t.derived else "")
        print(
            f"{t.row:>3} {t.source:<6} {t.label[:10]:<10} {t.n_gpus:>3} {t.config[:35]:<35} "
            f"{scope:<13} {t.measured:>7.0f} {t.estimate:>7.0f} {_pct(t.error):>7}"
        )
    print(line)
    print("derived: Qwen's s/it x (8 micro-batches of seq_len padded tokens), from its notes")
    print(f"  {'group':<22} {'n':>4} {'median':>9} {'p90':>9} {'worst':>9} {'under>10%':>10}")
    for name in SOURCES:
        s = stats([t.error for t in speeds if t.source == name])
        if s["n"]:
            print(_stat_line(name, s))
    print(_stat_line("all", stats([t.error for t in speeds])))


def _print_excluded(excluded: list[Excluded]) -> None:
    print(f"Not compared: {len(excluded)} rows, by reason (row numbers: CSV data rows, 0-based)")
    groups: dict[str, list[Excluded]] = {}
    for e in excluded:
        groups.setdefault(e.reason, []).append(e)
    for reason, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"  {reason}: {len(items)}")
        by_source: dict[tuple[str, str], list[int]] = {}
        for e in items:
            by_source.setdefault((e.source, e.detail), []).append(e.row)
        for (src, detail), rows in by_source.items():
            text = f"{src}: {detail} - rows {_ranges(rows)}"
            for part in textwrap.wrap(text, 99, initial_indent="    ", subsequent_indent="      "):
                print(part)


def _print_qwen_readings(rows: list[dict[str, str]], source: str | None, used: str) -> None:
    """What Qwen's "G" can be, and the overall statistics under each reading."""
    bound = qwen_g_bound(rows)
    text = (
        f"Qwen's 'G' (its README names no unit): row {QWEN_G_BOUND_ROW}'s "
        f"{float(rows[QWEN_G_BOUND_ROW]['peak_mem_gib']):.1f} G per GPU fits its 80 GiB card "
        f"only if one G is at most {bound:.4f} GiB. Read here as {used}; overall under each:"
    )
    print("\n".join(textwrap.wrap(text, 99)))
    print(f"  {'reading (GiB per G)':<22} {'n':>4} {'median':>9} {'p90':>9} {'worst':>9} "
          f"{'under>10%':>10}")  # fmt: skip
    for name, gib in QWEN_G_GIB.items():
        overall = summary(run(rows, source, name)[0])["overall"]
        label = f"{name} x{gib:.4f}" + ("" if gib <= bound else " impossible")
        print(_stat_line(label, overall["rows"]))
        print(_stat_line("  read as their launch", overall["own_launch"]))


def _ranges(rows: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7'."""
    out: list[str] = []
    start = prev = rows[0]
    for r in [*rows[1:], math.inf]:
        if r == prev + 1:
            prev = int(r)
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if r != math.inf:
            start = prev = int(r)
    return ",".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=SOURCES, help="keep the rows of one source")
    parser.add_argument("--json", metavar="PATH", help="save compared/tokens/excluded rows")
    parser.add_argument("--csv", metavar="PATH", help="save the compared rows as CSV")
    parser.add_argument(
        "--qwen-g", choices=list(QWEN_G_GIB), default=QWEN_G,
        help=f"how to read Qwen's 'G' (default {QWEN_G}: the largest reading row 44 allows)",
    )  # fmt: skip
    parser.add_argument("--data", metavar="PATH", default=str(CSV_PATH), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = load_rows(args.data)
    compared, speeds, excluded = run(rows, args.source, args.qwen_g)
    print_report(compared, speeds, excluded)
    if args.source in (None, "qwen"):
        print()
        _print_qwen_readings(rows, args.source, args.qwen_g)
    if args.json:
        payload = {
            "compared": [asdict(c) for c in compared],
            "tokens_per_s": [asdict(t) for t in speeds],
            "excluded": [asdict(e) for e in excluded],
            "summary": summary(compared),
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.csv:
        names = [f for f in Compared.__dataclass_fields__ if not f.endswith("_gib") or
                 f in ("measured_gib", "estimate_gib")]  # fmt: skip
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=names, extrasaction="ignore")
            writer.writeheader()
            for c in compared:
                writer.writerow(asdict(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
