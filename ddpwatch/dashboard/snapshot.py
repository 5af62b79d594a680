"""What the dashboard shows, computed from a ``Session`` without any UI.

The app folds messages into the session and, ten times a second, asks ``SnapshotBuilder`` for a
``Snapshot``; widgets only draw it. Segment figures of finished segments are cached and the
running one is recomputed at most once a second, so a long run does not slow the frame rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ddpwatch import metrics
from ddpwatch.session import Segment, Session
from instrumented_ddp.protocol import COMM_KINDS, COMPUTE_KINDS, StepReport

SEGMENT_REFRESH_S = 1.0
STRAGGLER_SHARE = 0.10  # the others waited over this share of the step for one rank
TREND_POINTS = 120


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


@dataclass(frozen=True)
class TimelineData:
    step: int
    strategy: str
    span_s: float
    ranks: tuple[RankLanes, ...]


@dataclass(frozen=True)
class HeaderData:
    session: str
    world_size: int
    strategy: str
    settings: str
    step: int
    total_steps: int
    eta_s: float | None
    samples_per_s: float
    following: bool  # the latest step, or a step the user chose


@dataclass(frozen=True)
class RankRow:
    rank: int
    node: int | None
    host: str
    device: str
    status: str
    step: int
    step_ms: float | None
    compute_pct: float | None
    non_compute_pct: float | None
    overlap_pct: float | None
    waited_ms: float | None
    utilization: str
    memory: str
    dropped: int


@dataclass(frozen=True)
class DeviceSeries:
    rank: int
    label: str  # says what was measured: "GPU util %" (NVML) or "CPU % (no GPU)"
    values: tuple[float, ...]


@dataclass(frozen=True)
class SegmentRow:
    label: str
    steps: str
    compute_pct: float
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float
    comm_overhead_pct: float
    all_reduce_calls: float
    all_reduce_ms: float
    step_ms_p50: float
    samples_per_s: float


@dataclass(frozen=True)
class Snapshot:
    header: HeaderData
    timeline: TimelineData | None
    ranks: tuple[RankRow, ...]
    devices: tuple[DeviceSeries, ...]
    loss: tuple[float, ...]
    step_ms: tuple[float, ...]
    segments: tuple[SegmentRow, ...]
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class StepSummary:
    """What the trends and the header need from one step, so a frame reads 120 of these
    rather than 120 steps x 64 ranks of reports."""

    ranks: int  # reports it was computed from
    loss: float | None  # mean over ranks that reported one (NaN left out)
    step_ms: float  # mean over ranks
    wall_s: float  # the slowest rank's window: the step took that long for everyone
    samples: int


def summarize(reports: dict[int, StepReport]) -> StepSummary:
    losses = [r.loss for r in reports.values() if r.loss is not None and r.loss == r.loss]
    windows = [r.end - r.start for r in reports.values()]
    return StepSummary(len(reports), sum(losses) / len(losses) if losses else None,
                       1000 * sum(windows) / len(windows), max(windows), sum(r.samples for r in reports.values()))


@dataclass
class SnapshotBuilder:
    """Turns the session into a snapshot; keeps the caches that make that cheap.

    Each cache is keyed by a step and the number of reports it had, so a frame recomputes only
    what a new report changed: at 64 ranks a report arrives between almost every two frames.
    """

    session: Session
    _segment_rows: dict[int, tuple[float, tuple[Any, ...], SegmentRow]] = field(default_factory=dict)
    _summaries: dict[int, StepSummary] = field(default_factory=dict)
    _waits: dict[int, tuple[int, dict[int, float]]] = field(default_factory=dict)  # step -> (ranks seen, waits)
    _shown_step: tuple[Any, ...] = ()  # (step, reports) the timeline and desync below were made from
    _timeline: TimelineData | None = None
    _desync: metrics.Desync | None = None
    _devices: dict[int, tuple[float, DeviceSeries]] = field(default_factory=dict)  # rank -> (newest sample, series)

    def waits_of(self, step: int | None) -> dict[int, float]:
        """Cross-rank waits of a step, computed once per set of reports (the straggler check
        looks at the last ten steps every frame)."""
        reports = self.session.reports.get(step, {}) if step is not None else {}
        cached = self._waits.get(step)  # type: ignore[arg-type]
        if cached is None or cached[0] != len(reports):
            cached = (len(reports), metrics.cross_rank_waits(reports) if reports else {})
            self._waits[step] = cached  # type: ignore[index]
            for old in [s for s in self._waits if s not in self.session.reports]:
                del self._waits[old]
        return cached[1]

    def summaries(self, steps: list[int]) -> list[StepSummary]:
        """Of the given kept steps, in order; forgets steps the session no longer keeps."""
        out = []
        for step in steps:
            reports = self.session.reports[step]
            cached = self._summaries.get(step)
            if cached is None or cached.ranks != len(reports):
                cached = self._summaries[step] = summarize(reports)
            out.append(cached)
        if len(self._summaries) > len(self.session.reports):
            for old in [s for s in self._summaries if s not in self.session.reports]:
                del self._summaries[old]
        return out

    def build(self, selected_step: int | None = None, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        session = self.session
        latest = session.latest_complete_step()
        step = selected_step if selected_step in session.reports else latest
        reports = session.reports.get(step, {}) if step is not None else {}
        waits = self.waits_of(step)
        if (step, len(reports)) != self._shown_step:
            self._shown_step = (step, len(reports))
            self._timeline = timeline_of(step, reports) if step is not None and reports else None
            self._desync = metrics.find_desync(reports) if reports else None
        figures = session.step_figures(step) if step is not None else {}
        trend = self.summaries(sorted(session.reports)[-TREND_POINTS:])
        return Snapshot(
            header=self._header(step, selected_step is None or selected_step == latest, trend),
            timeline=self._timeline,
            ranks=tuple(self._rank_row(rank, figures.get(rank), waits.get(rank), now) for rank in sorted(session.ranks)),
            devices=tuple(self._device_series(rank) for rank in sorted(session.ranks)),
            loss=tuple(s.loss for s in trend if s.loss is not None),
            step_ms=tuple(s.step_ms for s in trend),
            segments=tuple(self._segment_row(segment, now) for segment in session.segments),
            warnings=tuple(self._warnings(step, now)),
        )

    # -- parts -------------------------------------------------------------------------------------
    def _header(self, step: int | None, following: bool, trend: list[StepSummary]) -> HeaderData:
        session = self.session
        hello = next((s.hello for _, s in sorted(session.ranks.items()) if s.hello), None)
        current = session.segments[-1] if session.segments else None
        strategy = current.strategy if current else (hello.strategy if hello else "—")
        settings = current.label.removeprefix(strategy).strip(" ()") if current else ""
        rate, step_s = self._recent_rate(trend)
        total = hello.total_steps if hello else 0
        done = max((s.last_step for s in session.ranks.values()), default=0)
        eta = (total - done) * step_s if step_s and total else None
        return HeaderData(session.session_id or "waiting for a run…", session.world_size, strategy, settings,
                          step or 0, total, eta, rate, following)

    def _recent_rate(self, trend: list[StepSummary], window: int = 20) -> tuple[float, float | None]:
        """Global samples/s and seconds per step over the last ``window`` complete steps."""
        complete = [s for s in trend[-window:] if s.ranks >= self.session.world_size]
        if len(complete) < 2:
            return 0.0, None
        wall = sum(s.wall_s for s in complete)
        return (sum(s.samples for s in complete) / wall if wall > 0 else 0.0), wall / len(complete)

    def _rank_row(self, rank: int, figures: metrics.StepFigures | None, waited_s: float | None, now: float) -> RankRow:
        state = self.session.ranks[rank]
        hello = state.hello
        sample = state.devices[-1] if state.devices else None
        utilization, memory = describe_device(sample.readings if sample else {}, sample.kind if sample else "")
        return RankRow(
            rank=rank, node=hello.node_rank if hello else None, host=hello.host if hello else "?", device=hello.device if hello else "?",
            status=self.session.status(rank, now), step=state.last_step,
            step_ms=figures.step_ms if figures else None, compute_pct=figures.compute_pct if figures else None,
            non_compute_pct=figures.non_compute_pct if figures else None, overlap_pct=figures.overlap_pct if figures else None,
            waited_ms=waited_s, utilization=utilization, memory=memory,
            dropped=state.sender_dropped + state.lost_messages,
        )

    def _device_series(self, rank: int) -> DeviceSeries:
        """Rebuilt only when the rank sent a new sample."""
        devices = self.session.ranks[rank].devices
        newest = devices[-1].time if devices else -1.0
        cached = self._devices.get(rank)
        if cached is not None and cached[0] == newest:
            return cached[1]
        samples = list(devices)[-TREND_POINTS:]
        gpu = bool(samples) and samples[-1].kind == "gpu"
        key = "gpu_util_pct" if gpu else "process_cpu_pct"
        values = tuple(s.readings[key] for s in samples if key in s.readings)
        series = DeviceSeries(rank, "GPU util %" if gpu else "CPU % (no GPU)", values)
        self._devices[rank] = (newest, series)
        return series

    def _segment_row(self, segment: Segment, now: float) -> SegmentRow:
        """Figures of the running segment are recomputed at most once a second (its step range
        every frame); a closed segment's only when a late step is folded into it."""
        steps = f"{segment.first_step}-{segment.last_step}"
        running = segment is self.session.segments[-1]
        key = (segment.label, segment.first_step, segment.folded_records)
        cached = self._segment_rows.get(segment.index)
        if cached is not None:
            made_at, made_for, row = cached
            same_segment = made_for[:2] == key[:2]
            if made_for == key or (running and same_segment and now - made_at < SEGMENT_REFRESH_S):
                return row if row.steps == steps else replace(row, steps=steps)
        f = self.session.segment_figures(segment, include_pending=False, per_rank=False)
        row = SegmentRow(segment.label, steps, f.compute_pct, f.non_compute_pct,
                         f.idle_pct, f.overlap_pct, f.comm_overhead_pct, f.all_reduce_calls, f.all_reduce_ms,
                         f.step_ms_p50, f.samples_per_s)
        self._segment_rows[segment.index] = (now, key, row)
        return row

    def _warnings(self, step: int | None, now: float) -> list[str]:
        session, lines = self.session, []
        desync = self._desync
        if desync is not None:
            counts = ", ".join(f"rank {r}: {c}" for r, c in sorted(desync.calls_per_rank.items()))
            lines.append(f"DESYNC at step {desync.step}: the ranks issued different all-reduce counts ({counts})")
        for rank in sorted(session.ranks):
            if session.status(rank, now) == "lost":
                silent = now - session.ranks[rank].last_seen
                lines.append(f"rank {rank} lost: nothing heard from it for {silent:.1f} s")
        straggler = self._straggler(step)
        if straggler:
            lines.append(straggler)
        dropped = {r: s.sender_dropped for r, s in session.ranks.items() if s.sender_dropped}
        lost = {r: s.lost_messages for r, s in session.ranks.items() if s.lost_messages}
        if dropped or lost:
            parts = [f"rank {r} discarded {n}" for r, n in sorted(dropped.items())]
            parts += [f"{n} from rank {r} lost in transit" for r, n in sorted(lost.items())]
            lines.append("telemetry dropped: " + ", ".join(parts) + " (training was not slowed)")
        rejected = sum(session.rejected.values())
        if rejected:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(session.rejected.items()))
            lines.append(f"rejected {rejected} malformed message(s): {kinds}")
        return lines


    def _straggler_window(self, step: int | None, window: int = 10) -> list[int]:
        steps = [s for s in sorted(self.session.reports) if step is None or s <= step]
        return [s for s in steps[-window:] if len(self.session.reports[s]) >= self.session.world_size > 1]

    def _straggler(self, step: int | None) -> str | None:
        """Over the last ten steps, one rank the others kept waiting for (a single step is noise)."""
        steps = self._straggler_window(step)
        if not steps:
            return None
        totals: dict[int, float] = {}
        wall_ms = 0.0
        for s in steps:
            reports = self.session.reports[s]
            wall_ms += 1000 * max(r.end - r.start for r in reports.values())
            for rank, waited in self.waits_of(s).items():
                totals[rank] = totals.get(rank, 0.0) + waited
        slow = metrics.straggler(totals)
        others = [w for r, w in totals.items() if r != slow]
        if slow is None or not others or min(others) <= STRAGGLER_SHARE * wall_ms:
            return None
        return (f"rank {slow} is a straggler: over steps {steps[0]}-{steps[-1]} the others waited "
                f"{min(others) / len(steps):.1f} ms a step for it ({100 * min(others) / wall_ms:.0f}% of step time)")


