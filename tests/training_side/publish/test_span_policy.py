"""A rank's choice between a step's spans and its summary (``instrumented_ddp.publish.span_policy``)."""

from __future__ import annotations

from instrumented_ddp.wire.messages import Span, SpanRequest, StepReport, StepSummary
from instrumented_ddp.publish.span_policy import SpanPolicy
from instrumented_ddp.wire.messages import HELD_STEPS
from instrumented_ddp.wire.step_figures import summarize


def _report(step: int) -> StepReport:
    return StepReport(
        rank=1, step=step, strategy="hook", settings={}, start=float(step), end=step + 0.5,
        spans=[Span("forward", float(step), step + 0.1), Span("all_reduce", step + 0.2, step + 0.3, True, 16, "p0", "float32")],
        samples=4, tokens=32, loss=1.0,
    )


def test_every_step_goes_out_whole_until_the_listener_asks_otherwise() -> None:
    policy = SpanPolicy(world_size=2)
    assert [policy.messages_for(_report(step)) for step in range(3)] == [[_report(step)] for step in range(3)]
    assert policy.summaries == 0


def test_a_sampling_request_sends_a_summary_of_every_step_and_every_nth_steps_spans_after_it() -> None:
    policy = SpanPolicy(world_size=2)
    assert policy.on_request(SpanRequest(full=False, sample_every=3)) == []
    sent = [policy.messages_for(_report(step)) for step in range(7)]
    assert [[type(m).__name__ for m in messages] for messages in sent] == [
        ["StepSummary", "StepReport"], ["StepSummary"], ["StepSummary"], ["StepSummary", "StepReport"],
        ["StepSummary"], ["StepSummary"], ["StepSummary", "StepReport"]]
    assert sent[1] == [summarize(_report(1), 2)]  # the same figures the dashboard would compute
    assert sent[3] == [summarize(_report(3), 2), _report(3)]  # the spans follow, for the listener to keep
    assert policy.summaries == 7


def test_a_pinned_step_still_held_goes_out_whole_once() -> None:
    policy = SpanPolicy(world_size=2)
    policy.on_request(SpanRequest(full=False))
    for step in range(5):
        assert [type(m) for m in policy.messages_for(_report(step))] == [StepSummary]
    request = SpanRequest(full=False, pinned_steps=[1, 3, 99])
    assert policy.on_request(request) == [_report(1), _report(3)]
    assert policy.on_request(request) == []  # the request is resent every few seconds


def test_a_step_already_sent_whole_is_not_sent_again_when_pinned() -> None:
    policy = SpanPolicy(world_size=2)
    policy.messages_for(_report(0))  # whole: nobody asked yet
    policy.on_request(SpanRequest(full=False))
    policy.messages_for(_report(1))
    assert policy.on_request(SpanRequest(full=False, pinned_steps=[0, 1])) == [_report(1)]


def test_only_the_last_held_steps_can_be_pinned() -> None:
    policy = SpanPolicy(world_size=2)
    policy.on_request(SpanRequest(full=False))
    for step in range(HELD_STEPS + 2):
        policy.messages_for(_report(step))
    assert policy.on_request(SpanRequest(full=False, pinned_steps=[0, 1, 2])) == [_report(2)]


def test_a_report_the_figures_cannot_take_goes_out_whole() -> None:
    policy = SpanPolicy(world_size=2)
    policy.on_request(SpanRequest(full=False))
    odd = StepReport(rank=1, step=0, strategy="hook", settings={}, start=0.0, end=1.0,
                     spans=[Span("forward", "0.5", 1.0)],  # type: ignore[arg-type]  # a start no figure can subtract from
                     samples=1, tokens=1, loss=1.0)
    assert policy.messages_for(odd) == [odd]
    assert policy.summaries == 0
