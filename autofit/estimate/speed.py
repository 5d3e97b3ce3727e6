"""Napkin step time on one GPU: a roofline per matmul, memory-bound kernels, dequantisation, the
host's dispatched ops; what moves between GPUs and host (communication, offload, the optimizer
step) is `autofit.estimate.comm`'s.

Pure arithmetic. Each term is one function with its source; the constants are assumptions until a
GPU measurement calibrates them, and docs/accuracy.md tracks them. The terms (`TIME_KEYS`):

- `compute`: every matmul (projections, MoE experts, LM head, LoRA A/B, attention), forward and
  backward and recomputation, each max(FLOPs / tensor throughput, bytes / HBM bandwidth);
- `memory_bound`: norms, the activation, RoPE, residual adds, LoRA's scale-and-add, the
  cross-entropy over the vocabulary;
- `overhead`: the device's time between its kernels, a cost per dispatched op (`launch_gaps`),
  which no roofline holds; none on a CPU trial;
- `host`: the host's work that the device's does not hide: the ops a micro-step dispatches
  (counted from the model, `autofit.arch.ops_of`, at `HOST_OP_S` each: `host_time`) and FSDP2's
  per-parameter work in each collective. On a GPU the host issues kernels while the device runs
  earlier ones, so a micro-step lasts the longer of the two (`autofit.estimate.step`) and only
  the host's excess is `host`: none at a large micro-batch, a third of the step at micro-batch 1
  (issue 33). On a CPU trial the device is the host: all of it;
- `dequant`: NF4/int8 base weights dequantized to bf16 before each matmul;
- `communication`: the exposed (not overlapped) part of all-gathers and gradient reductions;
- `offload`: the exposed part of host<->device copies (FSDP2 `CPUOffloadPolicy`, torchao's
  `CPUOffloadOptimizer`); the optimizer step those run on the CPU is in `optimizer`;
- `optimizer`: the AdamW step, on the GPU or the CPU.
"""

from __future__ import annotations

from functools import lru_cache

from autofit.estimate.memory import BF16, FP32
from autofit.recipe import checkpointed_count, trained_embedding_modules
from autofit.settings import trained_token_count
from autofit.structure import Structure
from autofit.values import Checkpointing, Quant, TrainEmbeddings

TIME_KEYS = (
    "compute", "memory_bound", "overhead", "host", "dequant", "communication", "offload",
    "optimizer",
)  # fmt: skip
"""The step-time terms, in `Estimate.time_breakdown` order; they sum to the step time."""

# ----- matmuls ------------------------------------------------------------------------------------
# Fraction of the datasheet dense bf16 tensor throughput a large cuBLAS GEMM sustains: ~70% (H100
# SXM bf16 GEMMs of 8k x 8k x 8k run at 650-750 of 989 TFLOPS in NVIDIA's and others' published
# cuBLAS sweeps; A100 ~ 250-270 of 312). Assumed; checked against torchtitan's published Llama 3.1
# 8B throughput in tests/estimate/test_speed_model.py.
GEMM_EFFICIENCY = 0.7
# FlashAttention-2 reaches 50-73% of A100 peak in forward and less in backward (Dao 2023,
# arXiv 2307.08691, Fig. 4-6): 0.5 for the whole fused attention, forward and backward.
ATTENTION_EFFICIENCY = 0.5
# FlashAttention-2 backward does 2.5x the forward FLOPs (Dao 2023: 5 matmuls vs 2).
ATTN_BACKWARD_RATIO = 2.5

