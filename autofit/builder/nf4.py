"""NF4 base weights (torchao `NF4Tensor`) that FSDP2 shards over any number of ranks.

FSDP2 shards a parameter with `torch.chunk(param, world, dim=0)`: every rank but the last non-empty
one gets `ceil(rows / world)` rows, and the short ranks are padded to that size
(`_fsdp_param.py` `_init_sharded_param`: `_chunk_with_empty`, `new_zeros`, `narrow`, `copy_`).
A tensor subclass with the all-gather extension must itself all-gather inputs of the padded size
and unpad after the gather. torchao's NF4Tensor (0.18) only handles the even case: its
`aten.split` assumes `rows % split_size == 0`, it has no `aten.new_empty`, its `new_zeros` and
`aten.slice` only take whole fractions of the tensor, and `fsdp_pre_all_gather` /
`fsdp_post_all_gather` gather the local shard as is and call the result `local rows x world`.

An NF4Tensor is three flat arrays over the row-major elements: 4-bit codes (2 per byte), one int8
scale per `block_size` elements, one quantization factor per `block_size * scaler_block_size`
elements. A run of rows is itself an NF4Tensor (views of the three arrays) when it starts and ends
on a `block_size * scaler_block_size` boundary. So:

* `nf4_block_sizes` picks the block and scaler block so that every FSDP2 chunk boundary is such a
  boundary, for every shard count that divides the world size (QLoRA's 64 x 256 when the shape
  allows, smaller blocks only where a chunk would split a block);
* `ShardableNF4Tensor`, the subclass `to_shardable_nf4` creates, handles dim-0 `split`, `slice`,
  `new_zeros` and `new_empty` for any aligned row range, and overrides the two FSDP2 extension
  methods with versions that pad each inner array to the padded chunk and gather exactly the
  unsharded tensor. With an even split (rows divisible by the world size) they return what
  torchao's own do. Every other op is torchao's, its result re-wrapped in the subclass.

Only autofit's own weights are of the subclass: torchao's `NF4Tensor`, its op table and its
`CHUNK_SIZE` are left as they are, so a user's NF4Tensor in the same process (`autofit.apply`)
behaves as torchao wrote it.

torchao keeps `n_blocks` of the unsharded tensor on every shard (its `split`, `new_zeros` and
`fsdp_post_all_gather` copy it unchanged, and `copy_` requires it equal), so a shard knows the
unsharded row count and every rank computes the same padded size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor as _nf4
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

from autofit.recipe import NF4_BLOCK, NF4_QUANTIZE_CHUNK, NF4_SCALER_BLOCK

aten = torch.ops.aten


# The inner arrays FSDP2 all-gathers, in the order of torchao's `fsdp_pre_all_gather`.
_GATHERED = ("quantized_scalers", "quantization_factor", "quantized_data")


def shard_rows(rows: int, shards: int) -> int:
    """Rows of FSDP2's largest (padded) dim-0 chunk: `torch.chunk` splits by `ceil(rows/shards)`."""
    return -(-rows // shards)


def nf4_block_sizes(
    shape: Sequence[int],
    shards: int = 1,
    block: int = NF4_BLOCK,
    scaler_block: int = NF4_SCALER_BLOCK,
) -> tuple[int, int]:
    """(block_size, scaler_block_size) for `to_nf4` so that FSDP2 can shard the weight.

    Every chunk boundary `i * ceil(rows / k)` rows, for each shard count `k` dividing `shards`
    (a 1-D mesh over all ranks, or a smaller shard group of HSDP), must fall on a whole
    double-quantization block. Picks the largest even block <= `block` and then the largest
    scaler block <= `scaler_block` that satisfy this: 64 x 256 for a single rank, 64 x <= 256 for
    real model shapes, smaller blocks only for odd shapes (llama-debug's 256 x 688 `down_proj` on 3
    ranks: 32 x 43; on 6 ranks: 16 x 43). Smaller blocks only add scales (more precision).
    """
    rows, row_numel = shape[0], math.prod(shape[1:])
    unit = rows * row_numel  # elements in the largest run every chunk boundary is a multiple of
    for k in range(2, shards + 1):
        if shards % k == 0:
            unit = math.gcd(unit, row_numel * math.gcd(rows, shard_rows(rows, k)))
    blocks = [b for b in range(block, 1, -1) if b % 2 == 0 and unit % b == 0]
    if not blocks:
        raise ValueError(
            f"cannot quantize a {tuple(shape)} weight to NF4 in blocks that FSDP2 can shard over "
            f"{shards} ranks: the chunks hold no common even number of elements"
        )
    scalers = unit // blocks[0]
    return blocks[0], max(s for s in range(1, scaler_block + 1) if scalers % s == 0)


def to_shardable_nf4(weight: torch.Tensor, shards: int = 1) -> ShardableNF4Tensor:
    """`to_nf4(weight)` with block sizes from `nf4_block_sizes`, as a `ShardableNF4Tensor`."""
    return ShardableNF4Tensor.from_tensor(weight, *nf4_block_sizes(weight.shape, shards))


def quantize_chunk(numel: int) -> int:
    """Weights whose nearest NF4 level is found at once, for a weight of `numel` elements.

    torchao holds ~32 B per weight of the chunk meanwhile (16 bf16 distances each): 34 MiB for its
    `CHUNK_SIZE` of 1M, more than a whole decoder layer of a small model. Chunks of at most 1/8 of
    the weight keep that transient below the layer's own size (same codes: the chunking only
    bounds memory); weights of 8M elements and more (any 7B+ projection) keep torchao's chunk.
    """
    return min(NF4_QUANTIZE_CHUNK, max(64 * 1024, numel // 8))


def _elements_per_item(block_size: int, scaler_block_size: int) -> dict[str, int]:
    """Weight elements covered by one item of each inner array."""
    return {
        "quantized_scalers": block_size,
        "quantization_factor": block_size * scaler_block_size,
        "quantized_data": 2,
    }


def _row_numel(t: NF4Tensor) -> int:
    return math.prod(t.shape[1:])


def _with(t: NF4Tensor, size: Sequence[int], inner: dict[str, torch.Tensor]) -> NF4Tensor:
    """A new NF4Tensor like `t` (same blocks, `n_blocks`, `scaler_mean`) of `size`."""
    size = torch.Size(size)
    attrs = {"size": size, "stride": make_contiguous_strides_for(size), **inner}
    return ShardableNF4Tensor(*_nf4.construct_nf4_args(t, attrs))


def _inner_lengths(t: NF4Tensor, numel: int, what: str) -> dict[str, int]:
    lengths = {}
    for name, per in _elements_per_item(t.block_size, t.scaler_block_size).items():
        if numel % per:
            raise NotImplementedError(
                f"{what}: {numel} elements are not whole NF4 blocks of {per} "
                f"(block_size={t.block_size}, scaler_block_size={t.scaler_block_size}); "
                "quantize with autofit.builder.nf4.nf4_block_sizes"
            )
        lengths[name] = numel // per
    return lengths


def _rows(t: NF4Tensor, start: int, end: int) -> NF4Tensor:
    """Rows [start, end) of `t` as an NF4Tensor whose inner arrays are views of `t`'s."""
    row = _row_numel(t)
    what = f"rows [{start}, {end}) of a {tuple(t.shape)} NF4Tensor"
    offsets = _inner_lengths(t, start * row, what)
    lengths = _inner_lengths(t, (end - start) * row, what)
    inner = {n: getattr(t, n).narrow(0, offsets[n], lengths[n]) for n in _GATHERED}
    return _with(t, (end - start, *t.shape[1:]), inner)


def _new(t: NF4Tensor, size: Sequence[int], fill: bool, device: Any = None) -> NF4Tensor:
    """A fresh NF4Tensor of `size`; `fill`: the codes of 0.0 with unit scales (reads as zeros)."""
    lengths = _inner_lengths(t, math.prod(size), f"a new {tuple(size)} NF4Tensor")
    device = device if device is not None else t.device
    inner = {}
    for name in _GATHERED:
        like = getattr(t, name)
        inner[name] = torch.empty(lengths[name], dtype=like.dtype, device=device)
    if fill:
        zero = int(t.nf4.abs().argmin())  # the NF4 code of 0.0 (7), two per byte
        inner["quantized_data"].fill_(zero << 4 | zero)
        inner["quantized_scalers"].zero_()
        inner["quantization_factor"].fill_(1)
    inner["scaler_mean"] = t.scaler_mean.clone().to(device)
    inner["nf4"] = t.nf4.clone().to(device)
    return _with(t, size, {**inner, "device": torch.device(device)})


def _dim0(t: NF4Tensor, dim: int) -> bool:
    return dim % max(t.dim(), 1) == 0


def _split(torchao: Callable[[], Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """`aten.split.Tensor` on dim 0 (what `torch.chunk` runs): the last chunk may be shorter."""
    t, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not _dim0(t, dim):
        return torchao()
    rows = t.size(0)
    return [_rows(t, a, min(a + size, rows)) for a in range(0, max(rows, 1), size)]


def _slice(torchao: Callable[[], Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """`aten.slice.Tensor` on dim 0, step 1 (what `narrow` runs): a view of whole blocks."""
    t = args[0]
    dim, start, end, step = [*args[1:], *(0, None, None, 1)[len(args) - 1 :]]
    if not _dim0(t, dim) or step != 1:
        return torchao()
    rows = t.size(0)
    start = 0 if start is None else start + rows if start < 0 else start
    end = rows if end is None else end + rows if end < 0 else end
    start = min(max(start, 0), rows)
    return _rows(t, start, min(max(end, start), rows))


def _new_zeros(torchao: Callable[[], Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """`aten.new_zeros` of any size that is whole blocks (FSDP2's padded chunk)."""
    return _new(args[0], tuple(args[1]), fill=True, device=kwargs.get("device"))


def _new_empty(torchao: Callable[[], Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """`aten.new_empty` (FSDP2's `_chunk_with_empty` makes `new_empty(0)` for ranks left empty)."""
    return _new(args[0], tuple(args[1]), fill=False, device=kwargs.get("device"))


def _fsdp_pre_all_gather(
    self: ShardableNF4Tensor, mesh: DeviceMesh
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """torchao's `fsdp_pre_all_gather`, each inner array padded to FSDP2's padded chunk.

    The one-argument signature is kept: with the five-argument one FSDP2 asserts that every
    all-gather input has the padded parameter shape, which NF4's flat arrays never have.
    """
    shards = mesh.size()
    row = _row_numel(self)
    full = self.n_blocks * self.block_size  # elements of the unsharded tensor
    rows = full // row if row and full % row == 0 else 0
    if rows < self.size(0):  # n_blocks is not the unsharded tensor's: torchao's even split
        rows = self.size(0) * shards
    padded = _inner_lengths(self, shard_rows(rows, shards) * row, "FSDP2's padded NF4 chunk")
    inputs = []
    for name in _GATHERED:
        x = getattr(self, name)
        if x.numel() < padded[name]:
            x = torch.cat([x, x.new_zeros(padded[name] - x.numel())])
        inputs.append(x)
    size = torch.Size((rows, *self.shape[1:]))
    tensor_meta = _nf4.SubclassTensorArgs(
        size,
        make_contiguous_strides_for(size),
        0,
        self.dtype,
        self.device,
        self.requires_grad,
    )
    metadata = (
        tensor_meta,
        self.block_size,
        self.n_blocks,
        self.scaler_block_size,
        self.scaler_mean,
        self.nf4,
    )
    return tuple(inputs), metadata


def _fsdp_post_all_gather(
    self: ShardableNF4Tensor,
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[ShardableNF4Tensor, tuple[torch.Tensor, ...]] | None:
    """torchao's `fsdp_post_all_gather`, the padding at the end of each gathered array dropped."""
    tensor_meta, block_size, n_blocks, scaler_block_size, scaler_mean, nf4 = metadata
    if out is not None:  # later all-gathers write into the first one's output buffers
        assert isinstance(out, NF4Tensor), f"{type(out)}"
        for name, gathered in zip(_GATHERED, all_gather_outputs, strict=True):
            assert (
                getattr(out, name).untyped_storage().data_ptr()
                == gathered.untyped_storage().data_ptr()
            ), "Expects out's data to be the all-gather output"
        return None
    numel = math.prod(tensor_meta.original_shape)
    per = _elements_per_item(block_size, scaler_block_size)
    scalers, factor, data = (
        gathered.narrow(0, 0, numel // per[name])
        for name, gathered in zip(_GATHERED, all_gather_outputs, strict=True)
    )
    unsharded = ShardableNF4Tensor(
        tensor_meta,
        block_size,
        n_blocks,
        scaler_block_size,
        scalers,
        factor,
        scaler_mean,
        data,
        nf4,
    )
    return unsharded, tuple(all_gather_outputs)


# Dim-0 ops FSDP2 runs on any row range; `fn(torchao, args, kwargs)` calls `torchao()` (torchao's
# own handler) for what it leaves to torchao (other dims, steps).
_DIM0_OPS: dict[Any, Callable[..., Any]] = {
    aten.split.Tensor: _split,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_empty,
}


def _as_shardable(out: Any) -> Any:
    """`out` with every plain `NF4Tensor` in it (torchao's handlers build those) re-wrapped."""
    if isinstance(out, (list, tuple)):
        return type(out)(_as_shardable(x) for x in out)
    if isinstance(out, NF4Tensor) and not isinstance(out, ShardableNF4Tensor):
        return ShardableNF4Tensor(*_nf4.construct_nf4_args(out))
    return out


class ShardableNF4Tensor(NF4Tensor):
    """torchao's `NF4Tensor` that FSDP2 shards over any number of ranks (see the module's text).

    A subclass rather than entries in torchao's op table and methods of its class: those would
    change every NF4Tensor of the process, a user's own included. Ops run torchao's handlers and
    wrap their results back in the subclass, so a shard, a detached copy or a gathered weight
    stays shardable.
    """

    fsdp_pre_all_gather = _fsdp_pre_all_gather
    fsdp_post_all_gather = _fsdp_post_all_gather

    @staticmethod
    def convert_to_norm_float_weight(
        input_tensor: torch.Tensor, n_blocks: int, block_size: int, nf4: torch.Tensor
    ) -> torch.Tensor:
        """torchao's, the nearest levels found in chunks of `quantize_chunk` weights.

        torchao reads its chunk from the module-wide `CHUNK_SIZE`, which no function takes as an
        argument; setting it around `to_nf4` would race with other threads quantizing.
        `from_tensor` calls this through the class, so the chunk is per call here.
        """
        numel = input_tensor.numel()
        flat = input_tensor.flatten()
        scales = _nf4.get_block_absmax(flat, block_size).unsqueeze(-1)
        scaled = (flat.view(n_blocks, block_size) / scales).flatten()
        codes = torch.empty(numel, dtype=torch.uint8, device=input_tensor.device)
        chunk = quantize_chunk(numel)
        for start in range(0, numel, chunk):
            end = min(start + chunk, numel)
            codes[start:end] = NF4Tensor.quantize_tensor_nearest(scaled[start:end], nf4)
        return codes[::2] << 4 | codes[1::2]  # two codes per byte, as torchao packs them

    @classmethod
    @torch.compiler.disable
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}

        def torchao() -> Any:
            return _as_shardable(
                super(ShardableNF4Tensor, cls).__torch_dispatch__(func, types, args, kwargs)
            )

        handler = _DIM0_OPS.get(func)
        return handler(torchao, args, kwargs) if handler else torchao()

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _as_shardable(super().__torch_function__(func, types, args, kwargs))

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], metadata: Any, outer_size: Any, outer_stride: Any
    ) -> ShardableNF4Tensor:
        return _as_shardable(
            NF4Tensor.__tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride)
        )
