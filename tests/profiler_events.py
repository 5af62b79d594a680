"""Torch profiler events held against ddpwatch's spans of the same run: what the profiler
cross-checks (``test_profile_cross_check``, ``test_attach_end_to_end``) share."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from instrumented_ddp.protocol import Span, StepReport
from instrumented_ddp.step_figures import step_figures


def rank_reports(reports: Sequence[StepReport]) -> list[StepReport]:
    """The reports with their span lists copied once, so each read sees the same Span objects
    (``profiler_intervals`` keys them by identity)."""
    return [replace(report, spans=list(report.spans)) for report in reports]


def profiler_intervals(recorded: Sequence[Span], profiled: Sequence[dict]) -> dict[int, tuple[float, float]]:
    """Each recorded span's profiler event (paired in order), put on ddpwatch's clock by the
    median offset between their ends, in seconds, keyed by the span's ``id``."""
    offset_us = statistics.median(e["ts"] + e["dur"] - s.end * 1e6 for s, e in zip(recorded, profiled))
    return {id(s): ((e["ts"] - offset_us) / 1e6, (e["ts"] + e["dur"] - offset_us) / 1e6) for s, e in zip(recorded, profiled)}


def overlap_pcts(reports: Sequence[StepReport], intervals: dict[int, tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Each step's Overlap% as ddpwatch figured it, and with its all-reduces at the profiler's intervals."""
    ours = [step_figures(report).overlap_pct for report in reports]
    theirs = [step_figures(replace(report, spans=[s._replace(start=intervals[id(s)][0], end=intervals[id(s)][1])
                                                  if s.kind == "all_reduce" else s for s in report.spans])).overlap_pct
              for report in reports]
    return ours, theirs