# ----- memory-bound kernels -----------------------------------------------------------------------
# Achievable fraction of HBM bandwidth for elementwise and reduction kernels (STREAM-like copies
# reach 70-90% of nominal on A100/H100; assumed 0.7).
MEM_BW_EFFICIENCY = 0.7
# Bytes moved per element by the eager kernels of one op, (forward, backward), counted from the
# code that runs them (bf16 activations, fp32 where the code upcasts):
# - transformers' LlamaRMSNorm forward: to(fp32) 2+4, pow(2) 4+4, mean 4, x * rsqrt 4+4, to(bf16)
#   4+2, weight * x 2+2 = 36; backward: autograd of the same six ops, each reading its saved
#   input and the output gradient and writing the input gradient, about twice (assumed).
RMSNORM_BYTES = (36, 72)
# - SwiGLU `act_fn(gate) * up` per element of the MLP width (transformers' LlamaMLP): silu 2+2,
#   mul 2+2+2; backward: the mul's two gradients (2+2+2 each), silu's (2+2+2).
ACTIVATION_BYTES = (10, 18)
# - RoPE, transformers' `apply_rotary_pos_emb` per q/k element: rotate_half (neg 1+1 on half, cat
#   2+2), x * cos 2+2, rotate_half(x) * sin 2+2, add 2+2+2; backward: the same ops on the gradient.
ROPE_BYTES = (20, 20)
# - A residual add per hidden element: read two bf16 operands, write one; backward: the gradients
#   of the two branches summed where they meet.
RESIDUAL_BYTES = (6, 6)
# - peft's LoRA output `result + lora_B(lora_A(x)) * scaling` per output element (peft
#   `tuners/lora/layer.py` `Linear.forward`): mul 2+2, add 2+2+2; backward: the add passes the
#   gradient through, the mul scales it (2+2).
LORA_MERGE_BYTES = (10, 4)
# - Cross-entropy per logit (tokens x vocab), as transformers' `ForCausalLMLoss` runs it: the
#   upcast `logits.float()` 2+4, log_softmax 4+4; backward: log_softmax's 4+4+4, the cast of the
#   logits' gradient back to bf16 4+2. `loss: chunked|fused` bound the memory, not these bytes
#   (Liger's fused kernel still reads and writes each logit chunk), so `loss` is not timed.
CE_BYTES = (14, 18)
# ----- the host -----------------------------------------------------------------------------------
# Host seconds per dispatched op (an aten op as a `TorchDispatchMode` sees it: Python, the
# dispatcher, autograd and the kernel launch it issues), the ops counted from the model itself
# (`autofit.arch.ops_of`). Derived from autofit's own H200 trials (issue 33;
# bench/data/gpu-measurements/autofit-h200-2026-11-27.json and gpu-check/h200-2026-11-27-run1.json,
# torch 2.11, transformers 5.17): llama-7b LoRA r64 `ckpt=full` at micro-batch 1 dispatches 37,156
# ops per step with an NF4 base and 20,652 with a bf16 one, and took 0.55-0.72 s and 0.36-0.42 s
# (the two runs differ by 17-31%): 14.7-20.4 us per op; 17.5 us puts the four rows nearest. On
# this project's 2-core CPU machine an eager op costs about as much (21 us: llama-7b's layers at a
# reduced width, forward and backward). Other hosts differ (Qwen's published A100 rows at 256
# tokens imply about 8 us, docs/accuracy.md): a machine's calibration fits its own (`host`).
HOST_OP_S = 17.5e-6
# Device seconds between two kernels, per dispatched op (`launch_gaps`): what the rooflines leave
# out of each kernel (its launch on the device, a tail that does not fill the GPU). The H200 rows
# that the device bounds (micro-batch 2-4) ran 3.1-6.6 us per op slower than the rooflines; the
# published long-sequence rows (section 3 of docs/accuracy.md) were already below them. 2.5 us,
# half of `KERNEL_LAUNCH_S`, is a compromise of the two, assumed; a calibration fits it
# (`overhead`).
DEVICE_OP_GAP_S = 2.5e-6
# FSDP2 per-parameter CPU work for each all-gather (copy-in, `init_unsharded_param`, DTensor
# wrapping) and each reduce-scatter (`foreach_reduce`'s per-parameter views):
# torch `_fsdp_param.py`, `_fsdp_collectives.py`. Assumed: 5 us per parameter per collective.
FSDP2_PER_PARAM_S = 5e-6
# Kernel launch latency, CUDA: ~5 us per launch (NVIDIA's CUDA Graphs blog, "Getting started with
# CUDA Graphs", 2019). Bounds the dequantisation of small weights, and is the host's cost of each
# op of a compiled layer (`compiled_host_time`).
KERNEL_LAUNCH_S = 5e-6

