"""Everything a training script needs to be watched, behind one object.

``Watch.start`` builds this rank's timeline, publisher and device sampler; ``--no-watch`` gets
a ``Watch`` whose timeline does nothing, so instrumentation costs nothing when switched off.
A dashboard that is absent, slow or killed never reaches training: see ``publisher``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from msgspec.structs import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from instrumented_ddp.resources.device_sampler import DeviceSampler, cuda_device_identity, make_reader
from instrumented_ddp.distributed import DistributedContext
from instrumented_ddp.wire.messages import FAILED, Ack, Evaluation, Hello, StepReport, SwitchCommand
from instrumented_ddp.wire.curve_keys import ClientKeys
from instrumented_ddp.publish.stop_signals import held, interruption_reason
from instrumented_ddp.publish.publisher import TelemetryPublisher
from instrumented_ddp.publish import native_stack
from instrumented_ddp.publish.native_stack import NativeStack
from instrumented_ddp.publish.stall_probing import StallProbing
from instrumented_ddp.timing.clocks import CudaEventClock, HostClock
from instrumented_ddp.timing.timeline import NULL_TIMELINE, NullTimeline, StepTimeline
from instrumented_ddp.timing.unwatched_blocks import UnwatchedBlocks
from instrumented_ddp.publish.watch_environment import unwatched_blocks


#: Rank 0 spaces the ranks' agreements on a switch command about this far apart (see
#: ``Watch.agree_on_command``): a switch lands within two of them.
AGREEMENT_EVERY_S = 0.2
#: ... and this far apart while no dashboard is connected to rank 0, when no command can come:
#: a dashboard that connects then has its first switch land within this and one more agreement.
AGREEMENT_UNWATCHED_EVERY_S = 1.0
MAX_AGREEMENT_PERIOD = 20  # boundaries: so that a switch to a much slower strategy is not long in landing
#: Rank 0's refusal of a command whose asker stopped waiting before it could apply.
EXPIRED = ("expired: its asker stopped waiting before the run reached the step where it would land (two step "
           "boundaries after rank 0 hears it; later through a slow step or a pause): ask again, waiting longer "
           "(ddpwatch switch --timeout)")


def shared_session_id() -> str:
    """One id for the whole run, chosen by rank 0 (a collective)."""
    chosen = [time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def turn_on_nccl_timing(backend: str) -> bool:
    """Whether ProcessGroupNCCL records each collective's start event, so ``work._get_duration()``
    can be read (see ``CudaEventClock``). ``TORCH_NCCL_ENABLE_TIMING``, read as PyTorch's
    ``getCvarBool`` reads it, decides where it is set; unset, ddpwatch turns timing on for the
    default group (``_enable_collectives_timing()``: one more CUDA event recorded per collective,
    by ProcessGroupNCCL in C++), which saves a Python completion callback per collective. Any
    other group a timed collective runs in (a user's DDP on its own ``process_group``, HSDP's
    replicate groups) is turned on by the clock before its first one
    (``CudaEventClock.time_collectives_in``)."""
    setting = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "").strip().lower()
    if setting:
        return setting in ("1", "true", "yes", "y")
    if backend != "nccl":
        return False
    world = dist.group.WORLD
    if world is None:  # no default group (yet): nothing to turn timing on in
        return False
    try:
        # Bound in C++ but missing from torch's stub for ProcessGroup.
        world._enable_collectives_timing()  # type: ignore[attr-defined]
    except (RuntimeError, AttributeError):  # a PyTorch without it: the callbacks time the ends
        return False
    return True


def control_group() -> dist.ProcessGroup:
    """The group the ranks agree on commands in: a gloo group over every rank, made once at start
    (a collective), whatever the training backend. On NCCL the agreement would otherwise be a
    device tensor read back with ``.item()``: the host waiting for the GPU every step. On gloo,
    its own worker threads keep it out of the queue the strategies' collectives are timed in."""
    return dist.new_group(backend="gloo")


