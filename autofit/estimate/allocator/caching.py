"""The allocator's policy on one device and stream (`CachingAllocator`): rounding, pool choice,
best fit, splitting, merging, new segments, the OOM path; expandable segments are
`autofit.estimate.allocator.expandable`'s."""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import fields

from autofit.estimate.allocator.blocks import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    UNLIMITED,
    AllocatorOutOfMemory,
    Block,
    Pool,
    Replay,
    Segment,
    link_before,
    unfree,
)  # fmt: skip
from autofit.estimate.allocator.expandable import ExpandableSegments

# What a `Replay` reports of the allocator: each of its fields but the OOM event is the counter
# of the same name here.
_COUNTED = tuple(f.name for f in fields(Replay) if f.name != "oom_event")


class CachingAllocator(ExpandableSegments):
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
        self._max_split = UNLIMITED if max_split_size is None else max_split_size
        self._max_non_split_rounding = max_non_split_rounding_size
        self._large_segment = large_segment_size
        # Expandable segments map 2 MiB pages in the small pool, `large_segment_size` (20 MiB)
        # pages in the large one (find_expandable_block: `pool->is_small ? kSmallBuffer :
        # kLargeBuffer`)
        self._small = Pool(small=True, page=K_SMALL_BUFFER)
        self._large = Pool(small=False, page=large_segment_size)
        self._live: dict[int, Block] = {}
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
                if self._max_split != UNLIMITED and self._release_available_cached_blocks(
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
            head = Block(block.addr, size, block.seg)
            link_before(head, block)
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
            unfree(pool, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            unfree(pool, nxt)
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
        return Replay(oom_event=oom_event, **{k: getattr(self, k) for k in _COUNTED})

    # -- finding a cached block ----------------------------------------------------------------

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
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

    def _alloc_block(self, pool: Pool, size: int) -> Block | None:
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
        seg = Segment(self._take_addresses(alloc_size), alloc_size, 0, False, pool.small)
        self._grow_reserved(alloc_size)
        return Block(seg.base, alloc_size, seg)

    def _take_addresses(self, nbytes: int) -> int:
        base = self._next_addr
        self._next_addr = base + -(-nbytes // K_LARGE_BUFFER) * K_LARGE_BUFFER
        return base

    def _grow_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self.segments += 1  # stats.num_device_alloc++

    def _try_merge(self, pool: Pool, dst: Block, src: Block | None) -> None:
        """try_merge_blocks: absorb the neighbour `src` into `dst` (not in any list) if it is
        free and in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            unfree(pool, src)
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

    def _release_block(self, pool: Pool, block: Block) -> None:
        """release_block: cudaFree a whole free segment."""
        unfree(pool, block)
        self.reserved -= block.size

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
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

    # -- for tests -----------------------------------------------------------------------------

    def _check(self) -> None:
        """Assert the model's invariants (tests): each segment's blocks tile it, free mapped
        neighbours are coalesced, the lists hold exactly the free/unmapped blocks, the counters
        match the blocks."""
        blocks: dict[int, Block] = {id(b): b for b in self._live.values()}
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
            b: Block | None = head
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
