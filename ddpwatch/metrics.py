"""The product's figures, computed one way for the dashboard, the recorder and the exporter.

Keeping every definition in one pure module is what lets a number on the live
screen be compared with the same number in an exported report.  Spans and step
records are duck-typed (see :class:`SpanLike`, :class:`StepRecordLike`) so this
module depends on nothing else in the project.

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
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from ddpwatch.intervals import Interval, clip, intersect, merge, subtract, total_length, union

__all__ = [
    "BLOCKING_KINDS", "COMM_KINDS", "COMPUTE_KINDS", "Desync", "Figures", "Interval",
    "SegmentAccumulator", "SegmentFigures", "SpanLike", "StepFigures", "StepRecordLike", "algbw_gbps", "bus_factor",
    "busbw_gbps", "clip", "cross_rank_waits", "find_desync", "intersect", "merge",
    "segment_figures", "step_figures", "straggler", "subtract", "total_length", "union",
]

COMPUTE_KINDS = frozenset({"forward", "backward", "optimizer"})
COMM_KINDS = frozenset({"all_reduce", "broadcast"})
# A blocking span of one of these kinds means the main thread sat waiting on the
# network; if it happened inside e.g. a backward hook, it is not compute.
BLOCKING_KINDS = COMM_KINDS | {"wait"}
_BYTES_PER_GB = 1e9  # nccl-tests reports decimal GB/s


class SpanLike(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def blocking(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...


class StepRecordLike(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def spans(self) -> Sequence[SpanLike]: ...
    @property
    def samples(self) -> int: ...
    @property
    def tokens(self) -> int: ...


def _length(start: float, end: float) -> float:
    """Raw duration; faulty (reversed or non-finite) times count as no time at all."""
    d = end - start
    return d if math.isfinite(d) and d > 0 else 0.0


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def _all_reduces(record: StepRecordLike) -> list[SpanLike]:
    """In issue order, which is what lines the i-th call up across ranks."""
    return sorted((s for s in record.spans if s.kind == "all_reduce"), key=lambda s: s.start)


# --- bandwidth (nccl-tests definitions, see nccl-tests doc/PERFORMANCE.md) -------------


def algbw_gbps(nbytes: int, seconds: float) -> float | None:
    """S/t.  None for an empty payload or a non-positive time, which measure no link."""
    if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
        return None
    return nbytes / seconds / _BYTES_PER_GB


def bus_factor(kind: str, world_size: int) -> float | None:
    """Turns algbw into the per-link rate so that numbers compare across world sizes.

    all_reduce moves 2(n-1)/n of the payload over each link (ring lower bound);
    broadcast moves it once.  One rank gives 0 for all_reduce, as nccl-tests does.
    None for an unknown kind or a world size below 1.
    """
    if world_size < 1:
        return None
    if kind == "all_reduce":
        return 2.0 * (world_size - 1) / world_size
    if kind == "broadcast":
        return 1.0
    return None


def busbw_gbps(nbytes: int, seconds: float, world_size: int, kind: str = "all_reduce") -> float | None:
    alg, factor = algbw_gbps(nbytes, seconds), bus_factor(kind, world_size)
    return None if alg is None or factor is None else alg * factor


# --- one rank, one step ----------------------------------------------------------------


@dataclass(frozen=True)
class StepFigures:
    """One rank's step, kept whole so segments aggregate from it rather than re-scan spans."""

    rank: int
    step: int
    step_ms: float
    compute_pct: float
    non_compute_pct: float  # exposed communication
    idle_pct: float
    overlap_pct: float
    comm_overhead_pct: float  # merged communication wall clock
    all_reduce_calls: int
    all_reduce_ms: float  # sum of raw durations; concurrent buckets each count
    algbw_gbps: tuple[float, ...]  # per measurable all_reduce, in issue order
    busbw_gbps: float | None  # median over this step; None without a world size
    samples: int
    tokens: int


def step_figures(record: StepRecordLike, world_size: int | None = None) -> StepFigures:
    lo, hi = record.start, record.end
    window = _length(lo, hi)
    spans = list(record.spans)
    compute = [(s.start, s.end) for s in spans if s.kind in COMPUTE_KINDS]
    blocked = [(s.start, s.end) for s in spans if s.blocking and s.kind in BLOCKING_KINDS]
    comm = [(s.start, s.end) for s in spans if s.kind in COMM_KINDS]
    c = clip(subtract(compute, blocked), lo, hi)  # "blocked is not busy"
    m = clip(comm, lo, hi)
    c_len, m_len = total_length(c), total_length(m)
    busy = total_length(union(c, m))

    ars = _all_reduces(record)
    alg = tuple(a for a in (algbw_gbps(s.nbytes, _length(s.start, s.end)) for s in ars) if a is not None)
    factor = bus_factor("all_reduce", world_size) if world_size is not None else None
    return StepFigures(
        rank=record.rank,
        step=record.step,
        step_ms=1000.0 * window,
        compute_pct=_pct(c_len, window),
        non_compute_pct=_pct(busy - c_len, window),
        idle_pct=_pct(max(window - busy, 0.0), window),
        overlap_pct=_pct(total_length(intersect(c, m)), m_len),
        comm_overhead_pct=_pct(m_len, window),
        all_reduce_calls=len(ars),
        all_reduce_ms=1000.0 * sum(_length(s.start, s.end) for s in ars),
        algbw_gbps=alg,
        busbw_gbps=float(np.median(alg)) * factor if alg and factor is not None else None,
        samples=max(int(record.samples), 0),
        tokens=max(int(record.tokens), 0),
    )


