"""Napkin step time: FLOPs over achievable throughput, FSDP communication, offload traffic.

Pure arithmetic. The constants are assumptions until a GPU measurement calibrates them; each one
says so and docs/accuracy.md tracks them.
"""

from __future__ import annotations

from autofit.arch import Structure
from autofit.config import wrap_units
from autofit.estimate.memory import (
    BF16,
    FP32,
    base_bytes_per_param,
    embed_unit_bytes,
    gathered_layer_bytes,
    head_unit_bytes,
    master_bytes,
)
from autofit.recipe import state_value_bytes

# Fraction of peak bf16 tensor throughput a well-fed dense transformer step reaches: 40-55% MFU
# is what torchtitan and Megatron report for Llama 7B-70B on A100/H100 at a few thousand tokens
# per micro-step (torchtitan README; Narayanan et al. 2021). Assumed, GPU calibration pending.
PEAK_MFU = 0.55
# Tokens per micro-step at which efficiency reaches half of PEAK_MFU: small matmuls underfeed the
# tensor cores and fixed per-kernel costs dominate. Assumed.
HALF_EFFICIENCY_TOKENS = 1024
# Achievable fraction of link bandwidth for NCCL ring collectives (nccl-tests busbw on NVLink and
# PCIe is typically 70-85% of the nominal figure).
LINK_EFFICIENCY = 0.75
# Achievable fraction of nominal PCIe bandwidth for pinned host<->device copies.
PCIE_EFFICIENCY = 0.8
# Achievable fraction of HBM bandwidth for elementwise kernels (optimizer step, dequantisation).
MEM_BW_EFFICIENCY = 0.7
# torch's CPU AdamW (foreach) updates about this many parameters per second per process; the
# ZeRO-Offload paper (Ren et al. 2021) reports stock PyTorch CPU Adam at ~0.3-1 G params/s.
CPU_ADAM_PARAMS_PER_S = 0.4e9
# DDP's default gradient bucket (`bucket_cap_mb=25`, torch.nn.parallel.DistributedDataParallel).
DDP_BUCKET_BYTES = 25 * 1024**2
# FlashAttention-2 backward does 2.5x the forward FLOPs (Dao 2023: 5 matmuls vs 2).
ATTN_BACKWARD_RATIO = 2.5
# Share of the layers' compute time that `torch.compile` of each decoder layer removes. The
# torchtitan team's Llama 3.1 8B runs on H100s, the 1D (FSDP) experiments of the TorchTitan paper
# (Liang et al. 2024, arXiv 2410.06511; figures as in pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md, Table 1): 8 GPUs, local batch 2, selective
# activation checkpointing, FSDP 5,762 -> FSDP + torch.compile 6,667 tokens/s per GPU (+15.7%;
# 128 GPUs: 5,605 -> 6,514, +16.2%). Time per token falls by 1 - 5762/6667 = 13.6%. Fused
# element-wise kernels (norms, rotary embedding, activations), not faster matmuls: assumed the
# same share for LoRA and quantized bases until a GPU measurement calibrates it.
COMPILE_TIME_SAVED = 1.0 - 5762 / 6667

TIME_KEYS = ("compute", "communication", "offload", "optimizer")
"""The parts of a step time (`Estimate.time_breakdown`), in order."""


def matmul_efficiency(tokens_per_micro_step: int) -> float:
    """MFU as a function of tokens per micro-step (saturating; see the constants above)."""
    t = float(tokens_per_micro_step)
    return PEAK_MFU * t / (t + HALF_EFFICIENCY_TOKENS)


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
    recompute = {"full": 1.0, "every-2": 0.5}.get(checkpointing, 0.0) * layer_fwd
    return sum(f.values()) + backward + recompute


def compiled_compute_time(compute_s: float) -> float:
    """Compute time of the decoder layers' forward and backward when each layer is compiled
    (`compile: true`): `COMPILE_TIME_SAVED` of it removed. Communication, offload and the
    optimizer step are not compiled and keep their time; compile time itself is paid once, in
    the first step, and is not step time."""
    return compute_s * (1.0 - COMPILE_TIME_SAVED)


