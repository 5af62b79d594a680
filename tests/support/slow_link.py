"""A slow link, stood in: a ``torch.distributed`` backend whose all-reduce is gloo's, completed
``delay_s`` late on every rank. A collective on it stays in flight on every rank for that long,
its work not completed, as one over a congested network does, so that a stall inside one
collective can be made on CPU ranks. Registered as ``slowlink``: ``dist.new_group(backend="slowlink")``."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # torch's own tests' way
from torch.futures import Future

NAME = "slowlink"


class SlowLink(dist.ProcessGroup):
    """gloo's all-reduce, its work completed ``delay_s`` after gloo's (0: as soon)."""

    def __init__(self, inner: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # a Python backend's constructor
        self.inner = inner
        self.delay_s = 0.0

    def getBackendName(self) -> str:
        return NAME

    def getGroupName(self) -> str:
        return NAME

    def getGroupDesc(self) -> str:
        return NAME

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]  # the form c10d calls
        work = self.inner.allreduce(tensors, opts)
        done: Future[list[torch.Tensor]] = Future()
        delay_s = self.delay_s

        def complete() -> None:
            work.wait()
            time.sleep(delay_s)
            done.set_result(tensors)

        threading.Thread(target=complete, daemon=True).start()
        return _create_work_from_future(done)


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> SlowLink:
    return SlowLink(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)


def slow_link_group() -> SlowLink:
    """A group of every rank on the slow link (collective: every rank calls it)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    group = dist.new_group(backend=NAME)
    assert isinstance(group, SlowLink), type(group)
    return group
