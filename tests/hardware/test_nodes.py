"""Hardware past one machine: `--gpus NxKxNAME`, the network between nodes, and the world of a
torchrun or SLURM launch."""

from __future__ import annotations

import pytest

from autofit.errors import HardwareError
from autofit.hardware import launch_world, resolve_hardware
from autofit.hardware.presets import GPU_PRESETS
from autofit.hardware.world import World


def test_nodes_of_gpus_make_one_hardware_with_its_network():
    hw = resolve_hardware("4x8xh100-80gb")
    assert (hw.nodes, hw.gpus_per_node, hw.n_gpus) == (4, 8, 32)
    assert hw.link == "nvlink"
    # DGX H100 / AWS p5: one 400 Gb/s NIC per GPU = 50 GB/s per direction
    assert (hw.network, hw.inter_node_bw_gbs) == ("infiniband", 50.0)
    # RAM and cores are per node: a DGX H100 host, not 32 GPUs' worth
    assert hw.host_ram_bytes == resolve_hardware("8xh100-80gb").host_ram_bytes
    assert "4 nodes x 8x NVIDIA H100 80GB HBM3" in hw.describe()


def test_one_node_is_the_hardware_it_always_was():
    one, flat = resolve_hardware("1x8xh100-80gb"), resolve_hardware("8xh100-80gb")
    assert one == flat
    assert (flat.nodes, flat.network, flat.inter_node_bw_gbs) == (1, "", 0.0)


def test_pairs_across_nodes_go_over_the_network():
    hw = resolve_hardware("2x2xa100-80gb")
    kinds = {(a, b): kind for a, b, kind in hw.pairs}
    assert kinds[(0, 1)] == kinds[(2, 3)] == "nvlink"
    assert kinds[(0, 2)] == kinds[(1, 3)] == "network"


@pytest.mark.parametrize(
    ("text", "gbs"),
    [("400Gb/s", 50.0), ("400Gbps", 50.0), ("400 Gbit/s", 50.0), ("25GB/s", 25.0), (12.5, 12.5)],
)
def test_inter_node_bandwidth_reads_bits_and_bytes(text, gbs):
    hw = resolve_hardware("2x8xh100-80gb", inter_node_bandwidth=text)
    assert hw.inter_node_bw_gbs == gbs


@pytest.mark.parametrize("text", ["400", "fast", "0GB/s", "-5Gb/s"])
def test_inter_node_bandwidth_needs_a_unit_and_a_positive_number(text):
    with pytest.raises(HardwareError, match="--inter-node-bandwidth"):
        resolve_hardware("2x8xh100-80gb", inter_node_bandwidth=text)


def test_every_preset_names_its_cluster_network():
    for p in GPU_PRESETS.values():
        assert p.network in ("infiniband", "ethernet")
        # between a 10 Gb/s Ethernet port and a 400 Gb/s NDR NIC per GPU
        assert 1.25 <= p.inter_node_bw_gbs <= 50.0
        assert p.inter_node_bw_gbs < p.link_bw_gbs  # the network is never faster than the box


def test_cpu_nodes_of_processes():
    hw = resolve_hardware("2x1", device="cpu", gpu_memory="256MiB")
    assert (hw.nodes, hw.gpus_per_node, hw.source) == (2, 1, "cpu")
    held = resolve_hardware("2x2xrtx3090", device="cpu")
    assert (held.nodes, held.n_gpus) == (2, 4)


@pytest.mark.parametrize(
    ("env", "world"),
    [
        ({}, World()),
        # torchrun --nnodes=4 --nproc-per-node=1: one planner per node
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "2"}, World(4, 2, "torchrun")),
        # srun --nodes=3 --ntasks-per-node=1
        ({"SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "1"}, World(3, 1, "slurm")),
        # a batch script's own shell is one node, however many the job holds
        ({"SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "0"}, World()),
        ({"AUTOFIT_NODES": "2", "AUTOFIT_NODE_RANK": "1", "SLURM_STEP_NUM_NODES": "8"},
         World(2, 1, "autofit")),
    ],
)  # fmt: skip
def test_the_world_of_a_launch(env, world):
    assert launch_world(env) == world


def test_a_node_rank_outside_the_world_is_refused():
    with pytest.raises(HardwareError, match="AUTOFIT_NODE_RANK"):
        launch_world({"SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "5"})


@pytest.mark.parametrize("text", ["0x8xh100-80gb", "2x0xh100-80gb"])
def test_zero_nodes_or_gpus_are_refused(text):
    with pytest.raises(HardwareError, match="at least 1"):
        resolve_hardware(text)


def test_too_many_gpus_across_nodes_are_refused():
    with pytest.raises(HardwareError, match="at most"):
        resolve_hardware("1024x8xh100-80gb")
