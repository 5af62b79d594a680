"""A rank's timeline on CUDA events, against fakes that behave like NCCL (``tests/nccl_fakes.py``
says from what): marks resolve without a device sync, collectives read their transfer and not
their queueing, and a step whose marks cannot resolve goes out unresolved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch.distributed as dist

from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.timing.clocks import CudaEventClock, HostClock
from instrumented_ddp.timing.timeline import StepTimeline
from nccl_fakes import FakeCudaTensor, FakeGpu, FakeNcclWork, FakeProcessGroupNccl, FakeStream
from timeline_fakes import FakeHostTime, FakeWork, kinds_of, only_report


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu()


def _cuda_timeline(gpu: FakeGpu, nccl_timing: bool = False) -> StepTimeline:
    clock = CudaEventClock(gpu.torch())
    clock.nccl_timing = nccl_timing
    return StepTimeline(rank=0, clock=clock)


def test_cuda_step_stays_pending_until_its_events_complete(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    timeline = _cuda_timeline(gpu)
    host_time.now = 100.0
    timeline.begin_step(1, "bucket", {})
    gpu.host_ms = 5.0
    with timeline.phase("forward"):
        host_time.now = 100.001  # the host runs ahead; only the GPU times count
        gpu.compute.run(25.0)
    gpu.compute.run(12.0)
    timeline.end_step(samples=1, tokens=1)

    gpu.done_ms = 30.0  # the step's end event (42 ms) has not run yet
    assert timeline.completed_reports() == []
    assert timeline.has_pending()
    gpu.done_ms = 42.0

    report = only_report(timeline)
    (forward,) = report.spans
    assert forward.start == pytest.approx(100.005) and forward.end == pytest.approx(100.030)
    assert report.start == pytest.approx(100.0) and report.end == pytest.approx(100.042)


def test_cuda_pause_is_read_from_its_events_and_holds_its_step_until_they_ran(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """On a GPU the pause's ends are events, like the step's: step 2 begins at 10 ms, the
    evaluation's kernels run 10-40 ms and the pause ends at 40, the step at 45. Until the GPU
    reaches 45 ms step 2 waits; then it reads 40-45 ms, paused 30 ms."""
    timeline = _cuda_timeline(gpu)
    host_time.now = 100.0
    timeline.begin_step(1, "ddp", {})
    gpu.compute.run(10.0)
    timeline.end_step(samples=1, tokens=1)
    host_time.now = 100.010  # where the host is when the GPU reaches 10 ms: each step's events are read against it
    timeline.begin_step(2, "ddp", {})
    gpu.compute.run(30.0)
    timeline.paused_until("evaluate", timeline.stamp())
    gpu.compute.run(5.0)
    timeline.end_step(samples=1, tokens=1)

    gpu.done_ms = 42.0
    assert len(timeline.completed_reports()) == 1 and timeline.has_pending()
    gpu.done_ms = 45.0
    report = only_report(timeline)
    assert report.start == pytest.approx(100.040) and report.end == pytest.approx(100.045)
    assert report.paused_s == pytest.approx(0.030) and report.paused_for == "evaluate"


def _three_back_to_back_buckets(gpu: FakeGpu, timeline: StepTimeline, nccl_timing: bool,
                                through_ddp_hook: bool = False) -> list[FakeNcclWork]:
    """Backward hands NCCL a 4 ms bucket at 1, 2 and 3 ms: they run 1-5, 5-9 and 9-13 ms.
    ``through_ddp_hook``: closed as DDP's communication hook closes them, the future it returns
    doing the timing too."""
    group = FakeProcessGroupNccl(gpu, timing=nccl_timing)
    timeline.begin_step(1, "bucket", {})
    for index in range(3):
        gpu.host_ms = 1.0 + index
        span = timeline.open_collective("all_reduce", 1 << 20, f"b{index}", "float32", blocking=False)
        work = group.all_reduce(transfer_ms=4.0)
        if through_ddp_hook:
            timeline.close_collective_with_result(span, work)
        else:
            timeline.close_collective(span, work)
    gpu.host_ms = 3.5
    with timeline.phase("wait", blocking=True):
        for work in group.works:
            work.wait()  # the compute stream waits; the host does not
    timeline.end_step(samples=1, tokens=1)
    return group.works


class StepWaits:
    """What ``Attachment`` does for ``WaitedByTheLoop`` in a step: each wait a ``wait`` span."""

    def __init__(self, timeline: StepTimeline) -> None:
        self.timeline = timeline

    def wait_begins(self) -> Any:
        return self.timeline.stamp()

    def wait_ends(self, start: Any, tag: str = "") -> None:
        self.timeline.add_span("wait", start, self.timeline.stamp(), blocking=True, tag=tag)


@pytest.mark.parametrize("nccl_timing", [False, True], ids=["queue-replay", "nccl-timing"])
def test_a_loops_asynchronous_nccl_collectives_read_their_transfer_and_its_waits_the_streams_stall(
        gpu: FakeGpu, host_time: FakeHostTime, nccl_timing: bool) -> None:
    """ZeroRedundancyOptimizer's way on NCCL: three 4 ms broadcasts issued at 1, 2 and 3 ms (they
    run 1-5, 5-9 and 9-13 ms), then each waited in turn from 3.5 ms. ``wait()`` on NCCL makes the
    compute stream wait and the host not: the three ``wait`` spans are where the compute stream
    sat (3.5-5, 5-9, 9-13 ms), read from events, the host never made to wait for the device."""
    from instrumented_ddp.timing.collectives import WaitedByTheLoop

    timeline = _cuda_timeline(gpu, nccl_timing)
    group = FakeProcessGroupNccl(gpu, timing=nccl_timing)
    timeline.begin_step(1, "ddp", {})
    handed: list[WaitedByTheLoop] = []
    for index in range(3):
        gpu.host_ms = 1.0 + index
        span = timeline.open_collective("broadcast", 1 << 20, f"l{index}", "float32", blocking=False)
        work = group.all_reduce(transfer_ms=4.0)
        timeline.close_collective(span, work)
        handed.append(WaitedByTheLoop(cast(dist.Work, work), timeline, StepWaits(timeline)))  # as NCCL's work
    gpu.host_ms = 3.5
    for waited in handed:
        waited.wait()
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 12.0
    assert timeline.completed_reports() == []
    gpu.done_ms = 13.0

    report = only_report(timeline)
    as_ms = lambda spans: [(round(s.start * 1e3, 6), round(s.end * 1e3, 6)) for s in spans]  # noqa: E731
    assert as_ms(kinds_of(report, "broadcast")) == [(1.0, 5.0), (5.0, 9.0), (9.0, 13.0)]
    assert as_ms(kinds_of(report, "wait")) == [(3.5, 5.0), (5.0, 9.0), (9.0, 13.0)]
    assert all(s.blocking for s in kinds_of(report, "wait")) and gpu.synchronizations == 0
    assert [work.early_duration_reads for work in group.works] == [0, 0, 0]


@pytest.mark.parametrize("through_ddp_hook", [False, True], ids=["strategy", "ddp-hook"])
@pytest.mark.parametrize("nccl_timing", [False, True], ids=["queue-replay", "nccl-timing"])
def test_back_to_back_nccl_buckets_read_their_transfer_not_their_queueing(gpu: FakeGpu, host_time: FakeHostTime, nccl_timing: bool,
                                                                          through_ddp_hook: bool) -> None:
    """The future is complete at enqueue, so a duration read in the callback raises and every
    span used to start at its issue time: 4, 7 and 10 ms for three 4 ms transfers. A DDP hook
    must hand DDP a ``.then`` future anyway: that one callback also does the timing."""
    timeline = _cuda_timeline(gpu, nccl_timing)
    works = _three_back_to_back_buckets(gpu, timeline, nccl_timing, through_ddp_hook)
    gpu.done_ms = 12.0  # the last bucket is still running
    assert timeline.completed_reports() == []
    gpu.done_ms = 13.0

    report = only_report(timeline)
    collectives = kinds_of(report, "all_reduce")
    assert [(round(s.start * 1e3, 6), round(s.end * 1e3, 6)) for s in collectives] == [(1.0, 5.0), (5.0, 9.0), (9.0, 13.0)]
    assert [work.early_duration_reads for work in works] == [0, 0, 0]  # never read before completion
    # with NCCL's durations no .then for timing at all; a DDP hook's own .then is the only one
    assert gpu.pool_streams == (3 if through_ddp_hook or not nccl_timing else 0)
    (wait,) = kinds_of(report, "wait")  # the compute stream sat from 3.5 ms until the last bucket ended
    assert (round(wait.start * 1e3, 6), round(wait.end * 1e3, 6)) == (3.5, 13.0)


def test_nccl_bucket_issued_after_the_stream_is_free_starts_at_its_issue(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    timeline = _cuda_timeline(gpu)
    group = FakeProcessGroupNccl(gpu)
    timeline.begin_step(1, "bucket", {})
    for issue_ms in (1.0, 10.0):
        gpu.host_ms = issue_ms
        span = timeline.open_collective("all_reduce", 64, "b0", "float32", blocking=False)
        timeline.close_collective(span, group.all_reduce(transfer_ms=2.0))
    gpu.host_ms = 20.0
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 20.0
    collectives = kinds_of(only_report(timeline), "all_reduce")
    assert [(round(s.start * 1e3, 6), round(s.end * 1e3, 6)) for s in collectives] == [(1.0, 3.0), (10.0, 12.0)]


@pytest.mark.parametrize("nccl_timing", [False, True], ids=["queue-replay", "nccl-timing"])
def test_a_collective_on_another_groups_stream_is_not_replayed_behind_this_groups(
        gpu: FakeGpu, host_time: FakeHostTime, nccl_timing: bool) -> None:
    """HSDP: a unit's reduce-scatter on the shard group's NCCL stream, then its all-reduce across
    replicas on the replicate group's, then the next unit's reduce-scatter, which runs beside that
    all-reduce. Worked by hand: reduce-scatter 1-5 ms; the all-reduce issued at 2 ms on a stream
    made to wait for the reduce-scatter (FSDP's ``wait_stream``) runs 5-8; the second
    reduce-scatter, issued at 3 ms, runs 5-9 on its own stream. Replayed as one queue, the second
    reduce-scatter was made to start when the all-reduce ended, at 8 ms: 1 ms of transfer for 4."""
    timeline = _cuda_timeline(gpu, nccl_timing)
    shards = FakeProcessGroupNccl(gpu, timing=nccl_timing)
    replicas = FakeProcessGroupNccl(gpu, timing=nccl_timing, stream=FakeStream(gpu, "nccl replicas"))
    timeline.begin_step(1, "fsdp", {})
    gpu.host_ms = 1.0
    span = timeline.open_collective("reduce_scatter", 64, "u1", "float32", blocking=False)
    first = shards.all_reduce(transfer_ms=4.0)
    timeline.close_collective(span, first)
    gpu.host_ms = 2.0
    gpu.current = FakeStream(gpu, "fsdp all-reduce stream")
    gpu.current.wait_until(first.end_ms)  # all_reduce_stream.wait_stream(reduce_scatter_stream)
    span = timeline.open_collective("all_reduce", 32, "u1", "float32", blocking=False, queue="replicas")
    timeline.close_collective(span, replicas.all_reduce(transfer_ms=3.0))
    gpu.current = gpu.compute
    gpu.host_ms = 3.0
    span = timeline.open_collective("reduce_scatter", 64, "u0", "float32", blocking=False)
    timeline.close_collective(span, shards.all_reduce(transfer_ms=4.0))
    gpu.host_ms = 10.0
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 10.0
    report = only_report(timeline)
    assert [(s.kind, s.tag, round(s.start * 1e3, 6), round(s.end * 1e3, 6)) for s in report.spans if s.kind != "wait"] == [
        ("reduce_scatter", "u1", 1.0, 5.0), ("all_reduce", "u1", 5.0, 8.0), ("reduce_scatter", "u0", 5.0, 9.0)]


def test_synchronous_nccl_collectives_end_at_the_mark_after_the_call_with_no_callback(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """``simple``/``hook`` on a GPU: the mark after a synchronous call is on the compute stream,
    which the call made wait for NCCL, so it reads the collective's end; no ``.then`` is paid for.
    Compute runs 0-3 ms, the first all-reduce 3-7, a 1 ms division 7-8, the second 8-12."""
    timeline = _cuda_timeline(gpu)
    group = FakeProcessGroupNccl(gpu)
    timeline.begin_step(1, "simple", {})
    gpu.compute.run(3.0)
    for index in range(2):
        span = timeline.open_collective("all_reduce", 64, f"p{index}", "float32", blocking=True)
        group.all_reduce_synchronously(transfer_ms=4.0)  # returns None, as dist.all_reduce does
        timeline.close_collective(span, None)
        gpu.compute.run(1.0)
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 11.0  # the second all-reduce is still running
    assert timeline.completed_reports() == []
    gpu.done_ms = 13.0
    collectives = kinds_of(only_report(timeline), "all_reduce")
    assert [(round(s.start * 1e3, 6), round(s.end * 1e3, 6), s.blocking) for s in collectives] == [
        (3.0, 7.0, True), (8.0, 12.0, True)]
    assert gpu.pool_streams == 0 and gpu.synchronizations == 0


def test_cuda_collective_whose_end_is_still_running_holds_the_step(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    timeline = _cuda_timeline(gpu, nccl_timing=True)
    group = FakeProcessGroupNccl(gpu, timing=True)
    timeline.begin_step(1, "bucket", {})
    gpu.compute.run(1.0)
    span = timeline.open_collective("all_reduce", 64, "b0", "float32", blocking=False)
    timeline.close_collective(span, group.all_reduce(transfer_ms=8.0))  # NCCL: 1-9 ms
    gpu.host_ms = 5.0
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 6.0  # the step's end event ran, the collective has not finished
    assert timeline.completed_reports() == []
    gpu.done_ms = 9.0
    (collective,) = only_report(timeline).spans
    assert collective.end == pytest.approx(0.009) and collective.start == pytest.approx(0.001)


def test_nccl_work_that_completed_without_a_duration_sends_its_step_unresolved(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """The clock was told timing is on, but the group never recorded start events: once the work
    has completed and still has no duration, its span cannot resolve, and the step goes out
    marked unresolved rather than holding every later step."""
    timeline = _cuda_timeline(gpu, nccl_timing=True)
    group = FakeProcessGroupNccl(gpu, timing=False)
    timeline.begin_step(1, "bucket", {})
    span = timeline.open_collective("all_reduce", 64, "b0", "float32", blocking=False)
    work = group.all_reduce(transfer_ms=2.0)  # 0-2 ms
    timeline.close_collective(span, work)
    work.wait()
    with timeline.phase("optimizer"):
        gpu.compute.run(1.0)
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 1.0
    assert timeline.completed_reports() == []  # still running: it may yet say
    gpu.done_ms = 3.0
    report = only_report(timeline)
    assert report.unresolved and [s.kind for s in report.spans] == ["optimizer"]
    # what a lent H200 sent for every step of an attached HSDP run before its replicate groups were timed
    assert report.unresolved_reason.startswith("all_reduce b0 could not be timed: RuntimeError: ")
    assert "\n" not in report.unresolved_reason


def test_a_group_met_with_nccl_timing_off_has_it_turned_on_before_its_first_collective(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """A group ``Watch`` did not know of at start (a subgroup given to ``wrap``): the timeline turns
    its timing on, once, before the first asynchronous collective timed there, and the span gets
    NCCL's duration instead of failing as above. A gloo clock leaves groups alone."""
    timeline = _cuda_timeline(gpu, nccl_timing=True)
    group = FakeProcessGroupNccl(gpu, timing=False)
    timeline.begin_step(1, "bucket", {})
    span = timeline.open_collective("all_reduce", 64, "b0", "float32", blocking=False)
    timeline.time_collectives_in(group)
    work = group.all_reduce(transfer_ms=2.0)  # 0-2 ms
    timeline.close_collective(span, work)
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 3.0
    report = only_report(timeline)
    assert not report.unresolved and [(s.kind, s.start, s.end) for s in report.spans] == [
        ("all_reduce", pytest.approx(0.0), pytest.approx(0.002))]
    group.timing = False
    timeline.time_collectives_in(group)  # once per group: not asked again
    assert group.timing is False
    cpu_group = FakeProcessGroupNccl(gpu, timing=False)
    StepTimeline(rank=0, clock=HostClock()).time_collectives_in(cpu_group)
    assert cpu_group.timing is False


def test_cuda_loss_is_read_without_waiting_for_the_device(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    timeline = _cuda_timeline(gpu)
    timeline.begin_step(1, "bucket", {})
    gpu.compute.run(7.0)
    timeline.end_step(samples=1, tokens=1, loss=FakeCudaTensor(gpu, 2.5))
    gpu.done_ms = 3.0
    assert timeline.completed_reports() == []
    gpu.done_ms = 7.0
    assert only_report(timeline).loss == 2.5
    assert gpu.synchronizations == 0


def test_a_step_ended_at_an_earlier_mark_reads_its_loss_once_the_copy_after_that_mark_ran(
        gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """An attached step found only later to have ended at its backward (its update skipped): its
    end is the backward's mark (5 ms), but its loss is captured, the copy queued, after the next
    forward's kernels (9 ms). Read once the end's event ran, the copy had not: a stale loss
    (the fake asserts, where real pinned memory reads whatever it held)."""
    timeline = _cuda_timeline(gpu)
    timeline.begin_step(1, "ddp", {})
    gpu.compute.run(5.0)
    after_backward = timeline.stamp()
    gpu.compute.run(4.0)
    timeline.end_step(samples=1, tokens=1, loss=FakeCudaTensor(gpu, 2.5), at=after_backward, update_skipped=True)
    gpu.done_ms = 5.0  # every mark of the step has run; the copy, at 9 ms, not
    assert timeline.completed_reports() == []
    gpu.done_ms = 9.0
    report = only_report(timeline)
    assert (report.loss, report.unresolved, report.end) == (2.5, False, pytest.approx(report.start + 0.005))
    assert gpu.synchronizations == 0


def test_a_step_begun_at_an_earlier_mark_is_read_against_that_marks_reference_not_a_new_one(
        gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """By hand: step 1's backward runs 0-5 ms on the GPU, where its update is later found skipped;
    the host then queues 20 ms of kernels and moves on 2 ms. Step 2 begins at the backward's mark
    and its forward runs 25-35 ms on the GPU: a window of 5-35 ms. With a reference of its own,
    recorded at host 2 ms behind 25 ms of GPU work, its marks read 23 ms early: forward 2-12,
    before the step's own start (5, read against step 1's reference), and the window 2-12."""
    timeline = _cuda_timeline(gpu)
    timeline.begin_step(1, "ddp", {})
    gpu.compute.run(5.0)
    after_backward = timeline.stamp()
    gpu.compute.run(20.0)
    host_time.now = 0.002
    timeline.end_step(1, 1, at=after_backward, update_skipped=True)
    timeline.begin_step(2, "ddp", {}, at=after_backward)
    with timeline.phase("forward"):
        gpu.compute.run(10.0)
    host_time.now = 0.003
    timeline.end_step(1, 1)
    gpu.done_ms = 35.0
    first, second = timeline.completed_reports()
    (forward,) = second.spans
    assert 1e3 * first.start == pytest.approx(0.0) and 1e3 * first.end == pytest.approx(5.0)
    assert (1e3 * second.start, 1e3 * second.end) == (pytest.approx(5.0), pytest.approx(35.0))
    assert (1e3 * forward.start, 1e3 * forward.end) == (pytest.approx(25.0), pytest.approx(35.0))


def test_cuda_marks_record_on_the_stream_current_at_each_mark_building_each_stream_once(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """Marks are cheap on the host (one Stream object per stream, not per mark) yet still land on
    whichever stream is current: a user's side stream, or the callback's pool stream."""

    timeline = _cuda_timeline(gpu)
    side = FakeStream(gpu, "side")
    side.tail_ms = 20.0  # busy until 20 ms
    group = FakeProcessGroupNccl(gpu)
    for step in (1, 2):
        timeline.begin_step(step, "bucket", {})
        gpu.current = side
        with timeline.phase("forward"):
            side.run(5.0)  # runs 20-25 on the side stream, the first step; 25-30 the next
        gpu.current = gpu.compute
        span = timeline.open_collective("all_reduce", 64, "b0", "float32", blocking=False)
        timeline.close_collective(span, group.all_reduce(transfer_ms=1.0))
        timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 100.0

    first, second = timeline.completed_reports()
    forward = next(s for s in first.spans if s.kind == "forward")
    assert (forward.start, forward.end) == (pytest.approx(0.020), pytest.approx(0.025))
    forward = next(s for s in second.spans if s.kind == "forward")
    assert (forward.start, forward.end) == (pytest.approx(0.025), pytest.approx(0.030))
    # compute, side, and one pool stream per callback: each built once however many marks it took
    assert gpu.stream_objects_built == 2 + gpu.pool_streams


def test_cuda_completion_callback_that_raises_sends_its_step_unresolved_and_holds_nothing(gpu: FakeGpu, host_time: FakeHostTime) -> None:
    """An event that cannot be made inside the callback used to leave the span open forever,
    holding back every later report of the rank."""
    torch_ = gpu.torch()
    make_event = torch_.cuda.Event
    timeline = StepTimeline(rank=0, clock=CudaEventClock(torch_))
    group = FakeProcessGroupNccl(gpu)
    timeline.begin_step(1, "bucket", {})
    span = timeline.open_collective("all_reduce", 64, "b0", "float32", blocking=False)
    work = group.all_reduce(transfer_ms=1.0)
    torch_.cuda.Event = _raising("cudaErrorLaunchFailure")
    timeline.close_collective(span, work)
    torch_.cuda.Event = make_event
    with timeline.phase("optimizer"):
        gpu.compute.run(2.0)
    timeline.end_step(samples=1, tokens=1, loss=FakeCudaTensor(gpu, 1.0))
    timeline.begin_step(2, "bucket", {})
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 10.0

    first, second = timeline.completed_reports()
    assert (first.step, first.unresolved, [s.kind for s in first.spans]) == (1, True, ["optimizer"])
    assert first.unresolved_reason == "all_reduce b0 could not be timed: RuntimeError: cudaErrorLaunchFailure"
    assert first.loss is None and first.excluded is False
    assert (second.step, second.unresolved, second.unresolved_reason) == (2, False, "")
    assert timeline.unresolved_steps == 1


def test_host_work_that_cannot_say_whether_it_completed_sends_its_step_unresolved(host_time: FakeHostTime,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "async", {})
    span = timeline.open_collective("all_reduce", 4, "p0", "float32", blocking=False)
    work = FakeWork()
    timeline.close_collective(span, work)
    monkeypatch.setattr(work, "is_completed", _raising("work gone"))
    timeline.end_step(samples=1, tokens=1)  # a mark: it polls, and must not raise in the training loop
    (report,) = timeline.completed_reports()
    assert report.unresolved and report.spans == []


def test_a_completion_that_never_comes_is_sent_unresolved_after_the_limit(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.unresolved_after_steps = 3
    sent: list[StepReport] = []
    for step in range(1, 6):
        host_time.now = float(step)
        timeline.begin_step(step, "async", {})
        span = timeline.open_collective("all_reduce", 4, "p0", "float32", blocking=False)
        work = FakeWork()
        timeline.close_collective(span, work)
        work.completed = step != 1  # step 1's completion never comes
        timeline.end_step(samples=1, tokens=1)
        reports = timeline.completed_reports()
        if step < 4:
            assert reports == []  # held: it may still come
        sent += reports
    assert [(r.step, r.unresolved) for r in sent] == [(1, True), (2, False), (3, False), (4, False), (5, False)]
    assert sent[0].unresolved_reason == "1 timing mark had not completed 3 steps later"
    assert timeline.unresolved_steps == 1


def test_step_carrying_the_wrap_time_broadcast_is_excluded(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    span = timeline.open_collective("broadcast", 64, "state", "float32", blocking=True)  # wrap(), before any step
    timeline.close_collective(span, None)
    for step in (1, 2):
        timeline.begin_step(step, "bucket", {})
        timeline.end_step(samples=1, tokens=1)
    first, second = timeline.completed_reports()
    assert first.excluded and [s.tag for s in first.spans] == ["state"]
    assert not second.excluded


def _raising(message: str) -> Callable[..., Any]:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(message)

    return fail


