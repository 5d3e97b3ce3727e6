"""The estimate past one node (`--gpus NxKxNAME`), held to hand calculations and outside figures:
HSDP (`shard: node`) shards the states over a node's K GPUs, not over all N x K; a node's host
holds its own GPUs' offload; collectives are priced on the link their group spans."""

from __future__ import annotations

import dataclasses

import pytest

from autofit.config import Config
from autofit.estimate import LINK_KEYS, estimate
from autofit.estimate.comm import LINK_EFFICIENCY
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model

# meta-llama/Llama-2-70b-hf: 68,976,648,192 parameters (the checkpoint's count; the preset is
# built from its config.json)
LLAMA2_70B_PARAMS = 68_976_648_192
FULL = Config(micro_batch=1, seq_len=2048, checkpointing="full")  # bf16-mixed AdamW: fp32 states
LORA = Config(lora_rank=16, quant="nf4", micro_batch=1, seq_len=2048, checkpointing="full")


@pytest.fixture(scope="module")
def llama70b():  # type: ignore[no-untyped-def]
    return resolve_model("llama-70b")


def test_hsdp_shards_the_states_over_one_node_by_hand(llama70b) -> None:  # type: ignore[no-untyped-def]
    # 2 nodes x 8 H100, full fine-tune under bf16-mixed AdamW: fp32 master weights (4 B) and two
    # fp32 moments (8 B) per parameter. HSDP splits them over the 8 GPUs of a node, flat FSDP2
    # over all 16.
    hw = resolve_hardware("2x8xh100-80gb")
    hsdp = estimate(llama70b, hw, FULL.replace(shard="node")).breakdown
    flat = estimate(llama70b, hw, FULL).breakdown
    assert hsdp["trainable_weights"] == pytest.approx(LLAMA2_70B_PARAMS * 4 / 8, abs=1)
    assert hsdp["optimizer_state"] == pytest.approx(LLAMA2_70B_PARAMS * 8 / 8, abs=1)
    assert flat["trainable_weights"] == pytest.approx(LLAMA2_70B_PARAMS * 4 / 16, abs=1)
    assert flat["optimizer_state"] == pytest.approx(LLAMA2_70B_PARAMS * 8 / 16, abs=1)
    # the all-gathered (unsharded) parameters are the same whole units either way
    assert hsdp["gathered_params"] == flat["gathered_params"]


def test_on_one_node_shard_node_is_shard_all(llama70b) -> None:  # type: ignore[no-untyped-def]
    # `mesh_shape`: one node is one mesh whatever the knob says
    hw = resolve_hardware("8xh100-80gb")
    for cfg in (FULL, LORA, LORA.replace(offload="params", wrap="every-2")):
        a = estimate(llama70b, hw, cfg).to_dict()
        b = estimate(llama70b, hw, cfg.replace(shard="node")).to_dict()
        a.pop("config"), b.pop("config")
        assert a == b
        assert a["communication_by_link"]["inter"] == 0.0
        assert a["communication_by_link"]["network_busy"] == 0.0


def test_a_nodes_host_holds_its_own_gpus_offload(llama70b) -> None:  # type: ignore[no-untyped-def]
    # offload=optimizer puts each GPU's shard of the states on its node's host. Flat FSDP2 over
    # 2 nodes halves each GPU's shard, so each host holds half what one node of 8 holds; HSDP keeps
    # a whole replica per node, so each host holds as much as one node of 8.
    cfg = FULL.replace(offload="optimizer")
    one = estimate(llama70b, resolve_hardware("8xh100-80gb"), cfg).host_bytes
    two = resolve_hardware("2x8xh100-80gb")
    assert estimate(llama70b, two, cfg).host_bytes == pytest.approx(one / 2, rel=1e-9)
    assert estimate(llama70b, two, cfg.replace(shard="node")).host_bytes == pytest.approx(one)
    # fp32 moments (8 B) + fp32 param copy (4 B) + fp32 grads (4 B) per parameter, on one host
    assert one == pytest.approx(LLAMA2_70B_PARAMS * 16, rel=1e-9)


