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
    median offset between their ends, in seconds, keyed by the span's ``id``; its start moved
    earlier by the median pick-up (``pick_up_us``)."""
    offset_us = statistics.median(e["ts"] + e["dur"] - s.end * 1e6 for s, e in zip(recorded, profiled))
    pick_up = pick_up_us(recorded, profiled, offset_us)
    return {id(s): ((e["ts"] - offset_us - pick_up) / 1e6, (e["ts"] + e["dur"] - offset_us) / 1e6)
            for s, e in zip(recorded, profiled)}


def pick_up_us(recorded: Sequence[Span], profiled: Sequence[dict], offset_us: float) -> float:
    """How long after ddpwatch's start a gloo worker began running a collective, the median (0
    if it began sooner). A CPU span starts when the collective was issued with a worker free
    (``StepTimeline._start_when_a_worker_was_free``); the profiler's event when the worker ran
    it, after its thread was woken and scheduled: 145-225 us on this box idle, more under the
    suite's load, where it counts in each span as communication (the README says so). Figured
    into the profiler's starts, so that Overlap% is held against what ddpwatch measures, not
    against how busy the box was: in one clean-clone run the attached Trainer's rank 0, with
    1.7 ms buckets, read Overlap% 5.04 points above the profiler's, every step higher."""
    return max(0.0, statistics.median(e["ts"] - offset_us - s.start * 1e6 for s, e in zip(recorded, profiled)))


def overlap_pcts(reports: Sequence[StepReport], intervals: dict[int, tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Each step's Overlap% as ddpwatch figured it, and with its all-reduces at the profiler's intervals."""
    ours = [step_figures(report).overlap_pct for report in reports]
    theirs = [step_figures(replace(report, spans=[s._replace(start=intervals[id(s)][0], end=intervals[id(s)][1])
                                                  if s.kind == "all_reduce" else s for s in report.spans])).overlap_pct
              for report in reports]
    return ours, theirs


def assert_buckets_hold_against_the_profiler(reports: Sequence[StepReport], recorded: Sequence[Span],
                                             profiled: Sequence[dict]) -> None:
    """A DDP's buckets against the profiler's events, paired in order: each bucket's duration
    close (the median difference under half the typical bucket's, or 100 us), and the mean
    Overlap% over the steps within 5 points of the profiler's."""
    typical = statistics.median(event["dur"] for event in profiled)
    differences = [abs(span.duration * 1e6 - event["dur"]) for span, event in zip(recorded, profiled)]
    assert statistics.median(differences) < max(0.5 * typical, 100.0), (statistics.median(differences), typical)
    ours, theirs = overlap_pcts(reports, profiler_intervals(recorded, profiled))
    assert abs(statistics.mean(ours) - statistics.mean(theirs)) < 5.0, (ours, theirs)
