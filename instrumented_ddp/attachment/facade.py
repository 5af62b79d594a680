"""Watch a training loop ddpwatch did not write: one line after the user's own DDP wrap.

    model = DistributedDataParallel(model, device_ids=[local_rank])
    watch = instrumented_ddp.attach(model, optimizer, address="tcp://127.0.0.1:5555")
    ...  # the loop, unchanged
    watch.detach()  # or let the process end: goodbye is sent either way

A model sharded with FSDP2 (``fully_shard`` on its layers and its root) is attached the same
way: its units' all-gathers and reduce-scatters are timed instead of DDP's buckets
(``FSDPTiming``), and its steps are reported as ``fsdp``.

Where the phases come from, since the loop is not ours to mark:

- a step ends when the optimizer's ``step()`` returns (its post-hook; given several, when each
  has stepped, or, where one sits out an update, where the last that stepped returned, found at
  the next training forward), and the next one begins there: the gap until the next forward
  (the data loader, ``zero_grad``, a scheduler, logging) is recorded as ``data``, and so is the
  gap from a micro-step's backward to the next forward (the next micro-batch's loading) under
  gradient accumulation;
- ``forward`` is the DDP module's forward (its pre- and post-hooks; DDP's buffer broadcast inside
  it is a collective of its own). Only forwards with gradients enabled count: an evaluation under
  ``torch.no_grad()`` is not a training step; and a forward is a micro-step, with its samples and
  loss, only once a gradient reaches its output (``TrainingForward``);
- ``backward`` starts when the first gradient reaches one of the forward's outputs (a tensor hook:
  a module's full-backward hooks see only tensor outputs, and a Hugging Face model returns a
  ``ModelOutput``) and ends in a callback queued on the autograd engine, which runs once DDP's own
  end-of-backward work (waiting for the last buckets) is done;
- ``optimizer`` runs from the end of the step's last backward to the return of the optimizer's
  ``step()``: what a loop does between them (gradient clipping, AMP's unscaling and inf check,
  the Trainer's ``max_grad_norm``) is part of the update, and would otherwise be an unnamed gap
  counted as idle; with no backward before it (a loop that steps twice), it is ``step()`` alone;
  where the forward and backward run inside ``step()``, in a closure (PyTorch Lightning, LBFGS),
  it runs from the end of that backward;
- a step whose update was skipped (a loss scaler that found inf or NaN does not call ``step()``,
  so no step hook fires) ends where its last backward ended, once the next forward finds the
  gradients that backward reduced cleared (``zero_grad``): ``_update_skipped``;
- every bucket's all-reduce goes through ``DDPTiming``'s hook, which does what DDP's default does,
  bit for bit; where the DDP already has a hook of the user's (gradient compression: fp16,
  PowerSGD, Accelerate's ``comm_hook``), DDP keeps it and the all-reduces it issues are timed as
  it issues them (``hooked_collectives``; a settings entry ``comm_hook`` names it). DDP's first
  iteration (one bucket of everything, before DDP rebuilds its buckets) is excluded from the
  statistics, as for the ``ddp`` strategy; under ``static_graph`` its first two
  (``DDPTiming.on_first_buckets``). Under FSDP2 every unit's all-gather and reduce-scatter
  goes through FSDP's custom-comm hooks, issuing what its defaults issue (``FSDPTiming``);
- the loop's own synchronous collectives between the model's phases (the Trainer's gathers
  before each forward and for its log, a loop's all-reduce of its loss, a broadcast before
  ``step()``) are timed as collectives of their kind, tagged ``l<k>``, the k-th of the step
  (``collective_stand_ins``; ``_time_loop_collective``): in the data time they are not data
  loading, and a rank waiting in one for a slower rank's loader names that rank the straggler;
- the loop's own work between steps that is not training (an evaluation, a checkpoint) is
  ``data`` too, unless marked: ``with watch.paused("evaluate"): ...`` (the Trainer callback
  marks its evaluations and checkpoints itself). The next step then begins where the pause
  ended, and the pause, from the end of the step before, is reported with it, in no figure
  (``StepReport.paused_s``);
- the loop's own compute outside the model (an average of the weights after ``step()``, a
  teacher's forward in distillation) is ``data`` where it falls before a forward, and idle time
  between a forward and its backward, unless marked: ``with watch.computing("ema"): ...``, a
  ``loop`` span, compute, the data gap cut around it;
- a rank stopped from outside (Ctrl-C at torchrun, torchrun's SIGTERM to the ranks left when one
  fails, a scheduler's preemption) says goodbye as *interrupted*: while attached, SIGTERM, whose
  default action kills at once, raises instead where the script set no handler of its own
  (``stop_signals``);
- ``detach()`` leaves that hook (DDP cannot drop one) averaging untimed, and a later ``attach`` of
  the same model (a Trainer's second ``train()``) times it again, a new run on the dashboard.

An attached run cannot switch strategies: the loop is the user's. Its hello says so, the
dashboard offers no switch, and a switch command is answered with a refusal.
"""

from __future__ import annotations

