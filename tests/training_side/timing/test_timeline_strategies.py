"""The strategies' timelines on a one-rank gloo group: each records the spans its seed says it
issues, where it issues them."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn

import instrumented_ddp
from instrumented_ddp.timing.forwarding_group import ForwardingGroup
from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.wire.kinds import COMM_KINDS
from instrumented_ddp.strategies.native import NativeDDP
from instrumented_ddp.timing.timeline import StepTimeline
from timeline_fakes import inside, kinds_of


def _run_one_step(strategy: str) -> tuple[StepReport, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    timeline = StepTimeline(0)
    wrapped = instrumented_ddp.wrap(model, strategy, timeline=timeline)
    try:
        timeline.begin_step(1, wrapped.name, wrapped.settings)
        loss = wrapped(torch.randn(5, 4)).pow(2).mean()
        with timeline.phase("backward"):
            loss.backward()
        wrapped.finish_gradient_sync()
        timeline.end_step(samples=5, tokens=0, loss=loss.detach())
        reports: list[StepReport] = []
        deadline = time.monotonic() + 10.0
        while not reports and time.monotonic() < deadline:  # gloo's callbacks fire on its own threads
            reports = timeline.completed_reports()
            time.sleep(0.001)
        assert len(reports) == 1
        return reports[0], trainable
    finally:
        instrumented_ddp.unwrap(wrapped)


def test_hook_strategy_reports_one_blocking_all_reduce_per_parameter_inside_backward(one_rank_group: None) -> None:
    report, trainable = _run_one_step("hook")
    (backward,) = kinds_of(report, "backward")
    all_reduces = kinds_of(report, "all_reduce")
    assert len(all_reduces) == trainable
    assert sorted(span.tag for span in all_reduces) == sorted(f"p{i}" for i in range(trainable))
    assert all(span.blocking for span in all_reduces)
    assert all(inside(span, backward) for span in all_reduces)
    assert {span.dtype for span in all_reduces} == {"float32"} and all(span.nbytes > 0 for span in all_reduces)
    # The wrap-time broadcast happened before the step and is reported with it.
    assert [span.tag for span in kinds_of(report, "broadcast")] == ["state"]
    assert report.loss is not None and report.start <= min(span.start for span in report.spans)


def test_async_strategy_reports_non_blocking_all_reduces_and_a_blocking_wait(one_rank_group: None) -> None:
    report, trainable = _run_one_step("async")
    (backward,) = kinds_of(report, "backward")
    all_reduces = kinds_of(report, "all_reduce")
    assert len(all_reduces) == trainable
    assert not any(span.blocking for span in all_reduces)
    # issued during backward: the ready marks are the issue stamps (a span's own start is when a
    # gloo worker took it, which on a loaded machine can be after backward ended)
    issued = {s.tag: s.start for s in kinds_of(report, "ready")}
    assert sorted(issued) == sorted(s.tag for s in all_reduces)
    assert all(backward.start <= issued[span.tag] <= min(span.start, backward.end) for span in all_reduces)
    waits = kinds_of(report, "wait")
    assert len(waits) == 1 and waits[0].blocking
    assert waits[0].start >= backward.end
    assert all(span.kind in {"forward", "backward", "wait", "ready", *COMM_KINDS} for span in report.spans)


@pytest.mark.parametrize(("strategy", "prefix"), [("hook", "p"), ("async", "p"), ("bucket", "b"), ("ddp", "b")])
def test_gradient_ready_marks_cover_every_gradient_once_inside_backward(one_rank_group: None, strategy: str, prefix: str) -> None:
    """What the bucket advisor replays backward from: per parameter where a hook reduces each
    one (the collective's own issue stamp), per bucket where buckets are (when the last of its
    gradients arrived; for DDP, when it handed the bucket to the hook)."""
    report, _ = _run_one_step(strategy)
    (backward,) = kinds_of(report, "backward")
    ready = kinds_of(report, "ready")
    assert ready and all(s.start == s.end and not s.blocking and backward.start <= s.start <= backward.end for s in ready)
    assert {s.tag[0] for s in ready} == {prefix} and len({s.tag for s in ready}) == len(ready)
    assert sum(s.nbytes for s in ready) == (4 * 8 + 8 + 8 + 1) * 4  # every float32 gradient, once
    issued = {s.tag: s for s in kinds_of(report, "all_reduce")}
    assert all(s.start <= issued[s.tag].start for s in ready)  # ready before (or as) its all-reduce starts
    if strategy != "bucket":  # issued the moment it is ready: one stamp for both (on a GPU, one event) ...
        ends = {span.end for span in report.spans if span.kind in COMM_KINDS}
        # ... unless both of gloo's workers were busy then: it starts as an earlier collective ends (the replay)
        assert all(issued[s.tag].start == s.start or issued[s.tag].start in ends for s in ready)


@pytest.mark.parametrize("find_unused_parameters", [False, True], ids=["forwarding group", "hook"])
def test_ddp_on_the_cpu_completes_its_buckets_in_backward_and_a_failed_all_reduce_fails_backward(
        one_rank_group: None, find_unused_parameters: bool) -> None:
    """On the CPU DDP's buckets are waited for at the end of backward on the rank's thread (no
    Python on gloo's: ``DDPTiming``), seen through a ``ForwardingGroup`` or, with
    ``find_unused_parameters``, through a hook handing DDP a future of its own: the gradients
    are DDP's own, every bucket ends inside backward, and a collective that fails still fails
    backward, neither hanging it nor passing gradients on unreduced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    timeline = StepTimeline(0)
    wrapped = cast(NativeDDP, instrumented_ddp.wrap(model, "ddp", timeline=timeline, find_unused_parameters=find_unused_parameters))
    try:
        assert isinstance(wrapped.ddp.process_group, ForwardingGroup) != find_unused_parameters
        inputs = torch.randn(5, 4)
        for step in (1, 2):
            timeline.begin_step(step, wrapped.name, wrapped.settings)
            with timeline.phase("backward"):
                wrapped(inputs).pow(2).mean().backward()
            wrapped.finish_gradient_sync()
            timeline.end_step(samples=5, tokens=5)
            reference(inputs).pow(2).mean().backward()
        assert all(p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
                   for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        for report in timeline.completed_reports()[1:]:
            (backward,) = kinds_of(report, "backward")
            all_reduces = kinds_of(report, "all_reduce")
            assert all_reduces and all(backward.start <= s.start <= s.end <= backward.end for s in all_reduces)

        silent_peer, _idle_peer = _gloo_group_whose_peer_never_answers(timeout_s=0.5)
        if find_unused_parameters:
            wrapped._timing.process_group = silent_peer
        else:
            cast(ForwardingGroup, wrapped.ddp.process_group).inner = silent_peer
        with pytest.raises(RuntimeError, match="Timed out waiting 500ms"):
            wrapped(inputs).pow(2).mean().backward()
    finally:
        instrumented_ddp.unwrap(wrapped)


def _gloo_group_whose_peer_never_answers(timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Rank 0 of a real two-rank gloo group, and its rank 1 (built on a thread, then left idle:
    keep it while rank 0 is used, or its going closes the connection). Rank 1 never joins a
    collective, so rank 0's all-reduces fail after ``timeout_s`` inside gloo, with a C++
    exception, as a dead peer's do. (A Python future set to an exception is no stand-in: DDP's
    reducer segfaults rethrowing it.)"""
    store = dist.HashStore()
    groups: dict[int, Any] = {}  # gloo's backend itself, used as a group (torch's stubs keep the two apart)

    def join(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # bound in C++, missing from the stub
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, options)

    peer = threading.Thread(target=join, args=(1,))
    peer.start()
    join(0)
    peer.join()
    return groups[0], groups[1]


def test_ddp_looks_at_its_buckets_once_per_share_of_the_gradient_elements_produced() -> None:
    """Walking last to first (backward's order), a look each time another 1/looks of the elements
    has been produced: 20 elements, 4 looks, so every 5: 2, then 2+6 = 8 (look), 1, 1+1 = 2,
    then 2+10 = 12 (look)."""
    from instrumented_ddp.timing.ddp_timing import parameters_to_look_from

    parameters = [nn.Parameter(torch.zeros(n)) for n in (10, 1, 1, 6, 2)]
    assert [p.numel() for p in parameters_to_look_from(parameters, looks=4)] == [6, 10]


def test_watched_ddp_on_the_cpu_looks_from_gradient_hooks_and_unwrap_removes_them(one_rank_group: None) -> None:
    """The gradient hooks that sharpen bucket ends on the CPU are on the model's own parameters:
    unwrapping (a live switch) must take them off with DDP."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16,640 elements: a look every 65
    wrapped = instrumented_ddp.wrap(model, "ddp", timeline=StepTimeline(0))
    try:
        hooked = [bool(p._post_accumulate_grad_hooks) for p in model.parameters()]
        assert any(hooked) and not all(hooked)  # the weights, not every bias
    finally:
        instrumented_ddp.unwrap(wrapped)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_ddp_records_its_per_forward_buffer_broadcast_inside_forward(one_rank_group: None) -> None:
    """DDP broadcasts a model's buffers from rank 0 before every forward: blocked, not compute."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    timeline = StepTimeline(0)
    wrapped = instrumented_ddp.wrap(model, "ddp", timeline=timeline)
    try:
        for step in (1, 2):
            timeline.begin_step(step, wrapped.name, wrapped.settings)
            loss = wrapped(torch.randn(5, 4)).pow(2).mean()
            with timeline.phase("backward"):
                loss.backward()
            wrapped.finish_gradient_sync()
            timeline.end_step(samples=5, tokens=0)
        reports: list[StepReport] = []
        deadline = time.monotonic() + 10.0
        while len(reports) < 2 and time.monotonic() < deadline:
            reports += timeline.completed_reports()
            time.sleep(0.001)
        for report in reports:
            (forward,) = kinds_of(report, "forward")
            (buffers,) = [span for span in kinds_of(report, "broadcast") if span.tag == "buffers"]
            assert buffers.blocking and inside(buffers, forward)
            assert buffers.nbytes == sum(b.numel() * b.element_size() for b in model.buffers())
    finally:
        instrumented_ddp.unwrap(wrapped)


class _FakeGradBucket:
    """What DDP hands a communication hook: the bucket's flat buffer and its index."""

    def __init__(self, values: list[float]) -> None:
        self._buffer = torch.tensor(values)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0


@pytest.mark.parametrize(("backend", "expected_op", "expected_buffer"), [
    ("gloo", dist.ReduceOp.SUM, [1.0, 2.0]),  # gloo has no average: the hook scales by 1/n, then sums
    ("nccl", dist.ReduceOp.AVG, [2.0, 4.0]),  # NCCL averages inside: no extra pass over the bucket
])
def test_timed_ddp_hook_averages_as_the_backend_allows(one_rank_group: None, monkeypatch: pytest.MonkeyPatch,
                                                        backend: str, expected_op: Any, expected_buffer: list[float]) -> None:
    """DDP's C++ default scales gradients while copying them into a bucket; the timed hook must
    not add a second pass where the backend can average (bit-equal to plain DDP on an H100, README)."""
    from instrumented_ddp.timing import ddp_timing

    monkeypatch.setattr(ddp_timing.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(ddp_timing.dist, "get_world_size", lambda group=None: 2)
    wrapped = cast(NativeDDP, instrumented_ddp.wrap(nn.Linear(2, 1), "ddp", timeline=StepTimeline(0)))
    try:
        issued: list[tuple[torch.Tensor, Any]] = []
        torchs = dist.distributed_c10d.all_reduce

        def all_reduce(tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
            issued.append((tensor.clone(), op))
            return torchs(tensor, async_op=True)  # one rank: a sum is the identity

        monkeypatch.setattr(ddp_timing.timed_all_reduce_result.__globals__["_c10d"], "all_reduce", all_reduce)
        timing = ddp_timing.DDPTiming(wrapped.ddp, StepTimeline(0))
        real_group = timing.process_group

        class RecordingGroup:  # the CPU path issues on DDP's group itself, as DDP's reducer does
            def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
                return all_reduce(tensors[0], op=options.reduceOp, group=real_group, async_op=True)

        timing.process_group = RecordingGroup()  # type: ignore[assignment]  # records what DDP's group is asked
        future = timing._all_reduce_hook()(None, _FakeGradBucket([2.0, 4.0]))
        (sent, op), = issued
        assert op == expected_op and sent.tolist() == expected_buffer
        assert future.wait().tolist() == expected_buffer
    finally:
        instrumented_ddp.unwrap(wrapped)



@pytest.mark.parametrize("strategy", instrumented_ddp.STRATEGY_NAMES)
def test_every_strategy_runs_unwatched_steps_and_times_the_steps_after_them_in_full(one_rank_group: None, strategy: str) -> None:
    """Steps 2 and 3 unwatched (``UnwatchedBlocks(4, 2)``): their reports hold their window alone,
    and steps 4 and 5, watched, hold every collective of their kind again, resolved; the optimizer
    steps throughout, so the model trains on."""
    from instrumented_ddp.timing.unwatched_blocks import UnwatchedBlocks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    timeline = StepTimeline(0, unwatched=UnwatchedBlocks(4, 2))
    wrapped = instrumented_ddp.wrap(model, strategy, bucket_mb=0.0001, timeline=timeline)
    optimizer = wrapped.make_optimizer(torch.optim.SGD, lr=0.1)
    reports: dict[int, StepReport] = {}
    try:
        for step in range(1, 6):
            timeline.begin_step(step, wrapped.name, wrapped.settings)
            loss = wrapped(torch.randn(5, 4)).pow(2).mean()
            with timeline.phase("backward"):
                loss.backward()
            wrapped.finish_gradient_sync()
            with timeline.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            timeline.end_step(samples=5, tokens=0, loss=loss.detach())
            deadline = time.monotonic() + 10.0
            while step not in reports and time.monotonic() < deadline:  # gloo's callbacks fire on its own threads
                reports.update((r.step, r) for r in timeline.completed_reports())
                time.sleep(0.001)
    finally:
        instrumented_ddp.unwrap(wrapped)
    assert sorted(reports) == [1, 2, 3, 4, 5]
    assert [reports[s].unwatched for s in range(1, 6)] == [False, True, True, False, False]
    assert reports[2].spans == [] == reports[3].spans and reports[2].end > reports[2].start
    comm = {s: sorted((span.kind, span.tag) for span in reports[s].spans if span.kind in COMM_KINDS and span.kind != "broadcast")
            for s in (1, 4, 5)}
    assert comm[4] == comm[5] == comm[1], comm  # the same collectives as a step before the block: none lost to it
    assert comm[4] or strategy == "fsdp"  # fsdp on one rank gathers and scatters nothing
    assert {span.kind for span in reports[4].spans} >= {"forward", "backward", "optimizer"}
    assert not any(reports[s].unresolved for s in (4, 5))
