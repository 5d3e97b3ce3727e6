"""The caching-allocator model held to sequences worked by hand from the allocator's rules
(c10/cuda/CUDACachingAllocator.cpp, c10/core/CachingDeviceAllocator.h; the rule each step uses is
named in the comments).

Speed: `.venv/bin/python bench/allocator_speed.py` replays 100,000 events in 0.1-0.2 s on one
core of the development machine (0.5-1e6 events/s, with or without expandable segments).
"""

from __future__ import annotations

import contextlib
import random

import pytest

from autofit.estimate.allocator import (
    AllocatorOutOfMemory,
    CachingAllocator,
    events_from_snapshot,
    replay,
)

KiB = 1024
MiB = 1024**2


def _alloc(expandable: bool = False, **kwargs: int) -> CachingAllocator:
    return CachingAllocator(expandable_segments=expandable, **kwargs)


def test_requests_round_up_to_512_bytes():
    a = _alloc()
    a.malloc(1)  # round_size: below kMinBlockSize -> 512
    assert (a.allocated, a.requested) == (512, 1)
    a.malloc(512)  # a multiple already: 512
    assert (a.allocated, a.requested) == (1024, 513)
    a.malloc(513)  # ceil(513 / 512) * 512 = 1024
    assert (a.allocated, a.requested) == (2048, 1026)
    # all three are small (<= 1 MiB): one 2 MiB small segment serves them
    assert (a.reserved, a.segments) == (2 * MiB, 1)
    a._check()