# ----- dequantisation -----------------------------------------------------------------------------
# torchao 0.18 `NF4Tensor.get_original_weight` (quantization/quantize_/workflows/nf4/nf4_tensor.py)
# runs, per weight element: `>> 4` 0.5+0.5, `.to(long)` 0.5+4, `& 0b1111` 0.5+0.5, `.to(long)`
# 0.5+4, two `nf4[idx]` lookups 8+2, two `repeated.flatten()` copies of the scales 2, two scale
# multiplies 4+2, `torch.stack` 2+2 (and a `.to(dtype)` that is a no-op for bf16): 33 B, in
# 11 kernels, plus 3 small ones that dequantize the scales. `linear_nf4` dequantizes in forward and
# again in backward (`LinearNF4.backward`).
NF4_DEQUANT_BYTES = 33
NF4_DEQUANT_KERNELS = 14
# torchao int8 weight-only at training batch sizes: dequantize (int8 -> bf16 1+2, x scale 2+2) then
# mm: 7 B per weight in 2 kernels.
INT8_DEQUANT_BYTES = 7
INT8_DEQUANT_KERNELS = 2

# ----- torch.compile ------------------------------------------------------------------------------
# Share of the decoder layers' time that `torch.compile` of each layer removes. The torchtitan
# team's Llama 3.1 8B runs on H100s, the 1D (FSDP) experiments of the TorchTitan paper (Liang et
# al. 2024, arXiv 2410.06511; figures as in pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md, Table 1): 8 GPUs, local batch 2, selective
# activation checkpointing, FSDP 5,762 -> FSDP + torch.compile 6,667 tokens/s per GPU (+15.7%;
# 128 GPUs: 5,605 -> 6,514, +16.2%). Time per token falls by 1 - 5762/6667 = 13.6%. Inductor
# fuses element-wise kernels (norms, rotary embedding, activations) and drops Python overhead;
# matmuls stay cuBLAS calls. So the saving is taken from the layers' memory-bound time first and
# only what exceeds it from their matmuls (`compiled_layer_time`).
COMPILE_TIME_SAVED = 1.0 - 5762 / 6667


def _recompute_share(checkpointing: str, layers: int) -> float:
    """Share of the `layers` decoder layers whose whole forward is re-run in backward: the
    checkpointed ones (`autofit.recipe.checkpointed_layers`, the builder's list: all with `full`,
    0, 2, 4, ... with `every-2`), none with op-level `selective` (no matmul is recomputed)."""
    if checkpointing == Checkpointing.SELECTIVE or layers <= 0:
        return 0.0
    return checkpointed_count(checkpointing, layers) / layers


# ----- FLOP counts (for MFU and the 6N check) -----------------------------------------------------
def forward_flops_per_token(
    s: Structure, seq_len: int, lora_rank: int, targets: tuple[str, ...] | None = None
) -> dict[str, float]:
    """Forward FLOPs per token by part: 2 FLOPs per weight per token for every matmul (Kaplan et
    al. 2020) a token goes through (the projections, a MoE router and the `experts_per_token`
    experts it is routed to, read from the model's structure), and causal attention at
    2 x seq_len x q_dim per layer (QK^T and AV, each 2 x s x d, halved by the causal mask that
    FlashAttention skips)."""
    return {
        "linear": 2.0 * s.layers * s.active_layer_matmul_params,
        "lm_head": 2.0 * s.vocab * s.hidden,
        "attention": 2.0 * seq_len * s.q_dim * s.layers,
        "lora": 2.0 * s.lora_params(lora_rank, targets),
    }


