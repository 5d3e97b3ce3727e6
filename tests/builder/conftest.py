"""Fixtures the builder's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

WORLD = 2  # the ranks a `rank` test runs as, one after the other, on the fake process group


@pytest.fixture(params=range(WORLD), ids=lambda r: f"rank{r}")
def rank(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each rank of a `WORLD`-rank fake process group in turn (no process launched): FSDP2's
    sharding as that rank sees it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=request.param, world_size=WORLD, store=FakeStore())
    try:
        yield request.param
    finally:
        dist.destroy_process_group()