# --- across ranks, one step ------------------------------------------------------------


def cross_rank_waits(records_of_one_step: Mapping[int, StepRecordLike]) -> dict[int, float]:
    """Milliseconds each rank spent in all-reduces waiting for the others to arrive.

    A collective cannot finish before its last participant joins, so the shortest
    duration of the i-th call over ranks is taken as the pure transfer and the rest
    of each rank's duration as waiting.  When call counts differ (see
    :func:`find_desync`) only the common prefix is matched: beyond it there is no
    counterpart to compare with.  Fewer than two ranks wait for nobody: all 0.0.
    """
    durations = {rank: [_length(s.start, s.end) for s in _all_reduces(rec)]
                 for rank, rec in records_of_one_step.items()}
    waits = {rank: 0.0 for rank in durations}
    if len(durations) < 2:
        return waits
    for i in range(min(len(d) for d in durations.values())):
        transfer = min(d[i] for d in durations.values())
        for rank, d in durations.items():
            waits[rank] += 1000.0 * (d[i] - transfer)
    return waits


def straggler(waits: Mapping[int, float], tolerance_ms: float = 0.0) -> int | None:
    """The rank everyone else waits for: the one that waited least (it always arrives last).

    None with fewer than two ranks, or when the spread of waits is within
    ``tolerance_ms`` (nobody is meaningfully late).  Ties go to the lowest rank.
    """
    if len(waits) < 2 or max(waits.values()) - min(waits.values()) <= tolerance_ms:
        return None
    return min(waits, key=lambda rank: (waits[rank], rank))


@dataclass(frozen=True)
class Desync:
    """Kept per rank so the dashboard can point at the rank that skipped or added a call."""

    step: int
    calls_per_rank: dict[int, int]


def find_desync(records_of_one_step: Mapping[int, StepRecordLike]) -> Desync | None:
    """Ranks issuing different numbers of all-reduces in a step will hang or corrupt gradients."""
    if not records_of_one_step:
        return None
    calls = {rank: len(_all_reduces(rec)) for rank, rec in sorted(records_of_one_step.items())}
    if len(set(calls.values())) <= 1:
        return None
    return Desync(step=next(iter(records_of_one_step.values())).step, calls_per_rank=calls)


# --- a run of steps under one strategy -------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """Aggregates over a set of (rank, step) records; "mean" is per rank per step."""

    steps: int  # distinct steps
    compute_pct: float  # mean over records with a positive window
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float  # mean over records that communicated at all
    comm_overhead_pct: float
    all_reduce_calls: float  # mean
    all_reduce_calls_total: int
    all_reduce_ms: float  # mean
    step_ms_p50: float  # over each step's wall time (max window over ranks), linear interp.
    step_ms_p95: float
    samples_per_s: float  # total samples / total wall time
    tokens_per_s: float
    busbw_gbps: float | None  # median over every measurable all_reduce
    waited_for_others_ms: float  # mean

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SegmentFigures(Figures):
    """Whole-segment figures; ``per_rank`` holds the same figures restricted to one rank."""

    world_size: int
    per_rank: dict[int, Figures]
    straggler_rank: int | None  # by total wait over the segment, see straggler()
    desyncs: tuple[Desync, ...]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["desyncs"] = list(out["desyncs"])
        return out


RESERVOIR = 4096  # step times and bandwidths kept per segment for percentiles: memory stays bounded


