"""What the session knows of one rank: its hello, what it was last heard saying, which steps it
reported and how, its device samples and the memory it holds.

One record a rank, shared by the session's collaborators: the liveness reads when it was heard
and where it stands, the checks which steps it reported, the step store whether a step's spans
came after its summary.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TypeGuard

from ddpwatch.figures.compact_steps import StepSet
from instrumented_ddp.wire.messages import DeviceSample, Goodbye, Hello, StepReport, StepSummary
from instrumented_ddp.wire.stall_probe import StallProbe

STEP_REORDER_SLACK = 2  # a report this many steps behind the rank's newest is neither late nor backwards
DEVICE_SAMPLES_PER_RANK = 600  # kept per rank (the dashboard's series, trace.json's device counters) ...
MIN_DEVICE_SAMPLES = 8  # ... or, in a session with ``device_samples`` set, that many over all ranks, this many at least


@dataclass
class RankState:
    hello: Hello | None = None
    last_seen: float = 0.0
    last_seq: int = -1
    lost_messages: int = 0  # sequence gaps seen by the receiver
    sender_dropped: int = 0  # what the rank's own queue discarded
    last_step: int = 0  # the newest step it is known to have passed (reports and heartbeats)
    last_step_at: float = 0.0  # when ``last_step`` last moved, on the session's clock
    last_reported: int = -1  # the newest step it sent a report for
    reported: StepSet = field(default_factory=StepSet)
    summarized: StepSet = field(default_factory=StepSet)  # ... of which first as a StepSummary
    detailed: StepSet = field(default_factory=StepSet)  # ... whose spans came after the summary
    details_unused: int = 0  # spans that came after the session forgot their step
    late: int = 0  # reports for a step it had already passed (not rejected: see ``note_report``)
    late_unused: int = 0  # ... of which came after the session had folded their step
    unresolved: int = 0  # reports whose timing marks never all resolved (left out of the figures)
    unresolved_reason: str = ""  # why, as the newest such report said
    goodbye: Goodbye | None = None
    devices: deque[DeviceSample] = field(default_factory=lambda: deque(maxlen=DEVICE_SAMPLES_PER_RANK))
    devices_received: int = 0  # ever appended to ``devices``: how many are new since a count
    memory: dict[str, int] = field(default_factory=dict)  # bytes held, from its newest report that measured them
    memory_step: int = -1
    pausing: str = ""  # what its loop pauses training for now, as its newest heartbeat said (``Heartbeat.pausing``)
    pausing_since: float = 0.0  # when a heartbeat first said it, on the session's clock
    phase: str = ""  # what its main thread is in, as its newest heartbeat said (``Heartbeat.phase``)
    probe: StallProbe | None = None  # its newest heartbeat's account of a stall; None once it steps again

    def is_detail(self, message: StepReport | StepSummary) -> TypeGuard[StepReport]:
        """Whether ``message`` is the spans of a step this rank sent as a summary (the dashboard
        asked for them since): the step's figures are in already, so only its spans are new."""
        return isinstance(message, StepReport) and message.step in self.summarized and message.step not in self.detailed

    def note_report(self, report: StepReport | StepSummary, folded: bool) -> None:
        """Count what a report (not a detail) says about this rank; ``folded``: its step is in its
        segment's running figures already.

        Late: the rank had passed the step by more than ``STEP_REORDER_SLACK`` (its heartbeats,
        sent from another thread, run ahead of reports that wait for their marks to resolve), or
        the session had folded it. A late report of a step not folded yet is used like any other;
        one of a folded step cannot be taken back into the running figures: ``late_unused``.
        """
        if folded or report.step < self.last_step - STEP_REORDER_SLACK:
            self.late += 1
            self.late_unused += folded
        if report.unresolved:
            self.unresolved += 1
            self.unresolved_reason = report.unresolved_reason or self.unresolved_reason
        self.reported.add(report.step)
        if isinstance(report, StepSummary):
            self.summarized.add(report.step)
        self.last_reported = max(self.last_reported, report.step)
        self.last_step = max(self.last_step, report.step)
        if report.memory and report.step >= self.memory_step:
            self.memory = {kind: count for kind, count in report.memory.items()}
            self.memory_step = report.step

    def add_device_sample(self, sample: DeviceSample, budget: int | None, world_size: int) -> None:
        """Keep ``sample``, the newest ``DEVICE_SAMPLES_PER_RANK``; with a ``budget`` over all
        ranks, this rank's share of it (``MIN_DEVICE_SAMPLES`` at least) instead."""
        self.devices.append(sample)
        self.devices_received += 1
        if budget is not None:
            while len(self.devices) > max(MIN_DEVICE_SAMPLES, budget // max(world_size, 1)):
                self.devices.popleft()