def test_small_requests_share_a_2_mib_segment_until_it_is_full():
    a = _alloc()
    # two 600 KiB requests: each rounds to 600 KiB (1200 x 512), small pool, one 2 MiB segment
    # serves both: the first splits the new segment (remainder 1448 KiB >= 512 B), the second
    # takes the 1448 KiB free block and splits it (848 KiB left)
    a.malloc(600 * KiB)
    a.malloc(600 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (2 * MiB, 1200 * KiB, 1)
    # a third fits the 848 KiB left (248 KiB remain)
    a.malloc(600 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (2 * MiB, 1800 * KiB, 1)
    # a fourth does not fit 248 KiB: a second 2 MiB segment (cudaMalloc)
    a.malloc(600 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (4 * MiB, 2400 * KiB, 2)
    a._check()


def test_one_mib_is_still_small_and_one_byte_more_is_large():
    a = _alloc()
    # 1 MiB <= kSmallSize: small pool; two fill one 2 MiB segment exactly (remainder 0, no split)
    a.malloc(MiB)
    a.malloc(MiB)
    assert (a.reserved, a.allocated, a.segments) == (2 * MiB, 2 * MiB, 1)
    # 1 MiB + 1 B rounds to 1 MiB + 512 B > kSmallSize: large pool, < 10 MiB: a 20 MiB segment
    a.malloc(MiB + 1)
    assert (a.reserved, a.allocated) == (22 * MiB, 3 * MiB + 512)
    a._check()


def test_small_free_space_never_serves_a_large_request():
    a = _alloc()
    a.malloc(600 * KiB)  # small segment of 2 MiB, 1448 KiB of it free
    # 1.2 MiB is large: the small pool's 1448 KiB block is not looked at, a 20 MiB segment is made
    a.malloc(int(1.2 * MiB))
    assert (a.reserved, a.segments) == (22 * MiB, 2)
    a._check()


def test_a_request_between_1_and_10_mib_gets_a_20_mib_segment_that_later_requests_split():
    a = _alloc()
    # 5 MiB: large pool, < kMinLargeAlloc: get_allocation_size gives kLargeBuffer = 20 MiB;
    # should_split: remainder 15 MiB > kSmallSize -> split
    a.malloc(5 * MiB)
    assert (a.reserved, a.allocated) == (20 * MiB, 5 * MiB)
    # another 5 MiB takes the 15 MiB free block and splits it: 10 MiB remain, no new segment
    a.malloc(5 * MiB)
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 10 * MiB, 1)
    # 8 MiB takes the 10 MiB block: remainder 2 MiB > 1 MiB is split off
    a.malloc(8 * MiB)
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 18 * MiB, 1)
    a._check()


def test_a_large_remainder_of_1_mib_or_less_is_not_split_off():
    a = _alloc()
    a.malloc(5 * MiB)  # 20 MiB segment, 15 MiB free
    a.malloc(5 * MiB)  # 10 MiB free
    # 9 MiB takes the 10 MiB block: remainder 1 MiB is not > kSmallSize, so the whole 10 MiB
    # block is handed out and counts in allocated (block->size): 5 + 5 + 10 = 20 MiB allocated
    # for 19 MiB requested
    a.malloc(9 * MiB)
    assert (a.reserved, a.allocated, a.requested) == (20 * MiB, 20 * MiB, 19 * MiB)
    assert (a.peak_allocated, a.peak_requested) == (20 * MiB, 19 * MiB)
    a._check()


def test_a_request_of_10_mib_or_more_gets_a_segment_rounded_to_2_mib():
    a = _alloc()
    # 10 MiB: not < kMinLargeAlloc: rounded to kRoundLarge: a 10 MiB segment, nothing left
    a.malloc(10 * MiB)
    assert (a.reserved, a.allocated) == (10 * MiB, 10 * MiB)
    # 11 MiB: a 12 MiB segment; remainder 1 MiB not split: allocated 12 MiB for 11 requested
    a.malloc(11 * MiB)
    assert (a.reserved, a.allocated, a.requested) == (22 * MiB, 22 * MiB, 21 * MiB)
    # 10.5 MiB: a 12 MiB segment; remainder 1.5 MiB > 1 MiB is split off as a free block ...
    a.malloc(10 * MiB + 512 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (34 * MiB, 32 * MiB + 512 * KiB, 3)
    # ... which a 1.5 MiB request (large pool) then takes exactly, with no new segment
    a.malloc(MiB + 512 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (34 * MiB, 34 * MiB, 3)
    a._check()


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    a = _alloc()
    # three segments of their own (>= 10 MiB each, rounded to 2 MiB, no remainder): 12, 16, 14
    h12, h16, h14 = a.malloc(12 * MiB), a.malloc(16 * MiB), a.malloc(14 * MiB)
    for h in (h12, h16, h14):
        a.free(h)
    assert (a.reserved, a.allocated) == (42 * MiB, 0)
    # 13 MiB: the free blocks are 12, 14, 16 MiB; the smallest >= 13 MiB is the 14 MiB one;
    # remainder 1 MiB: not split, so allocated is 14 MiB; no cudaMalloc
    assert a.malloc(13 * MiB) == h14
    assert (a.reserved, a.allocated, a.segments) == (42 * MiB, 14 * MiB, 3)
    a._check()


def test_freed_neighbours_coalesce_so_a_larger_request_reuses_their_space():
    a = _alloc()
    # four 4 MiB requests split one 20 MiB segment: [a 0-4][b 4-8][c 8-12][d 12-16][free 16-20]
    _, hb, hc, _ = (a.malloc(4 * MiB) for _ in range(4))
    a.free(hb)
    a.free(hc)  # c merges with the free b before it: one 8 MiB free block at 4-12
    # 8 MiB: the free blocks are 4 MiB (16-20) and 8 MiB (4-12): best fit is the merged block,
    # taken whole (remainder 0); without coalescing it would need a new 20 MiB segment
    assert a.malloc(8 * MiB) == hb
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 16 * MiB, 1)
    a._check()


def test_nothing_goes_back_to_the_driver_and_the_reserved_peak_stays():
    a = _alloc()
    handles = [a.malloc(4 * MiB) for _ in range(4)]  # one 20 MiB segment, 16 MiB allocated
    for h in handles:
        a.free(h)
    # everything freed: the whole segment is one cached 20 MiB block, still reserved
    assert (a.allocated, a.reserved, a.peak_allocated, a.peak_reserved) == (
        0, 20 * MiB, 16 * MiB, 20 * MiB
    )  # fmt: skip
    # 18 MiB (>= 10 MiB: needs 18 MiB) fits the cached 20 MiB block: split (remainder 2 MiB)
    a.malloc(18 * MiB)
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 18 * MiB, 1)
    a._check()


def test_fragmentation_costs_a_new_segment_without_expandable_segments_but_not_with_them():
    events = [(0, 20 * MiB), (1, 20 * MiB), (0, 0), (1, 0), (2, 22 * MiB)]
    # without: two 20 MiB segments (>= 10 MiB, rounded to 2 MiB); freed, they are two separate
    # 20 MiB cached blocks, neither fits 22 MiB: a third cudaMalloc of 22 MiB: 62 MiB reserved
    plain = replay(events)
    assert (plain.peak_reserved, plain.reserved, plain.segments) == (62 * MiB, 62 * MiB, 3)
    # with: the large pool's one segment maps a 20 MiB page per request (0-20, 20-40); freed,
    # the two coalesce into one 40 MiB block, which serves 22 MiB (split, 18 MiB left):
    # 40 MiB reserved, two mappings
    grown = replay(events, expandable_segments=True)
    assert (grown.peak_reserved, grown.reserved, grown.segments) == (40 * MiB, 40 * MiB, 2)
    assert plain.peak_allocated == grown.peak_allocated == 40 * MiB


def test_expandable_segments_grow_the_end_of_one_segment_in_20_mib_pages():
    a = _alloc(expandable=True)
    # 5 MiB: find_expandable_block makes the large pool's segment, map_block maps one 20 MiB
    # page; split with remainder 15 MiB
    a.malloc(5 * MiB)
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 5 * MiB, 1)
    # 30 MiB: no free block fits (15 MiB); the free 15 MiB at the end plus the unmapped range
    # after it have room: map ceil(15 / 20) = one more page and merge: 35 MiB, of which 30 go
    # out and 5 stay free. Without expandable segments: 20 + 30 = 50 MiB
    a.malloc(30 * MiB)
    assert (a.reserved, a.allocated, a.segments) == (40 * MiB, 35 * MiB, 2)
    assert replay([(0, 5 * MiB), (1, 30 * MiB)]).peak_reserved == 50 * MiB
    # 600 KiB: the small pool's own segment maps one 2 MiB page
    a.malloc(600 * KiB)
    assert (a.reserved, a.allocated, a.segments) == (42 * MiB, 35 * MiB + 600 * KiB, 3)
    a._check()


