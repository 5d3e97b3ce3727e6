"""What-if GPU presets: hardware the user may not own (`--gpus 2xrtx3090`).

Numbers are the vendors' datasheet figures: total memory as NVML reports it on that card, dense
bf16 tensor-core TFLOP/s with fp32 accumulation (what PyTorch matmuls use; GeForce cards run that
at half their fp16-accumulate rate), HBM/GDDR bandwidth, and the per-direction GPU-to-GPU
bandwidth of the usual box (NVLink on SXM parts, PCIe for the rest), and the network that joins
such boxes into a cluster, per GPU (`NETWORKS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

MiB = 1024**2


@dataclass(frozen=True)
class GPUPreset:
    name: str
    full_name: str
    memory_bytes: int
    bf16_tflops: float  # dense, fp32 accumulate
    mem_bw_gbs: float  # device memory bandwidth, GB/s
    interconnect: str  # "nvlink" or "pcie"
    link_bw_gbs: float  # GPU<->GPU per direction, GB/s (NVLink aggregate or PCIe)
    pcie_gen: int
    pcie_width: int
    compute_capability: tuple[int, int]
    aliases: tuple[str, ...] = ()
    # the network between nodes of this class, per GPU per direction (GB/s): see NETWORKS
    network: str = "ethernet"
    inter_node_bw_gbs: float = 1.25

    @property
    def bf16(self) -> bool:
        return self.compute_capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        return self.compute_capability >= (8, 9)

    @property
    def pcie_bw_gbs(self) -> float:
        """Host<->device bandwidth per direction: ~0.985 GB/s per lane per PCIe 3 lane, doubling
        each generation (PCI-SIG), before protocol overhead."""
        return 0.985 * 2 ** (self.pcie_gen - 3) * self.pcie_width


# The network between nodes, per GPU and direction, of the usual cluster of each GPU class (what
# `--gpus NxKxNAME` assumes; `--inter-node-bandwidth` replaces it). NCCL's rail-optimised rings
# give each GPU its own NIC, so a collective that spans nodes runs at this rate per GPU.
# - DGX H100/H200 and AWS p5/p5e: one 400 Gb/s ConnectX-7 (InfiniBand NDR) or 400 Gb/s EFA per GPU
#   (p5.48xlarge: 3200 Gbps for 8 GPUs) -> 50 GB/s;
# - DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU -> 25 GB/s;
# - H100 PCIe servers: one 100 Gb/s NIC per GPU -> 12.5 GB/s;
# - L40S (AWS g6e.48xlarge: 400 Gbps EFA for 8 GPUs) -> 6.25 GB/s;
# - A10G/L4 (g5.48xlarge / g6.48xlarge: 100 Gbps for 8 GPUs) -> 1.5625 GB/s;
# - GeForce/RTX workstations: 10 Gb/s Ethernet per GPU at best -> 1.25 GB/s.
NETWORKS: dict[str, tuple[str, float]] = {
    "h100-80gb": ("infiniband", 50.0),
    "h200": ("infiniband", 50.0),
    "a100-40gb": ("infiniband", 25.0),
    "a100-80gb": ("infiniband", 25.0),
    "h100-pcie": ("ethernet", 12.5),
    "l40s": ("ethernet", 6.25),
    "a10g": ("ethernet", 1.5625),
    "l4": ("ethernet", 1.5625),
}

# Sources: NVIDIA datasheets (GeForce RTX 3090/4090 whitepapers, A10G/L4/L40S/A100/H100/H200
# product briefs). Memory totals are what nvidia-smi shows for the card, in MiB.
GPU_PRESETS: dict[str, GPUPreset] = {
    p.name: p
    for p in (
        GPUPreset("rtx3090", "NVIDIA GeForce RTX 3090", 24576 * MiB, 71.0, 936.0, "pcie", 25.0,
                  4, 16, (8, 6), ("3090", "rtx-3090")),
        GPUPreset("rtx4090", "NVIDIA GeForce RTX 4090", 24564 * MiB, 165.2, 1008.0, "pcie", 25.0,
                  4, 16, (8, 9), ("4090", "rtx-4090")),
        GPUPreset("a10g", "NVIDIA A10G", 23028 * MiB, 70.0, 600.0, "pcie", 25.0,
                  4, 16, (8, 6), ("a10",)),
        GPUPreset("l4", "NVIDIA L4", 23034 * MiB, 121.0, 300.0, "pcie", 25.0,
                  4, 16, (8, 9), ()),
        GPUPreset("l40s", "NVIDIA L40S", 46068 * MiB, 362.0, 864.0, "pcie", 25.0,
                  4, 16, (8, 9), ("l40",)),
        GPUPreset("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960 * MiB, 312.0, 1555.0, "nvlink",
                  300.0, 4, 16, (8, 0), ("a100",)),
        GPUPreset("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920 * MiB, 312.0, 2039.0, "nvlink",
                  300.0, 4, 16, (8, 0), ()),
        GPUPreset("h100-80gb", "NVIDIA H100 80GB HBM3", 81559 * MiB, 989.0, 3350.0, "nvlink",
                  450.0, 5, 16, (9, 0), ("h100", "h100-sxm")),
        GPUPreset("h100-pcie", "NVIDIA H100 PCIe", 81559 * MiB, 756.0, 2000.0, "pcie", 50.0,
                  5, 16, (9, 0), ()),
        GPUPreset("h200", "NVIDIA H200", 143771 * MiB, 989.0, 4800.0, "nvlink", 450.0,
                  5, 16, (9, 0), ("h200-141gb",)),
        GPUPreset("rtx-a6000", "NVIDIA RTX A6000", 49140 * MiB, 155.0, 768.0, "pcie", 25.0,
                  4, 16, (8, 6), ("a6000",)),
    )
}  # fmt: skip

GPU_PRESETS = {
    name: replace(p, network=NETWORKS[name][0], inter_node_bw_gbs=NETWORKS[name][1])
    if name in NETWORKS
    else p
    for name, p in GPU_PRESETS.items()
}

_ALIASES = {alias: p.name for p in GPU_PRESETS.values() for alias in p.aliases}


def find_preset(name: str) -> GPUPreset | None:
    key = name.strip().lower().replace("_", "-").replace(" ", "")
    key = _ALIASES.get(key, key)
    return GPU_PRESETS.get(key)


def match_preset_by_name(nvml_name: str, memory_bytes: int) -> GPUPreset | None:
    """The preset whose name best matches a name NVML reports (for its speed figures).

    A match on the full marketing name beats a match on the short name; among equal matches the
    closest memory size wins (A100 40 GB vs 80 GB report the same family name).
    """

    def squash(text: str) -> str:
        return text.lower().replace("nvidia", "").replace(" ", "").replace("-", "")

    text = squash(nvml_name)
    scored: list[tuple[int, int, GPUPreset]] = []
    for p in GPU_PRESETS.values():
        names = [p.name.split("-")[0], *p.aliases] if p.name[:3] != "rtx" else [p.name]
        # the full name must not run on into more digits: 'l4' is not 'l40'/'l40s'
        if re.search(re.escape(squash(p.full_name)) + r"(?![0-9])", text):
            score = 2
        elif any(len(squash(n)) >= 3 and squash(n) in text for n in names):
            score = 1
        else:
            continue
        scored.append((-score, abs(p.memory_bytes - memory_bytes), p))
    return min(scored, key=lambda t: (t[0], t[1]))[2] if scored else None