def parameter_layout(model: nn.Module) -> list[tuple[str, int, str]]:
    return [(name, p.numel(), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters() if p.requires_grad]


def parameter_rows(model: nn.Module) -> list[int]:
    """Each trainable parameter's dim 0, in ``parameter_layout``'s order (``Hello.parameter_rows``)."""
    return [int(p.shape[0]) if p.dim() else 0 for p in model.parameters() if p.requires_grad]


class Watch:
    """This rank's timeline plus the machinery that streams it."""

    def __init__(self, timeline: StepTimeline | NullTimeline, publisher: TelemetryPublisher | None = None,
                 sampler: DeviceSampler | None = None) -> None:
        self.timeline = timeline
        self.publisher = publisher
        self.sampler = sampler
        self.probing: StallProbing | None = None  # what each heartbeat says of the rank's progress (``start``)
        self.steps = 0
        self.pausing = ""  # what the loop pauses training for now, if it does (``Heartbeat.pausing``)
        self._applied: set[str] = set()  # command ids agreed on: a resend is never announced again ...
        self._acks: dict[str, Ack] = {}  # ... only answered with this rank's ack of it, once there is one
        self._control: dist.ProcessGroup | None = None  # see control_group
        self._announced: tuple[Any, torch.Tensor, SwitchCommand | None] | None = None  # see agree_on_command
        self._boundaries = 0  # optimizer-step boundaries seen: the same count on every rank
        self._next_agreement = 0  # the boundary of the next agreement, as every rank was told
        self._last_agreement: tuple[int, float] | None = None  # rank 0: (boundary, time) of the last one
        self._clock: Callable[[], float] = time.perf_counter
        self.latest_loss: tuple[int, float] | None = None  # (step, loss) of the newest report sent

    @classmethod
    def disabled(cls) -> Watch:
        return cls(NULL_TIMELINE)

    @classmethod
    def start(cls, address: str, context: DistributedContext, hello_fields: dict[str, Any],
              keys: ClientKeys | None = None, switchable: bool = True, unwatched: UnwatchedBlocks | None = None) -> Watch:
        """A collective: every rank calls it. ``switchable=False`` (a loop ddpwatch did not start)
        makes no control group and tells the dashboard, which then offers no switch.
        ``unwatched``: the steps the timeline leaves unwatched (None: ``DDPWATCH_UNWATCHED``'s,
        read by the caller first where a bad value must be one line: ``unwatched_blocks``)."""
        on_gpu = context.device.type == "cuda"
        clock = CudaEventClock(torch, nccl_timing=turn_on_nccl_timing(context.backend)) if on_gpu else HostClock()
        blocks = unwatched if unwatched is not None else unwatched_blocks()
        timeline = StepTimeline(context.rank, clock, unwatched=blocks)
        reader, device_note = make_reader(context.device.type, cuda_device_identity(torch, context.device.index) if on_gpu else None)
        hello = Hello(
            rank=context.rank, world_size=context.world_size, session=shared_session_id(), host=socket.gethostname(),
            pid=os.getpid(), device=str(context.device), backend=context.backend,
            node_rank=int(os.environ.get("GROUP_RANK", "0")), local_rank=context.local_rank, device_note=device_note,
            switchable=switchable, unwatched_every=blocks.every, unwatched_steps=blocks.length if blocks.on else 0,
            **hello_fields,
        )
        watch = cls(timeline)
        watch._control = control_group() if switchable else None
        native = NativeStack(threading.get_native_id()) if native_stack.asked_for() else None
        watch.probing = StallProbing(timeline, lambda: watch.steps, lambda: watch.pausing, native)
        watch.publisher = TelemetryPublisher(address, hello, current_step=lambda: watch.steps,
                                             current_pause=lambda: watch.pausing, keys=keys,
                                             current_state=watch.probing.state)
        watch.sampler = DeviceSampler(context.rank, reader, watch.publisher.publish).start()
        watch.publisher.on_device_rate = watch.sampler.sample_every
        return watch

    def update_hello(self, **changes: Any) -> None:
        """After a strategy switch the layout a late dashboard learns must be the new one."""
        if self.publisher is not None:
            self.publisher.hello = replace(self.publisher.hello, **changes)
            self.publisher.publish(self.publisher.hello)  # now, not at the next periodic repeat

    def agree_on_command(self) -> SwitchCommand | None:
        """The switch command every rank applies now, or None. Every rank calls it at every
        optimizer-step boundary (never inside an accumulation); unwatched runs skip it alike.

        Only rank 0 hears the dashboard, and the ranks agree on what it heard at *agreement
        boundaries*, not at every step. At each one, rank 0 announces whether a command came and
        how many boundaries apart the next two agreements will be (so every rank knows when the
        one after next is), in one 8-byte broadcast issued without waiting; at the next agreement
        every rank waits for it (long done by then) and, only if a command was announced,
        receives it with a blocking broadcast and applies it. Rank 0
        spaces agreements ``AGREEMENT_EVERY_S`` apart by its own step time (every step when
        steps are slower than that), so an agreement's cost is paid a few times a second rather
        than every step, and a switch lands
        at most two agreements after the dashboard sent it. Everything is on CPU tensors in the
        gloo control group: nothing touches a GPU, so the host never waits for one.
        """
        if self.publisher is None:
            return None
        boundary = self._boundaries
        self._boundaries += 1
        if boundary < self._next_agreement:
            return None
        command, period = self._receive_announced()
        self._next_agreement = boundary + period
        announced, next_period = None, 1
        if dist.get_rank() == 0:
            announced, next_period = self._next_new_command(), self._period_to_announce(boundary)
        flag = torch.tensor([0 if announced is None else 1, next_period], dtype=torch.int32)
        work = dist.broadcast(flag, src=0, group=self._control, async_op=True)
        self._announced = (work, flag, announced)
        return command

    def _period_to_announce(self, boundary: int) -> int:
        """Rank 0: the period between the next two agreements, in boundaries, from the time per
        boundary since its last agreement, so that they come about ``AGREEMENT_EVERY_S`` apart, or
        ``AGREEMENT_UNWATCHED_EVERY_S`` while no dashboard is connected."""
        now = self._clock()
        last, self._last_agreement = self._last_agreement, (boundary, now)
        if last is None or boundary <= last[0]:
            return 1
        every_s = AGREEMENT_EVERY_S if self.publisher is not None and self.publisher.connected else AGREEMENT_UNWATCHED_EVERY_S
        per_boundary = (now - last[1]) / (boundary - last[0])
        return max(1, min(MAX_AGREEMENT_PERIOD, round(every_s / per_boundary) if per_boundary > 0 else MAX_AGREEMENT_PERIOD))

    def _receive_announced(self) -> tuple[SwitchCommand | None, int]:
        """The command announced at the previous agreement, now on every rank, or None; and how
        many boundaries from this one the next agreement is (1 at the first)."""
        if self._announced is None:
            return None, 1
        work, flag, held = self._announced
        self._announced = None
        work.wait()
        has_command, period = (int(v) for v in flag.tolist())
        period = max(1, period)
        if not has_command:
            return None, period
        expired = self._refuse_if_expired(held) if held is not None else False  # rank 0 holds it; the others, None
        box = [None if expired else held]  # None from rank 0: its asker stopped waiting, applied nowhere
        dist.broadcast_object_list(box, src=0, group=self._control)
        command = box[0]
        if command is None:
            return None, period
        self._applied.add(command.command_id)
        return command, period

    def _next_new_command(self) -> SwitchCommand | None:
        """The next command not agreed on yet. The dashboard resends a command until it hears an
        ack: a resend of one agreed on gets the ack again, as it was (applied or refused, the step
        it landed on), or nothing while the ack is still to come (the resend met the command at
        the boundary where it lands). An ack made up here could claim a step the switch has not
        reached, and ranks killed at that ack would look switched a step early."""
        assert self.publisher is not None
        while not self.publisher.commands.empty():
            command = self.publisher.commands.get_nowait()
            if command.command_id not in self._applied:
                if self._refuse_if_expired(command):
                    continue
                return command
            if command.command_id in self._acks:
                self.publisher.publish(self._acks[command.command_id])
        return None

    def _refuse_if_expired(self, command: SwitchCommand) -> bool:
        """Rank 0: whether its asker's wait (``SwitchCommand.expires_after_s``, from when rank 0
        heard it) is over; if so it is refused, so that a resend gets the same answer. Checked where
        it is announced and again where it would apply: two agreements apart, two steps when a step
        is slower than ``AGREEMENT_EVERY_S``."""
        assert self.publisher is not None
        deadline = self.publisher.command_deadlines.get(command.command_id)
        if deadline is None or time.monotonic() <= deadline:
            return False
        self._applied.add(command.command_id)
        self.acknowledge(command, False, self.steps + 1, EXPIRED)
        return True

    def refuse_commands(self, reason: str) -> None:
        """A run that cannot switch answers every command it heard with a refusal, so whoever
        asked (the dashboard, ``ddpwatch switch``) hears why at once instead of resending."""
        if self.publisher is None:
            return
        while not self.publisher.commands.empty():
            command = self.publisher.commands.get_nowait()
            self.acknowledge(command, False, self.steps + 1, reason)

    def acknowledge(self, command: SwitchCommand, applied: bool, step: int, detail: str = "") -> None:
        if self.publisher is not None:
            ack = Ack(self.publisher.hello.rank, command.command_id, applied, step, detail, command.strategy)
            self._acks[command.command_id] = ack
            self.publisher.publish(ack)

    def step_done(self) -> list[StepReport]:
        """Send the reports whose timings have resolved; returns them (for tests and logging)."""
        self.steps += 1
        return self._publish_completed()

    def _publish_completed(self) -> list[StepReport]:
        with held:  # a SIGTERM or Ctrl-C between taking a report and queuing it would lose it
            reports = self.timeline.completed_reports()
            if self.publisher is not None:
                for report in reports:
                    self.publisher.publish(report)
        for report in reports:
            if report.loss is not None:
                self.latest_loss = (report.step, report.loss)
        return reports

    def record_evaluation(self, metrics: dict[str, float]) -> None:
        """Send what an evaluation after the steps done so far measured (checked by the caller:
        ``messages.metrics_problem``); queued like every message, never blocking."""
        if self.publisher is not None:
            self.publisher.publish(Evaluation(self.publisher.hello.rank, self.steps, metrics))

    def close(self, reason: str = "finished", wait_for_pending_s: float = 1.0, trains_again: bool = False) -> None:
        """Send the steps that resolve within ``wait_for_pending_s`` (the last step's completion
        callbacks may still be due), then goodbye (``Goodbye.trains_again``: a run of this process
        follows at once); the sender gets a second to drain."""
        if self.sampler is not None:
            self.sampler.stop()
        if self._announced is not None and wait_for_pending_s > 0:
            self._announced[0].wait()  # every rank issued it: it completes; a command in it is dropped
            self._announced = None
        if self.publisher is not None:
            deadline = time.monotonic() + wait_for_pending_s
            self._publish_completed()
            while self.timeline.has_pending() and time.monotonic() < deadline:
                time.sleep(0.005)
                self._publish_completed()
            self.publisher.close(self.steps, reason, trains_again=trains_again)

    @contextmanager
    def sends_failure(self) -> Iterator[None]:
        """Training that fails inside the block (a dead peer fails a collective at once; torchrun
        then stops the other ranks), or that a signal stops (``stop_signals``), still sends what
        has resolved and a goodbye naming the failure or the signal: reports queued for the
        sender thread would otherwise die with the process, and the dashboard could not tell a
        rank that failed from one that vanished."""
        try:
            yield
        except BaseException as error:
            self.close(goodbye_reason(error), wait_for_pending_s=0.0)
            raise

    @property
    def dropped(self) -> int:
        return self.publisher.dropped if self.publisher is not None else 0


def goodbye_reason(error: BaseException) -> str:
    """A goodbye's reason for training that ended raising ``error``: ``interrupted: SIGTERM`` where
    a signal stopped it (``stop_signals.interruption_reason``), else ``failed: Kind: its first
    line``."""
    if (interrupted := interruption_reason(error)) is not None:
        return interrupted
    text = str(error).strip().splitlines()
    return f"{FAILED}{type(error).__name__}" + (f": {text[0][:200]}" if text else "")