def test_with_expandable_segments_a_large_remainder_of_512_bytes_is_split_off():
    # should_split: with expandable segments any pool splits a remainder >= kMinBlockSize
    grown = replay([(0, 20 * MiB - 512)], expandable_segments=True)
    assert (grown.peak_allocated, grown.peak_reserved) == (20 * MiB - 512, 20 * MiB)
    # without: 20 MiB - 512 rounds to a 20 MiB segment, remainder 512 B is not > 1 MiB
    plain = replay([(0, 20 * MiB - 512)])
    assert (plain.peak_allocated, plain.peak_reserved) == (20 * MiB, 20 * MiB)


def test_expandable_best_fit_keeps_the_end_of_the_segment_for_last():
    a = _alloc(expandable=True)
    # one 20 MiB page: [A 0-6][B 6-12][C 12-17][free 17-20, then unmapped]
    ha = a.malloc(6 * MiB)
    a.malloc(6 * MiB)
    a.malloc(5 * MiB)
    a.free(ha)  # free: 0-6 (6 MiB, inside) and 17-20 (3 MiB, at the end)
    # 2 MiB: the smallest block >= 2 MiB is the 3 MiB end block, but its expandable size is
    # 3 MiB + the unmapped range; the next block, 6 MiB inside, expands to less: take it
    assert a.malloc(2 * MiB) == ha
    # B 6 + C 5 + this 2 (split off the 6 MiB block, 4 MiB stay free): 13 MiB in the one page
    assert (a.reserved, a.allocated) == (20 * MiB, 13 * MiB)
    a._check()


