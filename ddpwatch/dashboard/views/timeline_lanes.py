"""One step's ranks as the timeline draws them: lanes of bars on one shared axis.

Pure: ``SnapshotBuilder`` makes a ``TimelineData`` from the session, and ``TimelineView`` only
paints it. Exposed communication is split into waiting for the other ranks and transfer, with
the same pairing as the ranks table's "waited" (``metrics.waiting_intervals``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from ddpwatch.figures.cross_rank import Groups, sharded_pairings, waiting_intervals
from ddpwatch.figures.metrics import ClockAlignment
from ddpwatch.ingest.segments import strategy_label
from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.wire.kinds import COMM_KINDS, COMPUTE_KINDS, LOOP_COMPUTE_KIND, is_barrier_wait
from instrumented_ddp.wire.step_figures import (BLOCKING_KINDS, CallTimes, StepFigures, StepTimes, issued_by_the_loop, marked_names,
                                                step_times)
from instrumented_ddp.wire.time_ranges import intersect, merge, subtract, total_length


class Bar(NamedTuple):
    """One interval on the shared axis, seconds from the step's origin (a tuple: a frame at 64
    ranks makes thousands)."""

    kind: str
    start: float
    end: float
    label: str = ""


@dataclass(frozen=True)
class RankLanes:
    rank: int
    compute: tuple[Bar, ...]
    communication: tuple[Bar, ...]
    exposed: tuple[tuple[float, float], ...]  # communication not hidden behind compute
    exposed_waiting: tuple[tuple[float, float], ...] = ()  # the part of it waiting for other ranks to arrive
    data: tuple[Bar, ...] = ()  # the loader and whatever a loop does between steps: neither compute nor communication


@dataclass(frozen=True)
class TimelineData:
    step: int
    strategy: str
    span_s: float
    ranks: tuple[RankLanes, ...]
    reported: int = 0  # ranks that reported the step; more than ``ranks`` when only some are drawn
    roles: tuple[tuple[int, str], ...] = ()  # (rank, why it is drawn) when only some are
    label: str = ""  # the strategy with its settings (``session.strategy_label``)
    #: What the title says of the step besides its number and strategy: a pause of training before
    #: it (``paused_text``), an evaluation left unmarked in its data loading (``nograd_text``), the
    #: loop's own collectives there (``data_collectives_text``).
    notes: str = ""


def pick_timeline_ranks(figures: dict[int, StepFigures], selected: int | None) -> tuple[tuple[int, str], ...]:
    """The ranks a large job's timeline draws, with why: the slowest and the fastest by step
    time (ties: the lowest rank) and the selected one, in rank order."""
    roles: dict[int, list[str]] = {}
    if figures:
        slowest = max(figures, key=lambda rank: (figures[rank].step_ms, -rank))
        fastest = min(figures, key=lambda rank: (figures[rank].step_ms, rank))
        roles.setdefault(slowest, []).append("slowest")
        roles.setdefault(fastest, []).append("fastest")
    if selected is not None:
        roles.setdefault(selected, []).append("selected")
    return tuple((rank, "+".join(why)) for rank, why in sorted(roles.items()))


def timeline_of(step: int, reports: dict[int, StepReport], calls: dict[int, CallTimes],
                times: dict[int, StepTimes] | None = None,
                roles: tuple[tuple[int, str], ...] | None = None, groups: Groups | None = None,
                sharded_calls: dict[int, CallTimes] | None = None) -> TimelineData | None:
    """The ranks of one step on one axis, put on the lowest drawn rank's clock by
    ``metrics.ClockAlignment`` over this one step: aligned at the end of each rank's last
    all-reduce (every rank leaves it together), ranks without one at their step start.
    ``times``: ranks' step times already known (``Session.step_times``); the rest are read.
    ``reports``: the ranks whose spans are at hand (None when no rank's are); ``calls``: every
    reporting rank's all-reduces, against which the waiting in the drawn ranks' collectives is
    judged (among ``groups``, where not every rank meets every other: HSDP); ``sharded_calls``:
    their reduce-scatters, all-gathers and barriers (``StepFigures.sharded_calls``), judged likewise among
    the shard groups. ``roles``: only these ranks are drawn (a large job)."""
    reported = max(len(reports), len(calls))
    if roles is not None:
        reports = {rank: reports[rank] for rank, _ in roles if rank in reports}  # whose spans came
    if not reports:
        return None
    waiting = waiting_intervals(calls, reports, groups)
    if sharded_calls:
        for paired, among, collectives in sharded_pairings(sharded_calls, groups):
            sharded = waiting_intervals(paired, reports, among, collectives=collectives)
            waiting = {rank: sorted(waiting.get(rank, []) + sharded.get(rank, [])) for rank in reports}
    known = times or {}
    clocks = ClockAlignment(reference=min(reports))
    clocks.add_step({rank: known[rank] if rank in known else step_times(report) for rank, report in reports.items()})
    offsets = clocks.offsets()
    shift = {rank: offsets.get(rank, 0.0) for rank in reports}
    origin = min(r.start + shift[rank] for rank, r in reports.items())
    end = max(r.end + shift[rank] for rank, r in reports.items())
    lanes = [_lanes(rank, reports[rank], shift[rank] - origin, waiting.get(rank, [])) for rank in sorted(reports)]
    first = next(iter(reports.values()))
    return TimelineData(step, first.strategy, max(end - origin, 1e-9), tuple(lanes), reported,
                        tuple(role for role in roles or () if role[0] in reports), strategy_label(first.strategy, first.settings),
                        " · ".join(filter(None, (paused_text(reports.values()), nograd_text(reports.values()),
                                                 loop_compute_text(reports), loop_collectives_text(reports),
                                                 barrier_text(reports), data_collectives_text(reports.values())))))


def paused_text(reports: Iterable[StepReport]) -> str:
    """What the drawn ranks' loop paused training for before the step and the longest pause,
    in words ("after 0.92 s paused: evaluate"), or "" where it did not: the step is drawn
    without it (``StepReport.paused_s``), and its title says it was there."""
    paused = [r for r in reports if r.paused_s or r.paused_for]
    if not paused:
        return ""
    longest = max(paused, key=lambda r: r.paused_s)
    return f"after {longest.paused_s:.2f} s paused: {longest.paused_for}" if longest.paused_s else f"paused inside: {longest.paused_for}"


def nograd_text(reports: Iterable[StepReport]) -> str:
    """Where the drawn ranks ran forwards of the model without gradients in the step's data
    loading, the most of one rank ("data held 8 forwards without gradients"), or "": an
    evaluation the loop did not mark, which the step's ``data`` span holds (``StepReport.nograd_forwards``)."""
    most = max((r.nograd_forwards for r in reports), default=0)
    return f"data held {most} forward{'s' if most != 1 else ''} without gradients" if most else ""


def loop_compute_text(reports: dict[int, StepReport]) -> str:
    """What the drawn ranks' loop marked as its own compute (``Attachment.computing``) and the
    rank that spent the longest in it ("the loop's own compute (ema): 9.7 ms on rank 0"), or "":
    its bars share the compute lane with the model's phases, in a colour of their own."""
    marked = {rank: spans for rank, report in sorted(reports.items())
              if (spans := [s for s in report.spans if s.kind == LOOP_COMPUTE_KIND])}
    if not marked:
        return ""
    seconds = {rank: total_length((s.start, s.end) for s in spans) for rank, spans in marked.items()}
    longest = max(seconds, key=lambda rank: (seconds[rank], -rank))
    names = marked_names(s for spans in marked.values() for s in spans)
    return f"the loop's own compute{f' ({names})' if names else ''}: {1000 * seconds[longest]:.1f} ms on rank {longest}"


def loop_collectives_text(reports: dict[int, StepReport]) -> str:
    """What the drawn ranks' loop issued itself and was timed (``l<k>``: the Trainer's gathers, a
    loss all-reduce), in words: the most of one rank, their kinds, and the rank that spent the
    longest in them ("the loop's own collectives: 3 (all_gather), 41.0 ms on rank 0"), or "".
    Drawn as collectives in the data time, they would otherwise read as DDP's."""
    counts: dict[int, int] = {}
    seconds: dict[int, float] = {}
    kinds: set[str] = set()
    for rank, report in reports.items():
        for s in report.spans:
            if s.kind in COMM_KINDS and issued_by_the_loop(s.tag):
                counts[rank] = counts.get(rank, 0) + 1
                seconds[rank] = seconds.get(rank, 0.0) + max(s.end - s.start, 0.0)
                kinds.add(s.kind)
    if not counts:
        return ""
    longest = max(seconds, key=lambda rank: (seconds[rank], -rank))
    return (f"the loop's own collectives: {max(counts.values())} ({', '.join(sorted(kinds))}), "
            f"{1000 * seconds[longest]:.1f} ms on rank {longest}")


def barrier_text(reports: dict[int, StepReport]) -> str:
    """Where the drawn ranks sat in the loop's barriers (``kinds.is_barrier_wait``), the rank
    that sat longest, in how many and how long ("a barrier held rank 0 30.1 ms"), or "": drawn
    as a ``wait`` in the communication lane, it could not be told from a wait for the loop's own
    collective."""
    stays = {rank: spans for rank, report in sorted(reports.items())
             if (spans := [s for s in report.spans if s.kind == "wait" and is_barrier_wait(s)])}
    if not stays:
        return ""
    seconds = {rank: sum(max(s.end - s.start, 0.0) for s in spans) for rank, spans in stays.items()}
    longest = max(seconds, key=lambda rank: (seconds[rank], -rank))
    count = len(stays[longest])
    return f"{'a barrier' if count == 1 else f'{count} barriers'} held rank {longest} {1000 * seconds[longest]:.1f} ms"


def data_collectives_text(reports: Iterable[StepReport]) -> str:
    """Where the drawn ranks issued collectives of their own in the step's data time, the most of
    one rank ("data held 2 untimed collectives"), or "": the ``data`` bars hold their time, and a
    wait in them for a slower rank (``StepReport.untimed_in_data``)."""
    most = max((r.untimed_in_data for r in reports), default=0)
    return f"data held {most} untimed collective{'s' if most != 1 else ''}" if most else ""


def _lanes(rank: int, report: StepReport, offset: float, waiting: list[tuple[float, float]]) -> RankLanes:
    """One pass over the rank's spans: a frame at 64 ranks walks a few thousand of them.
    ``waiting``: where this rank's collectives waited for the others (``metrics.waiting_intervals``,
    on its own clock): exposed communication is split into that and the transfer. Blocked is not
    busy: a phase is drawn only where its thread was not sitting in a blocking collective or wait
    (as Compute% counts it), so a backward blocked in its hooks' all-reduces shows gaps there."""
    phases: list[Bar] = []
    comm: list[Bar] = []
    data: list[Bar] = []
    collectives: list[tuple[float, float]] = []
    blocked: list[tuple[float, float]] = []
    for s in report.spans:
        start, end = s.start + offset, s.end + offset
        if s.kind in COMPUTE_KINDS:
            phases.append(Bar(s.kind, start, end))
        elif s.kind in COMM_KINDS:
            comm.append(Bar(s.kind, start, end, s.tag))
            collectives.append((start, end))
        elif s.kind == "wait":
            comm.append(Bar(s.kind, start, end, s.tag))
        elif s.kind == "data":
            data.append(Bar(s.kind, start, end))
        if s.blocking and s.kind in BLOCKING_KINDS:  # as ``step_figures`` takes them
            blocked.append((start, end))
    blocked = merge(blocked)
    compute = [Bar(bar.kind, start, end) for bar in phases for start, end in subtract([(bar.start, bar.end)], blocked)] \
        if blocked else phases
    busy = merge((b.start, b.end) for b in compute)
    exposed = subtract(collectives, busy)
    exposed_waiting = intersect(exposed, [(start + offset, end + offset) for start, end in waiting])
    return RankLanes(rank, tuple(compute), tuple(comm), tuple(exposed), tuple(exposed_waiting), tuple(data))