def micro_step_flops(
    s: Structure, seq_len: int, lora_rank: int, checkpointing: str,
    targets: tuple[str, ...] | None = None,
) -> float:  # fmt: skip
    """FLOPs per token of one forward+backward, with recomputation.

    Backward of a trainable matmul is 2x its forward (input grad and weight grad); of a frozen
    one 1x (input grad only): the LoRA saving on the base. Recomputation re-runs the forward of
    checkpointed layers: all of them (`full`), half (`every-2`); `selective` recomputes only
    pointwise ops (~no matmul FLOPs).
    """
    f = forward_flops_per_token(s, seq_len, lora_rank, targets)
    frozen = lora_rank > 0
    layer_fwd = f["linear"] + f["attention"] + f["lora"]
    backward = (
        (1.0 if frozen else 2.0) * (f["linear"] + f["lm_head"])
        + ATTN_BACKWARD_RATIO * f["attention"]
        + 2.0 * f["lora"]
    )
    return sum(f.values()) + backward + _recompute_share(checkpointing, s.layers) * layer_fwd


# ----- a roofline per matmul ----------------------------------------------------------------------
def gemm_time(m: float, k: float, n: float, flops_per_s: float, bytes_per_s: float) -> float:
    """One bf16 GEMM (m x k) @ (k x n): the larger of its FLOPs over achievable tensor throughput
    and its bytes (both operands read, the output written, 2 B each) over achievable bandwidth
    (the roofline model, Williams et al. 2009). LoRA's rank-r matmuls land on the bandwidth side."""
    return max(2.0 * m * k * n / flops_per_s, BF16 * (m * k + k * n + m * n) / bytes_per_s)


def linear_times(
    m: float, k: float, n: float, flops_per_s: float, bytes_per_s: float
) -> tuple[float, float, float]:
    """A linear layer x (m x k) @ W (k x n): forward, input gradient (m x n) @ (n x k), weight
    gradient (k x m) @ (m x n)."""
    return (
        gemm_time(m, k, n, flops_per_s, bytes_per_s),
        gemm_time(m, n, k, flops_per_s, bytes_per_s),
        gemm_time(k, m, n, flops_per_s, bytes_per_s),
    )


def layer_gemms(s: Structure, tokens: int) -> list[tuple[float, float, float]]:
    """(m, k, n) of every base matmul of one decoder layer for `tokens` tokens: the projections,
    a MoE router, and each expert's gate/up and down on the tokens routed to it (tokens x top-k /
    experts each, HF's per-expert loop)."""
    out = [(float(tokens), float(p.in_features), float(p.out_features)) for p in s.projections]
    if s.experts:
        routed = tokens * s.experts_per_token / s.experts
        out.append((float(tokens), float(s.hidden), float(s.experts)))
        for _ in range(s.experts):
            out.append((routed, float(s.hidden), 2.0 * s.expert_ffn))
            out.append((routed, float(s.expert_ffn), float(s.hidden)))
    return out


def lora_gemms(
    s: Structure, tokens: int, rank: int, targets: tuple[str, ...] | None
) -> list[tuple[float, float, float]]:
    """(m, k, n) of LoRA's A (in -> r) and B (r -> out) on each adapted projection of a layer."""
    if rank <= 0:
        return []
    out: list[tuple[float, float, float]] = []
    for p in s.targets(targets):
        out.append((float(tokens), float(p.in_features), float(rank)))
        out.append((float(tokens), float(rank), float(p.out_features)))
    return out


def attention_time(s: Structure, tokens: int, seq_len: int, flops_per_s: float) -> float:
    """Causal attention of one layer, forward: 2 x tokens x seq_len x q_dim FLOPs
    (`forward_flops_per_token`) at `ATTENTION_EFFICIENCY` of peak (fused, compute-bound)."""
    return 2.0 * tokens * seq_len * s.q_dim / (flops_per_s / GEMM_EFFICIENCY * ATTENTION_EFFICIENCY)


