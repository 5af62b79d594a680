"""Unwatched steps: which ones the schedule holds (the same on every rank, from the step number),
and what a timeline records in them: the step's window and nothing else."""

from __future__ import annotations

import pytest

from instrumented_ddp.publish.span_policy import SpanPolicy
from instrumented_ddp.publish.watch_environment import WatchEnvironmentError, unwatched_blocks
from instrumented_ddp.timing.clocks import HostClock
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.timing.unwatched_blocks import NEVER_UNWATCHED, UnwatchedBlocks, parse_unwatched
from instrumented_ddp.wire.messages import SpanRequest
from timeline_fakes import FakeHostTime, FakeWork


def test_blocks_of_length_steps_every_every_steps_begin_at_half_of_every() -> None:
    blocks = UnwatchedBlocks(every=10, length=2)
    assert [step for step in range(1, 40) if blocks.holds(step)] == [5, 6, 15, 16, 25, 26, 35, 36]
    default = UnwatchedBlocks()  # 4 in 100 from step 50
    assert [step for step in range(1, 260) if default.holds(step)] == [50, 51, 52, 53, 150, 151, 152, 153, 250, 251, 252, 253]
    assert not any(NEVER_UNWATCHED.holds(step) for step in range(1, 1000))


@pytest.mark.parametrize("text, expected", [
    ("", UnwatchedBlocks()), ("0", NEVER_UNWATCHED), ("off", NEVER_UNWATCHED), ("50", UnwatchedBlocks(50, 4)),
    ("20:2", UnwatchedBlocks(20, 2)), (" 30:5 ", UnwatchedBlocks(30, 5)), ("0:3", NEVER_UNWATCHED),
])
def test_a_schedule_reads_as_every_or_every_colon_length(text: str, expected: UnwatchedBlocks) -> None:
    assert parse_unwatched(text) == expected


@pytest.mark.parametrize("text, says", [
    ("often", "give EVERY or EVERY:LENGTH"), ("10:10", "fewer than every"), ("10:0", "at least 1 step"),
    ("-5", "fewer than every"), ("4:x", "give EVERY or EVERY:LENGTH"),
])
def test_a_schedule_that_cannot_be_read_is_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as raised:
        parse_unwatched(text)
    assert "\n" not in str(raised.value)


def test_the_flag_wins_over_the_environment_and_a_bad_variable_is_named() -> None:
    assert unwatched_blocks("20:2", {"DDPWATCH_UNWATCHED": "off"}) == UnwatchedBlocks(20, 2)
    assert unwatched_blocks(None, {"DDPWATCH_UNWATCHED": "off"}) == NEVER_UNWATCHED
    assert unwatched_blocks(None, {}) == UnwatchedBlocks()
    with pytest.raises(WatchEnvironmentError, match="^DDPWATCH_UNWATCHED: unwatched blocks 'sometimes'"):
        unwatched_blocks(None, {"DDPWATCH_UNWATCHED": "sometimes"})
    with pytest.raises(WatchEnvironmentError, match="^--unwatched: "):
        unwatched_blocks("3:3", {})


def run_step(timeline: StepTimeline, host_time: FakeHostTime, step: int) -> FakeWork:
    """A step as a strategy marks it: a forward, a ready bucket, an asynchronous all-reduce, a
    wait and a backward phase; 1 s of fake time each."""
    host_time.now = 10.0 * step
    timeline.begin_step(step, "bucket", {"bucket_mb": 1.0})
    with timeline.phase("forward"):
        host_time.now += 1.0
        assert timeline.current_phase == "forward"
    timeline.mark_ready("b0", 400)
    span = timeline.open_collective("all_reduce", 400, "b0", "float32", blocking=False)
    work = FakeWork()
    timeline.close_collective(span, work)
    timeline.add_span("wait", host_time.now, host_time.now + 1.0, blocking=True)
    work.completed = True
    timeline.poll()
    host_time.now += 2.0
    timeline.end_step(samples=8, tokens=64, loss=0.5)
    return work


