"""A rank's timeline on the host's clock: spans land in the right step, asynchronous work ends
when it completes, and a step report waits until every mark of its step has resolved. On CUDA
events against fakes that behave like NCCL: ``test_timeline_cuda.py``; the strategies' own
timelines on a one-rank gloo group: ``test_timeline_strategies.py``."""

from __future__ import annotations

import time

import pytest
import torch

from instrumented_ddp.wire.messages import Span
from instrumented_ddp.timing.clocks import HostClock
from instrumented_ddp.timing.step_reports import data_outside_loop_compute
from instrumented_ddp.timing.timeline import StepTimeline
from timeline_fakes import FakeHostTime, FakeWork, inside, kinds_of, only_report



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

    report = only_report(timeline)
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
    report = only_report(timeline)  # reading the reports looks, on this thread, at 7.0
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
    report = only_report(timeline)
    assert [(s.tag, s.end) for s in kinds_of(report, "all_reduce")] == [("p0", 1.5), ("p1", 3.25), ("p2", 5.0)]


def test_several_collectives_of_a_queue_seen_completed_at_one_look_end_in_turn_across_it_not_all_in_its_middle(
        host_time: FakeHostTime) -> None:
    """By hand: p0, p1, p2 issued at 0, 1 and 2 ms (gloo's two workers take p0 and p1; p2 waits for
    one), still running at the look at 3 ms, all seen completed at 10 ms. Given one end, the middle
    (6.5), the replay started p2 when a worker freed, at 6.5 too: 0 ms long. Now the i-th of the
    three ends at 3 + 7 * i / 4: 4.75, 6.5 and 8.25 ms, and p2 starts when p0 ends, at 4.75."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "async", {})
    works = []
    for index, tag in enumerate(("p0", "p1", "p2")):
        host_time.now = index * 0.001
        span = timeline.open_collective("all_reduce", 4, tag, "float32", blocking=False)
        works.append(FakeWork())
        timeline.close_collective(span, works[-1])
    host_time.now = 0.003
    timeline.poll()
    for work in works:
        work.completed = True
    host_time.now = 0.010
    timeline.poll()
    timeline.end_step(samples=1, tokens=1)
    spans = [(s.tag, round(1e3 * s.start, 6), round(1e3 * s.end, 6)) for s in kinds_of(only_report(timeline), "all_reduce")]
    assert spans == [("p0", 0.0, 4.75), ("p1", 1.0, 6.5), ("p2", 4.75, 8.25)]


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

        def is_completed(tag: str = tag, work: FakeWork = work) -> bool:
            looked.append(tag)
            return work.completed

        work.is_completed = is_completed  # type: ignore[method-assign]
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
    assert [s.tag for s in kinds_of(only_report(timeline), "all_reduce")] == ["p0", "p1", "p2", "p3"]


def test_host_clock_looks_at_a_collective_on_another_groups_queue_past_this_groups_running_ones(
        host_time: FakeHostTime) -> None:
    """Another process group has gloo workers of its own (HSDP's replicate group): with two of
    this group's still running, its collective may have run and ended, so it is still looked at,
    and ends between the two looks (2.0 and 4.0: 3.0), not at the first look after this group's."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "fsdp", {})
    busy = [FakeWork(), FakeWork()]
    for tag, work in zip(("u2", "u1"), busy, strict=True):
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
    (all_reduce,) = kinds_of(only_report(timeline), "all_reduce")
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
    (collective,) = only_report(timeline).spans
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

    report = only_report(timeline)
    (backward,) = kinds_of(report, "backward")
    (all_reduce,) = kinds_of(report, "all_reduce")
    (wait,) = kinds_of(report, "wait")
    assert (backward.start, backward.end, backward.blocking) == (1.0, 5.0, False)
    assert (wait.start, wait.end, wait.blocking) == (3.0, 4.0, True)
    assert inside(all_reduce, backward) and inside(wait, backward)


def test_phase_is_recorded_even_when_its_body_raises(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "simple", {})
    with pytest.raises(RuntimeError), timeline.phase("forward"):
        host_time.now = 1.0
        raise RuntimeError("out of memory")
    timeline.end_step(samples=1, tokens=1)
    assert [span.kind for span in only_report(timeline).spans] == ["forward"]


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

    report = only_report(timeline)
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
    report = only_report(timeline)
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

    report = only_report(timeline)
    assert (report.start, report.end, report.paused_s, report.paused_for) == (1.0, 4.0, 0.0, "evaluate")
    assert report.excluded


def test_step_without_loss_reports_none(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.begin_step(1, "simple", {})
    timeline.end_step(samples=1, tokens=1)
    report = only_report(timeline)
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


def test_a_step_whose_figures_raise_as_they_are_read_goes_out_unresolved_and_holds_none_after_it(
        host_time: FakeHostTime) -> None:
    """Reading runs inside the loop's ``optimizer.step()``: a figure that raises there (tokens of
    inf, ``int()`` of it an OverflowError) raised into the loop at that step and at every one after,
    the step held at the head of the queue."""
    timeline = StepTimeline(rank=0, clock=HostClock())
    for step, tokens in ((1, 8), (2, torch.tensor(float("inf"))), (3, 8)):
        host_time.now = float(step)
        timeline.begin_step(step, "ddp", {})
        with timeline.phase("forward"):
            host_time.now = step + 0.25
        host_time.now = step + 0.5
        timeline.end_step(samples=2, tokens=tokens)
    reports = timeline.completed_reports()
    assert [(r.step, r.unresolved, r.tokens) for r in reports] == [(1, False, 8), (2, True, 0), (3, False, 8)]
    assert (reports[1].start, reports[1].end, reports[1].spans, reports[1].samples) == (2.0, 2.5, [], 2)
    assert reports[1].unresolved_reason == "could not be read: OverflowError: cannot convert float infinity to integer"
    assert timeline.unresolved_steps == 1 and not timeline.has_pending()


def test_end_step_without_begin_step_reports_nothing(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock())
    timeline.end_step(samples=1, tokens=1)
    assert timeline.completed_reports() == [] and not timeline.has_pending()


def test_data_is_cut_around_the_loops_marked_compute_in_place_and_nothing_else_moves() -> None:
    """By hand: data 0-10 with marked compute 2-3 and 5-7 in it becomes 0-2, 3-5 and 7-10, where
    the data span was; a data span the marks cover whole goes; other spans stay as they were."""
    spans = [Span("data", 0.0, 10.0), Span("loop", 2.0, 3.0, tag="ema"), Span("forward", 10.0, 12.0),
             Span("loop", 5.0, 7.0, tag="teacher"), Span("data", 12.0, 13.0), Span("loop", 11.5, 13.5)]
    assert data_outside_loop_compute(spans) == [
        Span("data", 0.0, 2.0), Span("data", 3.0, 5.0), Span("data", 7.0, 10.0), Span("loop", 2.0, 3.0, tag="ema"),
        Span("forward", 10.0, 12.0), Span("loop", 5.0, 7.0, tag="teacher"), Span("loop", 11.5, 13.5)]
    unmarked = [Span("data", 0.0, 1.0), Span("forward", 1.0, 2.0)]
    assert data_outside_loop_compute(unmarked) is unmarked
