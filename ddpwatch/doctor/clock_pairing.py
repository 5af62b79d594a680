"""The two clocks of a doctor run put together: ddpwatch's spans and torch.profiler's kernels of
one rank, paired by kind, and the offset between their clocks estimated from those pairs.

* Which iteration a kernel belongs to is exact where the trace links it to its launch: a kernel
  and the ``cuda_runtime``/``cuda_driver`` call that launched it share ``args["correlation"]``,
  and the launch call's CPU time lies inside one ``ProfilerStep#N`` window. No clock is involved.
  ``ProfilerStep#N`` is ddpwatch step ``N + profiler_step_base`` (1 for train.py, whose loop counts
  steps from 1 and calls ``profiler.step()`` after each; torch's ``profile.start()`` opens #0).
* The two clocks (ddpwatch: seconds of the rank's ``perf_counter``; the profiler: microseconds
  since the trace's ``baseTimeNanoseconds``) are related by an offset **estimated** from the data:
  in each step, the NCCL kernels of a kind are paired in order of end with ddpwatch's spans of
  that kind (only where the counts agree), and the offset is the median of ``kernel end - span
  end``. The median over all pairs is the global offset; each step also gets its own median,
  because on a GPU ddpwatch converts event times per step against a reference event (its step
  start is the host time at which that event was *recorded*, not executed), so the true offset
  moves by the GPU's lag at each step start. Step windows, clipping and the "inside the step"
  test use the step's own offset. A constant delay of ddpwatch's end stamps is absorbed by the
  offset and cannot be seen here; durations and counts do not depend on the offset at all.
* Kernels with no launch link fall back to the clock: they belong to the step whose shifted window
  holds their midpoint. With no link anywhere, the offset comes from pairing all spans and kernels
  of a kind in order over the compared steps, trying small shifts of one sequence against the
  other and keeping the one whose end differences agree best ("order-paired"); with no NCCL kernel
  at all, from the ProfilerStep starts ("coarse": biased early by the work between
  ``profiler.step()`` and the step start).

Pure: standard library, ``profiler_trace`` and ``instrumented_ddp.wire`` only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ddpwatch.doctor.profiler_trace import Kernel, ProfilerTrace
from instrumented_ddp.wire.messages import Span, StepReport
from instrumented_ddp.wire.kinds import COMM_KINDS

__all__ = ["COMM_SPAN_KINDS", "US_PER_S", "ClockOffset", "by_kind_in_end_order", "collective_spans", "estimate_offset",
           "kernel_kind", "launched_in", "paired_kind"]

#: ddpwatch span kinds that are collectives (what the protocol can carry).
COMM_SPAN_KINDS = frozenset(COMM_KINDS)

US_PER_S = 1e6

#: Collectives whose NCCL kernel is a point-to-point one: ProcessGroupNCCL issues a gather and a
#: scatter as grouped ncclSend/ncclRecv calls, and an all-to-all so too where NCCL has no
#: all-to-all of its own, one kernel a call, which the profiler names SendRecv
#: (``profiler_trace``: ``send_recv``). Spans and kernels are held together under that one kind.
_POINT_TO_POINT = {"all_to_all": "send_recv", "gather": "send_recv", "scatter": "send_recv"}


def paired_kind(kind: str) -> str:
    """The kind a span is paired and counted under (``_POINT_TO_POINT``)."""
    return _POINT_TO_POINT.get(kind, kind)


def kernel_kind(kernel: Kernel) -> str:
    """The kind a collective kernel is paired and counted under ("nccl" where its name said none)."""
    return paired_kind(kernel.collective or "nccl")


@dataclass(frozen=True)
class ClockOffset:
    """profiler µs = ddpwatch seconds × 1e6 + offset. ``per_step_us`` where a step had pairs of its
    own; ``method``: ``launch-paired``, ``order-paired`` or ``coarse`` (see the module notes)."""

    offset_us: float
    per_step_us: Mapping[int, float]
    pairs: int
    method: str

    def for_step(self, step: int) -> float:
        return self.per_step_us.get(step, self.offset_us)

    @property
    def spread_us(self) -> float:
        """How far the per-step offsets stray from the global one: the GPU lag at step starts."""
        return max((abs(v - self.offset_us) for v in self.per_step_us.values()), default=0.0)


def collective_spans(report: StepReport) -> list[Span]:
    """The report's spans of a collective's kind, in the report's order."""
    return [s for s in report.spans if s.kind in COMM_SPAN_KINDS]


