"""Gradient accumulation that reduces gradients in more than one micro-step: what ``no_sync`` skips.

Why: accumulating K micro-batches before one optimizer step, only the last micro-step's gradients
need averaging across ranks; DDP's ``no_sync()`` around the others (what the Trainer and
Accelerate's ``accumulate`` do, and ddpwatch's ``ga`` strategy) skips their all-reduces. A hand-
written loop that leaves it out all-reduces every gradient K times a step. Nothing fails: the step
is only slower, and a count of all-reduces a step does not say so unless one knows DDP's bucket
count. The article's baseline (``simple``) reduces in every micro-step on purpose.

Read from a step's spans alone (no torch, no UI): each ``forward`` begins a micro-step, and an
all-reduce belongs to the micro-step in which it started. Pure, used by the session (the
dashboard's note) and the exporters alike; the note's words are ``wording.accumulation_text``'s.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from instrumented_ddp.wire.time_ranges import merge, total_length
from instrumented_ddp.wire.step_figures import SpanLike

from ddpwatch.figures.compact_steps import StepSet
from ddpwatch.wording.accumulation_text import early_reductions_text

KEPT_STEPS = 64  # the steps the medians are taken over (the newest)


class StepReportLike(Protocol):
    """What this module reads of a step report (read-only: ``StepReport`` is frozen)."""

    @property
    def step(self) -> int: ...
    @property
    def strategy(self) -> str: ...
    @property
    def settings(self) -> Mapping[str, Any]: ...
    @property
    def spans(self) -> Sequence[SpanLike]: ...
    @property
    def excluded(self) -> bool: ...
    @property
    def unresolved(self) -> bool: ...


class MicroStepReduction(NamedTuple):
    """What one rank's accumulating step reduced before its last micro-step."""

    micro_steps: int  # forwards in the step
    reducing: int  # micro-steps in which an all-reduce started
    early_calls: int  # all-reduces started before the last micro-step's forward
    early_s: float  # their wall time, overlaps merged
    step_s: float  # from the step's first span to its last


def micro_step_reduction(spans: Iterable[SpanLike]) -> MicroStepReduction | None:
    """The step's reductions before its last micro-step, or None where there is nothing to say:
    fewer than two forwards (no accumulation), or no all-reduce before the last forward (the
    earlier micro-steps ran under ``no_sync``, as they should)."""
    forwards: list[float] = []
    all_reduces: list[tuple[float, float]] = []
    first, last = float("inf"), float("-inf")
    for span in spans:
        first, last = min(first, span.start), max(last, span.end)
        if span.kind == "forward":
            forwards.append(span.start)
        elif span.kind == "all_reduce":
            all_reduces.append((span.start, span.end))
    if len(forwards) < 2:
        return None
    forwards.sort()
    last_forward = forwards[-1]
    early = [(start, end) for start, end in all_reduces if start < last_forward]
    if not early:
        return None
    reducing = len({bisect_right(forwards, start) for start, _ in all_reduces} - {0})  # i: after the i-th forward
    return MicroStepReduction(len(forwards), reducing, len(early), total_length(merge(early)), last - first)


@dataclass
class EarlyReductions:
    """The steps whose micro-steps before the last reduced gradients, one rank's reading per
    step (every rank runs the same loop), and the medians of the newest ``KEPT_STEPS``."""

    steps: StepSet = field(default_factory=StepSet)
    checked: StepSet = field(default_factory=StepSet)  # steps read already, with or without a finding
    strategies: set[str] = field(default_factory=set)  # of the steps found
    _kept: deque[MicroStepReduction] = field(default_factory=lambda: deque(maxlen=KEPT_STEPS))

    def wants(self, step: int) -> bool:
        """Whether ``step`` is still to be read: one report's spans a step, so that at a thousand
        ranks a sampled step is not read a thousand times."""
        return step not in self.checked

    def note(self, step: int, reduction: MicroStepReduction | None, strategy: str = "") -> None:
        if step in self.checked:
            return
        self.checked.add(step)
        if reduction is not None:
            self.steps.add(step)
            self._kept.append(reduction)
            self.strategies.add(strategy)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def figures(self) -> dict[str, float]:
        """Medians over the kept steps: micro-steps and reducing micro-steps a step, the
        all-reduces before the last micro-step, their wall time (ms) and its share of the step."""
        kept = list(self._kept)
        early_ms = statistics.median(r.early_s for r in kept) * 1e3
        step_ms = statistics.median(r.step_s for r in kept) * 1e3
        return {"micro_steps": statistics.median(r.micro_steps for r in kept),
                "reducing_micro_steps": statistics.median(r.reducing for r in kept),
                "early_all_reduces": statistics.median(r.early_calls for r in kept),
                "early_all_reduce_ms": round(early_ms, 3),
                "early_all_reduce_pct": round(100.0 * early_ms / step_ms, 2) if step_ms > 0 else 0.0}

    def text(self) -> str:
        """The dashboard's note (``wording.accumulation_text.early_reductions_text``)."""
        return early_reductions_text(self.steps.ranges(), self.figures(), self.strategies)

    def as_dict(self) -> dict[str, object]:
        """summary.json's ``early_reductions`` of a segment: its steps and the figures."""
        return {"steps": [step for a, b in self.steps.ranges() for step in range(a, b + 1)], **self.figures()}


def reads(report: StepReportLike) -> bool:
    """Whether a report is one to read: an accumulating step's (``grad_accum`` over 1), with its
    spans, counted (not excluded, as DDP's first iteration is, nor unresolved)."""
    return (int(report.settings.get("grad_accum", 1) or 1) > 1 and bool(report.spans)
            and not report.excluded and not report.unresolved)


def early_reductions_of(reports: Iterable[StepReportLike]) -> EarlyReductions:
    """The finding over a segment's reports (the exporters'), read as the session reads them."""
    found = EarlyReductions()
    for report in reports:
        if reads(report) and found.wants(report.step):
            found.note(report.step, micro_step_reduction(report.spans), report.strategy)
    return found
