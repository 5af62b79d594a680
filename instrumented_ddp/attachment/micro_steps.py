"""What one step of an attached loop trained on: its training forwards, the backwards that made
micro-steps of them, their samples and tokens, and the step's loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from instrumented_ddp.attachment.forward_values import batch_size_and_tokens, loss_of, mean_loss


@dataclass
class TrainingForward:
    """One training forward's samples, tokens and loss, counted in its step once a gradient
    reaches its output: a forward that no backward follows (an evaluation run with gradients
    enabled) is neither a micro-step nor part of the step's batch or loss."""

    samples: int
    tokens: Any  # an int, or a device tensor (an attention mask's sum), read when the step resolves
    loss: torch.Tensor | None
    reached_by_backward: bool = False


class MicroSteps:
    """The forwards, micro-steps and losses of the step under way.

    Every backward that reaches a forward's output is timed, and one is a micro-step where it
    reaches a forward no backward of the step reached before: a gradient penalty's
    ``torch.autograd.grad`` of the output and then the loss's ``backward()`` (WGAN-GP, R1) are
    two backwards of one micro-step, as are two losses' backwards through one forward
    (``retain_graph=True``); two forwards and one backward of their joint loss, one."""

    def __init__(self) -> None:
        self.count = 0  # backwards in this step that reached a forward none before them did
        self._backward_counted = False  # the backward running now is one of ``count``
        self._forwards: list[TrainingForward] = []  # this step's, with what each returned (``loss_of``)
        self._inputs: tuple[int, Any] = (0, 0)  # samples and tokens of the forward running now
        self._recorded_losses: list[torch.Tensor] = []  # what the loop handed over (``record_loss``)

    @property
    def any_forward(self) -> bool:
        """Whether a training forward has returned in this step."""
        return bool(self._forwards)

    def clear(self) -> None:
        """A step begins: nothing trained in it yet."""
        self.count, self._forwards, self._recorded_losses = 0, [], []

    def forward_begins(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward begins with these inputs: its samples and tokens, read from shapes."""
        self._inputs = batch_size_and_tokens(args, kwargs)

    def forward_ends(self, output: Any) -> TrainingForward:
        """The training forward begun last returned ``output``: one of the step's forwards.

        Its loss is kept as a copy, not the tensor: a loop may scale its loss in place before
        backward (the Trainer's ``loss *= num_processes`` under average_tokens_across_devices, a
        ``loss /= grad_accum``), and the loss the step reports is what the forward returned (a
        one-element copy on the device, never waited for)."""
        loss = loss_of(output)
        forward = TrainingForward(*self._inputs, loss.detach().clone() if loss is not None else None)
        self._forwards.append(forward)
        return forward

    def backward_begins(self) -> None:
        """A backward begins: not yet a micro-step."""
        self._backward_counted = False

    def gradient_reached(self, forward: TrainingForward) -> None:
        """A gradient of the backward running now reached ``forward``'s output: it trains, and
        the backward is a micro-step if no backward of the step reached that forward before."""
        first_to_reach_it = not forward.reached_by_backward
        forward.reached_by_backward = True
        if first_to_reach_it and not self._backward_counted:
            self.count += 1
            self._backward_counted = True

    def record_loss(self, loss: torch.Tensor) -> None:
        """A loss the loop computed outside the model, copied as it is now (``forward_ends``):
        a step with losses recorded reports those alone."""
        self._recorded_losses.append(loss.detach().clone())

    def totals(self) -> tuple[int, Any, torch.Tensor | None]:
        """The step's samples, tokens and mean loss, over the forwards a backward reached; the
        loss is the recorded ones' where any were recorded, None where there is none."""
        trained = [forward for forward in self._forwards if forward.reached_by_backward]
        samples = sum(forward.samples for forward in trained)
        tokens = sum((forward.tokens for forward in trained), 0)
        losses = self._recorded_losses or [forward.loss for forward in trained if forward.loss is not None]
        return samples, tokens, mean_loss(losses) if losses else None
