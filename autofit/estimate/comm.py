"""Napkin step time between GPUs and host: FSDP2's all-gathers and reduce-scatters, DDP's
all-reduce, HSDP's all-reduce across nodes, how much of each prefetching or backward hides
(`prefetched_exposed`), host<->device copies of offload, the optimizer step.
`autofit.estimate.speed` times the work on one GPU that these hide behind;
`autofit.estimate.step` puts both together.

Pure arithmetic; each constant names its source or says it is assumed (docs/accuracy.md).
"""

from __future__ import annotations

from autofit.estimate.memory import (
    embed_unit_bytes,
    gathered_layer_bytes,
    head_unit_bytes,
    master_bytes,
)
from autofit.estimate.speed import HOST_OP_S, MEM_BW_EFFICIENCY
from autofit.layout import wrap_unit_count
from autofit.recipe import DTYPE_BYTES, reduce_dtype, state_value_bytes, trainable_dtype
from autofit.structure import Structure
from autofit.values import OptimizerImpl, Wrap

# ----- communication and offload ------------------------------------------------------------------
# Achievable fraction of link bandwidth for NCCL ring collectives (nccl-tests busbw on NVLink and
# PCIe is typically 70-85% of the nominal figure).
LINK_EFFICIENCY = 0.75
# Achievable fraction of nominal PCIe bandwidth for pinned host<->device copies.
PCIE_EFFICIENCY = 0.8
# Latency of one collective call whatever its size (the alpha of Hockney's alpha-beta model).
# NCCL within one node: tens of microseconds for small messages (nccl-tests' small-size rows);
# assumed 20 us.
NCCL_LATENCY_S = 20e-6
# Per inter-node step of a ring collective, on top of the above: NCCL's own latency model,
# `hwLat[NET][Ring][Simple]` = 9.6 us per network hop against 3.4 us per NVLink hop
# (NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel`: a ring all-gather or reduce-scatter over
# `nNodes` nodes pays `nNodes - 1` of them, an all-reduce `2 (nNodes - 1)`).
NET_STEP_LATENCY_S = 9.6e-6
# gloo between the two CPU processes of a CPU trial on this project's 2-core machine, measured
# (`python bench/gloo_latency.py`): 0.6-0.8 ms per `all_gather_into_tensor`, 1.0-1.5 ms per
# `reduce_scatter_tensor` of 256 to 65,536 values. 1 ms.
GLOO_LATENCY_S = 1e-3
# torch's CPU AdamW for an optimizer this file does not count (torchao's low-bit ones under
# `offload: optimizer`): about this many parameters per second per process; the ZeRO-Offload
# paper (Ren et al. 2021) reports stock PyTorch CPU Adam at ~0.3-1 G params/s.
CPU_ADAM_PARAMS_PER_S = 0.4e9
# torch AdamW's step on host tensors, per implementation (`recipe.ADAMW_IMPLS`), from torch's own
# code (`torch/optim/adam.py`, weight decay 0, fp32 states): (aten ops per parameter tensor, bytes
# moved per parameter). The for-loop (`_single_tensor_adam`, what `offload: params` steps: FSDP2's
# sharded parameters are host DTensors) runs `step_t += 1`, `exp_avg.lerp_(grad)`,
# `exp_avg_sq.mul_()`, `.addcmul_(grad, grad)`, a `.item()` of the step, `sqrt()`,
# `/ bias_correction2_sqrt`, `.add_(eps)` and `param.addcdiv_()`: 9 ops a tensor, each a pass over
# memory: 12 + 8 + 12 + 8 + 8 + 8 + 16 = 72 B per fp32 parameter. foreach makes the same passes
# in list-wide ops, and reads two bias corrections per tensor (`.item()`). The fused kernel
# (`_fused_adamw_`, one op for every tensor; torchao's `CPUOffloadOptimizer` on CUDA) reads the
# parameter, gradient and both moments and writes three: 28 B. `tests/estimate/test_speed_model.py`
# counts the ops with a dispatch mode.
CPU_ADAMW_COST = {
    OptimizerImpl.FOR_LOOP: (9, 72),
    OptimizerImpl.FOREACH: (2, 72),
    OptimizerImpl.FUSED: (0, 28),
}
# The host memory bandwidth those passes run at (all cores of a GPU server's host): autofit's own
# H200 machine (16 cores) stepped tinyllama-1.1b's full fine-tune under `offload: params` (1.10 G
# fp32 parameters, 201 tensors) in 1.6-1.9 s beyond the rest of its step (rows b7 and e8 of
# `bench/gpu_rows.py`: 1.79 and 2.14 s a step, 0.20 s of it on the GPU): 41-50 GB/s of the
# for-loop's 72 B per parameter. Assumed for every host until a machine's calibration fits its
# own (`optimizer`); on this project's 2-core CPU machine the same loop measured 25 GB/s.
HOST_MEM_BW_BYTES_PER_S = 45e9
# DDP's default gradient bucket (`bucket_cap_mb=25`, torch.nn.parallel.DistributedDataParallel).
DDP_BUCKET_BYTES = 25 * 1024**2


