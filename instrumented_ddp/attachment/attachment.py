"""Watch a training loop ddpwatch did not write: one line after the user's own DDP wrap.

    model = DistributedDataParallel(model, device_ids=[local_rank])
    watch = instrumented_ddp.attach(model, optimizer, address="tcp://127.0.0.1:5555")
    ...  # the loop, unchanged
    watch.detach()  # or let the process end: goodbye is sent either way

A model sharded with FSDP2 (``fully_shard`` on its layers and its root) is attached the same
way: its units' all-gathers and reduce-scatters are timed instead of DDP's buckets
(``FSDPTiming``), and its steps are reported as ``fsdp``.

``Attachment`` is what the user holds; the work is its collaborators':

- ``PhaseHooks`` (``phase_hooks``): the hooks on the model and its optimizers, where the phases
  come from, since the loop is not ours to mark; none raises into the loop (``hook_faults``);
- ``StepBoundaries`` (``step_boundaries``): where each step begins and ends, and its phases'
  spans; what each step trained on (``MicroSteps``) and what the watch hears at its end
  (``StepReporter``);
- ``LoopWork`` (``loop_work``): the loop's own collectives, waits and marked compute in a step;
- ``ProcessHooks`` (``process_hooks``): the process's exit, uncaught exceptions and stop signals.

Where the model's own collectives are timed: every bucket's all-reduce goes through
``DDPTiming``'s hook, which does what DDP's default does, bit for bit; where the DDP already has
a hook of the user's (gradient compression: fp16, PowerSGD, Accelerate's ``comm_hook``), DDP keeps
it and the all-reduces it issues are timed as it issues them (``hooked_collectives``; a settings
entry ``comm_hook`` names it). DDP's first iteration (one bucket of everything, before DDP
rebuilds its buckets) is excluded from the statistics, as for the ``ddp`` strategy; under
``static_graph`` its first two (``DDPTiming.on_first_buckets``). Under FSDP2 every unit's
all-gather and reduce-scatter goes through FSDP's custom-comm hooks, issuing what its defaults
issue (``FSDPTiming``).

The loop's own work between steps that is not training (an evaluation, a checkpoint) is ``data``
unless marked: ``with watch.paused("evaluate"): ...`` (the Trainer callback marks its
evaluations and checkpoints itself). The next step then begins where the pause ended, and the
pause, from the end of the step before, is reported with it, in no figure
(``StepReport.paused_s``). The loop's own compute outside the model is ``data`` where it falls
before a forward, and idle time between a forward and its backward, unless marked: ``with
watch.computing("ema"): ...``, a ``loop`` span, compute, the data gap cut around it.

``detach()`` leaves DDP's hook (DDP cannot drop one) averaging untimed, and a later ``attach`` of
the same model (a Trainer's second ``train()``) times it again, a new run on the dashboard. An
attached run cannot switch strategies: the loop is the user's. Its hello says so, the dashboard
offers no switch, and a switch command is answered with a refusal.
"""

from __future__ import annotations

import numbers
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, SupportsFloat, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.attachment.disabled_watch import DisabledWatch
from instrumented_ddp.attachment.attached_model import (
    all_reduce_group,
    backend_of,
    compute_device,
    first_bucket_setting,
    megabytes_given,
    sharded_timing,
    strategy_group,
)
from instrumented_ddp.attachment.forward_values import describe
from instrumented_ddp.attachment.issued_collectives import IssuedCollectives, StepCallCounts
from instrumented_ddp.attachment.loop_work import LoopWork
from instrumented_ddp.attachment.phase_hooks import PhaseHooks
from instrumented_ddp.attachment.problems import attach_problem, compiled_module, innermost_optimizer, is_fsdp2, optimizers_given
from instrumented_ddp.attachment.process_hooks import ATTACHED_AT, ProcessHooks
from instrumented_ddp.attachment.step_boundaries import StepBoundaries
from instrumented_ddp.attachment.step_reporter import StepReporter
from instrumented_ddp.distributed import DistributedContext
from instrumented_ddp.publish import stop_signals
from instrumented_ddp.publish.watch_environment import (
    WatchEnvironmentError, unwatched_blocks, watch_address, watch_key_file, watching_disabled)
