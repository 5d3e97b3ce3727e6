"""The NVML path: a fake `pynvml` at the module boundary, the real probing and `--gpus` code."""

from __future__ import annotations

import pytest

from autofit.errors import HardwareError
from autofit.hardware import NoDriver, local_hardware, resolve_gpus, resolve_hardware
from autofit.hardware.nvml import probe
from tests.conftest import MiB


def test_probe_reads_names_memory_and_compute_capability(fake_nvml):
    gpus, _ = probe()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    # bytes names (old pynvml) and str names (new) both come out as str
    assert [g.name for g in gpus] == [
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H100 80GB HBM3",
        "NVIDIA GeForce RTX 3090",
        "Tesla T4",
    ]
    assert gpus[0].memory_bytes == 81559 * MiB
    assert gpus[0].free_bytes == 80000 * MiB
    assert gpus[2].memory_bytes == 24576 * MiB
    assert [g.compute_capability for g in gpus] == [(9, 0), (9, 0), (8, 6), (7, 5)]


def test_probe_derives_bf16_and_fp8_from_compute_capability(fake_nvml):
    gpus, _ = probe()
    assert [g.bf16 for g in gpus] == [True, True, True, False]
    assert [g.fp8 for g in gpus] == [True, True, False, False]


def test_probe_reads_pcie_generation_width_and_bandwidth(fake_nvml):
    gpus, _ = probe()
    assert [(g.pcie_gen, g.pcie_width) for g in gpus] == [(5, 16), (5, 16), (4, 16), (3, 8)]
    # ~0.985 GB/s per PCIe 3 lane, doubling per generation
    assert gpus[0].pcie_bw_gbs == pytest.approx(0.985 * 4 * 16)
    assert gpus[2].pcie_bw_gbs == pytest.approx(0.985 * 2 * 16)
    assert gpus[3].pcie_bw_gbs == pytest.approx(0.985 * 8)


def test_probe_counts_active_nvlink_links(fake_nvml):
    gpus, _ = probe()
    assert [g.nvlink_links for g in gpus] == [18, 18, 0, 0]


def test_probe_classifies_each_pair_as_nvlink_or_pcie(fake_nvml):
    _, pairs = probe()
    assert pairs == [
        (0, 1, "nvlink"),
        (0, 2, "pcie"),
        (0, 3, "pcie"),
        (1, 2, "pcie"),
        (1, 3, "pcie"),
        (2, 3, "pcie"),
    ]


def test_probe_takes_speed_figures_from_the_matching_preset(fake_nvml):
    gpus, _ = probe()
    assert gpus[0].preset == "h100-80gb" and gpus[0].bf16_tflops == 989.0
    assert gpus[2].preset == "rtx3090" and gpus[2].mem_bw_gbs == 936.0
    # an unknown card gets no preset name but still has (conservative) speed figures
    assert gpus[3].preset is None and gpus[3].bf16_tflops > 0


def test_local_hardware_with_mixed_links_is_pcie_bound(fake_nvml):
    hw = local_hardware()
    assert hw.source == "nvml"
    assert hw.n_gpus == 4
    assert hw.link == "pcie"  # the slowest pair decides
    assert hw.link_bw_gbs == pytest.approx(0.985 * 8)  # the T4's gen3 x8 is the narrowest
    assert hw.capacity_bytes == 15360 * MiB  # the smallest GPU runs out first
    assert len(hw.pairs) == 6
    assert hw.host_ram_bytes > 0 and hw.cpu_cores >= 1


def test_gpus_auto_takes_every_nvml_gpu(fake_nvml):
    hw = resolve_gpus("auto")
    assert hw.n_gpus == 4 and hw.source == "nvml"


def test_gpus_count_takes_the_first_n_and_keeps_their_nvlink(fake_nvml):
    hw = resolve_gpus("2")
    assert [g.index for g in hw.gpus] == [0, 1]
    assert hw.link == "nvlink"
    assert hw.link_bw_gbs == 450.0  # the H100 preset's NVLink figure
    assert hw.pairs == ((0, 1, "nvlink"),)


def test_gpus_indices_pick_those_gpus_and_their_pair_link(fake_nvml):
    hw = resolve_gpus("0,2")
    assert [g.index for g in hw.gpus] == [0, 2]
    assert [g.name for g in hw.gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 3090"]
    assert hw.pairs == ((0, 2, "pcie"),)
    assert hw.link == "pcie"


def test_gpus_indices_accept_spaces(fake_nvml):
    assert [g.index for g in resolve_gpus("1, 3").gpus] == [1, 3]


@pytest.mark.parametrize("spec", ["0,7", "0,0", "4,1"])
def test_gpus_bad_indices_are_rejected_with_the_valid_range(fake_nvml, spec):
    with pytest.raises(HardwareError, match=r"between 0 and 3"):
        resolve_gpus(spec)


@pytest.mark.parametrize("spec", ["5", "0"])
def test_gpus_count_beyond_the_machine_is_rejected(fake_nvml, spec):
    with pytest.raises(HardwareError, match=r"this machine has 4"):
        resolve_gpus(spec)


def test_gpu_memory_caps_nvml_gpus_and_refuses_to_raise_them(fake_nvml):
    hw = resolve_hardware("0,1", gpu_memory="24GiB")
    assert all(g.memory_bytes == 24 * 1024**3 for g in hw.gpus)
    with pytest.raises(HardwareError, match=r"more than the 79\.6 GiB .* H100"):
        resolve_hardware("0,1", gpu_memory="1TiB")


def test_no_driver_raises_nodriver_naming_the_nvml_error(no_driver):
    with pytest.raises(NoDriver, match="Driver Not Loaded"):
        probe()


@pytest.mark.parametrize("spec", ["auto", "2", "0,1"])
def test_gpus_needing_nvml_without_a_driver_explain_how_to_plan_anyway(no_driver, spec):
    with pytest.raises(HardwareError) as info:
        resolve_gpus(spec)
    text = str(info.value)
    assert "needs NVIDIA GPUs" in text
    # a what-if preset to estimate or plan with, or this CPU; the command's own next step (plan's
    # --no-trials) is said where trials meet the hardware (`TRIALS_HERE_HINT`)
    assert "2xrtx3090" in text and "--device cpu" in text


def test_presets_need_no_driver(no_driver):
    hw = resolve_gpus("2xrtx3090")
    assert hw.n_gpus == 2 and hw.source == "preset"
