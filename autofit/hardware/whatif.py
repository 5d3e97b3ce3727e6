"""What-if hardware: `count` GPUs of a preset on one or more nodes, the network between nodes,
and the bounds a named box is held to. `autofit.hardware` resolves a `--gpus` text to one of
these, or to the local GPUs.
"""

from __future__ import annotations

import re

from autofit.errors import HardwareError, did_you_mean
from autofit.hardware.presets import GPU_PRESETS, find_preset
from autofit.hardware.spec import GPU, Hardware

# The most GPUs (or CPU processes) one plan is for: far above any one host, and small enough that
# a what-if box of that many is built in a blink.
MAX_GPUS = 4096
# Up to this many GPUs a preset lists every GPU pair with its link (`autofit hardware`, JSON);
# above it the pair list (which grows with the square of the count) is left out: `link` says it.
MAX_LISTED_PAIRS_GPUS = 64
# The figures a preset's GPU carries as the preset states them (a `GPU` field each, same name).
_FROM_PRESET = (
    "memory_bytes",
    "bf16_tflops",
    "mem_bw_gbs",
    "compute_capability",
    "pcie_gen",
    "pcie_width",
    "pcie_bw_gbs",
)


def preset_hardware(count: int, name: str, nodes: int = 1) -> Hardware:
    """`nodes` hosts of `count` identical GPUs of a preset each (NVLink inside a host if the
    preset has it; between hosts the preset's network, `presets.NETWORKS`)."""
    preset = find_preset(name)
    if preset is None:
        raise HardwareError(
            f"Unknown GPU preset {name!r}.{did_you_mean(name, GPU_PRESETS)} "
            f"Known presets: {', '.join(GPU_PRESETS)} (see `autofit hardware --presets`)."
        )
    if count < 1:
        raise HardwareError(f"The GPU count in --gpus must be at least 1; got {count}.")
    if nodes < 1:
        raise HardwareError(f"The node count in --gpus must be at least 1; got {nodes}.")
    per_node, count = count, count * nodes
    text = f"{nodes}x{per_node}x{preset.name}" if nodes > 1 else f"{count}x{preset.name}"
    check_count(count, text)
    gpus = tuple(
        GPU(
            index=i,
            name=preset.full_name,
            nvlink_links=18 if preset.interconnect == "nvlink" else 0,
            preset=preset.name,
            **{k: getattr(preset, k) for k in _FROM_PRESET},
        )
        for i in range(count)
    )
    pairs = (
        tuple(
            (a, b, preset.interconnect if a // per_node == b // per_node else "network")
            for a in range(count)
            for b in range(a + 1, count)
        )
        if count <= MAX_LISTED_PAIRS_GPUS
        else ()
    )
    # Host RAM of a what-if box is unknown: assume the common cloud shape of 2x the GPUs'
    # memory, at least 64 GiB (a p4d has 1152 GiB for 320 GiB of A100s; a g5.12xlarge 192/96).
    # RAM and cores are per node.
    ram = max(2 * per_node * preset.memory_bytes, 64 * 1024**3)
    return Hardware(
        gpus=gpus,
        link=preset.interconnect,
        link_bw_gbs=preset.link_bw_gbs,
        host_ram_bytes=ram,
        cpu_cores=max(8, 8 * per_node),
        source="preset",
        pairs=pairs,
        **network_fields(nodes, preset.network, preset.inter_node_bw_gbs),
    )


def network_fields(nodes: int, network: str, bw_gbs: float) -> dict[str, object]:
    """The `Hardware` fields of the network between `nodes` nodes (none on one node)."""
    if nodes <= 1:
        return {"nodes": 1, "network": "", "inter_node_bw_gbs": 0.0}
    return {"nodes": nodes, "network": network, "inter_node_bw_gbs": bw_gbs}


def on_nodes(hw: Hardware, nodes: int) -> Hardware:
    """`hw` (one node's GPUs) as `nodes` such nodes, joined by its GPUs' usual network (that of
    their preset, `presets.NETWORKS`; Ethernet where none is known): the world of a multi-node
    launch (`launch_world`)."""
    from dataclasses import replace

    if nodes <= 1:
        return hw
    per_node = hw.n_gpus
    check_count(per_node * nodes, f"auto ({nodes} nodes of {per_node} GPUs)")
    gpus = tuple(
        replace(g, index=node * per_node + i)
        for node in range(nodes)
        for i, g in enumerate(hw.gpus)
    )
    preset = find_preset(hw.smallest_gpu.preset or "") if hw.gpus else None
    network = (preset.network, preset.inter_node_bw_gbs) if preset else ("ethernet", 1.25)
    pairs = tuple(
        (node * per_node + a, node * per_node + b, kind)
        for node in range(nodes)
        for a, b, kind in hw.pairs
    )
    return replace(hw, gpus=gpus, pairs=pairs, **network_fields(nodes, *network))


def with_inter_node_bandwidth(hw: Hardware, value: str | float | None) -> Hardware:
    """`hw` with the network between its nodes at `value` per GPU and direction
    (`--inter-node-bandwidth`: `50GB/s`, `400Gb/s`, `400Gbps`; a float is GB/s)."""
    from dataclasses import replace

    if value is None:
        return hw
    bw = parse_bandwidth(value)
    if hw.nodes <= 1:
        import warnings

        from autofit.checks import AutofitWarning

        warnings.warn(
            f"--inter-node-bandwidth {value} is unused: {hw.describe()} is one node (name "
            "several with --gpus NxKxNAME, e.g. 4x8xh100-80gb).",
            AutofitWarning,
            stacklevel=3,
        )
        return hw
    return replace(hw, inter_node_bw_gbs=bw)


_BANDWIDTH = re.compile(
    r"^\s*([0-9]*\.?[0-9]+)\s*(gb/s|gbps|gbit/s|gb/sec|gbyte/s|gbytes/s)\s*$", re.IGNORECASE
)


def parse_bandwidth(value: str | float) -> float:
    """GB/s from `--inter-node-bandwidth`: `50GB/s` (bytes) or `400Gb/s` / `400Gbps` /
    `400Gbit/s` (bits, as NICs are sold); the unit is required (the two differ 8x)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number, gbytes = float(value), True
    else:
        match = _BANDWIDTH.match(str(value))
        if not match:
            raise HardwareError(
                f"Cannot read --inter-node-bandwidth {value!r}. Give the bandwidth per GPU and "
                "direction with its unit: GB/s for bytes (50GB/s) or Gb/s, Gbps, Gbit/s for bits "
                "as NICs are sold (400Gb/s = 50GB/s)."
            )
        number = float(match.group(1))
        unit = match.group(2)
        gbytes = unit.startswith("GB") or unit.lower().startswith("gbyte")
    gbs = number if gbytes else number / 8
    if not gbs > 0:
        raise HardwareError(
            f"--inter-node-bandwidth {value} must be more than 0 (e.g. 50GB/s or 400Gb/s)."
        )
    return gbs


def check_count(count: int, text: str) -> None:
    if count > MAX_GPUS:
        raise HardwareError(
            f"--gpus {text} asks for {count:,} GPUs; autofit plans for at most {MAX_GPUS:,} "
            "(one host's GPUs, or a what-if box of them). Name fewer, e.g. --gpus 8xh100-80gb."
        )