# ----- communication ------------------------------------------------------------------------------
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
    if wrap == Wrap.NONE:
        return 0.0
    edges = embed_unit_bytes(s) + head_unit_bytes(s)
    layers = s.layers * gathered_layer_bytes(s, quant, lora_rank, targets)
    regather = 0.0
    if reshard:
        regather = embed_unit_bytes(s) + (layers if wrap_unit_count(wrap, s.layers) else 0.0)
    return edges + layers + regather


def reduce_bytes_per_step(trainable: int, precision: str, optimizer: str, ddp: bool) -> float:
    """Gradient bytes reduced per optimizer step, in the dtype the builder reduces in. FSDP2:
    one reduce-scatter in `autofit.recipe.reduce_dtype` (`MixedPrecisionPolicy(reduce_dtype=fp32)`
    under bf16-mixed, bf16 under pure bf16, autofit/builder/fsdp.py). DDP: an all-reduce
    (= reduce-scatter + all-gather, 2x) of the gradients in their own dtype, the trainable
    params' (`autofit.recipe.trainable_dtype`: DDP has no mixed-precision policy in
    autofit/builder/ddp.py, so bf16 params reduce bf16 gradients and fp32 masters fp32 ones)."""
    if ddp:
        return 2.0 * trainable * DTYPE_BYTES[trainable_dtype(precision, optimizer)]
    return trainable * DTYPE_BYTES[reduce_dtype(precision)]


def collective_latency(on_cpu: bool, inter_steps: int = 0) -> float:
    """Seconds one collective call costs besides its bytes: gloo on CPU trials, else NCCL, plus
    `NET_STEP_LATENCY_S` for each of its `inter_steps` ring steps between nodes."""
    return (GLOO_LATENCY_S if on_cpu else NCCL_LATENCY_S) + inter_steps * NET_STEP_LATENCY_S


def group_bw(link_bw_gbs: float, net_bw_gbs: float, nodes: int, per_node: int) -> float:
    """GB/s (per direction) a ring collective over a group of `per_node` GPUs on each of `nodes`
    nodes moves at, the `busbw` of NCCL's performance notes (what `ring_time` divides by).

    Inside one node: the GPUs' link. Across nodes NCCL builds rail-optimised rings, one channel
    per NIC, each crossing every node boundary once (NCCL `ncclTopoTuneModel`: ring bus bandwidth
    = channels x per-channel inter-node speed): the group's `per_node` GPUs of a node drive their
    `per_node` NICs at once, and each GPU still forwards its ring share over the link inside the
    node, so min(link, per_node x network per GPU). A group of one GPU per node (HSDP's replicas)
    has one NIC: the network alone. Measured: nccl-tests all-reduce across 3 nodes of 8 A100 with
    4 x 200 Gb/s HDR NICs each (12.5 GB/s per GPU): 85-96 GB/s busbw, near 8 x 12.5 = 100
    (NVIDIA/nccl-tests issue #119); NVIDIA's "46-48 GB/s per [400 Gb/s NDR] NIC" (issue #290)."""
    if nodes <= 1:
        return link_bw_gbs
    if per_node <= 1:
        return net_bw_gbs
    return min(link_bw_gbs, per_node * net_bw_gbs)


