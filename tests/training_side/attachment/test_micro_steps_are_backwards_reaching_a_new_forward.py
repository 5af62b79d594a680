"""``MicroSteps``: a backward is a micro-step where it reaches a forward no backward of the step
reached before; a forward no backward reaches is not part of the step's batch or loss; losses the
loop recorded replace the forwards'."""

from __future__ import annotations

import torch

from instrumented_ddp.attachment.micro_steps import MicroSteps, TrainingForward


def forward(micro: MicroSteps, samples: int, loss: float) -> TrainingForward:
    micro.forward_begins((torch.zeros(samples, 3, dtype=torch.long),), {})
    return micro.forward_ends(torch.tensor(loss))


def backward(micro: MicroSteps, *reached: TrainingForward) -> None:
    micro.backward_begins()
    for each in reached:
        micro.gradient_reached(each)


def test_a_gradient_penalty_and_the_loss_through_one_forward_are_one_micro_step() -> None:
    micro = MicroSteps()
    output = forward(micro, 4, 1.0)
    backward(micro, output)  # ``torch.autograd.grad`` of the output: the penalty
    backward(micro, output)  # the loss's ``backward()``
    assert micro.count == 1


def test_one_backward_of_two_forwards_joint_loss_is_one_micro_step_and_two_micro_batches_are_two() -> None:
    joint = MicroSteps()
    first, second = forward(joint, 4, 1.0), forward(joint, 4, 3.0)
    backward(joint, first, second)
    assert joint.count == 1

    accumulated = MicroSteps()
    backward(accumulated, forward(accumulated, 4, 1.0))
    backward(accumulated, forward(accumulated, 4, 3.0))
    assert accumulated.count == 2
    assert accumulated.totals() == (8, 24, torch.tensor(2.0))


def test_a_forward_no_backward_reached_is_not_in_the_steps_batch_or_loss() -> None:
    micro = MicroSteps()
    forward(micro, 16, 9.0)  # an evaluation run with gradients enabled
    backward(micro, forward(micro, 4, 1.0))
    assert micro.any_forward and micro.totals() == (4, 12, torch.tensor(1.0))


def test_recorded_losses_replace_the_forwards_and_a_loss_scaled_in_place_after_is_read_as_returned() -> None:
    micro = MicroSteps()
    returned = torch.tensor(2.0)
    micro.forward_begins((torch.zeros(4, 3, dtype=torch.long),), {})
    backward(micro, micro.forward_ends(returned))
    returned /= 4  # ``loss /= grad_accum`` before backward
    assert micro.totals()[2] == torch.tensor(2.0)
    micro.record_loss(torch.tensor(0.5))
    micro.record_loss(torch.tensor(1.5))
    assert micro.totals()[2] == torch.tensor(1.0)


def test_a_cleared_step_holds_nothing() -> None:
    micro = MicroSteps()
    backward(micro, forward(micro, 4, 1.0))
    micro.record_loss(torch.tensor(3.0))
    micro.clear()
    assert (micro.count, micro.any_forward, micro.totals()) == (0, False, (0, 0, None))
