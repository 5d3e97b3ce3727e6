"""A model of PyTorch's CUDA caching allocator, built from its rules (no torch import).

Replays a sequence of allocations and frees the way `c10::cuda::CUDACachingAllocator`'s
`DeviceCachingAllocator` serves them and reports what torch would report: `allocated` (the sizes
of the allocated blocks, `max_memory_allocated`), `reserved` (cudaMalloc'd segments, or the
mapped pages of expandable segments: `max_memory_reserved`) and `requested` (the raw request
sizes), with their peaks.

Sources read (pytorch/pytorch): `c10/cuda/CUDACachingAllocator.cpp` (commit 001074d25084, the
CUDA allocator itself), `c10/core/CachingDeviceAllocator.h` (the generic
`CachingDeviceAllocatorImpl` the newest releases share between backends, same rules, where
`get_round_size` / `get_allocation_size` live now), `c10/core/AllocatorConfig.h` (the constants
`kMinBlockSize` .. `kRoundLarge`, `large_segment_size_mb` which defaults to `kLargeBuffer`, 20 MiB,
`max_split_size_mb`, `max_non_split_rounding_mb`) and `docs/source/notes/cuda.rst` (memory
management). Each rule below names the function it comes from.

The rules modelled:

- `round_size`: requests are rounded up to a multiple of 512 B (`kMinBlockSize`), at least 512 B.
  (`roundup_power2_divisions` is off by default and is not modelled.)
- `get_pool`: rounded sizes <= 1 MiB (`kSmallSize`) go to the small pool, the rest to the large
  pool; the pools never lend each other blocks.
- `get_allocation_size`: a new small segment is 2 MiB (`kSmallBuffer`); a large request < 10 MiB
  (`kMinLargeAlloc`) gets a 20 MiB segment (`kLargeBuffer` / `large_segment_size`); a larger one
  is rounded up to a multiple of 2 MiB (`kRoundLarge`).
- `get_free_block`: best fit, the smallest cached free block of the pool >= the size (blocks
  ordered by (stream, size, address), newer sources (size, stream, address): with one stream the
  same); with `max_split_size` set, a request below it never takes a block >= it (oversize), and a
  request >= it takes an oversize block only if it wastes < `max_non_split_rounding_size`.
  With expandable segments, a candidate whose next block is unmapped (the growing end of the
  segment) counts as its "expandable size", and the search walks on to the next larger block
  while that one's expandable size is smaller, which keeps the end of the segment for last.
- `should_split` / `alloc_found_block`: the remainder of the chosen block is split off as a new
  free block when it is >= 512 B in the small pool (and in every pool with expandable segments),
  and only when it is > 1 MiB (`kSmallSize`) in the large pool (and the request < max_split_size);
  otherwise the whole block is handed out and counts in `allocated`.
- `free_block` / `try_merge_blocks`: a freed block coalesces with free neighbours of its segment.
- `malloc` / `alloc_block`: a new segment (cudaMalloc) only when no cached block fits; nothing
  goes back to the driver during a replay (no `empty_cache`). With a `capacity`, a cudaMalloc (or
  mapping) that would exceed it fails, and the OOM path runs: `release_available_cached_blocks`
  (only with max_split_size) then `release_cached_blocks` (cudaFree every free unsplit segment,
  unmap every whole free page of expandable segments) and one retry; if that fails too,
  `AllocatorOutOfMemory`.
- Expandable segments (`expandable_segments:True`, Note [Expandable Segments],
  `ExpandableSegment`, `find_expandable_block`, `try_allocate_expandable_block`, `map_block`,
  `unmap_block`): one segment per pool (per stream), a virtual range of 9/8 of the GPU's memory
  (`capacity` here; unlimited without one) mapped in pages of 2 MiB (`kSmallBuffer`, small pool)
  or 20 MiB (`kLargeBuffer` / `large_segment_size`, large pool). A request that fits no free block
  maps just enough pages at the lowest address with room, normally the end of the segment, taking
  in the free block before it, so the tail grows instead of a new segment being made.
  `reserved` counts the mapped bytes.
- Statistics (`alloc_found_block`, `free`, `free_block`, `alloc_block`, `map_block`):
  `allocated` += block->size at malloc, -= at free; `requested` += the raw request size;
  `reserved` += the segment size (the mapped range). `segments` counts `num_device_alloc`
  (cudaMalloc calls plus cuMemMap calls).

Not modelled: cross-stream use (`record_stream`: blocks freed while another stream still uses
them wait on events; here every block belongs to the default stream and is reusable as soon as
it is freed), CUDA graph private pools / `MemPool`s, `garbage_collection_threshold` (which only
acts under `set_per_process_memory_fraction`), `roundup_power2_divisions`, the callbacks of
`trigger_free_memory_callbacks`, and the driver's placement of cudaMalloc'd segments: the model
hands out increasing addresses, which only matters for ties between free blocks of equal size.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "K_LARGE_BUFFER", "K_MIN_BLOCK_SIZE", "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE", "K_SMALL_BUFFER",
    "K_SMALL_SIZE", "AllocatorOutOfMemory", "CachingAllocator", "Replay", "events_from_snapshot",
    "replay",
]  # fmt: skip

MiB = 1024**2

# c10/core/AllocatorConfig.h (earlier: the top of c10/cuda/CUDACachingAllocator.cpp)
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = MiB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: allocations between 1 and 10 MiB use kLargeBuffer
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: round up large allocations to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer, the default `large_segment_size_mb`

_UNLIMITED = 2**64 - 1  # max_split_size's default: std::numeric_limits<size_t>::max()
_ADDRESS_SPACE = 2**50  # an expandable segment's virtual range when no capacity is given


class AllocatorOutOfMemory(MemoryError):
    """The model ran out of `capacity`: even after releasing the cached blocks (the allocator's
    OOM path), no segment or mapping of the size the request needs fits."""

    def __init__(self, nbytes: int, reserved: int, capacity: int) -> None:
        super().__init__(
            f"out of memory: {nbytes} bytes requested with {reserved} of {capacity} bytes reserved"
        )
        self.nbytes = nbytes
        self.reserved = reserved
        self.capacity = capacity


class _Segment:
    """One cudaMalloc'd range, or one expandable segment's virtual range."""

    __slots__ = ("base", "size", "page", "expandable", "small")

    def __init__(self, base: int, size: int, page: int, expandable: bool, small: bool) -> None:
        self.base = base
        self.size = size
        self.page = page  # expandable segments: the mapping granularity
        self.expandable = expandable
        self.small = small


class _Block:
    """A `Block` of CUDACachingAllocator.cpp: a piece of a segment, allocated, free (cached) or,
    in an expandable segment, unmapped. `prev`/`next` link the blocks of one segment."""

    __slots__ = ("addr", "size", "requested", "allocated", "mapped", "prev", "next", "seg")

    def __init__(self, addr: int, size: int, seg: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg = seg


class _Pool:
    """A `BlockPool`: the cached free blocks sorted by (size, address) (`BlockComparatorSize`)
    and, for expandable segments, the unmapped blocks sorted by address
    (`BlockComparatorAddress`)."""

    __slots__ = ("small", "page", "free", "unmapped")

    def __init__(self, small: bool, page: int) -> None:
        self.small = small
        self.page = page
        self.free: list[tuple[int, int, _Block]] = []
        self.unmapped: list[tuple[int, _Block]] = []


def _link_before(new: _Block, block: _Block) -> None:
    """Put `new` just before `block` in its segment's list of blocks."""
    new.prev = block.prev
    if new.prev is not None:
        new.prev.next = new
    new.next = block
    block.prev = new