# ----- memory-bound kernels -----------------------------------------------------------------------
def layer_elementwise_bytes(
    s: Structure, tokens: int, rank: int, targets: tuple[str, ...] | None
) -> tuple[float, float]:
    """Bytes the memory-bound kernels of one layer move, (forward, backward): two RMSNorms and two
    residual adds over the hidden width, the activation over the MLP width, RoPE over q and k, and
    LoRA's scale-and-add on each adapted projection's output."""
    widths = (
        (RMSNORM_BYTES, 2 * s.hidden),
        (RESIDUAL_BYTES, 2 * s.hidden),
        (ACTIVATION_BYTES, s.mlp_width),
        (ROPE_BYTES, s.q_dim + s.kv_dim),
    )
    if rank > 0:
        widths += ((LORA_MERGE_BYTES, sum(p.out_features for p in s.targets(targets))),)
    fwd = sum(b[0] * w for b, w in widths)
    bwd = sum(b[1] * w for b, w in widths)
    return float(tokens) * fwd, float(tokens) * bwd


def cross_entropy_bytes(s: Structure, tokens: int) -> tuple[float, float]:
    """Bytes of the loss over tokens x vocab fp32 logits and of the final norm, (forward,
    backward) (`CE_BYTES`, `RMSNORM_BYTES`)."""
    logits = float(tokens) * s.vocab
    norm = float(tokens) * s.hidden
    return (
        logits * CE_BYTES[0] + norm * RMSNORM_BYTES[0],
        logits * CE_BYTES[1] + norm * RMSNORM_BYTES[1],
    )


def trained_embedding_bytes(
    s: Structure, tokens: int, train_embeddings: str
) -> tuple[float, float]:
    """Bytes the memory-bound kernels of trained embeddings move, (forward, backward), beyond a
    frozen embedding's (the modules and rows of `autofit.recipe.trained_embedding_modules` and
    `trained_token_ids`):

    - `full`: the embedding copy's gradient, a scatter-add of tokens x hidden rows in fp32 (read
      and write, as a full fine-tune's);
    - `tokens:N`: peft merges the trained rows into a copy of each trained module's frozen weight
      at every forward (`index_copy`: vocab x hidden read and written in bf16); in backward the
      embedding's gradient is the whole merged weight's (zero-filled, then the tokens' rows
      scatter-added), of which the trained rows are kept."""
    if train_embeddings == TrainEmbeddings.NONE:
        return 0.0, 0.0
    if trained_token_count(train_embeddings) is None:
        return 0.0, 2.0 * FP32 * tokens * s.hidden
    modules = len(trained_embedding_modules(train_embeddings, s.tied_embeddings))
    weight = float(s.vocab) * s.hidden
    return modules * 2.0 * BF16 * weight, BF16 * weight + 2.0 * BF16 * tokens * s.hidden


@lru_cache(maxsize=1024)
def layer_param_tensors(s: Structure, rank: int, targets: tuple[str, ...] | None) -> int:
    """Parameter tensors of one decoder layer: projection weights and biases, norm scales (one per
    `hidden` values), a router and the experts' three stacked tensors, two per LoRA adapter."""
    norms = max(1, round(s.layer_norm_params / max(s.hidden, 1)))
    n = len(s.projections) + sum(p.bias for p in s.projections) + norms
    if s.experts:
        n += 4
    if rank > 0:
        n += 2 * len(s.targets(targets))
    return n


