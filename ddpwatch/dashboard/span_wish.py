"""Which spans and device samples the dashboard asks the ranks for, from what it shows."""

from __future__ import annotations

from ddpwatch.control.span_requests import LARGE_JOB_DEVICE_EVERY_S, SAMPLE_EVERY_STEPS, SpanWish
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.views.snapshot_parts import SMALL_JOB_MAX_RANKS
from ddpwatch.ingest.session import Session


def span_wish(session: Session, builder: SnapshotBuilder, selected_step: int | None, selected_rank: int | None) -> SpanWish:
    """Every span of a job small enough to draw every rank (``SMALL_JOB_MAX_RANKS``).
    Above that: every step of the ranks the timeline draws, their spans of the step on
    screen (held by the ranks: a rank just become the slowest still sends it), a whole step
    every ``SAMPLE_EVERY_STEPS``, every rank's spans of a step the user paused on
    (``selected_step``), and a device sample a second. The first rank's every step too: the
    advisor reads backward on its clock, from its gradient-ready marks
    (``advisor.recent_profile_steps``), which would otherwise come one step in
    ``SAMPLE_EVERY_STEPS``, a profile of one step where it takes the median of 20."""
    if session.world_size <= SMALL_JOB_MAX_RANKS:
        return SpanWish.everything()
    step = selected_step if selected_step is not None else session.latest_complete_step()
    drawn = {rank for rank, _ in builder.timeline_ranks(step, selected_rank)}
    first = {min(session.ranks)} if session.ranks else set()
    return SpanWish.sampled(SAMPLE_EVERY_STEPS, drawn | first, () if step is None else (step,),
                            None if selected_step is not None else drawn, LARGE_JOB_DEVICE_EVERY_S)
