"""The group a watched ``ddp`` strategy's DDP runs on, on the CPU: gloo's, with its all-reduces seen."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions
from torch import nn

import instrumented_ddp
from instrumented_ddp.timing.forwarding_group import ForwardingGroup
from instrumented_ddp.strategies.native import NativeDDP
from instrumented_ddp.timing.timeline import StepTimeline


class RecordingGroup:
    """Stands in for gloo's group: says what it was asked to do."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def rank(self) -> int:
        return 3

    def size(self) -> int:
        return 8

    def name(self) -> str:
        return "gloo"

    def allreduce(self, tensors: list[torch.Tensor], options: dist.AllreduceOptions) -> str:
        self.calls.append(("allreduce", (tensors, options)))
        return "all-reduce work"

    def broadcast(self, tensors: list[torch.Tensor], options: dist.BroadcastOptions) -> str:
        self.calls.append(("broadcast", (tensors, options)))
        return "broadcast work"

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: AllgatherOptions) -> str:
        self.calls.append(("allgather", (outputs, inputs, options)))
        return "all-gather work"

    def barrier(self, options: dist.BarrierOptions) -> str:
        self.calls.append(("barrier", options))
        return "barrier work"


def test_every_collective_reaches_the_inner_group_untouched_while_nothing_watches() -> None:
    inner = RecordingGroup()
    group = ForwardingGroup(inner)  # type: ignore[arg-type]
    assert (group.rank(), group.size()) == (3, 8)
    assert group.getBackendName() != "gloo"  # DDP would look "gloo" up among registered backends
    tensors, options = [torch.ones(2)], dist.AllreduceOptions()
    assert group.allreduce(tensors, options) == "all-reduce work"
    assert inner.calls[-1] == ("allreduce", (tensors, options))
    broadcast_options = dist.BroadcastOptions()
    assert group.broadcast(tensors, broadcast_options) == "broadcast work"
    assert inner.calls[-1] == ("broadcast", (tensors, broadcast_options))
    outputs, gather_options = [[torch.zeros(2)]], AllgatherOptions()
    assert group.allgather(outputs, tensors, gather_options) == "all-gather work"
    assert inner.calls[-1] == ("allgather", (outputs, tensors, gather_options))
    barrier_options = dist.BarrierOptions()
    assert group.barrier(barrier_options) == "barrier work"
    assert inner.calls[-1] == ("barrier", barrier_options)


def test_a_watcher_issues_each_all_reduce_itself_and_a_bare_tensor_arrives_as_a_list() -> None:
    """DDP's reducer passes a list and options; its ``join`` a bare tensor and no options."""
    inner = RecordingGroup()
    group = ForwardingGroup(inner)  # type: ignore[arg-type]
    seen: list[tuple[Any, list[torch.Tensor], dist.AllreduceOptions]] = []

    def watcher(issue_on: Any, tensors: list[torch.Tensor], options: dist.AllreduceOptions) -> Any:
        seen.append((issue_on, tensors, options))
        return issue_on.allreduce(tensors, options)

    group.watcher = watcher
    bucket, options = torch.ones(3), dist.AllreduceOptions()
    assert group.allreduce([bucket], options) == "all-reduce work"
    assert group.allreduce(bucket) == "all-reduce work"
    assert [(issue_on, tensors) for issue_on, tensors, _ in seen] == [(inner, [bucket]), (inner, [bucket])]
    assert seen[0][2] is options and seen[1][2].reduceOp == dist.ReduceOp.SUM
    assert len(inner.calls) == 2


def test_a_watched_ddp_on_the_cpu_runs_on_a_forwarding_group_and_unwrap_stops_the_watching(one_rank_group: None) -> None:
    """No communication hook: DDP's reducer issues its buckets on the forwarding group, which
    shows them to ``DDPTiming`` until the strategy is unwrapped (a live switch), and then only
    forwards; an unwatched DDP runs on the group it was given."""
    model = nn.Linear(4, 2)
    wrapped = cast(NativeDDP, instrumented_ddp.wrap(model, "ddp", timeline=StepTimeline(0)))
    group = wrapped.ddp.process_group
    try:
        assert isinstance(group, ForwardingGroup) and group.watcher is not None
        assert wrapped.ddp._get_ddp_logging_data().get("comm_hook") in (None, "")  # DDP's own reduction
    finally:
        instrumented_ddp.unwrap(wrapped)
    assert group.watcher is None
    unwatched = instrumented_ddp.wrap(model, "ddp")
    try:
        assert not isinstance(unwatched.ddp.process_group, ForwardingGroup)
    finally:
        instrumented_ddp.unwrap(unwatched)
