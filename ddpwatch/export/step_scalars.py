"""The scalars ``--tensorboard`` and ``--wandb`` write: one row per step, and each segment's
figures once it is over. Pure.

A step's row is written once every rank reported it (``Session.latest_complete_step``), for
each step the figures count (not a step excluded from them, as a strategy's first with its
state broadcast), from the figures the dashboard draws: the step's time is its slowest rank's window, the shares are
the ranks' mean, the wait the most any rank waited. A segment's row (``segment/…``, the
figures summary.json gives it) comes once the next segment has begun, or the run is over; its
step is the segment's last, and ``segment/index`` says which it is. Rows come in step order,
each step once, so a tracker that wants increasing steps (W&B) takes them as they are.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ddpwatch.ingest.segments import Segment
from ddpwatch.ingest.session import Session

#: Each per-step scalar: the tag, and what it is.
STEP_TAGS = {
    "step/time_ms": "the step's time: its slowest rank's window",
    "step/compute_pct": "Compute%, mean over the ranks",
    "step/non_compute_pct": "Non_Compute% (exposed communication), mean over the ranks",
    "step/idle_pct": "Idle%, mean over the ranks",
    "step/overlap_pct": "Overlap%, mean over the ranks",
    "step/data_wait_pct": "Data wait%, mean over the ranks",
    "step/waited_ms_max": "the most any rank waited in collectives for the others",
    "step/busbw_gbps": "all-reduce busbw, median over the ranks (absent without a measurable all-reduce)",
}
#: Each per-segment scalar: the tag and the ``SegmentFigures`` field it is.
SEGMENT_TAGS = {
    "segment/step_ms_p50": "step_ms_p50", "segment/step_ms_p95": "step_ms_p95", "segment/step_ms_mean": "step_ms_mean",
    "segment/compute_pct": "compute_pct", "segment/non_compute_pct": "non_compute_pct", "segment/idle_pct": "idle_pct",
    "segment/overlap_pct": "overlap_pct", "segment/waited_for_others_ms": "waited_for_others_ms",
    "segment/samples_per_s": "samples_per_s", "segment/tokens_per_s": "tokens_per_s", "segment/busbw_gbps": "busbw_gbps",
    "segment/steps": "steps",
}
#: The segment's ``watch_overhead`` (``Session.watch_overhead``), where its steps measured one.
WATCH_OVERHEAD_TAG = "segment/watch_overhead_pct"


def step_row(session: Session, step: int) -> dict[str, float]:
    """The step's scalars (``STEP_TAGS``), or {} where the session no longer holds it."""
    figures = session.step_figures(step)
    if not figures:
        return {}
    ranks = list(figures.values())
    waited, _ = session.step_waits(step)
    row = {"step/time_ms": max(f.step_ms for f in ranks),
           "step/compute_pct": statistics.fmean(f.compute_pct for f in ranks),
           "step/non_compute_pct": statistics.fmean(f.non_compute_pct for f in ranks),
           "step/idle_pct": statistics.fmean(f.idle_pct for f in ranks),
           "step/overlap_pct": statistics.fmean(f.overlap_pct for f in ranks),
           "step/data_wait_pct": statistics.fmean(f.data_wait_pct for f in ranks),
           "step/waited_ms_max": max(waited.values(), default=0.0)}
    busbw = [f.busbw_gbps for f in ranks if f.busbw_gbps is not None]
    if busbw:
        row["step/busbw_gbps"] = statistics.median(busbw)
    return row


def segment_row(session: Session, segment: Segment, final: bool) -> dict[str, float]:
    """The segment's figures (``SEGMENT_TAGS``) as summary.json gives them once ``final``."""
    figures = session.segment_figures(segment, include_pending=final, per_rank=False)
    row = {tag: float(value) for tag, name in SEGMENT_TAGS.items() if (value := getattr(figures, name)) is not None}
    row["segment/index"] = float(segment.index)
    if (cost := session.watch_overhead(segment)) is not None:
        row[WATCH_OVERHEAD_TAG] = cost.pct
    return row


@dataclass
class ScalarRows:
    """What of one session is written already: ``new_rows`` gives the rest, in step order."""

    written_step: int = 0
    written_segments: set[int] = field(default_factory=set)

    def new_rows(self, session: Session, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        """The rows not written yet: each step every rank reported, and each segment that is
        over (``final``: the last one too, and the steps still waiting for a rank)."""
        latest = session.latest_complete_step()
        if final:
            latest = max((state.last_reported for state in session.ranks.values()), default=latest or 0)
        rows: dict[int, dict[str, float]] = {}
        if latest is not None:
            for step in range(self.written_step + 1, latest + 1):
                if row := step_row(session, step):
                    rows[step] = row
            self.written_step = max(self.written_step, latest)
        for segment in session.segments:
            over = final or segment is not session.segments[-1]
            if over and segment.index not in self.written_segments and segment.last_step <= self.written_step:
                self.written_segments.add(segment.index)
                at = segment.last_step if segment.last_step in rows else min(rows, default=self.written_step)
                rows.setdefault(at, {}).update(segment_row(session, segment, final))
        return sorted(rows.items())
