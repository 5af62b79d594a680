"""A process group that forwards every collective to another, and shows its all-reduces to a watcher.

Why it exists: to time a ``DistributedDataParallel`` that ddpwatch builds itself (the ``ddp``
strategy) on the CPU without a communication hook. DDP's C++ reducer scales each gradient by
1/world size while it copies it into its bucket, one pass; a hook is handed the bucket already
filled, and gloo averages only by a division after the sum, so a hook scales it again: a second
pass over every gradient, which DDP on a forwarding group does not make, with bit-identical
parameters (``bench/ddp_watch_paths.py`` times both paths side by side). The reducer issues
each bucket on whatever group DDP was given (``process_group->allreduce``), and PyTorch runs DDP
on Python process groups in its own tests (``test/distributed/test_c10d_pypg.py``).

``attach`` uses one for HSDP: FSDP2 all-reduces each unit's shard across the replicas with a
plain ``dist.all_reduce`` on the replicate dimension's group, which no FSDP hook takes, so that
group is swapped for a forwarding one (``fsdp_timing.time_replica_all_reduces``). A user's DDP
holds the group it was built with and is timed through a communication hook instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

#: What sees each all-reduce: given the group to issue on, the tensors and the options, it
#: issues the collective (``group.allreduce``) and returns its work.
AllReduceWatcher = Callable[[dist.ProcessGroup, list[torch.Tensor], dist.AllreduceOptions], dist.Work]


class ForwardingGroup(dist.ProcessGroup):
    """``inner`` as DDP sees it: same rank and size, every collective DDP uses issued on ``inner``.

    DDP uses ``allreduce`` (its buckets, in bucket order, inside backward), ``broadcast`` (the
    state at construction, its buffers before each forward, its rebuilt bucket indices) and
    ``allgather`` (parameter shapes at construction), ``barrier`` in ``join``. Each is forwarded
    untouched; all-reduces go through ``watcher`` while one is set.

    ``getBackendName`` does not say "gloo": DDP would then look for the named backend among the
    registered ones and fail. Not registered with ``torch.distributed`` either, so use
    ``inner`` for ``dist.get_backend`` and ``dist.get_rank``.
    """

    def __init__(self, inner: dist.ProcessGroup) -> None:
        # torch's stub lists only ``(store, rank, size)``; the binding also takes ``(rank, size)``.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self.inner = inner
        self.watcher: AllReduceWatcher | None = None

    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor,  # type: ignore[override]
                  options: dist.AllreduceOptions | None = None) -> dist.Work:
        """DDP's reducer passes a list and options; its ``join`` a bare tensor and none."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        options = options if options is not None else dist.AllreduceOptions()
        watcher = self.watcher
        return watcher(self.inner, tensors, options) if watcher is not None else self.inner.allreduce(tensors, options)

    def broadcast(self, tensors: list[torch.Tensor], options: dist.BroadcastOptions) -> dist.Work:  # type: ignore[override]
        return self.inner.broadcast(tensors, options)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  options: AllgatherOptions) -> dist.Work:
        return self.inner.allgather(output_tensors, input_tensors, options)

    def barrier(self, options: dist.BarrierOptions) -> dist.Work:  # type: ignore[override]
        return self.inner.barrier(options)

    def getBackendName(self) -> str:  # noqa: N802 (ProcessGroup's name)
        return f"forwarding to {self.inner.name()}"