import atexit
import functools
import numbers
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from instrumented_ddp.timing import collective_stand_ins
from instrumented_ddp.publish import stop_signals
from instrumented_ddp.attachment.problems import attach_problem, compiled_module, innermost_optimizer, is_fsdp2, optimizers_given
from instrumented_ddp.attachment.attached_model import (
    all_reduce_group,
    backend_of,
    compute_device,
    first_bucket_setting,
    megabytes_given,
    sharded_timing,
    steps_any_of,
    strategy_group,
)
from instrumented_ddp.timing.collective_stand_ins import BARRIER, NOT_TIMED, LoopCall
from instrumented_ddp.timing.collectives import LooksWhenWaited, WaitedByTheLoop, gives_future, queue_of
from instrumented_ddp.timing.ddp_timing import DDPTiming, users_comm_hook
from instrumented_ddp.distributed import DistributedContext
from instrumented_ddp.attachment.forward_values import batch_size_and_tokens, describe, loss_of, mean_loss, output_tensors
from instrumented_ddp.attachment.issued_collectives import IssuedCollectives, StepCollectives
from instrumented_ddp.resources.memory import MemorySampler
from instrumented_ddp.wire.protocol import (
    COMM_KINDS,
    DEFAULT_ADDRESS,
    DETACHED,
    INTERRUPTED,
    LOOP_COMPUTE_KIND,
    MAX_PAUSED_FOR,
    NOT_SWITCHABLE,
    address_problem,
    barrier_tag,
    is_loopback,
    load_client_keys,
    metrics_problem,
)
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.publish.watch import Watch, goodbye_reason, parameter_layout

if TYPE_CHECKING:
    from instrumented_ddp.timing.fsdp_timing import FSDPTiming

__all__ = ["NOT_SWITCHABLE", "AttachError", "Attachment", "attach"]


class AttachError(RuntimeError):
    """A misuse of ``attach``, said in one line that names the fix; nothing was changed."""


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def never_raises_into_the_loop(detaches_here: bool) -> Callable[[_Hook], _Hook]:
    """A hook of the loop's model, its optimizers or its backward, which must never make the
    loop raise (nor raise again at every step after): where ddpwatch's own code raises in it,
    the rank stops being watched, said in one line, and training goes on unwatched. The hooks
    are removed at once where ``detaches_here`` (a forward's: torch copies its hooks before it
    calls them), else at the next forward or the exit, whichever comes first, since an
    optimizer's hooks are called from a loop over the very dict removing them would change;
    until then each is a no-op. A SIGTERM or a Ctrl-C that comes inside one is raised as it
    returns (``stop_signals.held``): a step's report is never made and left unsent."""

    def guard(hook: _Hook) -> _Hook:
        @functools.wraps(hook)
        def guarded(self: Attachment, *args: Any, **kwargs: Any) -> Any:
            if self.broken is None:
                try:
                    with stop_signals.held:  # a SIGTERM or Ctrl-C lands in the loop's code, not mid-report
                        return hook(self, *args, **kwargs)
                except Exception as error:
                    self.stop_watching_after(error, hook.__name__)
            if detaches_here:
                try:
                    self.detach(self.broken_reason())
                except Exception:  # what is left of the watch goes with the process
                    pass
            return None

        return cast(_Hook, guarded)

    return guard


#: The address each live attachment of this process sends to: a dashboard watches one run, and
#: a second model attached to the same address (a GAN's two DDPs) is another run, which it
#: leaves out whole.
_ADDRESSES_IN_USE: dict[str, Attachment] = {}


