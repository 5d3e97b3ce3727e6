"""Hardware: the local GPUs through NVML, or what-if presets (`2xrtx3090`)."""

from __future__ import annotations

import re

from autofit.errors import HardwareError, did_you_mean
from autofit.hardware.nvml import NoDriver, probe
from autofit.hardware.presets import GPU_PRESETS, GPUPreset, find_preset
from autofit.hardware.spec import GPU, Hardware, cpu_cores, host_ram_bytes
from autofit.hardware.whatif import (
    MAX_GPUS,
    check_count,
    network_fields,
    on_nodes,
    preset_hardware,
    with_inter_node_bandwidth,
)
from autofit.hardware.world import World, launch_world

__all__ = [
    "MAX_GPUS",
    "GPU",
    "GPU_PRESETS",
    "GPUPreset",
    "Hardware",
    "NoDriver",
    "World",
    "launch_world",
    "cpu_hardware",
    "local_hardware",
    "preset_hardware",
    "check_trial_hardware",
    "is_preset",
    "resolve_gpus",
    "resolve_hardware",
]

NO_GPU_HINT = (
    "To estimate or plan for hardware you do not have, name it: --gpus 2xrtx3090, --gpus "
    "8xh100-80gb (`autofit hardware --presets` lists the names); or use --device cpu to run real "
    "trials of small models on this CPU."
)

TRIALS_HERE_HINT = {
    "plan": "Add --no-trials to plan from estimates alone, use --gpus auto (or N) to run trials "
    "on this machine's GPUs, or --device cpu to run the trials of a small model on this CPU.",
    "trial": "A trial runs on this machine: use --gpus auto (or N) for its GPUs, or --device cpu "
    "to run a small model's trial on this CPU; `autofit estimate` takes hardware you do not have.",
    "calibrate": "Calibration measures this machine: use --gpus auto (or N) for its GPUs, or "
    "--device cpu --gpus N for N processes on its CPU.",
}
"""What to do instead of trials on hardware this machine lacks, by command (`trial` and
`calibrate` have no --no-trials to offer)."""


def is_preset(gpus: str) -> bool:
    """`--gpus` names what-if hardware (`2xrtx3090`, `4x8xh100-80gb`, `h100-80gb`), not this
    machine's GPUs or CPU processes."""
    text = gpus.strip()
    return bool(_NKX.match(text) or _KX.match(text) or find_preset(text.lower()))


def local_hardware() -> Hardware:
    """The GPUs NVML sees plus this host's RAM and cores. Raises `NoDriver` without a driver."""
    gpus, pairs = probe()
    return _assemble(tuple(gpus), pairs)


def _assemble(gpus: tuple[GPU, ...], pairs: list[tuple[int, int, str]] | tuple) -> Hardware:
    pairs = tuple(
        p for p in pairs if p[0] in {g.index for g in gpus} and p[1] in {g.index for g in gpus}
    )
    nvlink = bool(pairs) and all(kind == "nvlink" for _, _, kind in pairs)
    link_bw = 25.0
    if nvlink:
        presets = [GPU_PRESETS[g.preset] for g in gpus if g.preset in GPU_PRESETS]
        link_bw = min((p.link_bw_gbs for p in presets if p.interconnect == "nvlink"), default=150.0)
    elif gpus:
        link_bw = min(g.pcie_bw_gbs for g in gpus)
    return Hardware(
        gpus=gpus,
        link="nvlink" if nvlink else "pcie",
        link_bw_gbs=link_bw,
        host_ram_bytes=host_ram_bytes(),
        cpu_cores=cpu_cores(),
        source="nvml",
        pairs=pairs,
    )


def cpu_hardware(nprocs: int, memory_bytes: int | None = None, nodes: int = 1) -> Hardware:
    """`nprocs` CPU processes standing in for GPUs (`--device cpu` trials), as `nodes` "nodes" of
    `nprocs // nodes` (joined over localhost TCP); `memory_bytes` is the cap each is held to
    (default: an equal share of host RAM)."""
    ram = host_ram_bytes()
    mem = memory_bytes or ram // max(nprocs, 1)
    gpus = tuple(
        GPU(
            index=i,
            name="CPU (gloo)",
            memory_bytes=mem,
            bf16_tflops=0.2,  # a few cores doing bf16 matmuls; only the ranking matters here
            mem_bw_gbs=10.0,
            compute_capability=(8, 0),
            pcie_bw_gbs=10.0,
        )
        for i in range(nprocs)
    )
    return Hardware(
        gpus, "pcie", 5.0, ram, cpu_cores(), "cpu", (), **network_fields(nodes, "tcp", 5.0)
    )