def test_an_unwatched_step_reports_its_window_loss_and_samples_and_no_span(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=1, clock=HostClock(), unwatched=UnwatchedBlocks(every=4, length=1))  # step 2, 6, ...
    for step in (1, 2, 3):
        run_step(timeline, host_time, step)
    reports = {report.step: report for report in timeline.completed_reports()}
    watched, unwatched = reports[1], reports[2]
    assert not watched.unwatched and {span.kind for span in watched.spans} == {"forward", "ready", "all_reduce", "wait"}
    assert unwatched.unwatched and unwatched.spans == []
    assert (unwatched.start, unwatched.end, unwatched.samples, unwatched.tokens, unwatched.loss) == (20.0, 23.0, 8, 64, 0.5)
    assert not unwatched.excluded and not unwatched.unresolved
    assert reports[3].spans and not reports[3].unwatched
    # every collective is numbered on its queue, unwatched ones too: a seq names the same call on every rank
    assert timeline.issued == {"": 3}
    assert timeline.current_phase == "" and timeline.watching


def test_an_unwatched_step_registers_no_completion_and_names_its_phase_while_it_runs(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock(), unwatched=UnwatchedBlocks(every=2, length=1))  # step 1, 3, ...
    host_time.now = 1.0
    timeline.begin_step(1, "async", {})
    assert not timeline.watching
    with timeline.phase("backward"):
        assert timeline.current_phase == "backward"
    span = timeline.open_collective("all_reduce", 40, "p0", "float32", blocking=False)
    work = FakeWork()  # never completes: a watched step would wait for it
    timeline.close_collective(span, work)
    assert timeline.unreported_collectives() == []  # nothing kept for the stall probe to look at either
    timeline.end_step(samples=1, tokens=1)
    [report] = timeline.completed_reports()
    assert report.unwatched and report.spans == [] and not timeline.has_pending()


def test_a_step_that_begins_with_spans_made_before_it_is_watched_whatever_the_schedule(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock(), unwatched=UnwatchedBlocks(every=2, length=1))
    host_time.now = 1.0
    span = timeline.open_collective("broadcast", 40, "buffers", "float32", blocking=True)  # a wrap-time broadcast
    timeline.close_collective(span, None)
    timeline.begin_step(1, "ddp", {})
    assert timeline.watching
    host_time.now = 2.0
    timeline.end_step(samples=1, tokens=1)
    [report] = timeline.completed_reports()
    assert not report.unwatched and [s.kind for s in report.spans] == ["broadcast"] and report.excluded


def test_a_pause_in_an_unwatched_step_is_told_before_from_inside_its_training_as_in_a_watched_one(
        host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock(), unwatched=UnwatchedBlocks(every=2, length=1))  # steps 1, 3
    host_time.now = 1.0
    timeline.begin_step(1, "simple", {})
    host_time.now = 4.0
    assert timeline.paused_until("evaluate", timeline.stamp())  # before training: the step starts at its end
    with timeline.phase("forward"):
        host_time.now = 5.0
    host_time.now = 6.0
    timeline.end_step(samples=1, tokens=1)
    timeline.begin_step(2, "simple", {})  # watched
    timeline.end_step(samples=1, tokens=1)
    host_time.now = 10.0
    timeline.begin_step(3, "simple", {})
    with timeline.phase("forward"):
        host_time.now = 11.0
    assert not timeline.paused_until("save", timeline.stamp())  # inside training: the step is excluded
    host_time.now = 12.0
    timeline.end_step(samples=1, tokens=1)
    before, _, inside = timeline.completed_reports()
    assert before.unwatched and not before.excluded and (before.start, before.paused_s, before.paused_for) == (4.0, 3.0, "evaluate")
    assert inside.unwatched and inside.excluded and inside.paused_for == "save" and inside.start == 10.0


def test_an_unwatched_report_goes_out_whole_and_is_not_held_for_a_pin(host_time: FakeHostTime) -> None:
    timeline = StepTimeline(rank=0, clock=HostClock(), unwatched=UnwatchedBlocks(every=2, length=1))
    run_step(timeline, host_time, 1)
    [report] = timeline.completed_reports()
    policy = SpanPolicy(world_size=2)
    policy.request = SpanRequest(full=False, sample_every=0)
    assert policy.messages_for(report) == [report] and policy.summaries == 0
    assert policy.on_request(SpanRequest(full=False, pinned_steps=[1])) == []
