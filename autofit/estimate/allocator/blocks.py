"""The caching allocator's data: its constants (c10/core/AllocatorConfig.h), segments, blocks
(a segment's blocks are a doubly linked list, as `Block::prev`/`next`), the two pools' sorted
free lists, and the statistics a replay reports (`Replay`)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

MiB = 1024**2

# c10/core/AllocatorConfig.h (earlier: the top of c10/cuda/CUDACachingAllocator.cpp)
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = MiB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: allocations between 1 and 10 MiB use kLargeBuffer
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: round up large allocations to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer, the default `large_segment_size_mb`

UNLIMITED = 2**64 - 1  # max_split_size's default: std::numeric_limits<size_t>::max()
ADDRESS_SPACE = 2**50  # an expandable segment's virtual range when no capacity is given


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


class Segment:
    """One cudaMalloc'd range, or one expandable segment's virtual range."""

    __slots__ = ("base", "size", "page", "expandable", "small")

    def __init__(self, base: int, size: int, page: int, expandable: bool, small: bool) -> None:
        self.base = base
        self.size = size
        self.page = page  # expandable segments: the mapping granularity
        self.expandable = expandable
        self.small = small


class Block:
    """A `Block` of CUDACachingAllocator.cpp: a piece of a segment, allocated, free (cached) or,
    in an expandable segment, unmapped. `prev`/`next` link the blocks of one segment."""

    __slots__ = ("addr", "size", "requested", "allocated", "mapped", "prev", "next", "seg")

    def __init__(self, addr: int, size: int, seg: Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.seg = seg


class Pool:
    """A `BlockPool`: the cached free blocks sorted by (size, address) (`BlockComparatorSize`)
    and, for expandable segments, the unmapped blocks sorted by address
    (`BlockComparatorAddress`)."""

    __slots__ = ("small", "page", "free", "unmapped")

    def __init__(self, small: bool, page: int) -> None:
        self.small = small
        self.page = page
        self.free: list[tuple[int, int, Block]] = []
        self.unmapped: list[tuple[int, Block]] = []


def link_before(new: Block, block: Block) -> None:
    """Put `new` just before `block` in its segment's list of blocks."""
    new.prev = block.prev
    if new.prev is not None:
        new.prev.next = new
    new.next = block
    block.prev = new


def link_after(new: Block, block: Block) -> None:
    """Put `new` just after `block` in its segment's list of blocks: before the block that
    follows it, or last."""
    if block.next is not None:
        link_before(new, block.next)
    else:
        new.prev, new.next, block.next = block, None, new


def unfree(pool: Pool, block: Block) -> None:
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