def _link_after(new: _Block, block: _Block) -> None:
    """Put `new` just after `block` in its segment's list of blocks."""
    new.next = block.next
    if new.next is not None:
        new.next.prev = new
    new.prev = block
    block.next = new


def _unfree(pool: _Pool, block: _Block) -> None:
    """Take a free block out of its pool's sorted free list (before its size/addr change)."""
    free = pool.free
    del free[bisect_left(free, (block.size, block.addr))]


@dataclass(frozen=True)
class Replay:
    """What a replay of events through `CachingAllocator` ends with."""

    peak_allocated: int
    """`torch.cuda.max_memory_allocated()`: the peak sum of allocated block sizes."""
    peak_reserved: int
    """`torch.cuda.max_memory_reserved()`: the peak of cudaMalloc'd (or mapped) bytes."""
    peak_requested: int
    """`memory_stats()["requested_bytes.all.peak"]`: the peak sum of raw request sizes."""
    segments: int
    """`num_device_alloc`: cudaMalloc calls, or expandable-segment mappings."""
    allocated: int
    """Allocated bytes after the last event (or at the OOM)."""
    reserved: int
    """Reserved bytes after the last event (or at the OOM)."""
    alloc_retries: int
    """`num_alloc_retries`: times the OOM path released cached blocks and retried."""
    oom_event: int | None
    """With a capacity: the index of the event that ran out of memory (the replay stops there);
    None if all fit."""


