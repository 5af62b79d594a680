"""A rank's timeline: spans land in the right step, asynchronous work ends when it completes,
and a step report waits until every mark of its step has resolved."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import instrumented_ddp
from instrumented_ddp import timeline as timeline_module
from instrumented_ddp.forwarding_group import ForwardingGroup
from instrumented_ddp.protocol import COMM_KINDS, Span, StepReport
from instrumented_ddp.timeline import CudaEventClock, HostClock, StepTimeline
from nccl_fakes import FakeCudaTensor, FakeGpu, FakeNcclWork, FakeProcessGroupNccl, FakeStream


class FakeHostTime:
    """Stands in for the ``time`` module inside ``instrumented_ddp.timeline``: the test sets the clock."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def host_time(monkeypatch: pytest.MonkeyPatch) -> FakeHostTime:
    fake = FakeHostTime()
    monkeypatch.setattr(timeline_module, "time", fake)
    return fake


class FakeFuture:
    """Keeps the callbacks so the test decides when the collective completes."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], Any]] = []

    def add_done_callback(self, callback: Callable[[Any], Any]) -> None:
        self.callbacks.append(callback)

    def then(self, callback: Callable[[Any], Any]) -> FakeFuture:
        self.callbacks.append(callback)
        return FakeFuture()

    def fire(self) -> None:
        for callback in self.callbacks:
            callback(self)


class FakeWork:
    """A gloo work as the CPU clock sees it: ``is_completed()`` turns true when the test says."""

    def __init__(self, duration_ms: float | None = None) -> None:
        self.future = FakeFuture()
        self.duration_ms = duration_ms
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed

    def get_future(self) -> FakeFuture:
        return self.future

    def _get_duration(self) -> float:
        if self.duration_ms is None:
            raise RuntimeError("TORCH_NCCL_ENABLE_TIMING is not set")
        return self.duration_ms


def _only_report(timeline: StepTimeline) -> StepReport:
    reports = timeline.completed_reports()
    assert len(reports) == 1, reports
    return reports[0]


def _kinds(report: StepReport, kind: str) -> list[Span]:
    return [span for span in report.spans if span.kind == kind]


def _inside(inner: Span, outer: Span) -> bool:
    return outer.start <= inner.start and inner.end <= outer.end


# -- HostClock -----------------------------------------------------------------------------------


def test_synchronous_collective_is_a_blocking_span_ending_at_close(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=3, clock=HostClock())
    host_time.now = 1.0
    timeline.begin_step(5, "hook", {})
    host_time.now = 2.0
    span = timeline.open_collective("all_reduce", 40, "p0", "float32", blocking=True)
    host_time.now = 3.0
    timeline.close_collective(span, None)
    host_time.now = 4.0
    timeline.end_step(samples=8, tokens=64)

    report = _only_report(timeline)
    assert report.spans == [Span("all_reduce", 2.0, 3.0, True, 40, "p0", "float32")]
    assert (report.rank, report.step, report.start, report.end) == (3, 5, 1.0, 4.0)


def test_asynchronous_collective_holds_its_step_until_a_poll_sees_it_completed(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    host_time.now = 1.0
    timeline.begin_step(1, "async", {})
    host_time.now = 2.0
    span = timeline.open_collective("all_reduce", 400, "p1", "float32", blocking=False)
    work = FakeWork()
    host_time.now = 2.5
    timeline.close_collective(span, work)
    host_time.now = 4.0
    timeline.end_step(samples=1, tokens=1)

    assert timeline.completed_reports() == []
    assert timeline.has_pending()
    work.completed = True
    host_time.now = 7.0
    report = _only_report(timeline)  # reading the reports looks, on this thread, at 7.0
    # seen running at 4.0 (the end_step mark and the read before), completed at 7.0: the middle
    assert report.spans == [Span("all_reduce", 2.0, 5.5, False, 400, "p1", "float32")]
    assert not timeline.has_pending()


def test_host_clock_puts_nothing_on_gloos_thread_and_ends_a_collective_between_two_looks_or_at_its_wait(
        host_time: FakeHostTime) -> None:
    """No completion callback (it needs the GIL on gloo's thread: see ``HostClock``). A work seen
    completed at a look ended in the middle of it and the look before (or its issue); the one
    whose ``wait()`` just returned ended then, exactly."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "async", {})
    host_time.now = 1.0
    works = []
    for tag in ("p0", "p1", "p2"):
        span = timeline.open_collective("all_reduce", 4, tag, "float32", blocking=False)  # a mark: a look
        works.append(FakeWork())
        timeline.close_collective(span, works[-1])
        if tag == "p0":
            works[0].completed = True  # before the next mark, issued at 1.0: (1.0 + 2.0) / 2
            host_time.now = 2.0
    host_time.now = 3.0
    timeline.poll()  # a gradient hook: p1 and p2 still running
    works[1].completed = True
    host_time.now = 3.5
    timeline.poll()  # p1 seen completed: (3.0 + 3.5) / 2
    host_time.now = 5.0
    works[2].completed = True
    timeline.poll(waited=works[2])  # p2's wait returned at 5.0: its end, not the middle (4.25)
    host_time.now = 6.0
    timeline.end_step(samples=1, tokens=1)

    assert all(work.future.callbacks == [] for work in works)
    report = _only_report(timeline)
    assert [(s.tag, s.end) for s in _kinds(report, "all_reduce")] == [("p0", 1.5), ("p1", 3.25), ("p2", 5.0)]


def test_host_clock_stops_looking_past_as_many_running_collectives_as_gloo_has_workers(host_time: FakeHostTime) -> None:
    """Gloo's two workers take collectives in issue order: with the first two still running, no
    later one has started, so a rank far behind pays for two looks a mark, not one per work."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "async", {})
    looked: list[str] = []
    works = []
    for tag in ("p0", "p1", "p2", "p3"):
        span = timeline.open_collective("all_reduce", 4, tag, "float32", blocking=False)
        work = FakeWork()
        work.is_completed = lambda tag=tag, work=work: looked.append(tag) or work.completed  # type: ignore[method-assign]
        timeline.close_collective(span, work)
        works.append(work)
    looked.clear()
    timeline.poll()
    assert looked == ["p0", "p1"]
    works[1].completed = True
    looked.clear()
    timeline.poll()  # p1 done: a worker is free, so p2 may be running; p3 still cannot be
    assert looked == ["p0", "p1", "p2"]
    for work in works:
        work.completed = True
    host_time.now = 1.0
    timeline.end_step(samples=1, tokens=1)
    assert [s.tag for s in _kinds(_only_report(timeline), "all_reduce")] == ["p0", "p1", "p2", "p3"]


def test_host_clock_looks_at_a_collective_on_another_groups_queue_past_this_groups_running_ones(
        host_time: FakeHostTime) -> None:
    """Another process group has gloo workers of its own (HSDP's replicate group): with two of
    this group's still running, its collective may have run and ended, so it is still looked at,
    and ends between the two looks (2.0 and 4.0: 3.0), not at the first look after this group's."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "fsdp", {})
    busy = [FakeWork(), FakeWork()]
    for tag, work in zip(("u2", "u1"), busy):
        timeline.close_collective(timeline.open_collective("reduce_scatter", 4, tag, "float32", blocking=False), work)
    across = FakeWork()
    host_time.now = 1.0
    timeline.close_collective(timeline.open_collective("all_reduce", 4, "u2", "float32", blocking=False, queue="replicas"),
                              across)
    host_time.now = 2.0
    timeline.poll()
    across.completed = True
    host_time.now = 4.0
    timeline.poll()
    for work in busy:
        work.completed = True
    host_time.now = 6.0
    timeline.end_step(samples=1, tokens=1)
    (all_reduce,) = _kinds(_only_report(timeline), "all_reduce")
    assert (all_reduce.start, all_reduce.end) == (1.0, 3.0)


def test_asynchronous_collective_end_with_the_real_host_clock_is_when_its_wait_returned() -> None:
    timeline = StepTimeline(rank=0)
    timeline.begin_step(1, "async", {})
    span = timeline.open_collective("all_reduce", 4, "p0", "float32", blocking=False)
    work = FakeWork()
    timeline.close_collective(span, work)
    work.completed = True
    before_wait_returned = time.perf_counter()
    timeline.poll(waited=work)
    after_wait_returned = time.perf_counter()
    timeline.end_step(samples=1, tokens=1)
    (collective,) = _only_report(timeline).spans
    assert before_wait_returned <= collective.end <= after_wait_returned


def test_phases_nest_with_their_collectives(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "hook", {})
    host_time.now = 1.0
    with timeline.phase("backward"):
        host_time.now = 2.0
        span = timeline.open_collective("all_reduce", 4, "p0", "float32", blocking=True)
        host_time.now = 3.0
        timeline.close_collective(span, None)
        with timeline.phase("wait", blocking=True):
            host_time.now = 4.0
        host_time.now = 5.0
    host_time.now = 6.0
    timeline.end_step(samples=1, tokens=1)

    report = _only_report(timeline)
    (backward,) = _kinds(report, "backward")
    (all_reduce,) = _kinds(report, "all_reduce")
    (wait,) = _kinds(report, "wait")
    assert (backward.start, backward.end, backward.blocking) == (1.0, 5.0, False)
    assert (wait.start, wait.end, wait.blocking) == (3.0, 4.0, True)
    assert _inside(all_reduce, backward) and _inside(wait, backward)


def test_phase_is_recorded_even_when_its_body_raises(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "simple", {})
    with pytest.raises(RuntimeError), timeline.phase("forward"):
        host_time.now = 1.0
        raise RuntimeError("out of memory")
    timeline.end_step(samples=1, tokens=1)
    assert [span.kind for span in _only_report(timeline).spans] == ["forward"]


def test_spans_before_begin_step_join_the_next_step_and_widen_its_window(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    host_time.now = 0.5
    span = timeline.open_collective("broadcast", 1024, "state", "float32", blocking=True)
    host_time.now = 0.75
    timeline.close_collective(span, None)
    host_time.now = 2.0
    timeline.begin_step(1, "ddp", {})
    host_time.now = 3.0
    timeline.end_step(samples=1, tokens=1)
    host_time.now = 4.0
    timeline.begin_step(2, "ddp", {})
    host_time.now = 5.0
    timeline.end_step(samples=1, tokens=1)

    first, second = timeline.completed_reports()
    assert first.spans == [Span("broadcast", 0.5, 0.75, True, 1024, "state", "float32")]
    assert (first.start, first.end) == (0.5, 3.0)
    assert second.spans == [] and (second.start, second.end) == (4.0, 5.0)


def test_excluded_loss_samples_and_settings_reach_the_report(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=1, clock=HostClock())
    settings = {"bucket_mb": 25.0}
    timeline.begin_step(9, "ddp", settings)
    settings["bucket_mb"] = 1.0  # the report keeps the settings of its own step
    timeline.end_step(samples=16, tokens=2048, loss=torch.tensor(2.5), excluded=True)

    report = _only_report(timeline)
    assert report.excluded is True
    assert type(report.loss) is float and report.loss == 2.5
    assert (report.samples, report.tokens, report.strategy, report.settings) == (16, 2048, "ddp", {"bucket_mb": 25.0})


def test_a_step_in_which_torch_compile_compiled_is_marked_compiling_and_excluded(host_time: FakeHostTime) -> None:
    """Dynamo's count of compiled graphs moves in a step only where that step compiled: the first
    call of a compiled function, and a call whose guard fails (here a new input shape); a cached
    call, or a compile between two steps, leaves the step counted."""
    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    timeline = StepTimeline(rank=0, clock=HostClock())
    calls = {1: [torch.ones(2)], 2: [torch.ones(2)], 3: [torch.ones(3)], 4: []}  # step 3: a new shape
    for step, inputs in calls.items():
        timeline.begin_step(step, "ddp", {})
        for x in inputs:
            compiled(x)
        timeline.end_step(samples=1, tokens=1)
        if step == 3:
            torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))  # between steps 3 and 4
    reports = timeline.completed_reports()
    assert [(r.compiling, r.excluded) for r in reports] == [(True, True), (False, False), (True, True), (False, False)]


def test_collectives_issued_beyond_the_timed_ones_are_reported_untimed(host_time: FakeHostTime) -> None:
    """Every timed collective kind counts against what the step issued; phases do not; a step
    whose issued count is unknown reports 0; never fewer than none."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    for step, issued in ((1, 6), (2, None), (3, 1)):
        timeline.begin_step(step, "fsdp", {})
        with timeline.phase("forward"):
            for kind in ("all_gather", "reduce_scatter", "broadcast"):
                timeline.close_collective(timeline.open_collective(kind, 4, "u0", "float32", blocking=True), None)
        timeline.end_step(samples=1, tokens=1, issued_collectives=issued)
    assert [r.untimed_collectives for r in timeline.completed_reports()] == [3, 0, 0]


def test_a_pause_between_steps_moves_the_next_steps_start_to_its_end_and_takes_what_it_issued(host_time: FakeHostTime) -> None:
    """Step 1 ends at 1.0 and step 2 begins there; the loop evaluates, issuing a gather (1.2-1.3),
    until 3.0, then saves until 3.5: step 2's window is 3.5-4.0, and it was paused 3.5 - 1.0 =
    2.5 s, for both; the gather is the pause's, not the step's."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "ddp", {})
    host_time.now = 1.0
    timeline.end_step(samples=1, tokens=1)
    timeline.begin_step(2, "ddp", {}, at=1.0)
    host_time.now = 1.2
    gather = timeline.open_collective("all_gather", 8, "", "float32", blocking=True)
    host_time.now = 1.3
    timeline.close_collective(gather, None)
    timeline.paused_until("evaluate", 3.0)
    timeline.paused_until("save", 3.5)
    host_time.now = 3.6
    with timeline.phase("forward"):
        host_time.now = 3.9
    host_time.now = 4.0
    timeline.end_step(samples=1, tokens=1, issued_collectives=0)

    first, second = timeline.completed_reports()
    assert (first.paused_s, first.paused_for) == (0.0, "")
    assert (second.start, second.end) == (3.5, 4.0)
    assert second.paused_s == pytest.approx(2.5) and second.paused_for == "evaluate, save"
    assert [s.kind for s in second.spans] == ["forward"] and not second.excluded


def test_the_collectives_a_step_timed_so_far_are_counted_afresh_after_a_pause_took_its_spans(host_time: FakeHostTime) -> None:
    """``timed_collectives`` looks only at spans added since it was last asked (asked at each data
    gap's ends of an attached loop): here the gather counted before the pause is the pause's,
    and the two all-reduces after it are the step's; a forward is not a collective."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    assert timeline.timed_collectives() == 0  # outside a step
    timeline.begin_step(1, "ddp", {})
    host_time.now = 1.0
    timeline.end_step(samples=1, tokens=1)
    timeline.begin_step(2, "ddp", {}, at=1.0)
    timeline.close_collective(timeline.open_collective("all_gather", 8, "", "float32", blocking=True), None)
    assert timeline.timed_collectives() == 1
    host_time.now = 2.0
    timeline.paused_until("evaluate", 2.0)
    assert timeline.timed_collectives() == 0
    with timeline.phase("forward"):
        host_time.now = 2.5
    for tag in ("b0", "b1"):
        timeline.close_collective(timeline.open_collective("all_reduce", 8, tag, "float32", blocking=True), None)
        assert timeline.timed_collectives() == int(tag[1]) + 1
    host_time.now = 3.0
    timeline.end_step(samples=1, tokens=1, issued_collectives=3)
    assert [r.untimed_collectives for r in timeline.completed_reports()] == [0, 1]


def test_what_torch_compile_compiled_in_a_pause_is_the_pauses_not_the_steps(host_time: FakeHostTime) -> None:
    """An evaluation under ``no_grad`` compiles a compiled model again (a guard on grad mode):
    that compile is the pause's, and the step after it, which compiled nothing, is counted."""
    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    compiled(torch.ones(2))
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "ddp", {})
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))  # the evaluation's compile
    host_time.now = 1.0
    timeline.paused_until("evaluate", 1.0)
    compiled(torch.ones(2))  # cached
    host_time.now = 2.0
    timeline.end_step(samples=1, tokens=1)
    report = _only_report(timeline)
    assert not report.compiling and not report.excluded and report.paused_for == "evaluate"