def test_peak_allocated_counts_rounded_blocks_and_peak_requested_the_raw_sizes():
    # 11 MiB -> a 12 MiB block (remainder 1 MiB not split); 100 B -> a 512 B block
    result = replay([(0, 11 * MiB), (1, 100), (0, 0), (1, 0)])
    assert result.peak_allocated == 12 * MiB + 512
    assert result.peak_requested == 11 * MiB + 100
    assert (result.allocated, result.reserved, result.peak_reserved) == (0, 14 * MiB, 14 * MiB)


def test_the_oom_path_frees_cached_segments_and_retries():
    a = _alloc(capacity=40 * MiB)
    ha = a.malloc(20 * MiB)  # a 20 MiB segment
    a.malloc(12 * MiB)  # a 12 MiB segment: 32 MiB reserved
    a.free(ha)
    # 24 MiB: no cached block fits; cudaMalloc of 24 MiB: 32 + 24 > 40 fails; release_cached_blocks
    # frees the cached unsplit 20 MiB segment (12 reserved); the retry fits: 12 + 24 = 36 MiB
    a.malloc(24 * MiB)
    assert (a.reserved, a.peak_reserved, a.alloc_retries) == (36 * MiB, 36 * MiB, 1)
    # 8 MiB needs a 20 MiB segment: 56 > 40, nothing cached to free: out of memory
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(8 * MiB)
    a._check()
    events = [(0, 20 * MiB), (1, 12 * MiB), (0, 0), (2, 24 * MiB), (3, 8 * MiB), (4, 1)]
    result = replay(events, capacity=40 * MiB)
    assert (result.oom_event, result.reserved) == (4, 36 * MiB)
    # with 58 MiB nothing is released: 20 + 12 + 24 = 56 MiB reserved, the 8 MiB request splits
    # the cached 20 MiB block, the 1 B request adds a 2 MiB small segment: 58 MiB
    roomy = replay(events, capacity=58 * MiB)
    assert (roomy.oom_event, roomy.peak_reserved, roomy.alloc_retries) == (None, 58 * MiB, 0)


def test_the_oom_path_unmaps_free_pages_of_an_expandable_segment():
    a = _alloc(expandable=True, capacity=60 * MiB)
    ha = a.malloc(20 * MiB)  # page 0-20
    a.malloc(20 * MiB)  # page 20-40: 40 MiB mapped
    a.free(ha)  # 0-20 free, inside (the block after it is allocated)
    # 30 MiB: the 20 MiB free block cannot grow (an allocated block follows); the end can: map
    # two pages (40 MiB): 40 + 40 > 60 fails. release_cached_blocks unmaps the free page 0-20
    # (20 MiB mapped); the retry maps the two pages at the end: 20 + 40 = 60 MiB
    a.malloc(30 * MiB)
    assert (a.reserved, a.peak_reserved, a.alloc_retries) == (60 * MiB, 60 * MiB, 1)
    a._check()
    # with 40 MiB of capacity even after the unmap 20 + 40 > 40: out of memory
    b = _alloc(expandable=True, capacity=40 * MiB)
    hb = b.malloc(20 * MiB)
    b.malloc(20 * MiB)
    b.free(hb)
    with pytest.raises(AllocatorOutOfMemory):
        b.malloc(30 * MiB)
    b._check()


def test_max_split_size_keeps_oversize_blocks_whole():
    a = _alloc(max_split_size=32 * MiB)
    h = a.malloc(40 * MiB)  # >= max_split_size: an oversize 40 MiB segment
    a.free(h)
    # 4 MiB < max_split_size never takes an oversize block: a 20 MiB segment of its own
    a.malloc(4 * MiB)
    assert (a.reserved, a.segments) == (60 * MiB, 2)
    # 36 MiB may take the cached 40 MiB block: it wastes 4 MiB < max_non_split_rounding (20 MiB)
    assert a.malloc(36 * MiB) == h
    assert (a.reserved, a.allocated) == (60 * MiB, 44 * MiB)
    a._check()


