"""Everything a training script needs to be watched, behind one object.

``Watch.start`` builds this rank's timeline, publisher and device sampler; ``--no-watch`` gets
a ``Watch`` whose timeline does nothing, so instrumentation costs nothing when switched off.
A dashboard that is absent, slow or killed never reaches training: see ``telemetry``.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .device_sampler import DeviceSampler, make_reader
from .distributed import DistributedContext
from .protocol import Hello, StepReport
from .telemetry import TelemetryPublisher
from .timeline import NULL_TIMELINE, CudaEventClock, HostClock, NullTimeline, StepTimeline


def shared_session_id() -> str:
    """One id for the whole run, chosen by rank 0 (a collective)."""
    chosen = [time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def parameter_layout(model: nn.Module) -> list[tuple[str, int, str]]:
    return [(name, p.numel(), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters() if p.requires_grad]


class Watch:
    """This rank's timeline plus the machinery that streams it."""

    def __init__(self, timeline: StepTimeline | NullTimeline, publisher: TelemetryPublisher | None = None,
                 sampler: DeviceSampler | None = None) -> None:
        self.timeline = timeline
        self.publisher = publisher
        self.sampler = sampler
        self.steps = 0

    @classmethod
    def disabled(cls) -> Watch:
        return cls(NULL_TIMELINE)

    @classmethod
    def start(cls, address: str, context: DistributedContext, hello_fields: dict[str, Any]) -> Watch:
        clock = CudaEventClock(torch) if context.device.type == "cuda" else HostClock()
        timeline = StepTimeline(context.rank, clock)
        hello = Hello(
            rank=context.rank, world_size=context.world_size, session=shared_session_id(), host=socket.gethostname(),
            pid=os.getpid(), device=str(context.device), backend=context.backend,
            node_rank=int(os.environ.get("GROUP_RANK", "0")), local_rank=context.local_rank, **hello_fields,
        )
        watch = cls(timeline)
        watch.publisher = TelemetryPublisher(address, hello, current_step=lambda: watch.steps)
        reader = make_reader(context.device.type, context.device.index)
        watch.sampler = DeviceSampler(context.rank, reader, watch.publisher.publish).start()
        return watch

    def update_hello(self, **changes: Any) -> None:
        """After a strategy switch the layout a late dashboard learns must be the new one."""
        if self.publisher is not None:
            from dataclasses import replace

            self.publisher.hello = replace(self.publisher.hello, **changes)

    def step_done(self) -> list[StepReport]:
        """Send the reports whose timings have resolved; returns them (for tests and logging)."""
        self.steps += 1
        reports = self.timeline.completed_reports()
        if self.publisher is not None:
            for report in reports:
                self.publisher.publish(report)
        return reports

    def close(self, reason: str = "finished") -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.publisher is not None:
            deadline = time.monotonic() + 1.0  # the last step's completion callbacks may still be due
            while self.timeline.has_pending() and time.monotonic() < deadline:
                for report in self.timeline.completed_reports():
                    self.publisher.publish(report)
                time.sleep(0.005)
            self.publisher.close(self.steps, reason)

    @property
    def dropped(self) -> int:
        return self.publisher.dropped if self.publisher is not None else 0