class CachingAllocator:
    """The allocator's state on one device, one stream (the default): `malloc` returns a handle
    (the block's modelled address, unique among live blocks), `free` takes it back.

    `allocated`, `reserved`, `requested` and `peak_allocated`, `peak_reserved`,
    `peak_requested` are plain int attributes (read them, do not set them); `segments` counts
    cudaMalloc calls (or mappings), `alloc_retries` the OOM path's retries.

    Settings, as in `PYTORCH_CUDA_ALLOC_CONF`: `expandable_segments`, `max_split_size`
    (`max_split_size_mb` in bytes; default unlimited), `max_non_split_rounding_size`
    (`max_non_split_rounding_mb` in bytes; default 20 MiB), `large_segment_size`
    (`large_segment_size_mb` in bytes; default 20 MiB, `kLargeBuffer`). `capacity`: the bytes
    the allocator may reserve (the GPU's memory less the CUDA context and anything else on it);
    None: unlimited, no OOM path.
    """

    def __init__(
        self,
        *,
        expandable_segments: bool = False,
        capacity: int | None = None,
        max_split_size: int | None = None,
        max_non_split_rounding_size: int = K_LARGE_BUFFER,
        large_segment_size: int = K_LARGE_BUFFER,
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        if large_segment_size < K_MIN_LARGE_ALLOC or large_segment_size % K_ROUND_LARGE:
            raise ValueError(
                f"large_segment_size must be a multiple of {K_ROUND_LARGE} bytes and at least "
                f"{K_MIN_LARGE_ALLOC}, not {large_segment_size}"
            )
        self.expandable_segments = expandable_segments
        self.capacity = capacity
        self._max_split = _UNLIMITED if max_split_size is None else max_split_size
        self._max_non_split_rounding = max_non_split_rounding_size
        self._large_segment = large_segment_size
        # Expandable segments map 2 MiB pages in the small pool, `large_segment_size` (20 MiB)
        # pages in the large one (find_expandable_block: `pool->is_small ? kSmallBuffer :
        # kLargeBuffer`)
        self._small = _Pool(small=True, page=K_SMALL_BUFFER)
        self._large = _Pool(small=False, page=large_segment_size)
        self._live: dict[int, _Block] = {}
        self._next_addr = 1 << 40  # where the next modelled segment starts
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.segments = 0
        self.alloc_retries = 0

    # -- public API --------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes` (> 0) as `DeviceCachingAllocator::malloc` does; returns a handle.
        Raises `AllocatorOutOfMemory` when a capacity is set and the request does not fit."""
        if nbytes <= 0:
            raise ValueError(f"malloc of {nbytes} bytes: torch allocates nothing for 0 bytes")
        # round_size: a multiple of kMinBlockSize, at least kMinBlockSize
        size = (nbytes + (K_MIN_BLOCK_SIZE - 1)) & -K_MIN_BLOCK_SIZE
        # get_pool: small pool for sizes <= kSmallSize
        pool = self._small if size <= K_SMALL_SIZE else self._large
        block = self._get_free_block(pool, size)
        if block is None:
            # malloc: alloc_block || (release_available_cached_blocks && alloc_block)
            #         || (release_cached_blocks && alloc_block(isRetry))
            block = self._alloc_block(pool, size)
            if block is None:
                if self._max_split != _UNLIMITED and self._release_available_cached_blocks(
                    pool, size
                ):
                    block = self._alloc_block(pool, size)
                if block is None:
                    self._release_cached_blocks()
                    self.alloc_retries += 1
                    block = self._alloc_block(pool, size)
                if block is None:
                    assert self.capacity is not None
                    raise AllocatorOutOfMemory(nbytes, self.reserved, self.capacity)
        # should_split
        remaining = block.size - size
        if pool.small or self.expandable_segments:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        if split:
            # alloc_found_block: the front `size` bytes become the allocated block, the rest
            # stays a free block of the pool
            head = _Block(block.addr, size, block.seg)
            _link_before(head, block)
            block.addr += size
            block.size = remaining
            insort(pool.free, (remaining, block.addr, block))
            block = head
        block.allocated = True
        block.requested = nbytes
        self._live[block.addr] = block
        # alloc_found_block: allocated_bytes += block->size, requested_bytes += orig_size
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self.requested += nbytes
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return block.addr

    def free(self, handle: int) -> None:
        """Free the block `malloc` returned as `handle` (`free` then `free_block`: it goes back
        to its pool's cache, coalesced with free neighbours; no memory goes back to CUDA)."""
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"free of handle {handle}, which is not allocated")
        block.allocated = False
        self.allocated -= block.size  # free: allocated_bytes -= block->size
        self.requested -= block.requested  # free_block: requested_bytes -= requested_size
        pool = self._small if block.seg.small else self._large
        # free_block: try_merge_blocks with prev and next (free and mapped alike)
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            _unfree(pool, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            _unfree(pool, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        insort(pool.free, (block.size, block.addr, block))

    def reset_peak_stats(self) -> None:
        """`torch.cuda.reset_peak_memory_stats()`: peaks restart from the current values."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_requested = self.requested

    def result(self, oom_event: int | None = None) -> Replay:
        """The statistics so far as a `Replay`."""
        return Replay(
            peak_allocated=self.peak_allocated,
            peak_reserved=self.peak_reserved,
            peak_requested=self.peak_requested,
            segments=self.segments,
            allocated=self.allocated,
            reserved=self.reserved,
            alloc_retries=self.alloc_retries,
            oom_event=oom_event,
        )

    # -- finding a cached block ----------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block: the smallest free block >= size (lower_bound on (size, address))."""
        free = pool.free
        i = bisect_left(free, (size,))
        n = len(free)
        if i == n:
            return None
        block = free[i][2]
        if self.expandable_segments:
            # "for the purposes of best fit we consider its size to be the size it can expand
            # to": walk on while the next block's expandable size is smaller
            nxt = block.next
            grow = block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
            while i + 1 < n:
                other = free[i + 1][2]
                onxt = other.next
                ogrow = other.size + (onxt.size if onxt is not None and not onxt.mapped else 0)
                if ogrow >= grow:
                    break
                i += 1
                block = other
                grow = ogrow
        max_split = self._max_split
        # "Do not return an oversized block for a large request"
        if size < max_split and block.size >= max_split:
            return None
        # "Allow oversized block size to be rounded up but within a limit"
        if size >= max_split and block.size >= size + self._max_non_split_rounding:
            return None
        del free[i]
        return block

    # -- new memory ----------------------------------------------------------------------------

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """alloc_block: a new segment of get_allocation_size(size) (cudaMalloc), or with
        expandable segments try_allocate_expandable_block. None when capacity is exceeded."""
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        # get_allocation_size
        if size <= K_SMALL_SIZE:
            alloc_size = K_SMALL_BUFFER
        elif size < K_MIN_LARGE_ALLOC:
            alloc_size = self._large_segment
        else:
            alloc_size = -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None  # cudaMalloc fails with cudaErrorMemoryAllocation
        seg = _Segment(self._take_addresses(alloc_size), alloc_size, 0, False, pool.small)
        self._grow_reserved(alloc_size)
        return _Block(seg.base, alloc_size, seg)

    def _take_addresses(self, nbytes: int) -> int:
        base = self._next_addr
        self._next_addr = base + -(-nbytes // K_LARGE_BUFFER) * K_LARGE_BUFFER
        return base

    def _grow_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self.segments += 1  # stats.num_device_alloc++

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block: map pages at the lowest address with room."""
        candidate = self._find_expandable_block(pool, size)
        # candidate: unmapped -> null | unmapped -> free -> * | free -> unmapped -> *
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # free -> unmapped -> *: map_block maps some of the unmapped block and merges it
            # with the free one before it
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped and not nxt.allocated
            if not self._map_block(pool, nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        _unfree(pool, candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """find_expandable_block: the lowest-addressed unmapped block (or the free block right
        before it) from which free and unmapped blocks add up to `size`; else a new segment."""
        for _, unmapped in pool.unmapped:
            candidate = unmapped
            prev = unmapped.prev
            if prev is not None and not prev.allocated:
                candidate = prev
            room = 0
            b: _Block | None = candidate
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return candidate
        # a new ExpandableSegment: address space for 9/8 of the GPU's memory, in pages
        page = pool.page
        total = _ADDRESS_SPACE if self.capacity is None else self.capacity + self.capacity // 8
        va = -(-total // page) * page
        seg = _Segment(self._take_addresses(va), va, page, True, pool.small)
        block = _Block(seg.base, va, seg, mapped=False)
        insort(pool.unmapped, (block.addr, block))
        return block

    def _map_block(self, pool: _Pool, to_map: _Block, size: int) -> bool:
        """map_block: map the pages covering [to_map.addr, +size) (ExpandableSegment::map), split
        off what stays unmapped, merge with free neighbours, cache the result as a free block."""
        seg = to_map.seg
        page = seg.page
        offset = to_map.addr - seg.base
        begin = offset // page  # segmentLeft (unmapped blocks start on a page)
        end = -(-(offset + size) // page)  # segmentRight
        mapped = (end - begin) * page
        if mapped == 0 or (self.capacity is not None and self.reserved + mapped > self.capacity):
            return False  # cuMemCreate fails: the pages created so far are released
        unmapped = pool.unmapped
        del unmapped[bisect_left(unmapped, (to_map.addr,))]
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, seg, mapped=False)
            _link_after(rest, to_map)
            insort(unmapped, (rest.addr, rest))
            to_map.size = mapped
        self._try_merge(pool, to_map, to_map.prev)
        self._try_merge(pool, to_map, to_map.next)
        insort(pool.free, (to_map.size, to_map.addr, to_map))
        self._grow_reserved(mapped)  # reserved_bytes += mapped_range.size
        return True

    def _try_merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks: absorb the neighbour `src` into `dst` (not in any list) if it is
        free and in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            _unfree(pool, src)
        else:
            del pool.unmapped[bisect_left(pool.unmapped, (src.addr,))]
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- the OOM path ------------------------------------------------------------------------

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """release_block: cudaFree a whole free segment."""
        _unfree(pool, block)
        self.reserved -= block.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: with max_split_size set, cudaFree the smallest free
        oversize segment >= the request, or the largest ones until they add up to it. (The
        model releases only unsplit blocks, i.e. whole segments.)"""
        max_split = self._max_split
        key = max(size, max_split)
        free = pool.free
        i = bisect_left(free, (key,))
        if i == len(free) or free[i][2].seg.expandable:
            released = 0
            j = i - 1
            while released < key and j >= 0 and free[j][0] >= max_split:
                block = free[j][2]
                if not block.seg.expandable and block.prev is None and block.next is None:
                    self._release_block(pool, block)
                    released += block.size
                j -= 1
            return released >= key
        block = free[i][2]
        if block.prev is not None or block.next is not None:
            return False
        self._release_block(pool, block)
        return True

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks -> release_blocks(large), release_blocks(small): cudaFree every
        free unsplit segment; unmap the whole free pages of expandable segments."""
        for pool in (self._large, self._small):
            to_unmap = []
            for _, _, block in list(pool.free):
                if block.seg.expandable:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)
            for block in to_unmap:
                self._unmap_block(pool, block)
                if block.prev is None and block.next is None:
                    # release_expandable_segment: the whole range is unmapped again
                    del pool.unmapped[bisect_left(pool.unmapped, (block.addr,))]

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """unmap_block: unmap the pages lying wholly inside a free block (the parts before and
        after stay mapped free blocks) and merge the unmapped range with unmapped neighbours."""
        seg = block.seg
        page = seg.page
        offset = block.addr - seg.base
        begin = -(-offset // page)  # segmentRight(ptr)
        end = (offset + block.size) // page  # segmentLeft(ptr + size)
        if begin >= end:
            return
        _unfree(pool, block)
        start = seg.base + begin * page
        length = (end - begin) * page
        before = start - block.addr
        if before > 0:
            head = _Block(block.addr, before, seg)
            _link_before(head, block)
            insort(pool.free, (head.size, head.addr, head))
        after = block.size - before - length
        if after > 0:
            tail = _Block(start + length, after, seg)
            _link_after(tail, block)
            insort(pool.free, (tail.size, tail.addr, tail))
        block.addr = start
        block.size = length
        block.mapped = False
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        insort(pool.unmapped, (block.addr, block))
        self.reserved -= length

    # -- for tests -----------------------------------------------------------------------------

    def _check(self) -> None:
        """Assert the model's invariants (tests): each segment's blocks tile it, free mapped
        neighbours are coalesced, the lists hold exactly the free/unmapped blocks, the counters
        match the blocks."""
        blocks: dict[int, _Block] = {id(b): b for b in self._live.values()}
        for pool in (self._small, self._large):
            assert pool.free == sorted(pool.free, key=lambda t: (t[0], t[1]))
            assert pool.unmapped == sorted(pool.unmapped, key=lambda t: t[0])
            for size, addr, b in pool.free:
                assert (size, addr) == (b.size, b.addr) and b.mapped and not b.allocated
                assert b.seg.small == pool.small
                blocks[id(b)] = b
            for addr, b in pool.unmapped:
                assert addr == b.addr and not b.mapped and not b.allocated
                blocks[id(b)] = b
        heads = [b for b in blocks.values() if b.prev is None]
        allocated = reserved = requested = 0
        for head in heads:
            seg = head.seg
            assert head.addr == seg.base
            b: _Block | None = head
            end = seg.base
            while b is not None:
                assert b.seg is seg and b.addr == end and b.size > 0
                assert id(b) in blocks, "a block of a segment is in no list"
                if b.next is not None:
                    assert b.next.prev is b
                    both_free = not b.allocated and not b.next.allocated
                    assert not (both_free and b.mapped == b.next.mapped), "not coalesced"
                if b.allocated:
                    allocated += b.size
                    requested += b.requested
                if b.mapped:
                    reserved += b.size
                end += b.size
                b = b.next
            assert end == seg.base + seg.size
        assert (allocated, reserved, requested) == (self.allocated, self.reserved, self.requested)


def replay(
    events: Iterable[tuple[Any, int]],
    *,
    expandable_segments: bool = False,
    capacity: int | None = None,
    max_split_size: int | None = None,
    large_segment_size: int = K_LARGE_BUFFER,
) -> Replay:
    """Replay `events` through a fresh `CachingAllocator` and return its statistics.

    events: (key, nbytes) with nbytes > 0 allocating a block under `key` (any hashable, not
    allocated already), nbytes == 0 freeing the block allocated under `key`. With a `capacity`
    the replay stops at the first allocation that does not fit (`Replay.oom_event`).
    """
    allocator = CachingAllocator(
        expandable_segments=expandable_segments,
        capacity=capacity,
        max_split_size=max_split_size,
        large_segment_size=large_segment_size,
    )
    malloc = allocator.malloc
    free = allocator.free
    handles: dict[Any, int] = {}
    for index, (key, nbytes) in enumerate(events):
        if nbytes > 0:
            if key in handles:
                raise ValueError(f"event {index}: key {key!r} is allocated already")
            try:
                handles[key] = malloc(nbytes)
            except AllocatorOutOfMemory:
                return allocator.result(oom_event=index)
        elif nbytes == 0:
            handle = handles.pop(key, None)
            if handle is None:
                raise ValueError(f"event {index}: free of key {key!r}, which is not allocated")
            free(handle)
        else:
            raise ValueError(f"event {index}: negative size {nbytes}")
    return allocator.result()


def events_from_snapshot(
    snapshot: Mapping[str, Any], *, device: int | None = None
) -> list[tuple[int, int]]:
    """The (key, nbytes) events of a `torch.cuda.memory._snapshot()` recorded with
    `torch.cuda.memory._record_memory_history()`, for `replay`.

    Reads `snapshot["device_traces"][device]` (`device` None: the one device with a trace). An
    `alloc` entry becomes (key, size) with a new key: its `size` is the raw requested size
    (`record_trace(ALLOC, ptr, orig_size)` in alloc_found_block), which is what the model rounds.
    A `free_completed` entry (the block is back in the cache, `free_block`) becomes (key, 0); a
    trace recorded with `skip_actions=["free_completed"]` uses `free_requested` instead. Frees of
    blocks allocated before the trace began (or lost from a full ring buffer) are dropped, as are
    entries of private pools (CUDA graphs, `MemPool`: `pool_id` other than (0, 0)); segment and
    snapshot entries carry no request. Record on a fresh allocator (nothing allocated or cached)
    for a replay to see all the memory; streams are not told apart.
    """
    traces = snapshot.get("device_traces", [])
    if device is None:
        used = [i for i, trace in enumerate(traces) if trace]
        if len(used) > 1:
            raise ValueError(f"the snapshot has traces of devices {used}: pass device=")
        if not used:
            return []
        device = used[0]
    trace = traces[device]
    actions = {entry.get("action") for entry in trace}
    free_action = "free_completed" if "free_completed" in actions else "free_requested"
    events: list[tuple[int, int]] = []
    live: dict[int, int] = {}
    for entry in trace:
        action = entry.get("action")
        pool_id = entry.get("pool_id")
        if pool_id and any(pool_id):
            continue
        if action == "alloc":
            size = int(entry["size"])
            if size <= 0:
                continue
            key = len(events)
            live[entry["addr"]] = key
            events.append((key, size))
        elif action == free_action:
            key = live.pop(entry["addr"], None)
            if key is not None:
                events.append((key, 0))
    return events