def test_network_time_of_the_gradient_by_hand(llama70b) -> None:  # type: ignore[no-untyped-def]
    # 4 nodes x 8 H100 on 100 Gb/s per GPU (12.5 GB/s). The gradient is reduced in fp32:
    # G = 4 B x params.
    n_nodes, k, bw = 4, 8, 12.5e9 * LINK_EFFICIENCY
    n = n_nodes * k
    hw = resolve_hardware("4x8xh100-80gb", inter_node_bandwidth="100Gb/s")
    grad = 4 * LLAMA2_70B_PARAMS
    # HSDP: reduce-scatter inside the node (NVLink), then each GPU all-reduces its G/K shard with
    # its peers of the other nodes over its own NIC: 2 (N-1)/N x G/K on the network. Nothing else
    # crosses it (the all-gathers stay inside the node).
    hsdp = estimate(llama70b, hw, FULL.replace(shard="node")).communication_by_link
    by_hand = 2 * (n_nodes - 1) / n_nodes * grad / k / bw
    assert hsdp["network_busy"] == pytest.approx(by_hand, rel=0.01)  # + per-call latency
    # Flat FSDP2: one ring reduce-scatter over all 32 GPUs, (n-1)/n x G per GPU. NCCL's
    # rail-optimised rings cross each node boundary once per channel, one channel per NIC, so a
    # node's 8 NICs carry it side by side: (n-1)/n x G / (8 x 12.5 GB/s). The all-gathers repeat
    # every micro-step, so two micro-steps less one leave the reduce-scatter alone.
    one = estimate(llama70b, hw, FULL).communication_by_link["network_busy"]
    two = estimate(llama70b, hw, FULL.replace(grad_accum=2)).communication_by_link["network_busy"]
    flat_reduce = 2 * one - two
    assert flat_reduce == pytest.approx((n - 1) / n * grad / (k * bw), rel=0.01)
    # So HSDP puts 2 (N-1)/N / ((n-1)/n) = 1.55x flat FSDP's gradient bytes on each NIC (an
    # all-reduce of a shard against a reduce-scatter of the whole over 8 NICs) but none of its
    # all-gathers, which flat FSDP2 repeats every micro-step.
    assert hsdp["network_busy"] / flat_reduce == pytest.approx(
        2 * (n_nodes - 1) / n_nodes / ((n - 1) / n), rel=0.02
    )
    assert hsdp["network_busy"] < one


def test_a_faster_network_speeds_flat_fsdp_more_than_hsdp(llama70b) -> None:  # type: ignore[no-untyped-def]
    # From 10 to 100 Gb/s per GPU: flat FSDP2's all-gathers of the NF4 base and its gradient
    # reduction cross the network every step; HSDP's only all-reduce of the LoRA gradients does.
    def step(bandwidth: str, shard: str) -> float:
        hw = resolve_hardware("4x8xh100-80gb", inter_node_bandwidth=bandwidth)
        return estimate(llama70b, hw, LORA.replace(shard=shard)).step_time_s

    flat_gain = step("10Gb/s", "all") - step("100Gb/s", "all")
    hsdp_gain = step("10Gb/s", "node") - step("100Gb/s", "node")
    assert flat_gain > 10 * hsdp_gain > 0
    # and at 10 Gb/s HSDP is the faster one
    assert step("10Gb/s", "node") < step("10Gb/s", "all")


def test_communication_by_link_sums_to_communication(llama70b) -> None:  # type: ignore[no-untyped-def]
    hw = resolve_hardware("4x8xh100-80gb", inter_node_bandwidth="10Gb/s")
    for cfg in (FULL, FULL.replace(shard="node"), LORA, FULL.replace(wrap="none")):
        e = estimate(llama70b, hw, cfg)
        links = e.communication_by_link
        assert set(links) == set(LINK_KEYS)
        assert links["intra"] + links["inter"] == pytest.approx(e.time_breakdown["communication"])
        assert min(links.values()) >= 0
        # the network is one resource: the step lasts at least as long as it is busy
        assert e.step_time_s >= links["network_busy"] * (1 - 1e-9)


# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, 1D FSDP,
# local batch 2, seq 8192, selective AC, tokens/s per GPU on 8 GPUs (one host) and 128 (16 hosts
# of 8 on 400 Gb/s RDMA per GPU): 5,762 -> 5,605 eager, 6,667 -> 6,514 compiled.
TITAN_SCALING = ((False, 5_762, 5_605), (True, 6_667, 6_514))


@pytest.mark.parametrize(("compiled", "one_node", "sixteen_nodes"), TITAN_SCALING)
def test_flat_fsdp_over_sixteen_nodes_keeps_torchtitans_per_gpu_throughput(
    compiled: bool, one_node: float, sixteen_nodes: float
) -> None:
    # The published per-GPU throughput falls 2.3-2.7% from one host to sixteen: the network hides
    # behind compute. The napkin's ratio (flat FSDP2 over 16 x 8, the 400 Gb/s preset network)
    # must stay within 5 points of it; the GPU tweaks are test_speed_model's `titan_hardware`.
    model = resolve_model("llama-3-8b")
    cfg = Config(micro_batch=2, seq_len=8192, checkpointing="selective", compile=compiled)

    def per_gpu(gpus: str) -> float:
        hw = resolve_hardware(gpus)
        tweaked = tuple(
            dataclasses.replace(g, bf16_tflops=(989 + 835) / 2, mem_bw_gbs=2400.0,
                                memory_bytes=96 * 1024**3)
            for g in hw.gpus
        )  # fmt: skip
        hw = dataclasses.replace(hw, gpus=tweaked)
        return estimate(model, hw, cfg).tokens_per_s / hw.n_gpus

    napkin = per_gpu("16x8xh100-80gb") / per_gpu("8xh100-80gb")
    assert napkin == pytest.approx(sixteen_nodes / one_node, abs=0.05)
