"""The hardware a plan is for: GPUs (probed or preset), their links, and the host."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_bytes: int
    bf16_tflops: float
    mem_bw_gbs: float
    compute_capability: tuple[int, int]
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_bw_gbs: float = 25.0
    free_bytes: int | None = None
    nvlink_links: int = 0
    preset: str | None = None  # the preset its speed figures come from
    # the CUDA context a training process holds on it, as this machine's trials measured it
    # (`autofit.calibration.Calibration.context_bytes`); None: the estimate's default
    context_bytes: int | None = None

    @property
    def bf16(self) -> bool:
        return tuple(self.compute_capability) >= (8, 0)

    @property
    def fp8(self) -> bool:
        return tuple(self.compute_capability) >= (8, 9)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = f"{self.compute_capability[0]}.{self.compute_capability[1]}"
        d["bf16"] = self.bf16
        d["fp8"] = self.fp8
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPU:
        """The inverse of `to_dict` (derived keys such as `bf16` are recomputed, not read)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        major, minor = str(values["compute_capability"]).split(".")
        values["compute_capability"] = (int(major), int(minor))
        return cls(**values)


@dataclass(frozen=True)
class Hardware:
    """N GPUs in `nodes` hosts of `n_gpus // nodes` each. `link` is the slowest GPU pair's path
    inside a node ('nvlink' or 'pcie'); `network` joins the nodes ('infiniband' or 'ethernet') at
    `inter_node_bw_gbs` per GPU and direction (what one GPU's share of a collective that spans
    nodes moves at)."""

    gpus: tuple[GPU, ...]
    link: str = "pcie"
    link_bw_gbs: float = 25.0  # per direction between GPUs, as used by ring collectives
    host_ram_bytes: int = 0
    cpu_cores: int = 0
    source: str = "preset"  # "nvml", "preset" or "cpu"
    pairs: tuple[tuple[int, int, str], ...] = field(default_factory=tuple)
    nodes: int = 1
    network: str = ""  # between nodes; "" on one node
    inter_node_bw_gbs: float = 0.0  # per GPU per direction; 0 on one node

    @property
    def n_gpus(self) -> int:
        return len(self.gpus)

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpus) // max(self.nodes, 1)

    @cached_property
    def smallest_gpu(self) -> GPU:
        """The GPU with the least memory: the one that runs out first, whose capacity and speed
        figures the estimate and the plan use."""
        return min(self.gpus, key=lambda g: g.memory_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.smallest_gpu.memory_bytes

    def describe(self) -> str:
        if not self.gpus:
            return "no GPUs"
        if self.source == "cpu":  # CPU processes standing in for GPUs: no GPU link to name
            procs = f"{self.n_gpus} CPU process{'es' if self.n_gpus != 1 else ''} (gloo)"
            return (
                f"{procs} as {self.nodes} nodes of {self.gpus_per_node}"
                if self.nodes > 1
                else procs
            )
        names = {g.name for g in self.gpus}
        name = names.pop() if len(names) == 1 else "mixed GPUs"
        if self.nodes > 1:
            return (
                f"{self.nodes} nodes x {self.gpus_per_node}x {name} ({self.link}; "
                f"{self.network} {self.inter_node_bw_gbs:g} GB/s per GPU between nodes)"
            )
        return f"{self.n_gpus}x {name} ({self.link})"

    @property
    def context_bytes(self) -> int | None:
        """The largest CUDA context this machine's trials measured on its GPUs (None: not
        measured; the estimate takes its default, `estimate.memory.CUDA_CONTEXT_BYTES`)."""
        found = [g.context_bytes for g in self.gpus if g.context_bytes is not None]
        return max(found) if found else None

    def with_context(self, context_bytes: int | None) -> Hardware:
        """The same hardware with the CUDA context its trials measured (None: unmeasured)."""
        from dataclasses import replace

        gpus = tuple(replace(g, context_bytes=context_bytes) for g in self.gpus)
        return replace(self, gpus=gpus)

    def with_capacity(self, memory_bytes: int) -> Hardware:
        """The same hardware with each GPU capped to `memory_bytes` (`--gpu-memory`)."""
        from dataclasses import replace

        gpus = tuple(replace(g, memory_bytes=memory_bytes) for g in self.gpus)
        return replace(self, gpus=gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [g.to_dict() for g in self.gpus],
            "link": self.link,
            "link_bw_gbs": self.link_bw_gbs,
            "pairs": [{"a": a, "b": b, "link": k} for a, b, k in self.pairs],
            "host_ram_bytes": self.host_ram_bytes,
            "cpu_cores": self.cpu_cores,
            "source": self.source,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "network": self.network,
            "inter_node_bw_gbs": self.inter_node_bw_gbs,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        """The inverse of `to_dict`."""
        return cls(
            gpus=tuple(GPU.from_dict(g) for g in data["gpus"]),
            link=data["link"],
            link_bw_gbs=data["link_bw_gbs"],
            host_ram_bytes=data["host_ram_bytes"],
            cpu_cores=data["cpu_cores"],
            source=data["source"],
            pairs=tuple((p["a"], p["b"], p["link"]) for p in data.get("pairs", [])),
            nodes=data.get("nodes", 1),
            network=data.get("network", ""),
            inter_node_bw_gbs=data.get("inter_node_bw_gbs", 0.0),
        )


def host_ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # pragma: no cover - psutil is a dependency
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_cores() -> int:
    return os.cpu_count() or 1
