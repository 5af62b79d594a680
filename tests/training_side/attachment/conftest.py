"""What the tests of the attachment's collaborators share: a user's loop driven by hand through
the step boundaries (``StepBoundaries``), each event at a time the test gives, on a timeline whose
host clock the test sets (``host_time``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from instrumented_ddp.attachment.issued_collectives import IssuedCollectives, StepCallCounts
from instrumented_ddp.attachment.micro_steps import TrainingForward
from instrumented_ddp.attachment.step_boundaries import StepBoundaries
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.wire.messages import StepReport

#: The optimizer a loop with one steps (the boundaries tell optimizers apart by identity).
THE_OPTIMIZER = object()


class FakeModelTiming:
    """DDP's timing as the boundaries see it: every backward reduces unless the test says not."""

    on_first_buckets = False

    def __init__(self) -> None:
        self.reduces = True
        self.backwards_begun = 0

    def backward_began(self) -> None:
        self.backwards_begun += 1

    def backward_ended(self) -> bool:
        return self.reduces


class StepEndsSeen:
    """The steps the boundaries reported, as ``(step, samples)``; no memory sampled."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def memory(self) -> dict[str, int] | None:
        return None

    def reported(self, step: int, samples: int) -> None:
        self.seen.append((step, samples))


class HandDrivenLoop:
    """A loop over one model with a single weight, each of its events at the time given. A
    forward's batch is ``samples`` rows of 3 token ids (tokens: 3 a row); its output is its loss."""

    def __init__(self, clock: Any, optimizers: int) -> None:
        self._clock = clock
        self.timeline = StepTimeline(rank=0)
        self.weight = nn.Parameter(torch.zeros(2))
        self.timing = FakeModelTiming()
        self.ends = StepEndsSeen()
        calls = StepCallCounts(IssuedCollectives(lambda: []), self.timeline.timed_collectives)
        self.boundaries = StepBoundaries(self.timeline, self.timing, calls, self.ends, "ddp",
                                         lambda: {"grad_accum": 1}, optimizers, [self.weight])

    def at(self, now: float) -> StepBoundaries:
        """The boundaries, with the host clock at ``now``."""
        self._clock.now = now
        return self.boundaries

    def forward(self, start: float, end: float, samples: int = 4, loss: float = 1.0) -> TrainingForward:
        self.at(start).forward_begins((torch.zeros(samples, 3, dtype=torch.long),), {})
        forward = self.at(end).forward_ends(torch.tensor(loss))
        assert forward is not None
        return forward

    def backward(self, start: float, end: float, *reached: TrainingForward) -> None:
        """A backward from ``start`` to ``end`` that reaches the outputs of ``reached``, and
        leaves a gradient on the weight."""
        for forward in reached:
            self.at(start).gradient_reached(forward)
        self.weight.grad = torch.ones(2)
        self.at(end).backward_ends()

    def step(self, start: float, end: float, optimizer: object = THE_OPTIMIZER) -> None:
        self.at(start).update_begins()
        self.at(end).optimizer_stepped(optimizer)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()``: gradients cleared to None, as its default does."""
        self.weight.grad = None

    def reports(self) -> list[StepReport]:
        return self.timeline.completed_reports()


def spans_of(report: StepReport) -> list[tuple[str, float, float]]:
    return sorted(((span.kind, span.start, span.end) for span in report.spans), key=lambda span: span[1])


@pytest.fixture
def hand_driven_loop(host_time: Any) -> Callable[..., HandDrivenLoop]:
    """``hand_driven_loop(optimizers=1)``: a loop driven by hand on the host clock."""

    def make(optimizers: int = 1) -> HandDrivenLoop:
        return HandDrivenLoop(host_time, optimizers)

    return make


@pytest.fixture
def spans() -> Callable[[StepReport], list[tuple[str, float, float]]]:
    """A report's spans as ``(kind, start, end)``, in the order they began."""
    return spans_of