class _UncaughtNoted:
    """Python's hook for an exception no one caught, which runs before the exit's: the loop
    raised, and each live attachment's goodbye says so (it said *finished*, and the rank read
    so). One for the process, installed with the first attachment and taken out with the last,
    reading the live ones as it runs: a hook of each attachment's own, chained, was put back by
    the later one's detach, and held the earlier one's model for the rest of the process."""

    def __init__(self) -> None:
        self.previous: Callable[..., Any] | None = None

    def __call__(self, kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        for attachment in list(_ADDRESSES_IN_USE.values()):
            attachment.uncaught = error
        (self.previous or sys.__excepthook__)(kind, error, trace)

    def install(self) -> None:
        if sys.excepthook is not self:
            self.previous, sys.excepthook = sys.excepthook, self

    def remove_if_unused(self) -> None:
        """Put the hook before it back once no attachment is live, unless one set after it is
        there now (it chains to this one, which then passes every exception on)."""
        if not _ADDRESSES_IN_USE and sys.excepthook is self:
            sys.excepthook, self.previous = self.previous or sys.__excepthook__, None


_NOTE_UNCAUGHT = _UncaughtNoted()


def attach(model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
           address: str = DEFAULT_ADDRESS, watch_key: str | None = None, total_steps: int = 0) -> Attachment:
    """Watch ``model``, a ``DistributedDataParallel`` the caller built (or a model sharded with
    FSDP2's ``fully_shard``, its root included), and the ``optimizer`` that steps it (or a list of
    each that does, where the loop steps several: the update ends when every one has). Every rank
    calls it once, after wrapping and before the first backward (it is a collective: the ranks
    agree on a session id). ``watch_key``: the dashboard's ``client.json`` when ``address`` is
    beyond loopback. ``total_steps``: the optimizer steps the loop will take, where it knows them
    (the dashboard's progress bar and ETA; 0: unknown). Raises ``AttachError`` (one line) on a
    misuse, having changed nothing. A ``torch.compile`` of the model is seen through to the module
    it compiled."""
    model = compiled_module(model)
    problem = attach_problem(model, optimizer)
    if problem is None and (isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0):
        problem = f"total_steps must be a whole number of optimizer steps, 0 or more (0: unknown), not {total_steps!r}"
    if problem is None:
        problem = address_problem(address)
        if problem is None and watch_key is None and not is_loopback(address):
            problem = f"address {address} is not loopback: pass watch_key= (the dashboard's client.json)"
        if problem is None and address in _ADDRESSES_IN_USE:
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


@dataclass
class TrainingForward:
    """One training forward's samples, tokens and loss, counted in its step once a gradient
    reaches its output: a forward that no backward follows (an evaluation run with gradients
    enabled) is neither a micro-step nor part of the step's batch or loss."""

    samples: int
    tokens: Any  # an int, or a device tensor (an attention mask's sum), read when the step resolves
    loss: torch.Tensor | None
    reached_by_backward: bool = False


class Attachment:
    """The hooks ``attach`` installed on one DDP (or FSDP2) model and its optimizers, and the watch
    they feed."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], address: str, keys: Any,
                 total_steps: int = 0) -> None:
        self.model, self.optimizers = model, tuple(optimizers)
        sharded = is_fsdp2(model)
        self.strategy = "fsdp" if sharded else "ddp"
        ddp = None if sharded else cast(DistributedDataParallel, model)  # ``attach_problem`` let a DDP or an FSDP2 model in
        module = model if ddp is None else cast(nn.Module, ddp.module)  # torch types ``DDP.module`` as Tensor | Module
        group = None if ddp is None else ddp.process_group  # FSDP's: its mesh, over the default group's ranks
        self.device = compute_device(model, module, sharded)
        meets = all_reduce_group(model, sharded)
        replicas = len(meets) if sharded and len(meets) > 1 else 0
        self._mesh_settings = {"replicas": replicas} if replicas else {}  # HSDP: the replicate dimension's size
        users_hook = None if ddp is None else users_comm_hook(ddp)
        self._hook_settings = {"comm_hook": users_hook} if users_hook else {}  # gradient compression, named
        context = DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                                     self.device, backend_of(group, self.device))
        self.watch = Watch.start(address, context, {
            "strategy": self.strategy, "settings": self._settings(1),
            "model_parameters": sum(p.numel() for p in module.parameters()),
            "parameter_layout": parameter_layout(module), "all_reduce_group": meets, "total_steps": total_steps,
        }, keys=keys, switchable=False)
        timeline = self.watch.timeline
        assert isinstance(timeline, StepTimeline)  # ``Watch.start`` times every run it starts: narrowed for the type checker
        self.timeline: StepTimeline = timeline
        kept: DDPTiming | FSDPTiming | None = getattr(model, "_ddpwatch_timing", None)
        if kept is not None:  # attached before and detached: DDP keeps the hook it was given, FSDP its comms
            kept.resume(self.timeline)
            self.timing = kept
        else:
            self.timing = sharded_timing(model, self.timeline) if ddp is None else DDPTiming(ddp, self.timeline)
            self.timing.install()
            # Plain attributes, read back with getattr: ``nn.Module.__setattr__`` is typed for tensors and modules only.
            setattr(model, "_ddpwatch_timing", self.timing)
        self._steps = 0
        self._micro_steps = 0  # backwards in this step that reached a forward none before them did
        self._backward_is_a_micro_step = False  # the backward running now reached such a forward
        self._forwards: list[TrainingForward] = []  # this step's, with what each returned (``loss_of``)
        self._inputs: tuple[int, Any] = (0, 0)  # samples and tokens of the forward running now
        self._recorded_losses: list[torch.Tensor] = []  # what the loop handed over (``record_loss``)
        self._data_from: Any = None  # when the gap before this step's first forward began
        self._forward_from: Any = None
        self._backward_from: Any = None
        self._optimizer_from: Any = None
        self._after_backward: Any = None  # when this step's latest backward ended, until a forward or the step names the gap
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        self._parameters: list[torch.Tensor] = list(module.parameters())  # FSDP's are its DTensor shards
        self._memory = MemorySampler()  # bytes held, every few steps, as train.py measures
        #: The script's own collectives: what the step issued beyond what we time, and where.
        self._collectives = StepCollectives(IssuedCollectives(), lambda: self.timeline.timed_collectives())
        self._nograd_forwards = 0  # forwards without gradients in this step's data gap, outside a pause: ``_before_forward``
        #: After a backward that reduced, a parameter it left a gradient on: ``_update_skipped``.
        self._reduced_gradient_of: nn.Parameter | None = None
        self._inside_optimizer_step = False  # between an optimizer's step pre- and post-hooks
        self._stepped_inside_forward = False  # an update inside the model's forward: ``_before_optimizer_step``
        self._stepped_in_update: set[int] = set()  # ids of the optimizers whose step() returned in this update
        #: Where the latest of them returned while others are still to step; the update ended
        #: there if none of them steps before the next training forward.
        self._update_returned: Any = None
        self._bucket_layout_sent = False
        self._loop_calls = 0  # the loop's collectives timed in this step: ``l<k>``
        self._strategy_group = strategy_group(model, sharded)  # a loop's collective on it waits in their queue: ``queue_of``
        self._nccl_groups: dict[int, tuple[Any, bool]] = {}  # by id: a group, and whether NCCL reduces its CUDA tensors
        #: Their spans since a point the step may prove to have ended at, until a forward or the
        #: update: its latest backward (found to have ended it where the update was skipped), or
        #: an optimizer's return with others still to step (where none of them does). The next
        #: step's, where it did end there.
        self._loop_spans_since_possible_end: list[Any] = []
        #: What ddpwatch's own code raised in a hook, where it did: watching stops (``never_raises_into_the_loop``).
        self.broken: Exception | None = None
        self._handles = [
            # before FSDP's own pre-forward hook, whose all-gather is then inside the forward
            model.register_forward_pre_hook(torch.compiler.disable(self._before_forward), with_kwargs=True, prepend=True),
            model.register_forward_hook(torch.compiler.disable(self._after_forward), with_kwargs=True),
            *(optimizer.register_step_pre_hook(self._before_optimizer_step) for optimizer in self.optimizers),
            *(optimizer.register_step_post_hook(self._after_optimizer_step) for optimizer in self.optimizers),
            register_optimizer_step_post_hook(self._any_optimizer_stepped),
        ]
        self._other_optimizers: set[int] = set()  # ids of unattached ones judged: ``_any_optimizer_stepped``
        setattr(model, "_ddpwatch_attached", True)
        _ADDRESSES_IN_USE[address] = self
        self.address = address
        self.uncaught: BaseException | None = None  # what ended the process, if the loop raised
        _NOTE_UNCAUGHT.install()
        atexit.register(self._detach_at_exit)
        collective_stand_ins.stand_in(self)
        self._loop_thread = collective_stand_ins.time_loop_calls(self._time_loop_collective)
        self._stops_on_sigterm = stop_signals.stop_on_sigterm()  # torchrun's stop, a preemption: a goodbye, not *lost*
        stop_signals.when_stuck(self._goodbye_while_blocked)
        self._holds_ctrl_c = stop_signals.hold_ctrl_c()  # a Ctrl-C in a hook: raised as it returns

    @property
    def publisher(self) -> Any:
        return self.watch.publisher

    def detach(self, reason: str = "finished", trains_again: bool = False) -> None:
        """Remove the hooks and say goodbye (``trains_again``: the loop begins again at once, a run
        of its own). DDP keeps its communication hook (it cannot drop one), which goes on
        averaging as DDP's default does, untimed. Safe to call twice."""
        if not self._handles:
            return
        if reason == "finished":  # its last update done, whichever of the optimizers stepped in it
            self._end_a_step_whose_update_ended_with_others_not_stepping()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        collective_stand_ins.stop_timing_loop_calls(self._loop_thread, self._time_loop_collective)
        collective_stand_ins.stand_down(self)
        self.timing.stop_timing()
        setattr(self.model, "_ddpwatch_attached", False)
        if _ADDRESSES_IN_USE.get(self.address) is self:
            del _ADDRESSES_IN_USE[self.address]
        atexit.unregister(self._detach_at_exit)
        _NOTE_UNCAUGHT.remove_if_unused()
        stop_signals.not_when_stuck(self._goodbye_while_blocked)
        if self._stops_on_sigterm and not _ADDRESSES_IN_USE:  # the last attachment: SIGTERM kills again
            stop_signals.default_on_sigterm()
        if self._holds_ctrl_c and not _ADDRESSES_IN_USE:
            stop_signals.release_ctrl_c()
        self.watch.close(reason, trains_again=trains_again)

    def _detach_at_exit(self) -> None:
        """The end of the process detaches what the script did not: finished, failed with what
        it raised, or interrupted by the signal that stopped it (a ``SystemExit``, which never
        reaches ``sys.excepthook``); where watching had stopped on an error of ddpwatch's own,
        detached with it."""
        ended_by = self.uncaught or stop_signals.received
        self.detach(goodbye_reason(ended_by) if ended_by is not None else self.broken_reason() if self.broken else "finished")

    def _goodbye_while_blocked(self) -> None:
        """A SIGTERM found the loop blocked in C++, and the process ends from another thread
        (``stop_signals``): the goodbye goes out from there, the publisher's alone (what the
        main thread holds, the timeline's lock among it, is not waited for)."""
        if self.publisher is not None and self._handles:
            self.publisher.close(self.watch.steps, f"{INTERRUPTED}SIGTERM")

    def stop_watching_after(self, error: Exception, where: str) -> None:
        """ddpwatch's own code raised ``error`` in the hook ``where``: every hook is a no-op from
        now on (``never_raises_into_the_loop`` removes them), said in one line on this rank."""
        self.broken = error
        try:
            print(f"instrumented_ddp.attach: rank {self.timeline.rank}: ddpwatch raised "
                  f"{self.broken_reason().removeprefix(DETACHED)} in {where}: this rank is no longer watched and trains on "
                  "unwatched (a fault of ddpwatch's: please report it with this line)", file=sys.stderr, flush=True)
        except Exception:  # no stderr to say it on: the goodbye still says it
            pass

    def broken_reason(self) -> str:
        """The goodbye of a rank whose watching stopped on ``broken``: *detached: OverflowError: …*."""
        first_line = next(iter(str(self.broken).splitlines()), "")
        return f"{DETACHED}{type(self.broken).__name__}" + (f": {first_line[:200]}" if first_line else "")

    def held_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank holds (``memory.held_memory``; with ``optimizers``): the
        model's, or under FSDP its shards."""
        return self._parameters

    def record_loss(self, loss: torch.Tensor | SupportsFloat) -> None:
        """This micro-step's loss, for a loop that computes it outside the model (where the
        forward returns it, it is read there: ``loss_of``; a step with losses recorded here
        reports those alone). Optional, one line after the loss is computed; a device tensor is
        read when the step resolves, never waited for here. A number is taken too (a loop that
        logs ``loss.item()`` has one already): it was refused, an exception in the user's loop."""
        if isinstance(loss, numbers.Real) and not isinstance(loss, bool):  # numpy's scalars too
            loss = torch.tensor(float(loss))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AttachError(f"record_loss: expected the loss as a one-element tensor or a number, got {describe(loss)}")
        self._recorded_losses.append(loss.detach().clone())  # as it is now: see ``_after_forward``

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
        start = self._loop_compute_begins()
        try:
            yield
        finally:  # what it computed before raising, the error caught by the loop, was computed all the same
            if start is not None:
                self._loop_compute_ends(start, what.strip()[:MAX_PAUSED_FOR])

    def _loop_compute_begins(self) -> Any:
        """Where a block the loop marked with ``computing`` begins: a stamp where it is the
        step's, else None."""
        if (not self._handles or not self.timeline.in_step or self._forward_from is not None or self.watch.pausing
                or threading.get_ident() != self._loop_thread):
            return None
        try:
            self._end_a_step_whose_update_was_skipped()  # gradients cleared since the backward: this is the next step's
            return self.timeline.stamp()
        except Exception:
            return None

    def _loop_compute_ends(self, start: Any, what: str) -> None:
        if not self._handles or not self.timeline.in_step:
            return
        try:
            span = self.timeline.add_span(LOOP_COMPUTE_KIND, start, self.timeline.stamp(), blocking=False)
        except Exception:
            return
        span.tag = what
        if self._step_may_have_ended:  # the next step's, if the step proves to have ended before it
            self._loop_spans_since_possible_end.append(span)

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
        self._end_a_step_whose_update_ended_with_others_not_stepping()  # the pause came after it
        now = self.timeline.stamp()
        if self.timeline.paused_until(what, now):  # between steps: the next one begins now
            self._data_from = now
            self._collectives.restart(in_gap=True)  # the pause's collectives are not the step's
            self._nograd_forwards = 0  # nor its forwards, where the pause was not said to begin

    def _settings(self, micro_steps: int) -> dict[str, Any]:
        if isinstance(self.model, DistributedDataParallel):
            return {"bucket_mb": megabytes_given(self.model.bucket_bytes_cap), "grad_accum": micro_steps,
                    **first_bucket_setting(self.model), **self._hook_settings}
        return {"grad_accum": micro_steps, **self._mesh_settings}

    # -- the hooks ---------------------------------------------------------------------------------
    def _begin_step(self, at: Any = None) -> None:
        self._steps += 1
        self.timeline.begin_step(self._steps, self.strategy, self._settings(1), at=at)
        self._micro_steps, self._forwards, self._recorded_losses = 0, [], []
        carried = [span for span in self._loop_spans_since_possible_end if span.kind in COMM_KINDS]
        for index, span in enumerate(carried):  # from a step found to have ended before them: this one's first
            span.tag = f"l{index}"
        self._loop_calls = len(carried)
        self._loop_spans_since_possible_end = []
        self._after_backward = self._reduced_gradient_of = self._update_returned = None
        self._stepped_in_update = set()
        self._began_on_first_buckets = self.timing.on_first_buckets  # DDP's first iteration: excluded

    def _end_step(self, at: Any = None, update_skipped: bool = False) -> None:
        """Report this step, ended now or at ``at``, and begin the next one there. A step found
        only now to have ended at ``at`` (its update skipped at its backward, or ended at an
        optimizer's return with the others not stepping) gives what the loop did since to the next."""
        trained = [forward for forward in self._forwards if forward.reached_by_backward]
        samples = sum(forward.samples for forward in trained)
        tokens = sum((forward.tokens for forward in trained), 0)
        losses = self._recorded_losses or [forward.loss for forward in trained if forward.loss is not None]
        loss = mean_loss(losses) if losses else None
        memory = self._memory.sample(self) if self.publisher is not None else None
        found_later = at is not None
        nograd_forwards = 0 if found_later else self._nograd_forwards  # they came after ``at``
        self._nograd_forwards -= nograd_forwards
        issued, in_data = self._collectives.step_ends(gap_to_next=found_later)
        self.timeline.end_step(samples, tokens, loss, excluded=self._began_on_first_buckets, memory=memory,
                               settings={"grad_accum": max(1, self._micro_steps)}, at=at, update_skipped=update_skipped,
                               issued_collectives=issued, untimed_in_data=in_data, nograd_forwards=nograd_forwards,
                               carried=self._loop_spans_since_possible_end if found_later else ())
        if self._steps == 1 and self.publisher is not None:
            self.watch.update_hello(global_batch=samples * dist.get_world_size())
        if not self._bucket_layout_sent and (layout := self.timing.bucket_layout()):
            self.watch.update_hello(bucket_layout=layout)  # which parameters each b<i> holds: the advisor reads it
            self._bucket_layout_sent = True
        self.watch.step_done()
        self.watch.refuse_commands(NOT_SWITCHABLE)
        self._begin_step(at=at)
        self._data_from = at if at is not None else self.timeline.stamp()

    def _update_skipped(self) -> bool:
        """Whether this step's gradients were reduced and then cleared with no ``optimizer.step()``
        between: the update was skipped, and the step is over. ``torch.amp.GradScaler`` skips
        ``step()`` when it finds inf or NaN among the gradients (so do Accelerate's and the
        Trainer's fp16 paths, through it), which an fp16 run does at its first steps while the
        scale settles and now and then after; without this, the next step's forwards, backwards
        and all-reduces would be reported inside the skipped one. Seen only where the loop clears
        gradients to None (``zero_grad()``'s default) before the next forward; one zeroed in
        place, or cleared after the forward, leaves the two steps merged."""
        gradient_of = self._reduced_gradient_of
        return (self._after_backward is not None and gradient_of is not None and gradient_of.grad is None
                and not self._inside_optimizer_step)  # LBFGS's closure clears them for its next evaluation

    def _end_a_step_whose_update_was_skipped(self) -> None:
        """Where the update was skipped (``_update_skipped``), the step ended at its backward: end
        it there, so that what the loop does now (a forward, a collective, a wait) is the next one's."""
        if self._update_skipped():
            self._end_step(at=self._after_backward, update_skipped=True)

    @property
    def _step_may_have_ended(self) -> bool:
        """Whether the step may prove to have ended already: at its latest backward (where the
        update turns out skipped), or at an optimizer's return with others of the list still to
        step (where none of them does). What the loop issues meanwhile is kept aside
        (``_loop_spans_since_possible_end``), to be the next step's if so."""
        return self._after_backward is not None or self._update_returned is not None

    def _end_a_step_whose_update_ended_with_others_not_stepping(self) -> None:
        """Where some of the attached optimizers stepped since the last backward and the rest did
        not before this training forward (one stepped every other update), the update ended
        where the last of them returned: end the step there."""
        returned = self._update_returned
        if returned is not None:
            self.timeline.add_span("optimizer", self._optimizer_from, returned, blocking=False)
            self._end_step(at=returned)

    def _time_loop_collective(self, call: LoopCall, issue: Callable[[], Any]) -> Any:
        """A collective the loop issued on its thread (``collective_stand_ins``), timed as a
        collective of its kind, ``l<k>``, where a step is open and outside a pause of training
        (an evaluation's are the pause's); ``NOT_TIMED``, issuing nothing, elsewhere (torch's own
        function issues it untimed, and it is counted). Inside the training forward too: a
        mixture of experts' all-to-alls, a ``SyncBatchNorm``'s gathers, a blocking span inside the
        forward's, which the figures take out of its compute (they were counted untimed, their
        time read as the forward's compute). A synchronous
        one is issued asynchronously, a blocking span, and waited for here; an asynchronous one
        is a span like the ``async`` strategy's, its work handed back to the loop in a wrapper
        whose wait is the step's (``wait_begins``). A step whose update was skipped ends first,
        as at the next forward, so that what the loop issues after it is the next step's.
        ddpwatch's bookkeeping raising never loses the user's collective: issued untimed."""
        timeline = self.timeline
        if not self._handles or not timeline.in_step or self.watch.pausing or not self._on_the_steps_clock(call):
            return NOT_TIMED
        if call.kind == BARRIER:
            return self._time_loop_barrier(issue, call.async_op, call.group)
        try:
            self._end_a_step_whose_update_was_skipped()
            timeline.time_collectives_in(call.group)
            span = timeline.open_collective(call.kind, call.nbytes, f"l{self._loop_calls}", call.dtype, not call.async_op,
                                            queue=queue_of(call.group, self._strategy_group))
        except Exception:
            return NOT_TIMED
        self._loop_calls += 1
        if self._step_may_have_ended:
            self._loop_spans_since_possible_end.append(span)
        try:
            work = issue()
        except Exception as error:
            span.fail(error)
            raise
        if call.async_op:
            if call.kind == "reduce_scatter" and not gives_future(work):
                return WaitedByTheLoop(work, timeline, self, ends_when_waited=span)
            timeline.close_collective(span, work)
            return WaitedByTheLoop(work, timeline, self)
        timeline.close_collective(span, work)
        LooksWhenWaited(work, timeline).wait()  # on the CPU its end is its wait's return, exactly
        return None

    def _time_loop_barrier(self, issue: Callable[[], Any], async_op: bool, group: Any) -> Any:
        """A barrier the loop issued in a step (``_time_loop_collective`` said where): the time the
        rank sat in it, a blocked ``wait`` span tagged ``protocol.BARRIER_TAG``, one of the step's timed
        collectives. It carries nothing, so there is no transfer to tell from waiting: it is the
        wait for the last rank to arrive. On a GPU its marks are events on either side of torch's
        barrier, whose wait holds the host until the barrier's NCCL all-reduce has run: they bound
        it on the device's clock, and add no synchronisation of their own. An asynchronous one
        (``async_op=True``) is the loop's wait for its work, where the loop waits (``WaitedByTheLoop``):
        a barrier whose work is never waited for in a step stays counted, untimed. One on a group
        other than the world is tagged with the group's name (``protocol.barrier_tag``)."""
        world = group is None or group is dist.GroupMember.WORLD
        tag = barrier_tag("" if world else str(getattr(group, "group_name", "") or "group"))
        if async_op:
            return WaitedByTheLoop(issue(), self.timeline, self, wait_tag=tag)
        start = self.wait_begins()
        if start is None:
            return NOT_TIMED
        result = issue()
        self.wait_ends(start, tag)
        return result

    def _on_the_steps_clock(self, call: LoopCall) -> bool:
        """Whether the step's clock can time ``call``. The host's clock (a model on the CPU)
        times any. On a GPU the step's marks are CUDA events and a collective's end is NCCL's
        duration or an event its future's callback records: a call on CPU tensors (a metric
        all-reduced over a gloo side group) or through another backend has neither (gloo's
        works have no duration: with NCCL timing on, each such step went out unresolved), so it
        is counted, untimed, as before the loop's calls were timed at all."""
        if self.device.type != "cuda":
            return True
        if call.device != "cuda" and call.kind != BARRIER:  # a barrier has no tensor: its group says
            return False
        group = call.group if call.group is not None else dist.distributed_c10d._get_default_group()
        known = self._nccl_groups.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        try:
            nccl = group._get_backend(torch.device("cuda")).name() == "nccl"
        except Exception:  # no CUDA backend in that group
            nccl = False
        self._nccl_groups[id(group)] = (group, nccl)
        return nccl

    def wait_begins(self) -> Any:
        """Where the loop begins to wait for an asynchronous collective of its own (``WaitedByTheLoop``):
        a stamp, where the wait is a step's (in a step, on the loop's thread, outside a pause of
        training: as a collective of the loop's is timed); else None."""
        if (not self._handles or not self.timeline.in_step or self.watch.pausing
                or threading.get_ident() != self._loop_thread):
            return None
        try:
            self._end_a_step_whose_update_was_skipped()
            return self.timeline.stamp()
        except Exception:
            return None

    def wait_ends(self, start: Any, tag: str = "") -> None:
        """The loop's wait begun at ``start`` returned: a ``wait`` span, blocked time of the step
        (``tag``: what it waited in, where that is not a collective's work: ``protocol.barrier_tag``)."""
        try:
            span = self.timeline.add_span("wait", start, self.timeline.stamp(), blocking=True, tag=tag)
        except Exception:
            return
        if self._step_may_have_ended:
            self._loop_spans_since_possible_end.append(span)

    @never_raises_into_the_loop(detaches_here=True)
    def _before_forward(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():  # not training: counted where it will read as data loading, else not seen
            if not self.watch.pausing and (not self.timeline.in_step or self._data_from is not None
                                           or self._after_backward is not None):
                self._nograd_forwards += 1  # an evaluation the loop did not mark (``paused``): the dashboard says so
            return
        self.watch.pausing = ""  # training again, whatever a pause begun said it would do
        if not self.timeline.in_step:
            self._begin_step()
            self._collectives.restart(in_gap=False)  # counted from here: the first step's
            self._data_from = None
        else:
            self._end_a_step_whose_update_was_skipped()
            self._end_a_step_whose_update_ended_with_others_not_stepping()
        now = self.timeline.stamp()
        gap_from = self._data_from if self._data_from is not None else self._after_backward
        if gap_from is not None:  # the loader: after the last step, or after the last micro-step's backward
            self.timeline.add_span("data", gap_from, now, blocking=False)
            self._collectives.gap_ends()
        self._data_from = self._after_backward = None
        self._loop_spans_since_possible_end = []
        self._inputs = batch_size_and_tokens(args, kwargs)
        self._forward_from = now

    @never_raises_into_the_loop(detaches_here=True)
    def _after_forward(self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any) -> None:
        if self._stepped_inside_forward:
            self._stop_watching_a_loop_that_steps_inside_its_forward()
            return
        if self._forward_from is None:
            return
        self.timeline.add_span("forward", self._forward_from, self.timeline.stamp(), blocking=False)
        self._forward_from = None
        loss = loss_of(output)
        # A copy, not the tensor: a loop may scale its loss in place before backward (the Trainer's
        # ``loss *= num_processes`` under average_tokens_across_devices, a ``loss /= grad_accum``),
        # and the loss read at the step's end was that, not what the forward returned (a one-element
        # copy on the device, never waited for).
        forward = TrainingForward(*self._inputs, loss.detach().clone() if loss is not None else None)
        self._forwards.append(forward)
        self._backward_from = None
        for tensor in output_tensors(output):
            tensor.register_hook(functools.partial(self._gradient_reached_output, forward))

    @never_raises_into_the_loop(detaches_here=False)
    def _gradient_reached_output(self, forward: TrainingForward, _gradient: torch.Tensor) -> None:
        """A gradient reached ``forward``'s output: it trains. The first of this backward: backward
        has begun. The callback queued here runs when the engine ends the backward, before DDP's
        own (queued later, when the last bucket is launched), so it queues the one that stamps
        the end after DDP's.

        Every backward that reaches a forward's output is timed, and one is a micro-step where it
        reaches a forward no backward of the step reached before: a gradient penalty's
        ``torch.autograd.grad`` of the output and then the loss's ``backward()`` (WGAN-GP, R1) are
        two backwards of one micro-step, as are two losses' backwards through one forward
        (``retain_graph=True``); two forwards and one backward of their joint loss, one. Before,
        the penalty's took the step's one backward and the loss's went untimed, read as the update."""
        first_to_reach_it = not forward.reached_by_backward
        forward.reached_by_backward = True
        if self._backward_from is None:
            self._backward_from = self.timeline.stamp()
            self._backward_is_a_micro_step = False
            self.timing.backward_began()
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._backward_ended))
        if first_to_reach_it and not self._backward_is_a_micro_step:
            self._micro_steps += 1
            self._backward_is_a_micro_step = True

    @never_raises_into_the_loop(detaches_here=False)
    def _backward_ended(self) -> None:
        began, self._backward_from = self._backward_from, None
        if began is None or not self.timeline.in_step:
            return
        reduced = self.timing.backward_ended()  # its wait ends first: a step found skipped ends at ``ended``
        ended = self.timeline.stamp()
        self.timeline.add_span("backward", began, ended, blocking=False)
        self._after_backward = ended
        self._loop_spans_since_possible_end = []
        self._collectives.gap_begins()  # until the next forward, or the update
        self._reduced_gradient_of = next((p for p in self._trainable if p.grad is not None), None) if reduced else None

    @never_raises_into_the_loop(detaches_here=False)
    def _any_optimizer_stepped(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """Any optimizer of the process returned from ``step()`` (torch's global hook). One that
        was not attached, stepping some of this model's parameters after the update ended (a loop
        with Muon and AdamW that attached the one it steps first), has its step read as the next
        step's data loading and its state left out of the memory column: said once, in one line
        (rank 0), naming the fix. One stepped inside an attached one's ``step()`` (ZeRO's shard
        optimizer) or before it (inside the update) is not."""
        if (self._inside_optimizer_step or self._data_from is None or self._forwards or not self.timeline.in_step
                or any(optimizer is attached for attached in self.optimizers) or id(optimizer) in self._other_optimizers):
            return
        self._other_optimizers.add(id(optimizer))  # judged once: another model's, or told of now
        if steps_any_of(optimizer, self._trainable) and dist.get_rank() == 0:
            names = " and the ".join(type(o).__name__ for o in (*self.optimizers, optimizer))
            print(f"instrumented_ddp.attach: {type(optimizer).__name__}, not attached, steps this model after the "
                  f"attached {type(self.optimizers[-1]).__name__}, so its step() reads as the next step's data loading "
                  f"and its state is not counted: pass attach a list of every optimizer the loop steps (the {names}) "
                  "to time each one's step as the update", file=sys.stderr, flush=True)

    def _forward_is_running(self) -> bool:
        """Whether the model's forward is on this thread's stack (a frame of ``Module._call_impl``
        called on it), where a forward began and did not return: the loop steps inside it, or it
        raised and the loop went on (a batch that ran out of memory, skipped), which reads the
        same from the hooks. Looked at only there: walking the stack costs microseconds."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is self.model:
                return True
            frame = frame.f_back
        return False

    def _stop_watching_a_loop_that_steps_inside_its_forward(self) -> None:
        """The optimizer stepped inside the model's forward: the loop runs its whole training
        step, backward and update included, inside the model's ``forward`` (PyTorch Lightning's
        manual optimization: ``training_step`` calls ``manual_backward`` and ``step()`` inside
        DDP's forward). Forward, backward and update cannot be told apart from the model's and
        the optimizer's hooks there, and reading them as written gave steps cut mid-forward, all
        excluded, with no figures: say so in one line (rank 0) and detach, once the forward has
        returned (torch is not running the optimizer's hooks then, which detach removes); the
        training goes on unwatched."""
        if dist.get_rank() == 0:
            print("instrumented_ddp.attach: the optimizer stepped inside the model's forward (a training step run whole "
                  "inside it, as PyTorch Lightning's manual optimization runs training_step inside DDP's forward), where "
                  "ddpwatch cannot tell forward, backward and update apart: detached, training goes on unwatched",
                  file=sys.stderr, flush=True)
        self.detach(f"{DETACHED}the optimizer stepped inside the model's forward")

    @never_raises_into_the_loop(detaches_here=False)
    def _before_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._forward_from is not None:
            if self._forward_is_running():  # ``_stop_watching_a_loop_that_steps_inside_its_forward``
                self._stepped_inside_forward = True
                return
            self._forward_from = None  # a forward that raised (and the loop went on) never ran its post-hook
        if not self._stepped_in_update:  # the update's first optimizer: the phase begins
            self._optimizer_from = None
            if self.timeline.in_step:
                self._optimizer_from = self._after_backward if self._after_backward is not None else self.timeline.stamp()
        self._after_backward = self._update_returned = None
        self._inside_optimizer_step = True
        self._loop_spans_since_possible_end = []
        self._collectives.gap_cancelled()

    @never_raises_into_the_loop(detaches_here=False)
    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The update ran from the step's last backward, or, where a backward ended inside
        ``step()``, from that one's end: the step's forward and backward ran in a closure
        (``optimizer.step(closure)``: PyTorch Lightning's automatic optimization, LBFGS). It ends
        when every attached optimizer has stepped, in whatever order the loop steps them."""
        if self._stepped_inside_forward:
            return
        self._inside_optimizer_step = False
        start = self._after_backward if self._after_backward is not None else self._optimizer_from
        if start is None or not self.timeline.in_step:
            return  # a step() before any training forward
        self._stepped_in_update.add(id(optimizer))
        if len(self._stepped_in_update) < len(self.optimizers):  # others still to step, or none this update
            self._optimizer_from, self._after_backward = start, None
            self._update_returned = self.timeline.stamp()
            self._collectives.gap_begins()
            return
        self.timeline.add_span("optimizer", start, self.timeline.stamp(), blocking=False)
        self._end_step()
