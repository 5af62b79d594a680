"""``StepBoundaries``, driven by hand: a pause of training between steps (an evaluation marked
``paused``) begins the next step where it ended, reported with it in no figure; one between
micro-steps leaves its step out of the figures. A forward without gradients outside a pause is
counted in the step whose data time it falls in."""

from __future__ import annotations

from typing import Any


def one_step(loop: Any, start: float) -> None:
    """A forward, its backward and the update, one second each from ``start``."""
    forward = loop.forward(start, start + 1.0)
    loop.backward(start + 1.0, start + 2.0, forward)
    loop.step(start + 2.0, start + 3.0)


def test_a_pause_between_steps_begins_the_next_step_where_it_ended(hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop()
    one_step(loop, 1.0)  # ends at 4.0
    loop.at(5.0).forward_without_gradients()  # the pause's evaluation: not the step's
    loop.at(8.0).pause_ended("evaluate")
    one_step(loop, 9.0)

    first, second = loop.reports()
    assert (first.end, first.paused_s) == (4.0, 0.0)
    assert (second.start, second.end, second.paused_s, second.paused_for) == (8.0, 12.0, 4.0, "evaluate")
    assert (second.excluded, second.nograd_forwards) == (False, 0)
    assert spans(second)[0] == ("data", 8.0, 9.0)


def test_a_pause_between_micro_steps_leaves_the_step_out_of_the_figures(hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    loop.at(4.0).pause_ended("save")
    forward = loop.forward(5.0, 6.0)
    loop.backward(6.0, 7.0, forward)
    loop.step(7.0, 8.0)

    (report,) = loop.reports()
    assert (report.start, report.end, report.excluded, report.paused_s, report.paused_for) == (1.0, 8.0, True, 0.0, "save")
    assert ("data", 3.0, 5.0) in spans(report)


def test_a_forward_without_gradients_in_the_data_time_is_counted_in_the_step_and_one_inside_a_step_is_not(
        hand_driven_loop: Any) -> None:
    loop = hand_driven_loop()
    loop.at(0.5).forward_without_gradients()  # before any step: counted in the first
    forward = loop.forward(1.0, 2.0)
    loop.at(2.5).forward_without_gradients()  # between a forward and its backward: not in the data time
    loop.backward(3.0, 4.0, forward)
    loop.step(4.0, 5.0)
    loop.at(5.5).forward_without_gradients()  # after the update: the next step's data time
    loop.at(5.75).forward_without_gradients()
    one_step(loop, 6.0)

    first, second = loop.reports()
    assert (first.nograd_forwards, second.nograd_forwards) == (1, 2)
