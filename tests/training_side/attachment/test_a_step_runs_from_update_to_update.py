"""``StepBoundaries``, driven by hand: a step ends where the update ends (when every attached
optimizer has stepped, or at the next forward where one sat the update out), the next begins
there, and the gaps between the model's phases are ``data``."""

from __future__ import annotations

from typing import Any


def test_the_first_step_begins_at_its_forward_and_the_next_where_the_update_ended(hand_driven_loop: Any,
                                                                                   spans: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.5, 3.0, forward)
    loop.step(3.5, 4.0)  # the update: from the backward's end to step()'s return
    forward = loop.forward(5.0, 6.0, loss=3.0)
    loop.backward(6.0, 7.0, forward)
    loop.step(7.0, 8.0)

    first, second = loop.reports()
    assert (first.step, first.start, first.end, first.samples, first.tokens) == (1, 1.0, 4.0, 4, 12)
    assert spans(first) == [("forward", 1.0, 2.0), ("backward", 2.5, 3.0), ("optimizer", 3.0, 4.0)]
    assert (second.step, second.start, second.end, second.loss) == (2, 4.0, 8.0, 3.0)
    assert spans(second) == [("data", 4.0, 5.0), ("forward", 5.0, 6.0), ("backward", 6.0, 7.0), ("optimizer", 7.0, 8.0)]
    assert loop.ends.seen == [(1, 4), (2, 4)]


def test_under_gradient_accumulation_the_gap_between_micro_steps_is_data(hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop()
    first = loop.forward(1.0, 2.0, loss=1.0)
    loop.backward(2.0, 3.0, first)
    second = loop.forward(4.0, 5.0, loss=3.0)  # the next micro-batch loaded from 3.0 to 4.0
    loop.backward(5.0, 6.0, second)
    loop.step(6.5, 7.0)

    (report,) = loop.reports()
    assert spans(report) == [("forward", 1.0, 2.0), ("backward", 2.0, 3.0), ("data", 3.0, 4.0),
                             ("forward", 4.0, 5.0), ("backward", 5.0, 6.0), ("optimizer", 6.0, 7.0)]
    assert (report.settings["grad_accum"], report.samples, report.tokens, report.loss) == (2, 8, 24, 2.0)


def test_with_two_optimizers_the_update_ends_when_both_have_stepped_in_either_order(hand_driven_loop: Any,
                                                                                    spans: Any) -> None:
    loop = hand_driven_loop(optimizers=2)
    muon, adamw = object(), object()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    loop.step(3.5, 4.0, muon)
    assert loop.reports() == []  # AdamW is still to step
    loop.step(4.5, 5.0, adamw)
    forward = loop.forward(6.0, 7.0)
    loop.backward(7.0, 8.0, forward)
    loop.step(8.0, 9.0, adamw)
    loop.step(9.0, 10.0, muon)

    first, second = loop.reports()
    assert (first.end, spans(first)[-1]) == (5.0, ("optimizer", 3.0, 5.0))
    assert (second.start, second.end, spans(second)[-1]) == (5.0, 10.0, ("optimizer", 8.0, 10.0))


def test_an_update_one_optimizer_sat_out_ends_where_the_other_returned_found_at_the_next_forward(
        hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop(optimizers=2)
    muon, adamw = object(), object()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    loop.step(3.0, 4.0, muon)
    loop.step(4.0, 5.0, adamw)
    forward = loop.forward(6.0, 7.0)
    loop.backward(7.0, 8.0, forward)
    loop.step(8.5, 9.0, muon)  # AdamW steps every other update: not this one
    forward = loop.forward(10.0, 11.0)
    loop.backward(11.0, 12.0, forward)
    loop.step(12.0, 13.0, muon)
    loop.step(13.0, 14.0, adamw)

    _, second, third = loop.reports()
    assert (second.start, second.end) == (5.0, 9.0)
    assert spans(second) == [("data", 5.0, 6.0), ("forward", 6.0, 7.0), ("backward", 7.0, 8.0), ("optimizer", 8.0, 9.0)]
    assert (third.start, third.end) == (9.0, 14.0)
    assert spans(third) == [("data", 9.0, 10.0), ("forward", 10.0, 11.0), ("backward", 11.0, 12.0),
                            ("optimizer", 12.0, 14.0)]


def test_an_update_with_no_backward_before_it_is_its_step_alone(hand_driven_loop: Any, spans: Any) -> None:
    loop = hand_driven_loop()
    forward = loop.forward(1.0, 2.0)
    loop.backward(2.0, 3.0, forward)
    loop.step(3.0, 4.0)
    loop.step(5.0, 6.0)  # a loop that steps twice

    _, second = loop.reports()
    assert (second.start, second.end, spans(second)) == (4.0, 6.0, [("optimizer", 5.0, 6.0)])


def test_a_step_before_any_training_forward_begins_no_step(hand_driven_loop: Any) -> None:
    loop = hand_driven_loop()
    loop.step(1.0, 2.0)
    assert loop.reports() == [] and not loop.timeline.in_step and loop.boundaries.steps == 0