def dequant_passes(checkpointing: str) -> float:
    """How often each quantized base weight is dequantized per micro-step: forward, backward
    (input grad), and again in recomputation."""
    return 2.0 + {"full": 1.0, "every-2": 0.5}.get(checkpointing, 0.0)


def dequant_time(s: Structure, quant: str, checkpointing: str, mem_bw_gbs: float) -> float:
    """Dequantizing int8/NF4 weights to bf16 before each matmul is memory-bound: read the packed
    weight, write bf16, read it back in the matmul (torchao NF4 `linear_nf4`; int8 weight-only
    falls back to dequantize+mm at training batch sizes)."""
    if quant == "none":
        return 0.0
    bytes_per_pass = s.linear_params * (base_bytes_per_param(quant) + 2 * BF16)
    return dequant_passes(checkpointing) * bytes_per_pass / (mem_bw_gbs * 1e9 * MEM_BW_EFFICIENCY)


def ring_time(nbytes: float, n: int, link_bw_gbs: float) -> float:
    """A ring all-gather or reduce-scatter moves (n-1)/n of the full buffer over each link
    (NCCL performance notes: busbw = algbw x (n-1)/n)."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / (link_bw_gbs * 1e9 * LINK_EFFICIENCY)


def comm_bytes_per_micro_step(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool,
    targets: tuple[str, ...] | None = None,
) -> float:  # fmt: skip
    """Bytes all-gathered per micro-step under FSDP2 laid out as torchtitan: forward, and again
    in backward for units resharded after forward (the embedding and layer units when `reshard`;
    `[norm, head]` and the root are kept). int8 weights are never gathered (replicated). The plain
    module and DDP gather nothing."""
    if wrap == "none":
        return 0.0
    edges = embed_unit_bytes(s) + head_unit_bytes(s)
    layers = s.layers * gathered_layer_bytes(s, quant, lora_rank, targets)
    regather = 0.0
    if reshard:
        regather = embed_unit_bytes(s) + (layers if wrap_units(wrap, s.layers) else 0.0)
    return edges + layers + regather


def reduce_bytes_per_step(trainable: int, wrap: str) -> float:
    """Gradient reduction per optimizer step, in fp32 (`reduce_dtype=fp32`): one reduce-scatter
    under FSDP2, or an all-reduce (= reduce-scatter + all-gather, 2x) for DDP replicas."""
    return trainable * FP32 * (2.0 if wrap == "none" else 1.0)


def ddp_exposed_reduce_time(reduce_s: float, backward_s: float, grad_bytes: float) -> float:
    """DDP all-reduces gradient buckets of `DDP_BUCKET_BYTES` while backward still runs (PyTorch
    DDP notes): what exceeds the backward time, and at least the last bucket, is exposed."""
    if reduce_s <= 0 or grad_bytes <= 0:
        return 0.0
    last_bucket = reduce_s * min(1.0, DDP_BUCKET_BYTES / grad_bytes)
    return max(reduce_s - backward_s, last_bucket)


def optimizer_step_time(
    trainable_per_gpu: float, optimizer: str, precision: str, mem_bw_gbs: float, on_cpu: bool
) -> float:
    """AdamW is memory-bound: it reads param, grad and two states and writes param and states.
    On the GPU that is bytes / HBM bandwidth; on the CPU (offload) a measured update rate."""
    if on_cpu:
        return trainable_per_gpu / CPU_ADAM_PARAMS_PER_S
    pb = master_bytes(precision, optimizer)
    state = state_value_bytes(optimizer, pb)
    touched = trainable_per_gpu * (2 * pb + pb + 4 * state)
    return touched / (mem_bw_gbs * 1e9 * MEM_BW_EFFICIENCY)


def offload_traffic_time(
    bytes_h2d_per_micro: float, bytes_per_step: float, grad_accum: int, pcie_bw_gbs: float
) -> float:
    """Host<->device copies over PCIe: parameter shards copied up every micro-step (FSDP2
    CPUOffloadPolicy) and gradients/params moved once per optimizer step."""
    bw = pcie_bw_gbs * 1e9 * PCIE_EFFICIENCY
    return (grad_accum * bytes_h2d_per_micro + bytes_per_step) / bw