def test_a_pause_inside_a_step_excludes_it_and_a_pause_before_any_step_is_nothing(host_time: FakeHostTime) -> None:
    """Between micro-steps the pause is in the window (nothing moves, 0 s reported), and the step
    is left out; with no step begun there is nothing to keep apart."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.paused_until("evaluate", 0.5)  # before the first step: ignored
    host_time.now = 1.0
    timeline.begin_step(1, "ddp", {})
    with timeline.phase("forward"):
        host_time.now = 2.0
    timeline.paused_until("evaluate", 3.0)
    host_time.now = 4.0
    timeline.end_step(samples=1, tokens=1)

    report = _only_report(timeline)
    assert (report.start, report.end, report.paused_s, report.paused_for) == (1.0, 4.0, 0.0, "evaluate")
    assert report.excluded


def test_step_without_loss_reports_none(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "simple", {})
    timeline.end_step(samples=1, tokens=1)
    report = _only_report(timeline)
    assert report.loss is None and report.excluded is False


def test_reports_come_out_oldest_first_and_a_held_step_holds_the_later_ones(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    works = []
    for step in (1, 2, 3):
        host_time.now = float(step)
        timeline.begin_step(step, "async", {})
        span = timeline.open_collective("all_reduce", 4, "p0", "float32", blocking=False)
        work = FakeWork()
        timeline.close_collective(span, work)
        works.append(work)
        host_time.now = step + 0.5
        timeline.end_step(samples=1, tokens=1)

    works[2].completed = works[1].completed = True
    assert timeline.completed_reports() == []  # step 1 still in flight
    works[0].completed = True
    assert [report.step for report in timeline.completed_reports()] == [1, 2, 3]
    assert timeline.completed_reports() == []


def test_end_step_without_begin_step_reports_nothing(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.end_step(samples=1, tokens=1)
    assert timeline.completed_reports() == [] and not timeline.has_pending()


# -- CudaEventClock against fakes that behave like NCCL (tests/nccl_fakes.py says from what) ----------


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

    report = _only_report(timeline)
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
    report = _only_report(timeline)
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

    def wait_ends(self, start: Any) -> None:
        self.timeline.add_span("wait", start, self.timeline.stamp(), blocking=True)


@pytest.mark.parametrize("nccl_timing", [False, True], ids=["queue-replay", "nccl-timing"])
def test_a_loops_asynchronous_nccl_collectives_read_their_transfer_and_its_waits_the_streams_stall(
        gpu: FakeGpu, host_time: FakeHostTime, nccl_timing: bool) -> None:
    """ZeroRedundancyOptimizer's way on NCCL: three 4 ms broadcasts issued at 1, 2 and 3 ms (they
    run 1-5, 5-9 and 9-13 ms), then each waited in turn from 3.5 ms. ``wait()`` on NCCL makes the
    compute stream wait and the host not: the three ``wait`` spans are where the compute stream
    sat (3.5-5, 5-9, 9-13 ms), read from events, the host never made to wait for the device."""
    from instrumented_ddp.collectives import WaitedByTheLoop

    timeline = _cuda_timeline(gpu, nccl_timing)
    group = FakeProcessGroupNccl(gpu, timing=nccl_timing)
    timeline.begin_step(1, "ddp", {})
    handed: list[WaitedByTheLoop] = []
    for index in range(3):
        gpu.host_ms = 1.0 + index
        span = timeline.open_collective("broadcast", 1 << 20, f"l{index}", "float32", blocking=False)
        work = group.all_reduce(transfer_ms=4.0)
        timeline.close_collective(span, work)
        handed.append(WaitedByTheLoop(work, timeline, StepWaits(timeline)))
    gpu.host_ms = 3.5
    for work in handed:
        work.wait()
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 12.0
    assert timeline.completed_reports() == []
    gpu.done_ms = 13.0

    report = _only_report(timeline)
    as_ms = lambda spans: [(round(s.start * 1e3, 6), round(s.end * 1e3, 6)) for s in spans]  # noqa: E731
    assert as_ms(_kinds(report, "broadcast")) == [(1.0, 5.0), (5.0, 9.0), (9.0, 13.0)]
    assert as_ms(_kinds(report, "wait")) == [(3.5, 5.0), (5.0, 9.0), (9.0, 13.0)]
    assert all(s.blocking for s in _kinds(report, "wait")) and gpu.synchronizations == 0
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

    report = _only_report(timeline)
    collectives = _kinds(report, "all_reduce")
    assert [(round(s.start * 1e3, 6), round(s.end * 1e3, 6)) for s in collectives] == [(1.0, 5.0), (5.0, 9.0), (9.0, 13.0)]
    assert [work.early_duration_reads for work in works] == [0, 0, 0]  # never read before completion
    # with NCCL's durations no .then for timing at all; a DDP hook's own .then is the only one
    assert gpu.pool_streams == (3 if through_ddp_hook or not nccl_timing else 0)
    (wait,) = _kinds(report, "wait")  # the compute stream sat from 3.5 ms until the last bucket ended
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
    collectives = _kinds(_only_report(timeline), "all_reduce")
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
    report = _only_report(timeline)
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
        timeline.close_collective(span, group.all_reduce_synchronously(transfer_ms=4.0))
        gpu.compute.run(1.0)
    timeline.end_step(samples=1, tokens=1)
    gpu.done_ms = 11.0  # the second all-reduce is still running
    assert timeline.completed_reports() == []
    gpu.done_ms = 13.0
    collectives = _kinds(_only_report(timeline), "all_reduce")
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
    (collective,) = _only_report(timeline).spans
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
    report = _only_report(timeline)
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
    report = _only_report(timeline)
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
    assert _only_report(timeline).loss == 2.5
    assert gpu.synchronizations == 0


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


# -- a real strategy on a one-rank gloo group ---------------------------------------------------------


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
    (backward,) = _kinds(report, "backward")
    all_reduces = _kinds(report, "all_reduce")
    assert len(all_reduces) == trainable
    assert sorted(span.tag for span in all_reduces) == sorted(f"p{i}" for i in range(trainable))
    assert all(span.blocking for span in all_reduces)
    assert all(_inside(span, backward) for span in all_reduces)
    assert {span.dtype for span in all_reduces} == {"float32"} and all(span.nbytes > 0 for span in all_reduces)
    # The wrap-time broadcast happened before the step and is reported with it.
    assert [span.tag for span in _kinds(report, "broadcast")] == ["state"]
    assert report.loss is not None and report.start <= min(span.start for span in report.spans)


def test_async_strategy_reports_non_blocking_all_reduces_and_a_blocking_wait(one_rank_group: None) -> None:
    report, trainable = _run_one_step("async")
    (backward,) = _kinds(report, "backward")
    all_reduces = _kinds(report, "all_reduce")
    assert len(all_reduces) == trainable
    assert not any(span.blocking for span in all_reduces)
    # issued during backward: the ready marks are the issue stamps (a span's own start is when a
    # gloo worker took it, which on a loaded machine can be after backward ended)
    issued = {s.tag: s.start for s in _kinds(report, "ready")}
    assert sorted(issued) == sorted(s.tag for s in all_reduces)
    assert all(backward.start <= issued[span.tag] <= min(span.start, backward.end) for span in all_reduces)
    waits = _kinds(report, "wait")
    assert len(waits) == 1 and waits[0].blocking
    assert waits[0].start >= backward.end
    assert all(span.kind in {"forward", "backward", "wait", "ready", *COMM_KINDS} for span in report.spans)


@pytest.mark.parametrize(("strategy", "prefix"), [("hook", "p"), ("async", "p"), ("bucket", "b"), ("ddp", "b")])
def test_gradient_ready_marks_cover_every_gradient_once_inside_backward(one_rank_group: None, strategy: str, prefix: str) -> None:
    """What the bucket advisor replays backward from: per parameter where a hook reduces each
    one (the collective's own issue stamp), per bucket where buckets are (when the last of its
    gradients arrived; for DDP, when it handed the bucket to the hook)."""
    report, _ = _run_one_step(strategy)
    (backward,) = _kinds(report, "backward")
    ready = _kinds(report, "ready")
    assert ready and all(s.start == s.end and not s.blocking and backward.start <= s.start <= backward.end for s in ready)
    assert {s.tag[0] for s in ready} == {prefix} and len({s.tag for s in ready}) == len(ready)
    assert sum(s.nbytes for s in ready) == (4 * 8 + 8 + 8 + 1) * 4  # every float32 gradient, once
    issued = {s.tag: s for s in _kinds(report, "all_reduce")}
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
    wrapped = instrumented_ddp.wrap(model, "ddp", timeline=timeline, find_unused_parameters=find_unused_parameters)
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
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        for report in timeline.completed_reports()[1:]:
            (backward,) = _kinds(report, "backward")
            all_reduces = _kinds(report, "all_reduce")
            assert all_reduces and all(backward.start <= s.start <= s.end <= backward.end for s in all_reduces)

        silent_peer, _idle_peer = _gloo_group_whose_peer_never_answers(timeout_s=0.5)
        if find_unused_parameters:
            wrapped._timing.process_group = silent_peer
        else:
            wrapped.ddp.process_group.inner = silent_peer
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
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()
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
    from instrumented_ddp.ddp_timing import parameters_to_look_from

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
            (forward,) = _kinds(report, "forward")
            (buffers,) = [span for span in _kinds(report, "broadcast") if span.tag == "buffers"]
            assert buffers.blocking and _inside(buffers, forward)
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
    from instrumented_ddp import ddp_timing

    monkeypatch.setattr(ddp_timing.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(ddp_timing.dist, "get_world_size", lambda group=None: 2)
    wrapped = instrumented_ddp.wrap(nn.Linear(2, 1), "ddp", timeline=StepTimeline(0))
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

        timing.process_group = RecordingGroup()
        future = timing._all_reduce_hook()(None, _FakeGradBucket([2.0, 4.0]))
        (sent, op), = issued
        assert op == expected_op and sent.tolist() == expected_buffer
        assert future.wait().tolist() == expected_buffer
    finally:
        instrumented_ddp.unwrap(wrapped)
