"""Where each step of an attached loop begins and ends, and the model's phases between, read from
what the hooks on the loop's model and optimizers see (``PhaseHooks`` tells it each event):

- a step ends when the optimizer's ``step()`` returns (given several, when each has stepped, or,
  where one sits out an update, where the last that stepped returned, found at the next training
  forward), and the next one begins there: the gap until the next forward (the data loader,
  ``zero_grad``, a scheduler, logging) is ``data``, and so is the gap from a micro-step's
  backward to the next forward (the next micro-batch's loading) under gradient accumulation;
- ``forward`` is the model's forward, a training one only (gradients enabled);
- ``backward`` runs from the first gradient reaching one of the forward's outputs to the end of
  the engine's backward, after DDP's own end-of-backward work;
- ``optimizer`` runs from the end of the step's last backward to the return of the optimizer's
  ``step()``: what a loop does between them (gradient clipping, AMP's unscaling and inf check)
  is part of the update; with no backward before it (a loop that steps twice), it is ``step()``
  alone; where the forward and backward run inside ``step()``, in a closure (PyTorch
  Lightning, LBFGS), it runs from the end of that backward;
- a step whose update was skipped (a loss scaler that found inf or NaN does not call ``step()``)
  ends where its last backward ended, once the next forward finds the gradients that backward
  reduced cleared (``update_skipped``);
- a pause of training (``Attachment.paused``) between steps begins the next step where it ended.

Where a step may prove to have ended at a point already past (its latest backward, or an
optimizer's return with others still to step), the loop's own spans since then are kept aside,
to be the next step's if so (``keep_if_next_steps``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from instrumented_ddp.attachment.issued_collectives import StepCallCounts
from instrumented_ddp.attachment.micro_steps import MicroSteps, TrainingForward
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.wire.kinds import COMM_KINDS


class ModelTiming(Protocol):
    """What the boundaries ask of the model's own timing (``DDPTiming``, ``FSDPTiming``)."""

    @property
    def on_first_buckets(self) -> bool: ...

    def backward_began(self) -> None: ...

    def backward_ended(self) -> bool: ...


class StepEnds(Protocol):
    """Who is told of each step's end (``StepReporter``)."""

    def memory(self) -> dict[str, int] | None: ...

    def reported(self, step: int, samples: int) -> None: ...