def fsdp_collectives(units: int, tied: bool, reshard: bool) -> tuple[int, int]:
    """(all-gathers per micro-step, reduce-scatters per optimizer step) of FSDP2 laid out as
    torchtitan (autofit/builder/fsdp.py): one per unit (the layer units, the embedding and
    `[norm, head]` unless tied, the root) forward, the resharded ones (layer units, embedding)
    again in backward, and one reduce-scatter per unit on the last micro-step."""
    edges = 0 if tied else 2
    per_unit = units + edges + 1
    regather = (units + (0 if tied else 1)) if reshard else 0
    return per_unit + regather, per_unit


def prefetched_exposed(load_s: float, compute_s: float, units: int) -> float:
    """Exposed time of per-unit transfers FSDP2 prefetches (the next unit's all-gather, and under
    `CPUOffloadPolicy` its sharded params' H2D copy: torch `_fsdp_param.py` `all_gather_inputs`,
    `.to(device, non_blocking=True)` in the all-gather stream) while the current unit computes:
    the first unit's share cannot hide, and whatever exceeds the compute is exposed. One unit
    (`wrap: model`, the root alone) hides nothing."""
    if load_s <= 0:
        return 0.0
    if units <= 1:
        return load_s
    return max(load_s - compute_s, 0.0) + load_s / units


def ddp_exposed_reduce_time(reduce_s: float, backward_s: float, grad_bytes: float) -> float:
    """DDP all-reduces gradient buckets of `DDP_BUCKET_BYTES` while backward still runs (PyTorch
    DDP notes): what exceeds the backward time, and at least the last bucket, is exposed."""
    if reduce_s <= 0 or grad_bytes <= 0:
        return 0.0
    last_bucket = reduce_s * min(1.0, DDP_BUCKET_BYTES / grad_bytes)
    return max(reduce_s - backward_s, last_bucket)


def optimizer_step_time(
    trainable_per_gpu: float,
    optimizer: str,
    precision: str,
    mem_bw_gbs: float,
    on_cpu: bool,
    tensors: int = 0,
    impl: str | None = None,
) -> float:
    """AdamW is memory-bound: it reads param, grad and two states and writes param and states.
    On the GPU that is bytes / HBM bandwidth. On the host (offload) torch's AdamW of `impl`
    (`recipe.adamw_impl`) over `tensors` parameter tensors: its ops at the host's cost per op
    (`speed.HOST_OP_S`) and its passes over memory at the host's bandwidth (`CPU_ADAMW_COST`,
    `HOST_MEM_BW_BYTES_PER_S`); torchao's low-bit AdamWs at a measured update rate."""
    if on_cpu:
        if impl not in CPU_ADAMW_COST:
            return trainable_per_gpu / CPU_ADAM_PARAMS_PER_S
        ops, moved = CPU_ADAMW_COST[impl]
        return tensors * ops * HOST_OP_S + trainable_per_gpu * moved / HOST_MEM_BW_BYTES_PER_S
    pb = master_bytes(precision, optimizer)
    state = state_value_bytes(optimizer, pb)
    touched = trainable_per_gpu * (2 * pb + pb + 4 * state)
    return touched / (mem_bw_gbs * 1e9 * MEM_BW_EFFICIENCY)


def pcie_time(nbytes: float, pcie_bw_gbs: float) -> float:
    """Pinned host<->device copies over PCIe."""
    return nbytes / (pcie_bw_gbs * 1e9 * PCIE_EFFICIENCY)
