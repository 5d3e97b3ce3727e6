"""What lies outside the tensors: the caching allocator's assumed share, cuBLAS workspaces, the CUDA
context and NCCL's buffers, and the share of host RAM offload may take.
"""

from __future__ import annotations

from autofit.estimate.memory.widths import MiB


# ----- overheads --------------------------------------------------------------------------------
def allocator_overhead(allocated: float) -> float:
    """Caching-allocator slack, reserved minus allocated, where no allocation sequence was
    replayed (`autofit.estimate.slack` replays one for the configs that matter, and the others
    take the replayed configs' share): 5% + 256 MiB, assumed. Replays of 7B steps with
    expandable segments give 1.3-6% (docs/estimator.md)."""
    return 0.05 * allocated + 256 * MiB


CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""cuBLAS's workspace per (handle, stream) before Hopper: `:4096:2:16:8`, 8 MiB + 128 KiB
(torch `aten/src/ATen/cuda/CublasHandlePool.cpp` `parseChosenWorkspaceSize`;
`CUBLAS_WORKSPACE_CONFIG` overrides it)."""
CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * 8 * 1024
"""The same on compute capability 9.0 (H100, H200): 32 MiB."""
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
"""cuBLASLt's own workspace per (handle, stream), 1024 KiB (`parseCUDABlasLtWorkspaceSize`,
`CUBLASLT_WORKSPACE_SIZE`; not unified with cuBLAS's unless
`TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`)."""
BLAS_HANDLES = 2
"""cuBLAS handles that run a training step's matmuls on the compute stream: one per thread
(`getCurrentCUDABlasHandle` reserves a handle from a thread-local pool window), and a step's
matmuls run on two threads, the Python thread's forward and the autograd engine's device thread's
backward (torch `autograd/engine.cpp`: one worker thread per device)."""


def workspace_bytes(device: str, compute_capability: tuple[int, int] = (8, 0)) -> int:
    """cuBLAS and cuBLASLt workspaces: allocated through PyTorch's caching allocator
    (`getNewWorkspace`, `getNewCUDABlasLtWorkspace`), once per handle and stream and kept, so they
    are part of the allocated (and reserved) bytes from the first matmul on; none on CPU."""
    if device == "cpu":
        return 0
    cublas = (
        CUBLAS_WORKSPACE_BYTES_SM90
        if tuple(compute_capability) == (9, 0)
        else (CUBLAS_WORKSPACE_BYTES)
    )
    return BLAS_HANDLES * (cublas + CUBLASLT_WORKSPACE_BYTES)


CUDA_CONTEXT_BYTES = 767 * MiB
"""The CUDA context of a training process once its step has run, outside PyTorch's allocator:
the driver's state and the kernels loaded into device memory (cuBLAS's GEMMs, attention, the
optimizer's; with lazy module loading, PyTorch's default since 1.13, each as first used).
Measured on one H200 (compute capability 9.0; driver 580.159.04, torch 2.11.0+cu130):
766.8 MiB between the device level (`mem_get_info`) and `max_memory_reserved` in each of the 7
plain-module trials of `bench/data/gpu-check/h200-2026-11-28-run2.json` (no process group: four
llama-7b LoRA/QLoRA configs, tinyllama full, llama-3-8b QLoRA with either loss), the same to
0.1 MiB whatever the model, micro-batch or quantization. The two one-GPU FSDP2 trials beside
them (`offload: params`, which loads the host-copy and FSDP kernels too) held 2-20 MiB more over
their communicator. A bare context is smaller (287 MB on CUDA 11.7, pytorch/pytorch#86509;
426 MiB on CUDA 13 and an RTX 6000 Ada, unslothai/unsloth-zoo#1053). No other GPU class has been
measured, so every class takes this figure until this machine's calibration measures its own
(`autofit.calibration.Calibration.context_bytes`: each GPU trial's device peak less its reserved
peak and NCCL's bytes)."""

NCCL_ONE_RANK_BYTES = 512 * MiB
"""NCCL 2.28's one-rank communicator: no peer, yet its first collective allocates the NET
proxy's shared P2P buffer, 536,870,912 B (NVIDIA/nccl#2363: "Failed to CUDA calloc 536870912
bytes" on NCCL 2.28.9 with torch 2.11.0+cu130; the fix proposed in NVIDIA/nccl#2366 measured
-512 MiB). Where one GPU runs FSDP2 (`Layout.communicators`), its group of one holds it."""

NCCL_COMMUNICATOR_BYTES = 48 * MiB
"""What a communicator holds besides its buffers: NCCL's kernels loaded into the context and the
communicator's device state. Measured on the H200 as the same seven configs with and without a
one-rank NCCL group whose first collective had run: 1,324.8-1,326.8 MiB outside the allocator
with it (`bench/data/gpu-measurements/autofit-h200-2026-11-27.json`, whose trials all joined
one), 766.8 without (`bench/data/gpu-check/h200-2026-11-28-run2.json`): 558-560 MiB, the 512 MiB
buffer (`NCCL_ONE_RANK_BYTES`) and 46-48 MiB more."""

NCCL_CONNECTION_BYTES = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
"""NCCL's buffers for one connection of one channel, one per protocol: Simple 4 MiB
(`DEFAULT_BUFFSIZE`, `NCCL_BUFFSIZE`), LL128 4,915,200 B (`NCCL_LL128_ELEMS_PER_THREAD` 120 x
`NCCL_LL128_MAX_NTHREADS` 640 x `NCCL_STEPS` 8 x 8 B) and LL 524,288 B (8 lines per thread x 512
threads x 8 steps x 16 B): NCCL `src/init.cc` `DEFAULT_*BUFFSIZE`. Allocated with cudaMalloc or
cuMem, outside PyTorch's allocator."""
NCCL_CHANNELS = {"nvlink": 32, "pcie": 4}
"""Ring channels NCCL opens between the GPUs of a node: up to 32 over NVLink/NVSwitch (NCCL's
`MAXCHANNELS`-bound ring search; 8 x H100 logs show "32 coll channels"), 2-4 over PCIe. NCCL's
memory is linear in its channels, and a ring has two connections per GPU whatever the scale
(NVIDIA/nccl#864, #986); a GPU holds one connection's buffers per channel (it receives on one and
sends on the other). The upper ends: an under-estimate is the error a planner may not make."""


def nccl_bytes(device: str, n_gpus: int, link: str, communicators: int = 1) -> int:
    """NCCL's buffers on each GPU, per communicator (`Layout.communicators`: the process group's,
    which FSDP2's all-gathers and reduce-scatters and DDP's all-reduce share; HSDP's second,
    across the replicas): channels x one connection's buffers between GPUs, the one-rank buffer
    on one GPU (`NCCL_ONE_RANK_BYTES`). Nothing without a communicator or on CPU (gloo)."""
    if device == "cpu" or communicators <= 0:
        return 0
    if n_gpus <= 1:
        buffers = NCCL_ONE_RANK_BYTES
    else:
        buffers = NCCL_CHANNELS.get(link, NCCL_CHANNELS["pcie"]) * NCCL_CONNECTION_BYTES
    return communicators * (buffers + NCCL_COMMUNICATOR_BYTES)


def default_communicators(n_gpus: int) -> int:
    """The communicators of a run of `n_gpus` GPUs whose layout is not known: none on one GPU
    (the plain module), one on several (DDP or FSDP2 over them all)."""
    return 1 if n_gpus > 1 else 0


def outside_allocator_bytes(
    device: str,
    n_gpus: int = 1,
    link: str = "pcie",
    communicators: int | None = None,
    context: int | None = None,
) -> dict[str, int]:
    """Device memory a training process holds outside PyTorch's caching allocator, by part:
    the CUDA context (`context` as this machine measured it, else `CUDA_CONTEXT_BYTES`) and
    NCCL's buffers of its `communicators` (default: `default_communicators`).
    What runs out on a card is the reserved bytes plus these (`Estimate.device_bytes`); none on
    CPU trials, which count tensor bytes only."""
    if device == "cpu":
        return {"cuda_context": 0, "nccl": 0}
    k = default_communicators(n_gpus) if communicators is None else communicators
    ctx = CUDA_CONTEXT_BYTES if context is None else int(context)
    return {"cuda_context": ctx, "nccl": nccl_bytes(device, n_gpus, link, k)}


Outsides = tuple[dict[str, int], dict[str, int], dict[str, int]]
"""`outside_allocator_bytes` of a run with 0, 1 and 2 communicators, indexed by
`Layout.communicators`."""


def outsides(
    device: str, n_gpus: int = 1, link: str = "pcie", context: int | None = None
) -> Outsides:
    """What lies outside the allocator for each count of communicators a config's layout may
    have on these GPUs (`Layout.communicators`)."""
    a, b, c = (outside_allocator_bytes(device, n_gpus, link, k, context) for k in range(3))
    return a, b, c


def usable_bytes(
    capacity: float,
    device: str,
    n_gpus: int = 1,
    link: str = "pcie",
    communicators: int | None = None,
    context: int | None = None,
) -> float:
    """What `max_memory_reserved` may reach on a GPU of `capacity`: the capacity less what sits
    outside the allocator (`outside_allocator_bytes`)."""
    outside = outside_allocator_bytes(device, n_gpus, link, communicators, context)
    return capacity - sum(outside.values())


HOST_RAM_USABLE = 0.8
"""Share of host RAM that offloaded state (and pinned copies) may take: the rest is the OS, the
data loader and the Python processes themselves."""


def usable_host_bytes(host_capacity: float) -> float:
    """What offloaded state may take of a host with `host_capacity` bytes of RAM."""
    return HOST_RAM_USABLE * host_capacity