_KX = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9_.\- ]+?)\s*$")
_NKX = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*[xX*]\s*([A-Za-z][A-Za-z0-9_.\- ]*?)\s*$")
_NK = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def resolve_gpus(spec: str | Hardware, gpu_memory: int | None = None) -> Hardware:
    """Turn a `--gpus` value into `Hardware`.

    `auto` = every NVML GPU (on each node of a multi-node launch: `launch_world`); `N` = the
    first N; `0,2` = those indices; `KxNAME` = K preset GPUs (`2xrtx3090`); `NxKxNAME` = N nodes
    of K (`4x8xh100-80gb`); a bare preset name means one of it. `gpu_memory` caps each GPU.
    """
    if isinstance(spec, Hardware):
        hw = spec
    else:
        hw = _resolve(str(spec).strip())
    if gpu_memory is not None:
        # a cap never raises capacity: --gpu-memory emulates a smaller card on a bigger one
        if gpu_memory > hw.capacity_bytes and hw.gpus:
            from autofit.units import fmt_bytes

            gpu = hw.smallest_gpu
            which = "each" if len({g.memory_bytes for g in hw.gpus}) == 1 else "the smallest"
            raise HardwareError(
                f"--gpu-memory {fmt_bytes(gpu_memory, 'GiB')} is more than the "
                f"{fmt_bytes(gpu.memory_bytes, 'GiB')} ({gpu.memory_bytes:,} bytes) of {which} "
                f"GPU ({gpu.name}): --gpu-memory emulates a smaller card and cannot add "
                f"memory. Give at most {gpu.memory_bytes // 1024**2}MiB, or leave it out to plan "
                "for the whole card."
            )
        hw = hw.with_capacity(gpu_memory)
    return hw


def _resolve(text: str) -> Hardware:
    low = text.lower()
    match = _NKX.match(text)
    if match:
        return preset_hardware(int(match.group(2)), match.group(3), nodes=int(match.group(1)))
    match = _KX.match(text)
    if match:
        return preset_hardware(int(match.group(1)), match.group(2))
    if find_preset(low):
        return preset_hardware(1, low)
    if low == "auto" or re.fullmatch(r"\d+", low) or re.fullmatch(r"\d+(\s*,\s*\d+)+", low):
        try:
            gpus, pairs = probe()
        except NoDriver as exc:
            raise HardwareError(
                f"--gpus {text} needs NVIDIA GPUs, but NVML found none on this machine ({exc}). "
                + NO_GPU_HINT
            ) from None
        if not gpus:
            raise HardwareError(f"--gpus {text}: NVML reports no GPUs here. " + NO_GPU_HINT)
        if low == "auto":
            world = launch_world()
            return on_nodes(_assemble(tuple(gpus), pairs), world.nodes)
        elif "," not in low:
            n = int(low)
            if not 1 <= n <= len(gpus):
                raise HardwareError(
                    f"--gpus {text} asks for {n} GPUs but this machine has {len(gpus)}; "
                    f"use 1 to {len(gpus)}, 'auto', or a preset such as {n}xh100-80gb."
                )
            chosen = gpus[:n]
        else:
            idx = [int(x) for x in low.split(",")]
            bad = [i for i in idx if not 0 <= i < len(gpus)]
            if bad or len(set(idx)) != len(idx):
                raise HardwareError(
                    f"--gpus {text}: indices must be distinct and between 0 and {len(gpus) - 1} "
                    f"on this machine (it has {len(gpus)} GPUs)."
                )
            chosen = [gpus[i] for i in idx]
        return _assemble(tuple(chosen), pairs)
    raise HardwareError(
        f"Cannot read --gpus {text!r}.{did_you_mean(low, GPU_PRESETS)} Allowed: 'auto' (all "
        "NVML GPUs, on every node of a torchrun/SLURM launch), N (the first N), indices like 0,2, "
        "or KxNAME (K GPUs in one node) or NxKxNAME (N nodes of K) for hardware you do not have, "
        f"where NAME is one of {', '.join(GPU_PRESETS)} (e.g. 2xrtx3090, 4x8xh100-80gb)."
    )


def resolve_hardware(
    gpus: str | Hardware,
    *,
    device: str = "cuda",
    gpu_memory: str | int | None = None,
    inter_node_bandwidth: str | float | None = None,
) -> Hardware:
    """`--gpus` + `--device` + `--gpu-memory` + `--inter-node-bandwidth` -> Hardware.

    On `--device cpu` the GPUs are CPU processes: `N` gives N of them, `NxK` N "nodes" of K (each
    node's processes started by its own planner, joined over localhost), `KxNAME` / `NxKxNAME` as
    many held to that preset's memory, `auto` two (or one on a single-core machine); `--gpu-memory`
    sets the cap each process is held to.
    """
    cap = _parse_gpu_memory(gpu_memory) if gpu_memory is not None else None
    if device not in ("cuda", "cpu"):
        raise HardwareError(f"--device must be 'cuda' or 'cpu'; got {device!r}.")
    if device == "cuda" or isinstance(gpus, Hardware):
        hw = resolve_gpus(gpus, cap)
    else:
        hw = _resolve_cpu(str(gpus), cap)
    return with_inter_node_bandwidth(hw, inter_node_bandwidth)