def by_kind_in_end_order(spans: Iterable[Span], kernels: Iterable[Kernel]) -> dict[str, tuple[list[Span], list[Kernel]]]:
    """Spans and kernels of each kind, each in order of end (the order a stream completes them)."""
    out: dict[str, tuple[list[Span], list[Kernel]]] = {}
    for span in spans:
        out.setdefault(paired_kind(span.kind), ([], []))[0].append(span)
    for kernel in kernels:
        out.setdefault(kernel_kind(kernel), ([], []))[1].append(kernel)
    for s, k in out.values():
        s.sort(key=lambda x: x.end)
        k.sort(key=lambda x: x.end_us)
    return out


def launched_in(trace: ProfilerTrace, number: int) -> list[Kernel]:
    """NCCL kernels whose launch call ran inside ProfilerStep#number: exact, clock-free."""
    window = trace.steps.get(number)
    if window is None:
        return []
    return [k for k in trace.collectives if k.launched_us is not None and window[0] <= k.launched_us < window[1]]


def _equal_count_differences(report: StepReport, kernels: Sequence[Kernel]) -> list[float]:
    """kernel end - span end (µs) for every kind whose counts agree: then order pairing is exact."""
    out: list[float] = []
    for spans, ks in by_kind_in_end_order(collective_spans(report), kernels).values():
        if spans and len(spans) == len(ks):
            out.extend(k.end_us - s.end * US_PER_S for s, k in zip(spans, ks, strict=True))
    return out


def _best_shift(span_ends: Sequence[float], kernel_ends: Sequence[float], max_shift: int = 4) -> list[tuple[int, float]]:
    """(span index, difference) pairs for the shift of one ordered sequence against the other whose
    differences agree best (smallest median absolute deviation): an extra or missing kernel at
    either end of the profiled range then costs a few pairs instead of misaligning all of them."""
    best: tuple[tuple[float, int, int], list[tuple[int, float]]] | None = None
    needed = min(3, len(span_ends), len(kernel_ends))
    for shift in range(-max_shift, max_shift + 1):
        pairs = [(i, kernel_ends[i + shift] - end) for i, end in enumerate(span_ends) if 0 <= i + shift < len(kernel_ends)]
        if not pairs or len(pairs) < needed:
            continue
        diffs = [d for _, d in pairs]
        centre = statistics.median(diffs)
        key = (statistics.median(abs(d - centre) for d in diffs), -len(pairs), abs(shift))
        if best is None or key < best[0]:
            best = (key, pairs)
    return best[1] if best else []


def _order_paired_differences(trace: ProfilerTrace, reports: Sequence[StepReport], base: int) -> dict[int, list[float]]:
    """Fallback when no kernel is linked to its launch: pair each kind over all compared steps."""
    windows = [trace.steps[r.step - base] for r in reports if r.step - base in trace.steps]
    first = min((w[0] for w in windows), default=-math.inf)
    spans = [(r.step, s) for r in reports for s in collective_spans(r)]
    kernels = [k for k in trace.collectives if k.start_us >= first]  # launched no earlier than the first window
    out: dict[int, list[float]] = {}
    for kind in {paired_kind(s.kind) for _, s in spans}:
        tagged = sorted(((step, s) for step, s in spans if paired_kind(s.kind) == kind), key=lambda x: x[1].end)
        ks = sorted((k for k in kernels if kernel_kind(k) == kind), key=lambda k: k.end_us)
        for index, diff in _best_shift([s.end * US_PER_S for _, s in tagged], [k.end_us for k in ks]):
            out.setdefault(tagged[index][0], []).append(diff)
    return out


def estimate_offset(trace: ProfilerTrace, reports: Sequence[StepReport], profiler_step_base: int = 1) -> ClockOffset:
    """The offset from ddpwatch's clock to the profiler's, from the data alone (see module notes)."""
    by_step = {r.step: _equal_count_differences(r, launched_in(trace, r.step - profiler_step_base)) for r in reports}
    by_step = {step: diffs for step, diffs in by_step.items() if diffs}
    method = "launch-paired"
    if not by_step:
        by_step, method = _order_paired_differences(trace, reports, profiler_step_base), "order-paired"
    if by_step:
        every = [d for diffs in by_step.values() for d in diffs]
        return ClockOffset(statistics.median(every), {s: statistics.median(d) for s, d in sorted(by_step.items())}, len(every), method)
    starts = [trace.steps[r.step - profiler_step_base][0] - r.start * US_PER_S for r in reports if r.step - profiler_step_base in trace.steps]
    if not starts:
        raise ValueError("no profiled step has a ddpwatch report: the two clocks cannot be related")
    return ClockOffset(statistics.median(starts), {}, 0, "coarse")
