"""Steps that wait on their data: the part of Idle% a rank spent fetching its next batch, in words.

Why: after communication, the commonest reason a data-parallel step is slower than its compute is
input: a DataLoader that cannot keep up with the devices (too few workers, no pinned memory, heavy
transforms), or the loop's own work between steps. The timeline draws it as ``data`` bars and the
table counts it in Idle%, among other idle time; this line says which part it is.
``StepFigures.data_wait_pct`` counts only the ``data`` time with no compute or communication
beside it, so a loader that fetches while the device still computes is not blamed.

Pure: a segment's figures in, a line out; the dashboard's notes and summary.md say the same line.
"""

from __future__ import annotations

from collections.abc import Mapping

#: A segment whose steps waited on their data this share of the time or more (the mean of its
#: ranks, or any one rank's) gets the line; ranks this many points apart are named in it.
DATA_WAIT_NOTE_PCT = 10.0


def data_wait_text(segment: str, data_wait_pct: float, idle_pct: float, step_ms_p50: float,
                   collectives_in_data: int = 0, by_rank: Mapping[int, float] | None = None) -> str | None:
    """The line for ``segment`` (its name as the reader knows it), or None below ``DATA_WAIT_NOTE_PCT``.
    ``collectives_in_data``: the most collectives of its own a rank's loop issued in a step's data
    time (``StepReport.untimed_in_data``): ddpwatch does not time them, so their time, and a wait
    in them for a slower rank, is in the figure, where a straggler reads as a slow loader.
    ``by_rank``: each rank's own Data wait% over the segment, where known (``uneven_text``)."""
    if max(data_wait_pct, max((by_rank or {}).values(), default=0.0)) < DATA_WAIT_NOTE_PCT:
        return None
    issued = ("" if not collectives_in_data else
              f"; here the loop also issued up to {collectives_in_data} collective{'s' if collectives_in_data != 1 else ''} "
              "of its own a step in that gap, and a wait in them for a slower rank counts as waiting on data")
    return (f"{segment}: the step waited on its data {data_wait_pct:.1f} % of the time (about "
            f"{data_wait_pct / 100 * step_ms_p50:.0f} ms of a {step_ms_p50:.0f} ms step; Idle% {idle_pct:.1f}): the gap "
            "before each forward with nothing else running. A DataLoader that cannot keep up (more num_workers, "
            "pin_memory=True, a larger prefetch_factor), or the loop's own work between steps (logging, an "
            "evaluation not marked with watch.paused, an average of the weights not marked with watch.computing)"
            f"{issued}{uneven_text(by_rank or {})}")


def uneven_text(by_rank: Mapping[int, float]) -> str:
    """Where the ranks' Data wait% are ``DATA_WAIT_NOTE_PCT`` points apart or more, the rank that
    waited most and the one that waited least: one rank's slow loader, or its loop's own work
    between steps, is a straggler the others then wait for in the next step's collectives, and
    the segment's mean hides whose it is (one rank of 64 at 90 %: a mean of 1.4). "" where they
    are even."""
    if (apart := most_and_least(by_rank)) is None:
        return ""
    most, least = apart
    return (f". Unevenly: rank {most} waited on its data {by_rank[most]:.1f} % of the time, rank {least} "
            f"{by_rank[least]:.1f} % (the most and the least): rank {most}'s loader or its own work between steps, "
            "which the others then wait for")


def most_and_least(by_rank: Mapping[int, float]) -> tuple[int, int] | None:
    """The rank that waited on its data most and the one that waited least, where they are
    ``DATA_WAIT_NOTE_PCT`` points apart or more; None where the ranks are even, or fewer than two."""
    if len(by_rank) < 2:
        return None
    most, least = extremes(by_rank)
    return (most, least) if by_rank[most] - by_rank[least] >= DATA_WAIT_NOTE_PCT else None


def extremes(by_rank: Mapping[int, float]) -> tuple[int, int]:
    """The rank with the most and the one with the least (the lower rank on a tie) of a
    non-empty ``by_rank``."""
    return (max(by_rank, key=lambda rank: (by_rank[rank], -rank)), min(by_rank, key=lambda rank: (by_rank[rank], rank)))
