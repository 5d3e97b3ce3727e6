"""Expandable segments (`expandable_segments:True`, Note [Expandable Segments]): one virtual
range per pool, mapped and unmapped in pages, so a segment's tail grows instead of a new segment
being made. A mixin of `CachingAllocator`, whose state (pools, counters) it reads and updates."""

from __future__ import annotations

from bisect import bisect_left, insort

from autofit.estimate.allocator.blocks import (
    ADDRESS_SPACE,
    Block,
    Pool,
    Segment,
    link_after,
    link_before,
    unfree,
)  # fmt: skip


class ExpandableSegments:
    """`find_expandable_block`, `try_allocate_expandable_block`, `map_block`, `unmap_block`."""

    def _try_allocate_expandable_block(self, pool: Pool, size: int) -> Block | None:
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
        unfree(pool, candidate)
        return candidate

    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        """find_expandable_block: the lowest-addressed unmapped block (or the free block right
        before it) from which free and unmapped blocks add up to `size`; else a new segment."""
        for _, unmapped in pool.unmapped:
            candidate = unmapped
            prev = unmapped.prev
            if prev is not None and not prev.allocated:
                candidate = prev
            room = 0
            b: Block | None = candidate
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return candidate
        # a new ExpandableSegment: address space for 9/8 of the GPU's memory, in pages
        page = pool.page
        total = self.capacity + self.capacity // 8 if self.capacity is not None else ADDRESS_SPACE
        total = max(total, size)  # unlimited: a range smaller than the request could not hold it
        va = -(-total // page) * page
        seg = Segment(self._take_addresses(va), va, page, True, pool.small)
        block = Block(seg.base, va, seg, mapped=False)
        insort(pool.unmapped, (block.addr, block))
        return block

    def _map_block(self, pool: Pool, to_map: Block, size: int) -> bool:
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
            rest = Block(to_map.addr + mapped, to_map.size - mapped, seg, mapped=False)
            link_after(rest, to_map)
            insort(unmapped, (rest.addr, rest))
            to_map.size = mapped
        self._try_merge(pool, to_map, to_map.prev)
        self._try_merge(pool, to_map, to_map.next)
        insort(pool.free, (to_map.size, to_map.addr, to_map))
        self._grow_reserved(mapped)  # reserved_bytes += mapped_range.size
        return True

    def _unmap_block(self, pool: Pool, block: Block) -> None:
        """unmap_block: unmap the pages lying wholly inside a free block (the parts before and
        after stay mapped free blocks) and merge the unmapped range with unmapped neighbours."""
        seg = block.seg
        page = seg.page
        offset = block.addr - seg.base
        begin = -(-offset // page)  # segmentRight(ptr)
        end = (offset + block.size) // page  # segmentLeft(ptr + size)
        if begin >= end:
            return
        unfree(pool, block)
        start = seg.base + begin * page
        length = (end - begin) * page
        before = start - block.addr
        if before > 0:
            head = Block(block.addr, before, seg)
            link_before(head, block)
            insort(pool.free, (head.size, head.addr, head))
        after = block.size - before - length
        if after > 0:
            tail = Block(start + length, after, seg)
            link_after(tail, block)
            insort(pool.free, (tail.size, tail.addr, tail))
        block.addr = start
        block.size = length
        block.mapped = False
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        insort(pool.unmapped, (block.addr, block))
        self.reserved -= length
