"""``StepBoundaries``, driven by hand: a step whose update was skipped (a loss scaler that found
inf or NaN calls no ``step()``) ends where its backward ended, once the next forward finds the
gradients that backward reduced cleared; what the loop issued after that backward is the next
step's."""

from __future__ import annotations

from typing import Any


def test_the_next_forward_finding_the_gradients_cleared_ends_the_step_at_its_backward(hand_driven_loop: Any,
                                                                                       spans: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.5, 3.0, forward)
    loop.zero_grad()  # the scaler skipped step()
    forward = loop.forward(4.0, 5.0)
    loop.backward(5.0, 6.0, forward)
    loop.step(6.5, 7.0)

    skipped, second = loop.reports()
    assert (skipped.start, skipped.end, skipped.update_skipped) == (1.0, 3.0, True)
    assert spans(skipped) == [("forward", 1.0, 2.0), ("backward", 2.5, 3.0)]
    assert (second.start, second.end, second.update_skipped) == (3.0, 7.0, False)
    assert spans(second) == [("data", 3.0, 4.0), ("forward", 4.0, 5.0), ("backward", 5.0, 6.0), ("optimizer", 6.0, 7.0)]


def test_gradients_zeroed_in_place_leave_the_skipped_step_merged_with_the_next(hand_driven_loop: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    loop.weight.grad.zero_()  # ``zero_grad(set_to_none=False)``: nothing to tell a skip by
    forward = loop.forward(4.0, 5.0)
    loop.backward(5.0, 6.0, forward)
    loop.step(6.0, 7.0)

    (merged,) = loop.reports()
    assert (merged.start, merged.end, merged.update_skipped, merged.settings["grad_accum"]) == (1.0, 7.0, False, 2)


def test_a_backward_that_did_not_reduce_is_not_found_skipped(hand_driven_loop: Any) -> None:
    loop = hand_driven_loop()
    loop.timing.reduces = False  # under ``no_sync``
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    loop.zero_grad()
    loop.forward(4.0, 5.0)
    assert loop.reports() == [] and loop.boundaries.steps == 1


def test_the_loops_collective_after_the_skipped_backward_opens_the_next_step_as_its_first(
        hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.5, 3.0, forward)
    boundaries, timeline = loop.at(3.5), loop.timeline  # the loss all-reduced for the log
    logged = timeline.open_collective("all_reduce", 4, boundaries.loop_call_tag(), "float32", True)
    boundaries.loop_call_opened(logged)
    loop.at(3.75)
    timeline.close_collective(logged, None)
    loop.zero_grad()
    forward = loop.forward(4.0, 5.0)
    assert loop.boundaries.loop_call_tag() == "l1"  # the next one of the step's
    loop.backward(5.0, 6.0, forward)
    loop.step(6.0, 7.0)

    skipped, second = loop.reports()
    assert spans(skipped) == [("forward", 1.0, 2.0), ("backward", 2.5, 3.0)]
    assert spans(second)[:2] == [("data", 3.0, 4.0), ("all_reduce", 3.5, 3.75)]
    assert [span.tag for span in second.spans if span.kind == "all_reduce"] == ["l0"]


def test_the_loops_collective_after_a_backward_the_update_followed_stays_in_its_step(
        hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    boundaries, timeline = loop.at(3.25), loop.timeline
    logged = timeline.open_collective("all_reduce", 4, boundaries.loop_call_tag(), "float32", True)
    boundaries.loop_call_opened(logged)
    loop.at(3.5)
    timeline.close_collective(logged, None)
    loop.step(4.0, 5.0)

    (report,) = loop.reports()
    assert spans(report) == [("forward", 1.0, 2.0), ("backward", 2.0, 3.0), ("optimizer", 3.0, 5.0),
                             ("all_reduce", 3.25, 3.5)]  # inside the update, which runs from the backward's end
