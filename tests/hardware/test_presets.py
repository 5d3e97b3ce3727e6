"""What-if GPU presets: `--gpus KxNAME`, their datasheet figures, and NVML name matching."""

from __future__ import annotations

import pytest

from autofit.errors import HardwareError
from autofit.hardware import GPU_PRESETS, preset_hardware, resolve_gpus, resolve_hardware
from autofit.hardware.presets import find_preset, match_preset_by_name
from tests.conftest import GiB, MiB

REQUIRED = (
    "rtx3090",
    "rtx4090",
    "a10g",
    "l4",
    "l40s",
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "h200",
)


def test_the_common_cards_are_presets():
    assert set(REQUIRED) <= set(GPU_PRESETS)


@pytest.mark.parametrize("name", list(GPU_PRESETS))
def test_every_preset_has_plausible_datasheet_figures(name):
    p = GPU_PRESETS[name]
    assert 16 * GiB <= p.memory_bytes <= 150 * GiB
    assert 50 <= p.bf16_tflops <= 1000
    assert 250 <= p.mem_bw_gbs <= 5000
    assert p.interconnect in ("nvlink", "pcie")
    assert p.link_bw_gbs > 0
    assert p.bf16  # every preset is Ampere or newer


def test_preset_memory_matches_what_nvidia_smi_shows():
    assert GPU_PRESETS["rtx3090"].memory_bytes == 24576 * MiB
    assert GPU_PRESETS["a100-80gb"].memory_bytes == 81920 * MiB
    assert GPU_PRESETS["h100-80gb"].memory_bytes == 81559 * MiB


def test_hopper_and_ada_have_fp8_ampere_does_not():
    assert GPU_PRESETS["h100-80gb"].fp8 and GPU_PRESETS["rtx4090"].fp8 and GPU_PRESETS["l4"].fp8
    assert not GPU_PRESETS["a100-80gb"].fp8 and not GPU_PRESETS["rtx3090"].fp8


def test_k_x_name_builds_k_identical_gpus_in_one_host():
    hw = resolve_gpus("8xh100-80gb")
    assert hw.n_gpus == 8 and hw.source == "preset"
    assert {g.name for g in hw.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert hw.link == "nvlink" and hw.link_bw_gbs == 450.0
    assert len(hw.pairs) == 8 * 7 // 2
    assert all(kind == "nvlink" for _, _, kind in hw.pairs)
    assert all(g.nvlink_links == 18 for g in hw.gpus)


def test_pcie_presets_have_pcie_pairs_and_no_nvlink_links():
    hw = resolve_gpus("2xrtx3090")
    assert hw.link == "pcie" and hw.pairs == ((0, 1, "pcie"),)
    assert hw.gpus[0].nvlink_links == 0
    assert hw.capacity_bytes == 24576 * MiB


@pytest.mark.parametrize(
    ("spec", "count", "preset"),
    [
        ("2xrtx3090", 2, "rtx3090"),
        ("2X RTX3090", 2, "rtx3090"),
        ("4*a100-80gb", 4, "a100-80gb"),
        ("1xh100", 1, "h100-80gb"),  # alias
        ("a10g", 1, "a10g"),  # a bare preset name is one GPU
        ("2xa100_40gb", 2, "a100-40gb"),
    ],
)
def test_gpus_spellings_of_presets(spec, count, preset):
    hw = resolve_gpus(spec)
    assert hw.n_gpus == count
    assert {g.preset for g in hw.gpus} == {preset}


def test_near_miss_preset_names_get_did_you_mean():
    with pytest.raises(HardwareError, match=r"Did you mean 'rtx3090'"):
        resolve_gpus("2xrtx309")
    with pytest.raises(HardwareError, match=r"Did you mean 'h100-80gb'"):
        resolve_gpus("8xh100-80g")


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(HardwareError) as info:
        resolve_gpus("3xfoo")
    assert "'foo'" in str(info.value)
    assert all(name in str(info.value) for name in REQUIRED)


def test_unreadable_gpus_value_says_what_is_allowed():
    with pytest.raises(HardwareError, match=r"Cannot read --gpus 'lots'.*KxNAME"):
        resolve_gpus("lots")


def test_zero_gpus_of_a_preset_is_rejected():
    with pytest.raises(HardwareError, match="at least 1"):
        preset_hardware(0, "rtx3090")


def test_gpu_memory_sets_what_if_capacity():
    hw = resolve_hardware("2xh100-80gb", gpu_memory="24GiB")
    assert hw.capacity_bytes == 24 * GiB


def test_cpu_device_gives_cpu_processes_held_to_the_preset_memory():
    hw = resolve_hardware("2xrtx3090", device="cpu")
    assert hw.source == "cpu" and hw.n_gpus == 2
    assert hw.capacity_bytes == GPU_PRESETS["rtx3090"].memory_bytes
    assert resolve_hardware("3", device="cpu", gpu_memory="1GiB").capacity_bytes == GiB


def test_unknown_device_is_rejected():
    with pytest.raises(HardwareError, match="--device"):
        resolve_hardware("2xrtx3090", device="tpu")


def test_find_preset_accepts_aliases_and_case():
    assert find_preset("H100").name == "h100-80gb"
    assert find_preset("RTX-3090").name == "rtx3090"
    assert find_preset("nope") is None


@pytest.mark.parametrize(
    ("nvml_name", "memory", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", 81559 * MiB, "h100-80gb"),
        ("NVIDIA H100 PCIe", 81559 * MiB, "h100-pcie"),
        ("NVIDIA A100-SXM4-40GB", 40960 * MiB, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 81920 * MiB, "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", 81920 * MiB, "a100-80gb"),
        ("NVIDIA GeForce RTX 3090", 24576 * MiB, "rtx3090"),
        ("NVIDIA GeForce RTX 4090", 24564 * MiB, "rtx4090"),
        ("NVIDIA A10G", 23028 * MiB, "a10g"),
        ("NVIDIA L4", 23034 * MiB, "l4"),
        ("NVIDIA L40S", 46068 * MiB, "l40s"),
        ("NVIDIA L40", 46068 * MiB, "l40s"),  # not the much slower L4
        ("NVIDIA H200", 143771 * MiB, "h200"),
        ("NVIDIA RTX A6000", 49140 * MiB, "rtx-a6000"),
    ],
)
def test_nvml_names_match_the_right_preset(nvml_name, memory, preset):
    match = match_preset_by_name(nvml_name, memory)
    assert match is not None and match.name == preset


def test_unknown_nvml_name_matches_no_preset():
    assert match_preset_by_name("Tesla T4", 15360 * MiB) is None