@pytest.mark.parametrize("expandable", [False, True])
def test_random_sequences_keep_the_models_invariants(expandable: bool):
    # 4000 random requests of 1 B to 128 MiB against 500 MiB: the OOM path runs (releases,
    # unmaps, retries) and some requests fail
    rng = random.Random(7)
    a = _alloc(expandable=expandable, capacity=500 * MiB)
    live: list[int] = []
    for step in range(4000):
        if live and (rng.random() < 0.5 or len(live) > 300):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            with contextlib.suppress(AllocatorOutOfMemory):
                live.append(a.malloc(int(2 ** rng.uniform(0, 27))))
        if step % 97 == 0:
            a._check()
    a._check()
    assert a.alloc_retries > 0
    assert a.peak_allocated <= a.peak_reserved <= 500 * MiB


def test_replay_refuses_bad_events():
    with pytest.raises(ValueError, match="not allocated"):
        replay([(0, 0)])
    with pytest.raises(ValueError, match="allocated already"):
        replay([(0, 1), (0, 1)])


def test_events_from_a_recorded_snapshot():
    # the format of torch.cuda.memory._snapshot() (torch/cuda/memory.py: Snapshot, TraceEntry)
    trace = [
        {"action": "free_requested", "addr": 0x100, "size": 64, "stream": 0},  # allocated
        {"action": "free_completed", "addr": 0x100, "size": 64, "stream": 0},  # before: dropped
        {"action": "segment_alloc", "addr": 0x1000, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 600 * KiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000 + 600 * KiB, "size": 1000, "stream": 0},
        {"action": "free_requested", "addr": 0x1000, "size": 600 * KiB, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 600 * KiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 300, "stream": 0},  # the address again
        {"action": "alloc", "addr": 0x9000, "size": 8, "stream": 0, "pool_id": (1, 0)},  # graph
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
    ]
    snapshot = {"segments": [], "device_traces": [trace, []]}
    events = events_from_snapshot(snapshot)
    assert events == [(0, 600 * KiB), (1, 1000), (0, 0), (3, 300)]
    result = replay(events)
    # 600 KiB + 1000 B (-> 1024) in one 2 MiB small segment; then 300 B (-> 512) reuses the
    # freed front: peak allocated 600 KiB + 1024 B, peak requested 600 KiB + 1000 B
    assert (result.peak_allocated, result.peak_requested) == (600 * KiB + 1024, 600 * KiB + 1000)
    assert (result.peak_reserved, result.allocated) == (2 * MiB, 1024 + 512)
    # a trace without free_completed (skip_actions) frees at free_requested
    no_completed = [e for e in trace if e["action"] != "free_completed"]
    assert events_from_snapshot({"device_traces": [no_completed]}) == events
    with pytest.raises(ValueError, match="device"):
        events_from_snapshot({"device_traces": [trace, trace]})
    assert events_from_snapshot({"device_traces": [trace, trace]}, device=1) == events


def test_an_unlimited_expandable_pool_holds_a_request_past_its_default_range():
    # no capacity: one expandable segment's range is 1 PiB (ADDRESS_SPACE); a larger request
    # (an absurd micro-batch's logits) gets a range that holds it, as a mapping would, rather than
    # failing an assertion. With a capacity it is the OOM path, as before.
    a = _alloc(expandable=True)
    size = 3 * 2**50  # 3 PiB, a multiple of the 2 MiB page
    a.malloc(size)
    assert a.allocated == size and size <= a.reserved <= size + 20 * MiB  # mapped in pages
    with pytest.raises(AllocatorOutOfMemory):
        _alloc(expandable=True, capacity=80 * 1024 * MiB).malloc(size)
