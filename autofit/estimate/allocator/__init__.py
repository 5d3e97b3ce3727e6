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

from collections.abc import Iterable, Mapping
from typing import Any

from autofit.estimate.allocator.blocks import K_LARGE_BUFFER, AllocatorOutOfMemory, Replay
from autofit.estimate.allocator.caching import CachingAllocator

__all__ = ["AllocatorOutOfMemory", "CachingAllocator", "Replay", "events_from_snapshot", "replay"]


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
