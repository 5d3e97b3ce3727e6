"""NF4 base weights under FSDP2 on a world size that does not divide their rows (3 CPU ranks)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from autofit.builder.nf4 import nf4_block_sizes, shard_rows, to_shardable_nf4
from autofit.config import Config
from autofit.trials import run_trial

pytestmark = pytest.mark.slow

RANKS = 3
# llama-debug's projections (q/o, k/v, gate/up, down) and one with fewer rows than ranks.
SHAPES = [(256, 256), (128, 256), (688, 256), (256, 688), (2, 128)]


def weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def inputs(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(4, shape[1], generator=gen).to(torch.bfloat16)


def chunk_rows(rows: int) -> list[int]:
    """Rows of each rank's FSDP2 shard: `torch.chunk` on dim 0, empty shards for the rest."""
    sizes = [len(c) for c in torch.arange(rows).chunk(RANKS)]
    return sizes + [0] * (RANKS - len(sizes))


class Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.projs = nn.ModuleList(nn.Linear(c, r, bias=False) for r, c in SHAPES)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [proj(x) for proj, x in zip(self.projs, xs, strict=True)]


def _shard_and_gather(rank: int, store: str, out: str) -> None:
    """One rank: quantize as a trial does, `fully_shard`, run forward twice, save what it saw."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    timeout = timedelta(seconds=120)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS, timeout=timeout
    )
    model = Projections()
    for i, proj in enumerate(model.projs):
        nf4 = to_shardable_nf4(weight(SHAPES[i], i), dist.get_world_size())
        proj.weight = nn.Parameter(nf4, requires_grad=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (RANKS,)))
    shards = [p.weight.to_local() for p in model.projs]
    local = [(tuple(s.shape), s.quantized_data.numel()) for s in shards]
    xs = [inputs(shape, i) for i, shape in enumerate(SHAPES)]
    outputs = [model(xs), model(xs)]  # the 2nd all-gather reuses the 1st one's buffers
    model.unshard()
    gathered = [p.weight.get_original_weight().clone() for p in model.projs]
    model.reshard()
    torch.save({"local": local, "outputs": outputs, "gathered": gathered}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_block_sizes_put_every_fsdp2_chunk_boundary_on_a_whole_block() -> None:
    assert nf4_block_sizes((4096, 4096)) == (64, 256)  # QLoRA's defaults on one rank
    assert nf4_block_sizes((4096, 14336), 3)[0] == 64  # real shapes keep 64-weight blocks
    for shards in range(1, 9):
        for rows, cols in [*SHAPES, (4096, 14336), (14336, 4096), (1024, 4096)]:
            block, scaler_block = nf4_block_sizes((rows, cols), shards)
            unit = block * scaler_block
            assert block % 2 == 0 and (rows * cols) % unit == 0
            for k in (k for k in range(1, shards + 1) if shards % k == 0):
                assert (shard_rows(rows, k) * cols) % unit == 0, (rows, cols, shards, k)


def test_uneven_chunks_are_nf4_views_that_dequantize_to_the_rows() -> None:
    w = weight((256, 688), 0)
    nf4 = to_shardable_nf4(w, RANKS)
    full = nf4.get_original_weight()
    chunks = torch.chunk(nf4, RANKS, dim=0)  # aten.split.Tensor, as FSDP2 shards
    assert [c.shape[0] for c in chunks] == [86, 86, 84]
    assert torch.equal(torch.cat([c.get_original_weight() for c in chunks]), full)
    padded = chunks[-1].new_zeros((86, 688))
    assert torch.equal(padded.get_original_weight(), torch.zeros(86, 688, dtype=torch.bfloat16))
    padded.narrow(0, 0, 84).copy_(chunks[-1])  # FSDP2's padding of the short rank
    assert torch.equal(padded.narrow(0, 0, 84).get_original_weight(), full[172:])
    assert chunks[0].new_empty(0).numel() == 0


def test_sharded_nf4_gathers_to_the_single_process_weights_on_3_ranks(tmp_path: Path) -> None:
    out = str(tmp_path / "rank")
    mp.start_processes(
        _shard_and_gather, args=(str(tmp_path / "store"), out), nprocs=RANKS, start_method="spawn"
    )
    # The reference: the same quantization in this single process, no process group.
    refs = [
        to_shardable_nf4(weight(s, i), RANKS).get_original_weight() for i, s in enumerate(SHAPES)
    ]
    for rank in range(RANKS):
        seen = torch.load(f"{out}.{rank}", weights_only=False)
        for i, (rows, cols) in enumerate(SHAPES):
            local_rows = chunk_rows(rows)[rank]
            assert seen["local"][i] == (
                (local_rows, cols),
                local_rows * cols // 2,
            )  # really sharded
            assert torch.equal(seen["gathered"][i], refs[i])
            expected = inputs(SHAPES[i], i) @ refs[i].t()
            for outputs in seen["outputs"]:
                assert torch.equal(outputs[i], expected)


def test_nf4_lora_trial_trains_on_3_ranks() -> None:
    config = Config(seq_len=64, micro_batch=2, lora_rank=8, quant="nf4")
    result = run_trial("llama-debug", config, nprocs=RANKS, device="cpu", steps=2, timeout_s=300)
    assert result.status == "ok", result.message
    assert result.nprocs == RANKS
    assert len(result.losses) == 3  # 1 warm-up + 2 measured steps
    assert result.losses[-1] < result.losses[0]