class StepBoundaries:
    """The step-boundary state machine of an attached loop: each event the hooks report moves it
    on, and it opens and closes the phases' spans and the steps on the rank's timeline.
    ``optimizers``: how many optimizers the update waits for; ``trainable``: the model's
    parameters a backward leaves gradients on; ``settings``: each step's settings as it begins."""

    def __init__(self, timeline: StepTimeline, timing: ModelTiming, calls: StepCallCounts, ends: StepEnds,
                 strategy: str, settings: Callable[[], dict[str, Any]], optimizers: int,
                 trainable: Sequence[torch.Tensor]) -> None:
        self.timeline, self._timing, self._calls, self._ends = timeline, timing, calls, ends
        self._strategy, self._settings, self._optimizers, self._trainable = strategy, settings, optimizers, trainable
        self.steps = 0
        self.micro_steps = MicroSteps()
        self._data_from: Any = None  # when the gap before this step's first forward began
        self._forward_from: Any = None
        self._backward_from: Any = None
        self._optimizer_from: Any = None
        self._after_backward: Any = None  # when this step's latest backward ended, until a forward or the step names the gap
        #: After a backward that reduced, a parameter it left a gradient on: ``update_skipped``.
        self._reduced_gradient_of: torch.Tensor | None = None
        self.inside_update = False  # between an optimizer's step pre- and post-hooks
        self._stepped_in_update: set[int] = set()  # ids of the optimizers whose step() returned in this update
        #: Where the latest of them returned while others are still to step; the update ended
        #: there if none of them steps before the next training forward.
        self._update_returned: Any = None
        self._loop_calls = 0  # the loop's collectives timed in this step: ``l<k>``
        self._nograd_forwards = 0  # forwards without gradients in this step's data gap, outside a pause
        self._spans_after_possible_end: list[Any] = []  # the loop's since ``may_have_ended`` turned true
        self._began_on_first_buckets = False

    # -- what the boundaries say ---------------------------------------------------------------
    @property
    def phase(self) -> str:
        """What the loop's thread is in (``Heartbeat.phase``), read by the sender thread: plain
        attribute reads, no lock (a read racing a change reads the phase before or after it)."""
        if not self.timeline.in_step:
            return "between"
        if self.inside_update:
            return "optimizer"
        if self._forward_from is not None:
            return "forward"
        if self._backward_from is not None:
            return "backward"
        if self._data_from is not None:
            return "data"
        if self._after_backward is not None:
            return "between"  # after a backward: the optimizer's step or the next micro-step comes
        return "after_forward" if self.micro_steps.any_forward else "data"

    @property
    def forward_open(self) -> bool:
        """Whether a training forward began and has not returned (or raised unseen)."""
        return self._forward_from is not None

    @property
    def between_update_and_forward(self) -> bool:
        """Whether the update has ended and the next step has had no training forward yet."""
        return (not self.inside_update and self._data_from is not None and not self.micro_steps.any_forward
                and self.timeline.in_step)

    @property
    def may_have_ended(self) -> bool:
        """Whether the step may prove to have ended already: at its latest backward (where the
        update turns out skipped), or at an optimizer's return with others of the list still to
        step (where none of them does)."""
        return self._after_backward is not None or self._update_returned is not None

    def update_skipped(self) -> bool:
        """Whether this step's gradients were reduced and then cleared with no ``optimizer.step()``
        between: the update was skipped, and the step is over. ``torch.amp.GradScaler`` skips
        ``step()`` when it finds inf or NaN among the gradients (so do Accelerate's and the
        Trainer's fp16 paths, through it), which an fp16 run does at its first steps while the
        scale settles and now and then after; unseen, the next step's forwards, backwards and
        all-reduces are reported inside the skipped one. Seen only where the loop clears
        gradients to None (``zero_grad()``'s default) before the next forward; one zeroed in
        place, or cleared after the forward, leaves the two steps merged."""
        gradient_of = self._reduced_gradient_of
        return (self._after_backward is not None and gradient_of is not None and gradient_of.grad is None
                and not self.inside_update)  # LBFGS's closure clears them for its next evaluation

    # -- ending a step found over ----------------------------------------------------------------
    def end_if_update_skipped(self) -> None:
        """Where the update was skipped (``update_skipped``), the step ended at its backward: end
        it there, so that what the loop does now (a forward, a collective, a wait) is the next one's."""
        if self.update_skipped():
            self._end_step(at=self._after_backward, update_skipped=True)

    def end_after_partial_update(self) -> None:
        """Where some of the attached optimizers stepped since the last backward and the rest did
        not before now (one stepped every other update), the update ended where the last of them
        returned: end the step there."""
        returned = self._update_returned
        if returned is not None:
            self.timeline.add_span("optimizer", self._optimizer_from, returned, blocking=False)
            self._end_step(at=returned)

    # -- the model's events ------------------------------------------------------------------------
    def forward_without_gradients(self) -> None:
        """A forward with gradients disabled, outside a pause: counted where it reads as data
        loading (an evaluation the loop did not mark), else not seen."""
        if not self.timeline.in_step or self._data_from is not None or self._after_backward is not None:
            self._nograd_forwards += 1

    def forward_begins(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward begins: the first step begins here, or the gap before it is data."""
        if not self.timeline.in_step:
            self._begin_step()
            self._calls.restart(in_gap=False)  # counted from here: the first step's
            self._data_from = None
        else:
            self.end_if_update_skipped()
            self.end_after_partial_update()
        now = self.timeline.stamp()
        gap_from = self._data_from if self._data_from is not None else self._after_backward
        if gap_from is not None:  # the loader: after the last step, or after the last micro-step's backward
            self.timeline.add_span("data", gap_from, now, blocking=False)
            self._calls.gap_ends()
        self._data_from = self._after_backward = None
        self._spans_after_possible_end = []
        self.micro_steps.forward_begins(args, kwargs)
        self._forward_from = now

    def forward_ends(self, output: Any) -> TrainingForward | None:
        """The training forward returned ``output``: a ``forward`` span, and the forward whose
        output a backward may reach; None where no training forward was open."""
        if self._forward_from is None:
            return None
        self.timeline.add_span("forward", self._forward_from, self.timeline.stamp(), blocking=False)
        self._forward_from = None
        forward = self.micro_steps.forward_ends(output)
        self._backward_from = None
        return forward

    def gradient_reached(self, forward: TrainingForward) -> bool:
        """A gradient reached ``forward``'s output; True where it is this backward's first, and
        the backward begins now."""
        begins = self._backward_from is None
        if begins:
            self._backward_from = self.timeline.stamp()
            self.micro_steps.backward_begins()
            self._timing.backward_began()
        self.micro_steps.gradient_reached(forward)
        return begins

    def backward_ends(self) -> None:
        """The backward begun at the first gradient has ended, DDP's own end-of-backward work
        done: a ``backward`` span, and a data gap from here to the next forward or the update."""
        began, self._backward_from = self._backward_from, None
        if began is None or not self.timeline.in_step:
            return
        reduced = self._timing.backward_ended()  # its wait ends first: a step found skipped ends at ``ended``
        ended = self.timeline.stamp()
        self.timeline.add_span("backward", began, ended, blocking=False)
        self._after_backward = ended
        self._spans_after_possible_end = []
        self._calls.gap_begins()  # until the next forward, or the update
        self._reduced_gradient_of = next((p for p in self._trainable if p.grad is not None), None) if reduced else None

    def update_begins(self) -> None:
        """An attached optimizer's ``step()`` begins; the update's first begins the phase. A
        forward still open raised (and the loop went on): it never ran its post-hook."""
        self._forward_from = None
        if not self._stepped_in_update:
            self._optimizer_from = None
            if self.timeline.in_step:
                self._optimizer_from = self._after_backward if self._after_backward is not None else self.timeline.stamp()
        self._after_backward = self._update_returned = None
        self.inside_update = True
        self._spans_after_possible_end = []
        self._calls.gap_cancelled()

    def optimizer_stepped(self, optimizer: object) -> None:
        """An attached optimizer's ``step()`` returned. The update ran from the step's last
        backward, or, where a backward ended inside ``step()``, from that one's end; it ends,
        and the step with it, when every attached optimizer has stepped, in any order."""
        self.inside_update = False
        start = self._after_backward if self._after_backward is not None else self._optimizer_from
        if start is None or not self.timeline.in_step:
            return  # a step() before any training forward
        self._stepped_in_update.add(id(optimizer))
        if len(self._stepped_in_update) < self._optimizers:  # others still to step, or none this update
            self._optimizer_from, self._after_backward = start, None
            self._update_returned = self.timeline.stamp()
            self._calls.gap_begins()
            return
        self.timeline.add_span("optimizer", start, self.timeline.stamp(), blocking=False)
        self._end_step()

    # -- the loop's events -------------------------------------------------------------------------
    def pause_ended(self, what: str) -> None:
        """The loop paused training to do ``what`` and trains on from now: between steps, the
        next step begins here, and the pause's collectives and forwards are not its."""
        self.end_after_partial_update()  # the pause came after it
        now = self.timeline.stamp()
        if self.timeline.paused_until(what, now):
            self._data_from = now
            self._calls.restart(in_gap=True)
            self._nograd_forwards = 0  # where the pause was not said to begin

    def loop_call_tag(self) -> str:
        """The tag of the loop's next collective in this step: ``l<k>``, the k-th."""
        return f"l{self._loop_calls}"

    def loop_call_opened(self, span: Any) -> None:
        """The loop's collective tagged ``loop_call_tag`` is timed as ``span``."""
        self._loop_calls += 1
        self.keep_if_next_steps(span)

    def keep_if_next_steps(self, span: Any) -> None:
        """A span of the loop's own: the next step's if the step proves to have ended before it."""
        if self.may_have_ended:
            self._spans_after_possible_end.append(span)

    def record_loss(self, loss: torch.Tensor) -> None:
        """This micro-step's loss, as the loop computed it (``MicroSteps.record_loss``)."""
        self.micro_steps.record_loss(loss)

    # -- the steps -------------------------------------------------------------------------------
    def _begin_step(self, at: Any = None) -> None:
        self.steps += 1
        self.timeline.begin_step(self.steps, self._strategy, self._settings(), at=at)
        self.micro_steps.clear()
        carried = [span for span in self._spans_after_possible_end if span.kind in COMM_KINDS]
        for index, span in enumerate(carried):  # from a step found to have ended before them: this one's first
            span.tag = f"l{index}"
        self._loop_calls = len(carried)
        self._spans_after_possible_end = []
        self._after_backward = self._reduced_gradient_of = self._update_returned = None
        self._stepped_in_update = set()
        self._began_on_first_buckets = self._timing.on_first_buckets  # DDP's first iteration: excluded

    def _end_step(self, at: Any = None, update_skipped: bool = False) -> None:
        """Report this step, ended now or at ``at``, and begin the next one there. A step found
        only now to have ended at ``at`` (its update skipped at its backward, or ended at an
        optimizer's return with the others not stepping) gives what the loop did since to the next."""
        samples, tokens, loss = self.micro_steps.totals()
        memory = self._ends.memory()
        found_later = at is not None
        nograd_forwards = 0 if found_later else self._nograd_forwards  # they came after ``at``
        self._nograd_forwards -= nograd_forwards
        issued, in_data = self._calls.step_ends(gap_to_next=found_later)
        self.timeline.end_step(samples, tokens, loss, excluded=self._began_on_first_buckets, memory=memory,
                               settings={"grad_accum": max(1, self.micro_steps.count)}, at=at,
                               update_skipped=update_skipped, issued_collectives=issued, untimed_in_data=in_data,
                               nograd_forwards=nograd_forwards,
                               carried=self._spans_after_possible_end if found_later else ())
        self._ends.reported(self.steps, samples)
        self._begin_step(at=at)
        self._data_from = at if at is not None else self.timeline.stamp()