from instrumented_ddp.publish.watch import Watch, goodbye_reason, parameter_layout, parameter_rows
from instrumented_ddp.timing.collective_stand_ins import LoopCall
from instrumented_ddp.timing.ddp_timing import DDPTiming, users_comm_hook
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.wire.messages import MAX_PAUSED_FOR, NOT_SWITCHABLE, metrics_problem
from instrumented_ddp.wire.endpoints import address_problem, is_loopback
from instrumented_ddp.wire.curve_keys import load_client_keys

if TYPE_CHECKING:
    from instrumented_ddp.timing.fsdp_timing import FSDPTiming

__all__ = ["NOT_SWITCHABLE", "AttachError", "Attachment", "attach"]


class AttachError(RuntimeError):
    """A misuse of ``attach``, said in one line that names the fix; nothing was changed."""


def attach(model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
           address: str | None = None, watch_key: str | None = None, total_steps: int = 0) -> Attachment | DisabledWatch:
    """Watch ``model``, a ``DistributedDataParallel`` the caller built (or a model sharded with
    FSDP2's ``fully_shard``, its root included), and the ``optimizer`` that steps it (or a list of
    each that does, where the loop steps several: the update ends when every one has). Every rank
    calls it once, after wrapping and before the first backward (it is a collective: the ranks
    agree on a session id). ``watch_key``: the dashboard's ``client.json`` when ``address`` is
    beyond loopback. ``total_steps``: the optimizer steps the loop will take, where it knows them
    (the dashboard's progress bar and ETA; 0: unknown). Raises ``AttachError`` (one line) on a
    misuse, having changed nothing. A ``torch.compile`` of the model is seen through to the module
    it compiled. ``address`` None: ``DDPWATCH_ADDRESS``, else the default; ``watch_key`` None:
    ``DDPWATCH_KEY``; under ``DDPWATCH_DISABLE=1`` a ``DisabledWatch``, nothing installed
    (``publish.watch_environment``); ``DDPWATCH_UNWATCHED``: the steps left unwatched, by which
    the run measures what watching costs it."""
    try:
        if watching_disabled():
            return DisabledWatch()
        unwatched_blocks()
    except WatchEnvironmentError as error:
        raise AttachError(f"instrumented_ddp.attach: {error}") from None
    address, watch_key = watch_address(address), watch_key_file(watch_key)
    model = compiled_module(model)
    problem = attach_problem(model, optimizer)
    if problem is None and (isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0):
        problem = f"total_steps must be a whole number of optimizer steps, 0 or more (0: unknown), not {total_steps!r}"
    if problem is None:
        problem = address_problem(address)
        if problem is None and watch_key is None and not is_loopback(address):
            problem = f"address {address} is not loopback: pass watch_key= (the dashboard's client.json)"
        if problem is None and address in ATTACHED_AT:
            problem = (f"another model of this process is attached to {address}, and a dashboard watches one run: "
                       "detach that one first (its watch.detach()), or attach this one to another address, with a "
                       "dashboard of its own (ddpwatch --listen ADDRESS)")
    if problem is not None:
        raise AttachError(f"instrumented_ddp.attach: {problem}")
    try:
        keys = load_client_keys(watch_key) if watch_key is not None else None
    except ValueError as error:
        raise AttachError(f"instrumented_ddp.attach: {error}") from None
    return Attachment(model, [innermost_optimizer(each) for each in optimizers_given(optimizer)], address, keys, total_steps)


