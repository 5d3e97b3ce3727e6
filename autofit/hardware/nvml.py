"""Probe the local NVIDIA GPUs through NVML (`import pynvml`, from the nvidia-ml-py package).

`probe()` returns the GPUs and the pairwise links, or raises `NoDriver` when there is no NVIDIA
driver (or no NVML at all). Everything NVML-specific stays in this file so tests can replace the
`pynvml` module at this one boundary.
"""

from __future__ import annotations

from typing import Any

from autofit.hardware.presets import GPU_PRESETS, match_preset_by_name
from autofit.hardware.spec import GPU


class NoDriver(RuntimeError):
    """NVML is not available: no NVIDIA driver, or no GPU visible to this process."""


def _pynvml() -> Any:
    import pynvml

    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(fn: Any, *args: Any, default: Any = None) -> Any:
    nv = _pynvml()
    try:
        return fn(*args)
    except nv.NVMLError:
        return default


def probe() -> tuple[list[GPU], list[tuple[int, int, str]]]:
    """All GPUs NVML sees, and for each pair whether it talks over NVLink or PCIe."""
    try:
        nv = _pynvml()
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NoDriver(f"the nvidia-ml-py package is not installed ({exc})") from None
    try:
        nv.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NoDriver(str(exc) or type(exc).__name__) from None
    try:
        count = nv.nvmlDeviceGetCount()
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = [_describe(nv, i, h) for i, h in enumerate(handles)]
        pairs = []
        for a in range(count):
            for b in range(a + 1, count):
                pairs.append((a, b, _pair_link(nv, handles[a], handles[b])))
        return gpus, pairs
    finally:
        _try(nv.nvmlShutdown)


def _describe(nv: Any, index: int, handle: Any) -> GPU:
    name = _text(nv.nvmlDeviceGetName(handle))
    mem = nv.nvmlDeviceGetMemoryInfo(handle)
    cc = _try(nv.nvmlDeviceGetCudaComputeCapability, handle, default=(0, 0))
    gen = _try(nv.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    width = _try(nv.nvmlDeviceGetMaxPcieLinkWidth, handle)
    links = 0
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _try(nv.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break  # NotSupported / InvalidArgument: no (more) NVLink links
        links += int(state == getattr(nv, "NVML_FEATURE_ENABLED", 1))
    preset = match_preset_by_name(name, int(mem.total))
    # Speed figures (TFLOP/s, bandwidth) are not in NVML: take them from the matching preset, or
    # a conservative A10G-class guess for a card autofit does not know.
    ref = preset or GPU_PRESETS["a10g"]
    pcie_bw = 0.985 * 2 ** ((gen or 4) - 3) * (width or 16)
    return GPU(
        index=index,
        name=name,
        memory_bytes=int(mem.total),
        free_bytes=int(mem.free),
        bf16_tflops=ref.bf16_tflops,
        mem_bw_gbs=ref.mem_bw_gbs,
        compute_capability=(int(cc[0]), int(cc[1])),
        pcie_gen=gen,
        pcie_width=width,
        pcie_bw_gbs=pcie_bw,
        nvlink_links=links,
        preset=preset.name if preset else None,
    )


def _pair_link(nv: Any, a: Any, b: Any) -> str:
    caps = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 3)
    ok = getattr(nv, "NVML_P2P_STATUS_OK", 0)
    status = _try(nv.nvmlDeviceGetP2PStatus, a, b, caps)
    return "nvlink" if status == ok else "pcie"


def driver_version() -> str:
    """The NVIDIA driver's version as NVML reports it (`580.159.04`), or "none" without one."""
    try:
        nv = _pynvml()
        nv.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver, no GPU visible
        return "none"
    try:
        return _text(_try(nv.nvmlSystemGetDriverVersion, default="none"))
    finally:
        _try(nv.nvmlShutdown)