# ----- one micro-step, memoised -------------------------------------------------------------------
@lru_cache(maxsize=4096)
def micro_step_times(
    s: Structure, tokens: int, seq_len: int, rank: int, targets: tuple[str, ...] | None,
    checkpointing: str, flops_per_s: float, bytes_per_s: float,
    train_embeddings: str = TrainEmbeddings.NONE,
    head_recompute: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Seconds of one eager micro-step on one GPU, memoised by value (an equal structure is the
    same model, so an entry never answers for another; the returned dict is shared: read it):
    `compute` (matmuls) and `memory_bound` (elementwise kernels), each split as `layers_*`
    (inside the decoder layers, what compile touches) and the whole; `backward` is the part of
    both that runs in backward (what a reduce-scatter or gradient copy can hide behind). The
    host's work, which issues them, is `host_time`'s.

    `flops_per_s` and `bytes_per_s` are the achievable throughputs (peak x efficiency). A LoRA
    run that trains the embeddings and head (`train_embeddings`) computes the head's weight
    gradient and the embedding's (`trained_embedding_bytes`). `head_recompute`: the head's
    forward matmul runs again in backward (TRL's fused LM head, `launch: trl`, recomputes each
    tile of logits there instead of keeping them)."""
    frozen = rank > 0
    fwd = dgrad = wgrad = 0.0
    for m, k, n in layer_gemms(s, tokens):
        f, d, w = linear_times(m, k, n, flops_per_s, bytes_per_s)
        fwd, dgrad, wgrad = fwd + f, dgrad + d, wgrad + w
    lora_fwd = lora_bwd = 0.0
    for m, k, n in lora_gemms(s, tokens, rank, targets):
        f, d, w = linear_times(m, k, n, flops_per_s, bytes_per_s)
        lora_fwd, lora_bwd = lora_fwd + f, lora_bwd + d + w
    attn = attention_time(s, tokens, seq_len, flops_per_s)
    layer_fwd_mm = fwd + lora_fwd + attn
    layer_bwd_mm = dgrad + (0.0 if frozen else wgrad) + lora_bwd + ATTN_BACKWARD_RATIO * attn
    hf, hd, hw = linear_times(tokens, s.hidden, s.vocab, flops_per_s, bytes_per_s)
    # a trained head (a full fine-tune's, or `train_embeddings`': a copy, or rows of the merged
    # weight, whose gradient is the whole weight's) needs its weight gradient
    head_bwd = hd + (0.0 if frozen and train_embeddings == TrainEmbeddings.NONE else hw)
    if head_recompute:
        head_bwd += hf

    mem_bw = bytes_per_s  # achievable HBM bandwidth, as for the GEMMs' bytes
    ew_fwd, ew_bwd = layer_elementwise_bytes(s, tokens, rank, targets)
    layer_fwd_mb = ew_fwd / mem_bw
    layer_bwd_mb = ew_bwd / mem_bw
    ce_f, ce_b = cross_entropy_bytes(s, tokens)
    root_mb_fwd = ce_f / mem_bw
    root_mb_bwd = ce_b / mem_bw
    if not frozen:  # the embedding's gradient: a scatter-add of tokens x hidden (read + write)
        root_mb_bwd += 2.0 * FP32 * tokens * s.hidden / mem_bw
    elif train_embeddings != TrainEmbeddings.NONE:
        emb_fwd, emb_bwd = trained_embedding_bytes(s, tokens, train_embeddings)
        root_mb_fwd += emb_fwd / mem_bw
        root_mb_bwd += emb_bwd / mem_bw

    recompute = _recompute_share(checkpointing, s.layers)
    # `selective` re-runs the layers' pointwise ops (no matmuls) in backward
    recompute_mb = 1.0 if checkpointing == Checkpointing.SELECTIVE else recompute
    layers_mm = s.layers * (layer_fwd_mm * (1.0 + recompute) + layer_bwd_mm)
    layers_mb = s.layers * (layer_fwd_mb * (1.0 + recompute_mb) + layer_bwd_mb)
    backward = (
        s.layers
        * (layer_fwd_mm * recompute + layer_bwd_mm + layer_fwd_mb * recompute_mb + layer_bwd_mb)
        + head_bwd
        + root_mb_bwd
    )
    return {
        "layers_compute": layers_mm,
        "compute": layers_mm + hf + head_bwd,
        "layers_memory_bound": layers_mb,
        "memory_bound": layers_mb + root_mb_fwd + root_mb_bwd,
        "backward": backward,
    }


def compiled_layer_time(layers_compute: float, layers_memory_bound: float) -> tuple[float, float]:
    """(compute, memory_bound) of the decoder layers when each is compiled (`compile: true`):
    `COMPILE_TIME_SAVED` of their eager time is removed, from the memory-bound kernels first
    (Inductor fuses them and drops the Python overhead), then from the matmuls. Communication,
    offload and the optimizer step are not compiled; compile time is paid once and is not step
    time."""
    saved = COMPILE_TIME_SAVED * (layers_compute + layers_memory_bound)
    from_mb = min(saved, layers_memory_bound)
    return layers_compute - (saved - from_mb), layers_memory_bound - from_mb


def compiled_compute_time(compute_s: float) -> float:
    """Time of work of which `COMPILE_TIME_SAVED` is removed when it is all compiled (no
    memory-bound part to take it from first): the published share, applied whole."""
    return compiled_layer_time(compute_s, 0.0)[0]


def host_time(layer_ops: float, root_ops: float, layers: int, compiled: bool) -> float:
    """Host seconds of one micro-step: `layers` decoder layers of `layer_ops` dispatched ops each
    (forward, backward and recomputation, as counted: `autofit.arch.ops_of`) and the `root_ops`
    outside them, `HOST_OP_S` each. A compiled layer (`compile: true`) runs Inductor's generated
    code, which launches its kernels without the dispatcher or autograd: assumed at most one
    launch per eager op (fusion merges pointwise ops, so fewer), `KERNEL_LAUNCH_S` each."""
    per_op = KERNEL_LAUNCH_S if compiled else HOST_OP_S
    return layers * layer_ops * per_op + root_ops * HOST_OP_S


def launch_gaps(layer_ops: float, root_ops: float, layers: int) -> float:
    """Device seconds between the kernels of one micro-step: the rooflines time each kernel's
    FLOPs and bytes, not the device's own cost of starting it, which bounds a small kernel (a
    LoRA matmul, a norm at micro-batch 1): `DEVICE_OP_GAP_S` per dispatched op (views launch
    none, some ops several). With it a step the host does not bound is not read as free of
    per-op costs: the H200 rows at micro-batch 2-4 (issue 33) ran 4-21% slower than the kernels'
    rooflines."""
    return (layers * layer_ops + root_ops) * DEVICE_OP_GAP_S


# ----- dequantisation -----------------------------------------------------------------------------
def dequant_passes(checkpointing: str, layers: int) -> float:
    """How often each quantized base weight of `layers` decoder layers is dequantized per
    micro-step, on average: forward, backward (input grad), and again in recomputation."""
    return 2.0 + _recompute_share(checkpointing, layers)


@lru_cache(maxsize=1024)
def dequant_time(s: Structure, quant: str, checkpointing: str, mem_bw_gbs: float) -> float:
    """Dequantizing int8/NF4 weights to bf16 before each matmul, one micro-step: the kernels
    torchao runs (`NF4_DEQUANT_BYTES`, `INT8_DEQUANT_BYTES`) over HBM bandwidth, at least their
    launches per weight tensor (`KERNEL_LAUNCH_S`)."""
    if quant == Quant.NONE:
        return 0.0
    nbytes, kernels = {
        Quant.NF4: (NF4_DEQUANT_BYTES, NF4_DEQUANT_KERNELS),
        Quant.INT8: (INT8_DEQUANT_BYTES, INT8_DEQUANT_KERNELS),
    }[quant]
    per_pass = 0.0
    for p in s.projections:
        moved = p.weight_params * nbytes / (mem_bw_gbs * 1e9 * MEM_BW_EFFICIENCY)
        per_pass += max(moved, kernels * KERNEL_LAUNCH_S)
    return dequant_passes(checkpointing, s.layers) * s.layers * per_pass