def model_timing(model: nn.Module, ddp: DistributedDataParallel | None, timeline: StepTimeline) -> DDPTiming | FSDPTiming:
    """What times the model's own collectives on ``timeline``: DDP's buckets, or FSDP's units.
    Installed on the model once and kept there: a model attached before and detached keeps the
    hook DDP was given (FSDP its comms), which times again."""
    kept: DDPTiming | FSDPTiming | None = getattr(model, "_ddpwatch_timing", None)
    if kept is not None:
        kept.resume(timeline)
        return kept
    timing = sharded_timing(model, timeline) if ddp is None else DDPTiming(ddp, timeline)
    timing.install()
    # Plain attributes, read back with getattr: ``nn.Module.__setattr__`` is typed for tensors and modules only.
    setattr(model, "_ddpwatch_timing", timing)
    return timing


class Attachment:
    """The hooks ``attach`` installed on one DDP (or FSDP2) model and its optimizers, and the watch
    they feed: what the user holds, to mark the loop's pauses and compute, record its losses and
    evaluations, and detach."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], address: str, keys: Any,
                 total_steps: int = 0) -> None:
        self.model, self.optimizers = model, tuple(optimizers)
        sharded = is_fsdp2(model)
        self.strategy = "fsdp" if sharded else "ddp"
        ddp = None if sharded else cast(DistributedDataParallel, model)  # ``attach_problem`` let a DDP or an FSDP2 model in
        module = model if ddp is None else cast(nn.Module, ddp.module)  # torch types ``DDP.module`` as Tensor | Module
        group = None if ddp is None else ddp.process_group  # FSDP's: its mesh, over the default group's ranks
        device = compute_device(model, module, sharded)
        meets = all_reduce_group(model, sharded)
        replicas = len(meets) if sharded and len(meets) > 1 else 0
        self._mesh_settings = {"replicas": replicas} if replicas else {}  # HSDP: the replicate dimension's size
        users_hook = None if ddp is None else users_comm_hook(ddp)
        self._hook_settings = {"comm_hook": users_hook} if users_hook else {}  # gradient compression, named
        context = DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                                     device, backend_of(group, device))
        self.watch = Watch.start(address, context, {
            "strategy": self.strategy, "settings": self._step_settings(),
            "model_parameters": sum(p.numel() for p in module.parameters()),
            "parameter_layout": parameter_layout(module), "parameter_rows": parameter_rows(module), "all_reduce_group": meets, "total_steps": total_steps,
        }, keys=keys, switchable=False)
        timeline = self.watch.timeline
        assert isinstance(timeline, StepTimeline)  # ``Watch.start`` times every run it starts: narrowed for the type checker
        self.timeline: StepTimeline = timeline
        self.timing = model_timing(model, ddp, timeline)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._parameters: list[torch.Tensor] = list(module.parameters())  # FSDP's are its DTensor shards
        #: The script's own collectives: what the step issued beyond what we time, and where.
        calls = StepCallCounts(IssuedCollectives(), lambda: self.timeline.timed_collectives())
        self._boundaries = StepBoundaries(timeline, self.timing, calls, StepReporter(self.watch, self, self.timing),
                                          self.strategy, self._step_settings, len(self.optimizers), trainable)
        self._loop_work = LoopWork(self._boundaries, self.watch, device, strategy_group(model, sharded), self._attached)
        if self.watch.probing is not None:  # the loop's phases are in its step boundaries, not in timeline phases
            boundaries = weakref.ref(self._boundaries)  # weakly: what outlives a detach must not hold the model
            self.watch.probing.phase_of = lambda: held.phase if (held := boundaries()) is not None else ""
        self._hooks = PhaseHooks(model, self.optimizers, self._boundaries, self.watch, trainable, self.detach)
        self._hooks.install()
        setattr(model, "_ddpwatch_attached", True)
        self.address = address
        self.uncaught: BaseException | None = None  # what ended the process, if the loop raised
        self._process_hooks = ProcessHooks(self, address, self.watch, self._detach_at_exit, self._attached)
        self._loop_work.start()
        self._process_hooks.install()

    @property
    def publisher(self) -> Any:
        return self.watch.publisher

    @property
    def device(self) -> torch.device:
        """The device the model computes on, whose clock times its steps (``compute_device``)."""
        return self._loop_work.device

    @device.setter
    def device(self, device: torch.device) -> None:
        self._loop_work.device = device

    @property
    def broken(self) -> Exception | None:
        """What ddpwatch's own code raised in a hook, where it did: watching stops (``HookFaults``)."""
        return self._hooks.faults.error

    @property
    def _handles(self) -> list[Any]:
        """The hooks' handles while attached; empty once detached."""
        return self._hooks.handles

    @property
    def _steps(self) -> int:
        """The steps begun so far (``StepBoundaries.steps``)."""
        return self._boundaries.steps

    def _attached(self) -> bool:
        return bool(self._hooks.handles)

    def detach(self, reason: str = "finished", trains_again: bool = False) -> None:
        """Remove the hooks and say goodbye (``trains_again``: the loop begins again at once, a run
        of its own). DDP keeps its communication hook (it cannot drop one), which goes on
        averaging as DDP's default does, untimed. Safe to call twice."""
        if not self._handles:
            return
        if reason == "finished":  # its last update done, whichever of the optimizers stepped in it
            self._boundaries.end_after_partial_update()
        self._hooks.remove()
        self._loop_work.stop()
        self.timing.stop_timing()
        setattr(self.model, "_ddpwatch_attached", False)
        self._process_hooks.remove()
        self.watch.close(reason, trains_again=trains_again)

    def _detach_at_exit(self) -> None:
        """The end of the process detaches what the script did not: finished, failed with what
        it raised, or interrupted by the signal that stopped it (a ``SystemExit``, which never
        reaches ``sys.excepthook``); where watching had stopped on an error of ddpwatch's own,
        detached with it."""
        ended_by = self.uncaught or stop_signals.received
        self.detach(goodbye_reason(ended_by) if ended_by is not None else self.broken_reason() if self.broken else "finished")

    def stop_watching_after(self, error: Exception, where: str) -> None:
        """ddpwatch's own code raised ``error`` in the hook ``where``: every hook is a no-op from
        now on, said in one line on this rank (``HookFaults.stop_watching_after``)."""
        self._hooks.faults.stop_watching_after(error, where)

    def broken_reason(self) -> str:
        """The goodbye of a rank whose watching stopped on ``broken``: *detached: OverflowError: …*."""
        return self._hooks.faults.reason()

    def held_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank holds (``memory.held_memory``; with ``optimizers``): the
        model's, or under FSDP its shards."""
        return self._parameters

    def record_loss(self, loss: torch.Tensor | SupportsFloat) -> None:
        """This micro-step's loss, for a loop that computes it outside the model (where the
        forward returns it, it is read there: ``loss_of``; a step with losses recorded here
        reports those alone). Optional, one line after the loss is computed; a device tensor is
        read when the step resolves, never waited for here. A number is taken too (a loop that
        logs ``loss.item()`` has one already)."""
        if isinstance(loss, numbers.Real) and not isinstance(loss, bool):  # numpy's scalars too
            loss = torch.tensor(float(loss))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AttachError(f"record_loss: expected the loss as a one-element tensor or a number, got {describe(loss)}")
        self._boundaries.record_loss(loss)

    def record_evaluation(self, metrics: Mapping[str, Any]) -> None:
        """What an evaluation after the steps done so far measured, by name (``{"eval_loss": 0.41,
        "accuracy": 0.87}``), for the dashboard's Loss tab and the exports; optional, one line
        after the evaluation (the Trainer callback sends the Trainer's own). Numbers or
        one-element tensors: a tensor is read here (``.item()``, which waits for the device: an
        evaluation has just waited for its results anyway). A misuse is one line naming it."""
        if not isinstance(metrics, Mapping):
            raise AttachError(f"record_evaluation: expected the metrics as a mapping of names to numbers, got {describe(metrics)}")
        numbers_by_name: dict[str, Any] = {}
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            numbers_by_name[name] = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
        if (problem := metrics_problem(numbers_by_name)) is not None:
            raise AttachError(f"record_evaluation: {problem}")
        if self._handles:  # attached
            self.watch.record_evaluation(numbers_by_name)

    @contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """Mark the loop's own work between two steps that is not training, so that it does not
        read as the next step's data loading (a stall that is not one), and its collectives (an
        evaluation's gathers) as the step's::

            with watch.paused("evaluate"):
                accuracy = evaluate(model, eval_loader)

        The pause runs from the end of the step before it to the end of the block; the next step
        begins there. Inside a step (between the micro-steps of gradient accumulation) the step
        is left out of the figures instead: it holds time that was not training. While the block
        runs, the rank's heartbeats say what it is doing (the dashboard's notes: *ranks 0-1: the
        loop has paused training (evaluate) for 42 s*), so that a long evaluation does not read as
        a hang."""
        if not isinstance(what, str) or not what.strip():
            raise AttachError(f"paused: expected what the loop pauses for, in words (\"evaluate\"), got {describe(what)}")
        self.pause_begins(what.strip())
        try:
            yield
        finally:  # a checkpoint that failed to write, the error caught by the loop, paused it all the same
            self.pause_ends(what.strip())

    @contextmanager
    def computing(self, what: str) -> Iterator[None]:
        """Mark the loop's own compute outside the model's forward, backward and ``step()``, so
        that it reads as compute (a ``loop`` span tagged ``what``), not as the next step's data
        loading nor as idle time::

            with watch.computing("teacher forward"):
                with torch.no_grad():
                    teacher_logits = teacher(inputs)
            ...
            optimizer.step()
            with watch.computing("ema"):
                ema.update_parameters(model)

        Training's own work, unlike a pause: it stays in the step's figures (Compute%), and where
        it falls in the gap before a forward, that gap's ``data`` is cut around it. A block that
        runs after ``step()`` is in the next step's window, which begins there. Not counted: a
        block before the first training forward (no step has begun), inside the model's forward
        or inside a pause of training, or on another thread."""
        if not isinstance(what, str) or not what.strip():
            raise AttachError(f"computing: expected what the loop computes, in words (\"ema\"), got {describe(what)}")
        start = self._loop_work.compute_begins()
        try:
            yield
        finally:  # what it computed before raising, the error caught by the loop, was computed all the same
            if start is not None:
                self._loop_work.compute_ends(start, what.strip()[:MAX_PAUSED_FOR])

    def pause_begins(self, what: str) -> None:
        """The loop pauses training now to do ``what``: said in the rank's heartbeats until the
        pause ends or the next training forward (the Trainer callback's ``on_step_end``, when the
        Trainer will evaluate or save)."""
        if self._handles:
            self.watch.pausing = what

    def pause_ends(self, what: str) -> None:
        """The loop paused training since the step before ended, to do ``what``, and trains on
        from now (``paused``; the Trainer callback's ``on_evaluate`` and ``on_save``)."""
        if not self._handles:  # detached
            return
        self.watch.pausing = ""
        self._boundaries.pause_ended(what)

    def wait_begins(self) -> Any:
        """Where the loop begins to wait for an asynchronous collective of its own: a stamp,
        where the wait is a step's; else None (``LoopWork.wait_begins``)."""
        return self._loop_work.wait_begins()

    def wait_ends(self, start: Any, tag: str = "") -> None:
        """The loop's wait begun at ``start`` returned: a ``wait`` span, blocked time of the step."""
        self._loop_work.wait_ends(start, tag)

    def _on_the_steps_clock(self, call: LoopCall) -> bool:
        """Whether the step's clock can time the loop's ``call`` (``LoopWork.on_steps_clock``)."""
        return self._loop_work.on_steps_clock(call)

    def _step_settings(self) -> dict[str, Any]:
        """The settings each step begins with (its ``grad_accum`` counted as it ends)."""
        if isinstance(self.model, DistributedDataParallel):
            return {"bucket_mb": megabytes_given(self.model.bucket_bytes_cap), "grad_accum": 1,
                    **first_bucket_setting(self.model), **self._hook_settings}
        return {"grad_accum": 1, **self._mesh_settings}