def _resolve_cpu(gpus: str, cap: int | None) -> Hardware:
    text = gpus.strip().lower()
    match = _NK.match(text)
    if match and int(match.group(1)) >= 1 and int(match.group(2)) >= 1:
        nodes, per_node = int(match.group(1)), int(match.group(2))
        check_count(nodes * per_node, text)
        return cpu_hardware(nodes * per_node, cap, nodes)
    match = _NKX.match(text) or _KX.match(text)
    if match:
        nodes = int(match.group(1)) if match.re is _NKX else 1
        count, name = match.group(match.re.groups - 1), match.group(match.re.groups)
        preset = preset_hardware(int(count), name, nodes=nodes)
        return cpu_hardware(preset.n_gpus, cap or preset.capacity_bytes, nodes)
    if re.fullmatch(r"\d+", text) and int(text) >= 1:
        check_count(int(text), text)
        return cpu_hardware(int(text), cap)
    if text == "auto":
        return cpu_hardware(min(2, cpu_cores()), cap)
    raise HardwareError(
        f"With --device cpu, --gpus must be N (CPU processes), NxK (N nodes of K processes), "
        f"KxNAME or NxKxNAME (as many processes held to that GPU's memory) or auto; got {gpus!r}."
    )


def _parse_gpu_memory(value: str | int) -> int:
    """`--gpu-memory`: a size with a unit. A bare number would be bytes (24 -> 24 bytes), which
    nobody means for a GPU, so the unit is required; the Python API may pass an int of bytes."""
    from autofit.units import MiB, parse_size

    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", value):
        raise HardwareError(
            f"--gpu-memory {value.strip()} has no unit, so it would mean {value.strip()} bytes. "
            f"Write the unit, e.g. {value.strip()}GiB (GiB/MiB are powers of 1024, GB/MB powers "
            "of 1000)."
        )
    size = parse_size(value)
    if size < MiB:
        raise HardwareError(
            f"--gpu-memory {value} is {size:,} bytes, less than 1 MiB: no model fits in that. "
            "Write the size with its unit, e.g. 24GiB or 512MiB."
        )
    return size


def trial_memory_cap(hw: Hardware, device: str, gpu_memory: str | int | None) -> int | None:
    """The memory each trial rank is held to, for `plan` and `trial` alike: the capacity the user
    named with `--gpu-memory`, and on `--device cpu` always the capacity of `hw` (a CPU process has
    no device memory of its own to run out of). None: a GPU trial runs into the device's own limit.
    """
    if gpu_memory is not None or device == "cpu":
        return hw.capacity_bytes
    return None


def check_trial_hardware(
    hw: Hardware, device: str, gpus: str | Hardware, per_node: bool = False, command: str = "plan"
) -> None:
    """Refuse, before any trial runs, hardware that trials cannot run on here: a what-if preset
    (`--gpus 2xrtx3090`) on a machine without those GPUs, or far more CPU processes than cores
    (`--gpus 64 --device cpu` on 2 cores). A few more processes than cores only warn: the trials
    run, but time-share the cores, so their speeds are skewed. `per_node`: a plan's trials on
    several nodes, where each node's planner starts that node's share of them on its own host."""
    here = hw.gpus_per_node if per_node else hw.n_gpus  # the trial processes this host runs
    if device == "cpu":
        _check_cpu_ranks(here, cpu_cores(), str(gpus), command)
        return
    if hw.source != "preset":
        return
    wanted = {g.preset for g in hw.gpus}
    try:
        local, _ = probe()
    except NoDriver:
        local = []
    matching = [g for g in local[:here] if g.preset in wanted]  # trials use the first N
    if len(matching) >= here:
        return
    here = (
        f"this machine has {len(local)} GPU(s) ({', '.join(sorted({g.name for g in local}))})"
        if local
        else "this machine has no NVIDIA GPU"
    )
    from autofit.checks import user_error

    raise user_error(
        f"--gpus {gpus} names hardware to plan for ({hw.describe()}), but trials run on real "
        f"GPUs and {here}.",
        TRIALS_HERE_HINT.get(command, TRIALS_HERE_HINT["plan"]),
        HardwareError,
    )


def _check_cpu_ranks(nprocs: int, cores: int, gpus: str, command: str = "plan") -> None:
    if nprocs <= cores:
        return
    if nprocs > 2 * cores:
        from autofit.checks import user_error

        raise user_error(
            f"--gpus {gpus} --device cpu would run {nprocs} trial processes on {cores} CPU "
            "core(s): each would get a sliver of a core, so the trials would crawl and their "
            "speeds would say nothing about the configs.",
            f"Use --gpus {cores} or fewer with --device cpu (one process per core; up to "
            f"{2 * cores} run, with a warning)"
            + (
                f", or plan for {nprocs} GPUs from estimates alone: --gpus {nprocs}xNAME "
                f"--no-trials (e.g. {nprocs}xh100-80gb)."
                if command == "plan"
                else "."
            ),
            HardwareError,
        )
    import warnings

    from autofit.checks import AutofitWarning

    warnings.warn(
        f"--gpus {gpus} --device cpu runs {nprocs} trial processes on {cores} CPU core(s): they "
        "take turns on the cores, so trials are slower and their speeds less telling. --gpus "
        f"{cores} or fewer gives each process a core of its own.",
        AutofitWarning,
        stacklevel=3,
    )
