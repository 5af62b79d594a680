"""Fixtures shared by the test modules that run a strategy or a DDP model in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the test's duration."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