def timeline_of(step: int, reports: dict[int, StepReport]) -> TimelineData:
    """All ranks of one step on one axis, aligned at the end of each rank's last all-reduce
    (every rank leaves it together); ranks without one are aligned at their step start."""
    anchors = {rank: max((s.end for s in r.spans if s.kind == "all_reduce"), default=None) for rank, r in reports.items()}
    reference_rank = min(reports)
    reference = anchors[reference_rank]
    shift: dict[int, float] = {}
    for rank, report in reports.items():
        if reference is not None and anchors[rank] is not None:
            shift[rank] = reference - anchors[rank]
        else:
            shift[rank] = reports[reference_rank].start - report.start
    origin = min(r.start + shift[rank] for rank, r in reports.items())
    end = max(r.end + shift[rank] for rank, r in reports.items())
    lanes = [_lanes(rank, reports[rank], shift[rank] - origin) for rank in sorted(reports)]
    return TimelineData(step, next(iter(reports.values())).strategy, max(end - origin, 1e-9), tuple(lanes))


def _lanes(rank: int, report: StepReport, offset: float) -> RankLanes:
    """One pass over the rank's spans: a frame at 64 ranks walks a few thousand of them."""
    compute: list[Bar] = []
    comm: list[Bar] = []
    collectives: list[tuple[float, float]] = []
    blocked: list[tuple[float, float]] = []
    for s in report.spans:
        start, end = s.start + offset, s.end + offset
        if s.kind in COMPUTE_KINDS:
            compute.append(Bar(s.kind, start, end))
        elif s.kind in COMM_KINDS:
            comm.append(Bar(s.kind, start, end, s.tag))
            collectives.append((start, end))
        elif s.kind == "wait":
            comm.append(Bar(s.kind, start, end, s.tag))
        if s.blocking:
            blocked.append((start, end))
    busy = metrics.subtract([(b.start, b.end) for b in compute], blocked)
    exposed = metrics.subtract(collectives, busy)
    return RankLanes(rank, tuple(compute), tuple(comm), tuple(exposed))


def describe_device(readings: dict[str, float], kind: str) -> tuple[str, str]:
    """(utilization, memory) as the ranks table shows them; what was not measured is '—'."""
    if kind == "gpu":
        util = f"GPU {readings['gpu_util_pct']:.0f}%" if "gpu_util_pct" in readings else "GPU —"
        if "mem_used_bytes" in readings and "mem_total_bytes" in readings:
            return util, f"{readings['mem_used_bytes'] / 2**30:.1f}/{readings['mem_total_bytes'] / 2**30:.0f} GiB"
        return util, "—"
    if not readings:
        return "—", "—"
    util = f"CPU {readings['process_cpu_pct']:.0f}%" if "process_cpu_pct" in readings else "CPU —"
    memory = f"RSS {readings['rss_bytes'] / 2**20:.0f} MiB" if "rss_bytes" in readings else "—"
    return util, memory
