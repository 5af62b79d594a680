"""The product's figures across ranks and steps, computed one way for the dashboard, the recorder
and the exporter.

Reading every definition from one pure module is what lets a number on the live screen be
compared with the same number in an exported report. One rank's step figures live in
``instrumented_ddp.wire.step_figures``, since the ranks compute them too, and one step's ranks held
against each other (pairing, waits, the straggler, a desync) in :mod:`ddpwatch.figures.cross_rank`;
this module adds the rest across ranks and steps: clock alignment and segments. Each of those
names is imported from its own module, not through this one, and the words about the figures are
:mod:`ddpwatch.wording.figure_text`'s.
Spans and step records are duck-typed (see ``SpanLike``, ``StepRecordLike``).

Conventions, chosen so that no caller ever sees NaN or a ZeroDivisionError:

* A percentage of an empty whole is ``0.0``.  A step whose window has no
  positive, finite length therefore has all percentages 0 (not a 0/0/100
  split); elsewhere compute + non-compute + idle add up to 100.
* ``overlap_pct`` is 0 when the step had no communication: there was nothing
  to hide, so nothing was hidden.
* Bandwidths are ``None`` when nothing measurable happened (no all-reduce with
  bytes and a positive duration, or no valid world size): 0 GB/s would read as
  "a dead link", which is a different claim.
* Collective counts, durations and bandwidths use each span's raw, unclipped
  duration: a collective is one call whose size was moved in that whole time.
  Only the timeline percentages are clipped to the step window.
* ``all_reduce_calls`` always means calls per rank per step (a mean where
  ranks or steps differ); a total over ranks and steps is ``all_reduce_calls_total``.
* Throughput divides by wall time from a run of steps' first start to its last
  end with ranks on one clock (:class:`ClockAlignment`), never by a sum of step
  windows, which would leave out the time between steps.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from instrumented_ddp.wire.step_figures import CallTimes, StepFigures, StepRecordLike, StepTimes, bus_factor, figures_and_calls

from ddpwatch.figures.cross_rank import (
    STRAGGLER_STEPS,
    Desync,
    DesyncRange,
    Groups,
    StepWaits,
    Straggler,
    all_reduce_ranks,
    find_desync,
    find_straggler,
    shard_ranks,
    step_waits,
)
from ddpwatch.figures.float_reservoir import FloatReservoir
from ddpwatch.figures.order_statistics import median_of, percentiles_and_median_interval

__all__ = ["ALIGNMENT_STEPS", "MARKED_NAMES", "ClockAlignment", "Figures", "SegmentAccumulator", "SegmentFigures",
           "segment_figures"]

ALIGNMENT_STEPS = 512  # clock-offset samples kept per rank: a median over them, in bounded memory


# --- putting ranks on one clock ---------------------------------------------------------


class ClockAlignment:
    """Offsets that put every rank on a reference rank's clock, and the wall time the steps cover.

    Hosts' clocks differ, but no rank can leave an all-reduce before every rank joined it, so all
    ranks leave a step's last all-reduce together: per rank, the offset is the median over the
    steps it shares with the reference of (reference's anchor − its anchor); the median shrugs off
    a step whose completion was stamped late. A rank without all-reduces is aligned by step starts
    instead. The Chrome trace, the timeline and throughput all use this one rule.
    """

    def __init__(self, reference: int | None = None, keep: int | None = ALIGNMENT_STEPS) -> None:
        """``reference``: the rank whose clock the others are put on (default: the lowest rank of
        the first step added). ``keep``: offset samples kept per rank (None: all)."""
        self.reference = reference
        self._keep = keep
        self._anchor_deltas: dict[int, deque[float]] = {}
        self._start_deltas: dict[int, deque[float]] = {}
        self._first_start: dict[int, float] = {}  # each rank's own clock
        self._last_end: dict[int, float] = {}
        self._paused: dict[int, float] = {}  # each rank's pauses of training before its steps, summed
        self._paused_first: dict[int, float] = {}  # the pause before its earliest step: before its wall begins

    def add_step(self, times: Mapping[int, StepTimes]) -> None:
        """One step's times of every rank that reported it (steps may come in any order)."""
        if not times:
            return
        if self.reference is None:
            self.reference = min(times)
        ref = times.get(self.reference)
        for rank, t in times.items():
            if math.isfinite(t.start) and math.isfinite(t.end):
                if rank not in self._first_start or t.start < self._first_start[rank]:
                    self._paused_first[rank] = t.paused
                self._paused[rank] = self._paused.get(rank, 0.0) + t.paused
                self._first_start[rank] = min(self._first_start.get(rank, t.start), t.start)
                self._last_end[rank] = max(self._last_end.get(rank, t.end), t.end)
            if ref is None or rank == self.reference:
                continue
            if ref.anchor is not None and t.anchor is not None:
                self._anchor_deltas.setdefault(rank, deque(maxlen=self._keep)).append(ref.anchor - t.anchor)
                self._start_deltas.pop(rank, None)  # never used once an anchor is known
            elif rank not in self._anchor_deltas and math.isfinite(ref.start - t.start):
                self._start_deltas.setdefault(rank, deque(maxlen=self._keep)).append(ref.start - t.start)

    def offsets(self) -> dict[int, float]:
        """Seconds to add to each rank's clock to land on the reference's; a rank that never shared
        a step with the reference has no offset (it is left out, not guessed)."""
        if self.reference is None:
            return {}
        out = {self.reference: 0.0}
        for rank in set(self._anchor_deltas) | set(self._start_deltas):
            deltas = self._anchor_deltas.get(rank) or self._start_deltas.get(rank)
            if deltas:
                out[rank] = float(statistics.median(deltas))
        return out

    def own_wall_s(self, rank: int) -> float:
        """One rank's first step start to its last step end, on its own clock, less its pauses."""
        if rank not in self._first_start:
            return 0.0
        return max(self._last_end[rank] - self._first_start[rank] - self._paused_within(rank), 0.0)

    def wall_s(self) -> float:
        """First step start to last step end over every aligned rank: the time the steps took,
        the time between steps included, less the loop's pauses of training (an evaluation, a
        checkpoint: ``StepTimes.paused``) within it; those of the rank that paused least, so
        that no rank's training is counted short."""
        offsets = self.offsets()
        ranks = [r for r in self._first_start if r in offsets]
        if not ranks:
            return 0.0
        first = min(self._first_start[r] + offsets[r] for r in ranks)
        last = max(self._last_end[r] + offsets[r] for r in ranks)
        return max(last - first - min(self._paused_within(r) for r in ranks), 0.0)

    def _paused_within(self, rank: int) -> float:
        """A rank's pauses between its first step's start and its last step's end."""
        return self._paused.get(rank, 0.0) - self._paused_first.get(rank, 0.0)


# --- a run of steps under one strategy -------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """Aggregates over a set of (rank, step) records; "mean" is per rank per step."""

    steps: int  # distinct steps
    compute_pct: float  # mean over records with a positive window
    non_compute_pct: float
    idle_pct: float
    #: Mean of ``StepFigures.data_wait_pct``: the part of Idle% spent waiting for the next batch.
    data_wait_pct: float
    overlap_pct: float  # mean over records that communicated at all
    comm_overhead_pct: float
    hidden_comm_pct: float  # mean of 100*|C ∩ M|/K: communication hidden behind compute, in window terms
    all_reduce_calls: float  # per rank per step (mean over records)
    all_reduce_calls_total: int  # over every rank and step
    all_reduce_ms: float  # mean
    step_ms_p50: float  # over each step's wall time (max window over ranks), linear interp.
    step_ms_p95: float
    #: The mean of the same step times, over every step (exact: a running sum, where the
    #: percentiles are over a bounded sample): what a query over ``steps.parquet`` reproduces.
    step_ms_mean: float
    #: A distribution-free 90 % interval for the median step time (``order_statistics``):
    #: whether two segments' medians differ by more than their steps' spread. (0, 0) without steps.
    step_ms_p50_interval: tuple[float, float]
    wall_s: float  # first step start to last step end, ranks aligned (ClockAlignment)
    samples_per_s: float  # samples of every rank / wall_s
    tokens_per_s: float
    busbw_gbps: float | None  # median over every measurable all_reduce
    waited_for_others_ms: float  # mean
    #: Mean per rank per step of what the other ranks waited for this one (``waits_both_ways``'
    #: second half: each wait put down to the last to arrive); over ranks it totals the waits.
    others_waited_ms: float
    calls_by_kind: dict[str, float]  # per rank per step, every collective kind
    #: The most any rank held at a measured step end (``StepReport.memory``), per memory kind.
    memory: dict[str, int]
    #: The loop's own timed collectives (``StepFigures.loop_collectives``), per rank per step, and
    #: their ms (mean): what the script's own communication costs beside the gradients'.
    loop_collectives: float
    loop_collective_ms: float
    #: The loop's own compute it marked (``StepFigures.loop_compute_ms``), per rank per step (mean),
    #: and what it said it computed, each once, in the order first heard (``MARKED_NAMES`` at most).
    loop_compute_ms: float
    loop_computed: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SegmentFigures(Figures):
    """Whole-segment figures; ``per_rank`` holds the same figures restricted to one rank."""

    world_size: int
    per_rank: dict[int, Figures]
    straggler_rank: int | None  # find_straggler over the segment's last complete steps
    straggler: Straggler | None
    desyncs: tuple[Desync, ...]  # the first 100, each with its counts
    desync: DesyncRange | None  # all of them
    #: busbw of each other collective kind the segment issued (reduce-scatter, all-gather,
    #: broadcast): the median over its measurable calls times its bus factor over the ranks it
    #: spans (``shard_ranks``). Over the whole segment only, not per rank.
    other_busbw_gbps: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["desyncs"] = list(out["desyncs"])
        return out


MARKED_NAMES = 8  # names of the loop's marked compute kept per segment: a sender cannot grow it


@dataclass
class _RunningSums:
    """Running sums that make one ``Figures``: O(1) memory per step except two bounded windows."""

    steps: int = 0
    timed: int = 0
    compute: float = 0.0
    non_compute: float = 0.0
    idle: float = 0.0
    data_wait: float = 0.0
    comm_overhead: float = 0.0
    hidden_comm: float = 0.0
    talking: int = 0
    overlap: float = 0.0
    records: int = 0
    calls_total: int = 0
    all_reduce_ms: float = 0.0
    waited_ms: float = 0.0
    waited_on_ms: float = 0.0
    samples: int = 0
    tokens: int = 0
    walls_ms: FloatReservoir = field(default_factory=FloatReservoir)
    walls_total_ms: float = 0.0
    algbw: FloatReservoir = field(default_factory=FloatReservoir)
    calls_by_kind: dict[str, int] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    loop_calls: int = 0
    loop_ms: float = 0.0
    marked_ms: float = 0.0
    marked: dict[str, None] = field(default_factory=dict)  # names the loop's marked compute went by

    def add_record(self, f: StepFigures, waited_ms: float, waited_on_ms: float = 0.0) -> None:
        """Zero-length windows are left out of the percentage means: they carry no time."""
        self.records += 1
        if f.step_ms > 0:
            self.timed += 1
            self.compute += f.compute_pct
            self.non_compute += f.non_compute_pct
            self.idle += f.idle_pct
            self.data_wait += f.data_wait_pct
            self.comm_overhead += f.comm_overhead_pct
            self.hidden_comm += f.overlap_pct * f.comm_overhead_pct / 100.0  # |C∩M|/|M| * |M|/K
            if f.comm_overhead_pct > 0:
                self.talking += 1
                self.overlap += f.overlap_pct
        self.calls_total += f.all_reduce_calls
        totals = self.calls_by_kind  # a plain loop, cheaper than Counter.update: it runs for every record of every step
        for kind, calls in f.calls_by_kind.items():
            totals[kind] = totals.get(kind, 0) + calls
        if f.memory:  # one report in ten carries it
            for kind, nbytes in f.memory.items():
                self.memory[kind] = max(nbytes, self.memory.get(kind, 0))
        self.all_reduce_ms += f.all_reduce_ms
        self.loop_calls += f.loop_collectives
        self.loop_ms += f.loop_collective_ms
        if f.loop_computed or f.loop_compute_ms:
            self.marked_ms += f.loop_compute_ms
            for name in f.loop_computed.split(", "):
                if name and len(self.marked) < MARKED_NAMES:
                    self.marked[name] = None
        self.waited_ms += waited_ms
        self.waited_on_ms += waited_on_ms
        self.samples += f.samples
        self.tokens += f.tokens
        self.algbw.extend(f.algbw_gbps)

    def add_step_wall(self, wall_ms: float) -> None:
        self.steps += 1
        self.walls_ms.append(wall_ms)
        self.walls_total_ms += wall_ms

    def figures(self, all_reduce_ranks: int, wall_s: float) -> Figures:
        """``wall_s``: the time these steps took, from the accumulator's clock alignment;
        ``all_reduce_ranks``: how many ranks each all-reduce spans (``all_reduce_ranks``)."""
        def mean(total: float, n: int) -> float:
            return total / n if n else 0.0

        (p50, p95), interval = percentiles_and_median_interval(self.walls_ms.values(), (50, 95))
        factor = bus_factor("all_reduce", all_reduce_ranks)
        return Figures(
            steps=self.steps,
            compute_pct=mean(self.compute, self.timed),
            non_compute_pct=mean(self.non_compute, self.timed),
            idle_pct=mean(self.idle, self.timed),
            data_wait_pct=mean(self.data_wait, self.timed),
            overlap_pct=mean(self.overlap, self.talking),
            comm_overhead_pct=mean(self.comm_overhead, self.timed),
            hidden_comm_pct=mean(self.hidden_comm, self.timed),
            all_reduce_calls=mean(float(self.calls_total), self.records),
            all_reduce_calls_total=self.calls_total,
            all_reduce_ms=mean(self.all_reduce_ms, self.records),
            step_ms_p50=p50,
            step_ms_p95=p95,
            step_ms_mean=mean(self.walls_total_ms, self.steps),
            step_ms_p50_interval=interval,
            wall_s=wall_s,
            samples_per_s=self.samples / wall_s if wall_s > 0 else 0.0,
            tokens_per_s=self.tokens / wall_s if wall_s > 0 else 0.0,
            busbw_gbps=median_of(self.algbw.values()) * factor if len(self.algbw) and factor is not None else None,
            waited_for_others_ms=mean(self.waited_ms, self.records),
            others_waited_ms=mean(self.waited_on_ms, self.records),
            calls_by_kind={kind: mean(float(n), self.records) for kind, n in sorted(self.calls_by_kind.items())},
            memory=dict(self.memory),
            loop_collectives=mean(float(self.loop_calls), self.records),
            loop_collective_ms=mean(self.loop_ms, self.records),
            loop_compute_ms=mean(self.marked_ms, self.records),
            loop_computed=tuple(self.marked),
        )


class SegmentAccumulator:
    """Folds a segment's steps in one at a time, so a live dashboard can forget old steps.

    Means, totals and throughput are exact over every step folded in; step-time percentiles and
    the median bandwidth are over a uniform sample of ``float_reservoir.RESERVOIR`` steps and
    collectives (``FloatReservoir``), clock offsets over
    the last ``ALIGNMENT_STEPS`` steps of each rank, the straggler over the last
    ``STRAGGLER_STEPS`` complete steps.
    """

    def __init__(self, world_size: int, groups: Groups | None = None) -> None:
        """``groups``: who meets whom in the all-reduces (None: every rank): waits are paired
        within them, and busbw counts each all-reduce over their size."""
        self.world_size = world_size
        self.groups = groups
        self.all_reduce_ranks = all_reduce_ranks(groups, world_size)
        self.overall = _RunningSums()
        self.per_rank: dict[int, _RunningSums] = defaultdict(_RunningSums)
        self.clocks = ClockAlignment()
        self.recent_complete: list[StepWaits] = []  # the last STRAGGLER_STEPS steps every rank reported
        self.desyncs: list[Desync] = []
        self.desync: DesyncRange | None = None
        self.other_algbw: dict[str, FloatReservoir] = {}  # by kind, over every rank: see SegmentFigures.other_busbw_gbps

    def add_step(self, figures: Mapping[int, StepFigures], calls: Mapping[int, CallTimes],
                 waits: tuple[Mapping[int, float], Mapping[int, float]] | None = None) -> None:
        """One step: each rank's ``step_figures`` and all-reduces (``call_times``), computed
        centrally from spans or sent by the rank in a ``StepSummary``: the same either way.
        ``waits``: the step's ``step_waits(calls, figures, groups)`` (each rank's waiting in its
        all-reduces, reduce-scatters and all-gathers, and what the others waited for it) where
        the caller made them already (a session does, once a step: at 1,024 ranks a pass over
        300 calls each)."""
        if not figures:
            return
        waited, waited_on = step_waits(calls, figures, self.groups) if waits is None else waits
        step = next(iter(figures.values())).step
        desync = find_desync(calls, step, {rank: f.calls_by_kind for rank, f in figures.items()})
        if desync is not None:
            self.desync = DesyncRange.of(desync) if self.desync is None else self.desync.including(desync)
            if len(self.desyncs) < 100:
                self.desyncs.append(desync)
        walls = []
        times: dict[int, StepTimes] = {}
        for rank, f in sorted(figures.items()):
            for kind, alg in f.other_algbw_gbps.items():
                sample = self.other_algbw.get(kind)
                if sample is None:
                    sample = self.other_algbw[kind] = FloatReservoir()
                sample.extend(alg)
            self.overall.add_record(f, waited.get(rank, 0.0), waited_on.get(rank, 0.0))
            self.per_rank[rank].add_record(f, waited.get(rank, 0.0), waited_on.get(rank, 0.0))
            self.per_rank[rank].add_step_wall(f.step_ms)
            walls.append(f.step_ms)
            times[rank] = f.times
        self.overall.add_step_wall(max(walls))
        self.clocks.add_step(times)
        if len(figures) >= self.world_size > 1:
            self.recent_complete.append(StepWaits(step, waited, max(walls)))
            if len(self.recent_complete) > STRAGGLER_STEPS:
                self.recent_complete.sort(key=lambda s: s.step)
                del self.recent_complete[:-STRAGGLER_STEPS]

    def add_unwatched(self, rank: int, samples: int, tokens: int) -> None:
        """An unwatched step of ``rank`` (``watch_overhead``), in no figure: the samples and tokens
        it trained on are the segment's all the same, as its time is in the segment's wall, so
        samples/s is not read short by the steps left unwatched."""
        for running in (self.overall, self.per_rank[rank]):
            running.samples += samples
            running.tokens += tokens

    def regroup(self, world_size: int, groups: Groups | None) -> None:
        """The world and groups as the hellos now name them. A dashboard started mid-run can fold
        a segment's first steps before every hello (resent every 2 s) is in: busbw and the
        straggler are worked out from these when asked, so the whole segment then reads within
        the groups; the steps' waits already folded stay as they were paired."""
        if world_size != self.world_size or (groups is not self.groups and groups != self.groups):
            self.world_size, self.groups = world_size, groups
            self.all_reduce_ranks = all_reduce_ranks(groups, world_size)

    def copy(self) -> SegmentAccumulator:
        return copy.deepcopy(self)

    def data_wait_by_rank(self) -> dict[int, float]:
        """Each rank's Data wait% (``Figures.data_wait_pct`` of its own): a mean, none of the
        per-rank figures' percentile passes, so the dashboard can ask at 1,024 ranks."""
        return {rank: running.data_wait / running.timed if running.timed else 0.0
                for rank, running in sorted(self.per_rank.items())}

    @property
    def records(self) -> int:
        return self.overall.records

    def figures(self, per_rank: bool = True) -> SegmentFigures:
        """An empty segment gives zeros, ``busbw_gbps=None``, ``per_rank={}``, no straggler.
        ``per_rank=False`` skips the per-rank figures (a percentile pass per rank)."""
        overall = self.overall.figures(self.all_reduce_ranks, self.clocks.wall_s())
        slow = find_straggler(self.recent_complete, self.groups)
        spanned = shard_ranks(self.groups, self.world_size)  # a broadcast's factor is 1 whatever it spans
        other_busbw = {kind: median_of(sample.values()) * factor for kind, sample in sorted(self.other_algbw.items())
                       if len(sample) and (factor := bus_factor(kind, spanned)) is not None}
        return SegmentFigures(
            **{f.name: getattr(overall, f.name) for f in fields(Figures)},
            world_size=self.world_size,
            per_rank={rank: running.figures(self.all_reduce_ranks, self.clocks.own_wall_s(rank))
                      for rank, running in sorted(self.per_rank.items())} if per_rank else {},
            straggler_rank=slow.rank if slow is not None else None,
            straggler=slow,
            desyncs=tuple(self.desyncs),
            desync=self.desync,
            other_busbw_gbps=other_busbw,
        )


def segment_figures(records: Iterable[StepRecordLike], world_size: int,
                    folded: SegmentAccumulator | None = None, per_rank: bool = True,
                    groups: Groups | None = None) -> SegmentFigures:
    """Aggregate a run of steps (on top of the steps already ``folded``, if any); a repeated
    (rank, step) record replaces the earlier one. ``groups``: see ``SegmentAccumulator``."""
    latest: dict[tuple[int, int], StepRecordLike] = {}
    for rec in records:
        latest[(rec.step, rec.rank)] = rec
    by_step: dict[int, dict[int, StepRecordLike]] = defaultdict(dict)
    for (step, rank), rec in sorted(latest.items(), key=lambda kv: kv[0]):
        by_step[step][rank] = rec
    accumulator = folded.copy() if folded is not None else SegmentAccumulator(world_size, groups)
    for step in sorted(by_step):
        both = {rank: figures_and_calls(rec, world_size) for rank, rec in by_step[step].items()}
        accumulator.add_step({rank: f for rank, (f, _) in both.items()}, {rank: c for rank, (_, c) in both.items()})
    return accumulator.figures(per_rank)
