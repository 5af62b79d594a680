"""The hooks ``attach`` puts on the loop's model and optimizers, since the loop is not ours to mark:

- the model's forward pre- and post-hooks (DDP's buffer broadcast inside the forward is a
  collective of its own). Only forwards with gradients enabled count: an evaluation under
  ``torch.no_grad()`` is not a training step; and a forward is a micro-step, with its samples and
  loss, only once a gradient reaches its output (``TrainingForward``);
- a tensor hook on each of the forward's outputs, where backward begins (a module's
  full-backward hooks see only tensor outputs, and a Hugging Face model returns a
  ``ModelOutput``), which queues a callback on the autograd engine, where it ends: it runs once
  DDP's own end-of-backward work (waiting for the last buckets) is done;
- each attached optimizer's step pre- and post-hooks, where the update begins and ends;
- torch's global optimizer post-hook, which finds an optimizer the loop steps and did not attach.

Each reports what it saw to the step's boundaries (``StepBoundaries``), and none ever raises
into the loop (``never_raises_into_the_loop``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from instrumented_ddp.attachment.attached_model import steps_any_of
from instrumented_ddp.attachment.forward_values import output_tensors
from instrumented_ddp.attachment.hook_faults import HookFaults, never_raises_into_the_loop
from instrumented_ddp.attachment.micro_steps import TrainingForward
from instrumented_ddp.attachment.step_boundaries import StepBoundaries
from instrumented_ddp.publish.watch import Watch
from instrumented_ddp.wire.messages import DETACHED


class PhaseHooks:
    """The hooks on one attached model and its optimizers, installed by ``install`` and taken
    out by ``remove``; ``detach``: what ends the attachment, where a hook finds it must."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], boundaries: StepBoundaries,
                 watch: Watch, trainable: Sequence[torch.Tensor], detach: Callable[[str], None]) -> None:
        self._model, self._optimizers, self._boundaries, self._watch = model, tuple(optimizers), boundaries, watch
        self._trainable, self._detach = trainable, detach
        self.faults = HookFaults(boundaries.timeline.rank)
        self.handles: list[Any] = []
        self._stepped_inside_forward = False  # an update inside the model's forward: ``_before_optimizer_step``
        self._other_optimizers: set[int] = set()  # ids of unattached ones judged: ``_any_optimizer_stepped``

    def install(self) -> None:
        model = self._model
        self.handles = [
            # before FSDP's own pre-forward hook, whose all-gather is then inside the forward
            model.register_forward_pre_hook(torch.compiler.disable(self._before_forward), with_kwargs=True, prepend=True),
            model.register_forward_hook(torch.compiler.disable(self._after_forward), with_kwargs=True),
            *(optimizer.register_step_pre_hook(self._before_optimizer_step) for optimizer in self._optimizers),
            *(optimizer.register_step_post_hook(self._after_optimizer_step) for optimizer in self._optimizers),
            register_optimizer_step_post_hook(self._any_optimizer_stepped),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def detach(self, reason: str) -> None:
        """End the attachment, saying ``reason`` in its goodbye."""
        self._detach(reason)

    @never_raises_into_the_loop(detaches_here=True)
    def _before_forward(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():  # not training
            if not self._watch.pausing:  # an evaluation the loop did not mark (``paused``): the dashboard says so
                self._boundaries.forward_without_gradients()
            return
        self._watch.pausing = ""  # training again, whatever a pause begun said it would do
        self._boundaries.forward_begins(args, kwargs)

    @never_raises_into_the_loop(detaches_here=True)
    def _after_forward(self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any) -> None:
        if self._stepped_inside_forward:
            self._detach_stepped_in_forward()
            return
        forward = self._boundaries.forward_ends(output)
        if forward is None:
            return
        for tensor in output_tensors(output):
            tensor.register_hook(functools.partial(self._gradient_reached_output, forward))

    @never_raises_into_the_loop(detaches_here=False)
    def _gradient_reached_output(self, forward: TrainingForward, _gradient: torch.Tensor) -> None:
        """A gradient reached ``forward``'s output. The first of this backward: backward has
        begun. The callback queued here runs when the engine ends the backward, before DDP's
        own (queued later, when the last bucket is launched), so it queues the one that stamps
        the end after DDP's."""
        if self._boundaries.gradient_reached(forward):
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._backward_ended))

    @never_raises_into_the_loop(detaches_here=False)
    def _backward_ended(self) -> None:
        self._boundaries.backward_ends()

    @never_raises_into_the_loop(detaches_here=False)
    def _any_optimizer_stepped(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """Any optimizer of the process returned from ``step()`` (torch's global hook). One that
        was not attached, stepping some of this model's parameters after the update ended (a loop
        with Muon and AdamW that attached the one it steps first), has its step read as the next
        step's data loading and its state left out of the memory column: said once, in one line
        (rank 0), naming the fix. One stepped inside an attached one's ``step()`` (ZeRO's shard
        optimizer) or before it (inside the update) is not."""
        if (not self._boundaries.between_update_and_forward or any(optimizer is attached for attached in self._optimizers)
                or id(optimizer) in self._other_optimizers):
            return
        self._other_optimizers.add(id(optimizer))  # judged once: another model's, or told of now
        if steps_any_of(optimizer, self._trainable) and dist.get_rank() == 0:
            names = " and the ".join(type(o).__name__ for o in (*self._optimizers, optimizer))
            print(f"instrumented_ddp.attach: {type(optimizer).__name__}, not attached, steps this model after the "
                  f"attached {type(self._optimizers[-1]).__name__}, so its step() reads as the next step's data loading "
                  f"and its state is not counted: pass attach a list of every optimizer the loop steps (the {names}) "
                  "to time each one's step as the update", file=sys.stderr, flush=True)

    def _forward_is_running(self) -> bool:
        """Whether the model's forward is on this thread's stack (a frame of ``Module._call_impl``
        called on it), where a forward began and did not return: the loop steps inside it, or it
        raised and the loop went on (a batch that ran out of memory, skipped), which reads the
        same from the hooks. Looked at only there: walking the stack is not free."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is self._model:
                return True
            frame = frame.f_back
        return False

    def _detach_stepped_in_forward(self) -> None:
        """The optimizer stepped inside the model's forward: the loop runs its whole training
        step, backward and update included, inside the model's ``forward`` (PyTorch Lightning's
        manual optimization: ``training_step`` calls ``manual_backward`` and ``step()`` inside
        DDP's forward). Forward, backward and update cannot be told apart from the model's and
        the optimizer's hooks there (read as written, each step is cut mid-forward, excluded,
        with no figures): say so in one line (rank 0) and detach, once the forward has returned
        (torch is not running the optimizer's hooks then, which detach removes); the training
        goes on unwatched."""
        if dist.get_rank() == 0:
            print("instrumented_ddp.attach: the optimizer stepped inside the model's forward (a training step run whole "
                  "inside it, as PyTorch Lightning's manual optimization runs training_step inside DDP's forward), where "
                  "ddpwatch cannot tell forward, backward and update apart: detached, training goes on unwatched",
                  file=sys.stderr, flush=True)
        self.detach(f"{DETACHED}the optimizer stepped inside the model's forward")

    @never_raises_into_the_loop(detaches_here=False)
    def _before_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._boundaries.forward_open and self._forward_is_running():  # ``_detach_stepped_in_forward``
            self._stepped_inside_forward = True
            return
        self._boundaries.update_begins()

    @never_raises_into_the_loop(detaches_here=False)
    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._stepped_inside_forward:
            self._boundaries.optimizer_stepped(optimizer)