@dataclass
class _Running:
    """Running sums that make one ``Figures``: O(1) memory per step except two bounded windows."""

    steps: int = 0
    timed: int = 0
    compute: float = 0.0
    non_compute: float = 0.0
    idle: float = 0.0
    comm_overhead: float = 0.0
    talking: int = 0
    overlap: float = 0.0
    records: int = 0
    calls_total: int = 0
    all_reduce_ms: float = 0.0
    waited_ms: float = 0.0
    samples: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    walls_ms: deque = field(default_factory=lambda: deque(maxlen=RESERVOIR))
    algbw: deque = field(default_factory=lambda: deque(maxlen=RESERVOIR))

    def add_record(self, f: StepFigures, waited_ms: float) -> None:
        """Zero-length windows are left out of the percentage means: they carry no time."""
        self.records += 1
        if f.step_ms > 0:
            self.timed += 1
            self.compute += f.compute_pct
            self.non_compute += f.non_compute_pct
            self.idle += f.idle_pct
            self.comm_overhead += f.comm_overhead_pct
            if f.comm_overhead_pct > 0:
                self.talking += 1
                self.overlap += f.overlap_pct
        self.calls_total += f.all_reduce_calls
        self.all_reduce_ms += f.all_reduce_ms
        self.waited_ms += waited_ms
        self.samples += f.samples
        self.tokens += f.tokens
        self.algbw.extend(f.algbw_gbps)

    def add_step_wall(self, wall_ms: float) -> None:
        self.steps += 1
        self.wall_s += wall_ms / 1000.0
        self.walls_ms.append(wall_ms)

    def figures(self, world_size: int) -> Figures:
        def mean(total: float, n: int) -> float:
            return total / n if n else 0.0

        walls = list(self.walls_ms)
        factor = bus_factor("all_reduce", world_size)
        return Figures(
            steps=self.steps,
            compute_pct=mean(self.compute, self.timed),
            non_compute_pct=mean(self.non_compute, self.timed),
            idle_pct=mean(self.idle, self.timed),
            overlap_pct=mean(self.overlap, self.talking),
            comm_overhead_pct=mean(self.comm_overhead, self.timed),
            all_reduce_calls=mean(float(self.calls_total), self.records),
            all_reduce_calls_total=self.calls_total,
            all_reduce_ms=mean(self.all_reduce_ms, self.records),
            step_ms_p50=float(np.percentile(walls, 50)) if walls else 0.0,
            step_ms_p95=float(np.percentile(walls, 95)) if walls else 0.0,
            samples_per_s=self.samples / self.wall_s if self.wall_s > 0 else 0.0,
            tokens_per_s=self.tokens / self.wall_s if self.wall_s > 0 else 0.0,
            busbw_gbps=float(np.median(list(self.algbw))) * factor if self.algbw and factor is not None else None,
            waited_for_others_ms=mean(self.waited_ms, self.records),
        )


class SegmentAccumulator:
    """Folds a segment's steps in one at a time, so a live dashboard can forget old steps.

    Means, totals and throughput are exact over every step folded in; step-time percentiles and
    the median bandwidth are over the last ``RESERVOIR`` steps and collectives.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.overall = _Running()
        self.per_rank: dict[int, _Running] = defaultdict(_Running)
        self.wait_totals: dict[int, float] = defaultdict(float)
        self.desyncs: list[Desync] = []

    def add_step(self, records_of_one_step: Mapping[int, StepRecordLike],
                 figures: Mapping[int, StepFigures] | None = None) -> None:
        """``figures``: each rank's ``step_figures`` when the caller already has them."""
        if not records_of_one_step:
            return
        waits = cross_rank_waits(records_of_one_step)
        desync = find_desync(records_of_one_step)
        if desync is not None and len(self.desyncs) < 100:
            self.desyncs.append(desync)
        walls = []
        for rank, rec in sorted(records_of_one_step.items()):
            f = figures[rank] if figures is not None and rank in figures else step_figures(rec, self.world_size)
            self.overall.add_record(f, waits[rank])
            self.per_rank[rank].add_record(f, waits[rank])
            self.per_rank[rank].add_step_wall(f.step_ms)
            self.wait_totals[rank] += waits[rank]
            walls.append(f.step_ms)
        self.overall.add_step_wall(max(walls))

    def copy(self) -> SegmentAccumulator:
        return copy.deepcopy(self)

    @property
    def records(self) -> int:
        return self.overall.records

    def figures(self, per_rank: bool = True) -> SegmentFigures:
        """An empty segment gives zeros, ``busbw_gbps=None``, ``per_rank={}``, no straggler.
        ``per_rank=False`` skips the per-rank figures (a percentile pass per rank)."""
        overall = self.overall.figures(self.world_size)
        return SegmentFigures(
            **{f.name: getattr(overall, f.name) for f in fields(Figures)},
            world_size=self.world_size,
            per_rank={rank: running.figures(self.world_size) for rank, running in sorted(self.per_rank.items())}
            if per_rank else {},
            straggler_rank=straggler(self.wait_totals),
            desyncs=tuple(self.desyncs),
        )


def segment_figures(records: Iterable[StepRecordLike], world_size: int,
                    folded: SegmentAccumulator | None = None, per_rank: bool = True) -> SegmentFigures:
    """Aggregate a run of steps (on top of the steps already ``folded``, if any); a repeated
    (rank, step) record replaces the earlier one."""
    latest: dict[tuple[int, int], StepRecordLike] = {}
    for rec in records:
        latest[(rec.step, rec.rank)] = rec
    by_step: dict[int, dict[int, StepRecordLike]] = defaultdict(dict)
    for (step, rank), rec in sorted(latest.items(), key=lambda kv: kv[0]):
        by_step[step][rank] = rec
    accumulator = folded.copy() if folded is not None else SegmentAccumulator(world_size)
    for step in sorted(by_step):
        accumulator.add_step(by_step[step])
    return accumulator.figures(per_rank)
