"""A session's figures as Prometheus metric families: what ``--prometheus`` serves at ``/metrics``. Pure.

Every per-rank series carries the labels ``session``, ``rank``, ``node``, ``host`` and
``strategy``, and a few one more from a fixed set (a memory kind, a rank status, where a
message was dropped): no step, tag, time or free-text label, so a job of N ranks exposes a
fixed number of series per rank (``SERIES_PER_RANK``) and a switch of strategy replaces a rank's
series rather than adding to them. Figures are those of the newest segment (the strategy the
run is in now), the same as that segment's ``per_rank`` figures in ``summary.json``; readings
(memory held, the device) are the rank's newest. Names follow Prometheus's conventions: base
units in the name (seconds, bytes, watts), ``_ratio`` for a share between 0 and 1 (Compute%
over 100), ``_total`` for a counter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from ddpwatch.figures.metrics import Figures, SegmentFigures
from ddpwatch.ingest.segments import Segment
from ddpwatch.ingest.session import Session

RANK_LABELS = ("session", "rank", "node", "host", "strategy")
#: A rank's status (``Session.status``), one series each, 1 for the status it is in.
RANK_STATUSES = ("live", "lost", "finished", "failed", "interrupted", "detached")
STEP_QUANTILES = (0.5, 0.95)
#: Device readings (``DeviceSample.readings``) exposed, each as (metric, help, scale to base units).
DEVICE_READINGS: dict[str, tuple[str, str, float]] = {
    "gpu_util_pct": ("ddpwatch_device_utilization_ratio", "GPU utilization (NVML), newest reading", 0.01),
    "mem_used_bytes": ("ddpwatch_device_memory_used_bytes", "GPU memory used (NVML), newest reading", 1.0),
    "power_w": ("ddpwatch_device_power_watts", "GPU power draw (NVML), newest reading", 1.0),
    "process_cpu_pct": ("ddpwatch_process_cpu_ratio", "the rank's process CPU use (may pass 1 with threads)", 0.01),
    "rss_bytes": ("ddpwatch_process_resident_memory_bytes", "the rank's process resident memory", 1.0),
}


@dataclass(frozen=True)
class Gauge:
    """A per-rank gauge read from the rank's segment ``Figures``."""

    name: str
    help: str
    field: str
    scale: float


#: Per-rank gauges of the newest segment's figures (``Figures`` field, scaled to base units).
FIGURE_GAUGES = (
    Gauge("ddpwatch_compute_ratio", "Compute%/100: the step's window covered by compute, mean over the segment's steps",
          "compute_pct", 0.01),
    Gauge("ddpwatch_non_compute_ratio", "Non_Compute%/100: exposed communication, not hidden behind compute",
          "non_compute_pct", 0.01),
    Gauge("ddpwatch_idle_ratio", "Idle%/100: the window neither computing nor communicating", "idle_pct", 0.01),
    Gauge("ddpwatch_data_wait_ratio", "Data wait%/100: the part of Idle spent waiting for the next batch",
          "data_wait_pct", 0.01),
    Gauge("ddpwatch_overlap_ratio", "Overlap%/100: the share of communication hidden behind compute", "overlap_pct", 0.01),
    Gauge("ddpwatch_waited_seconds", "time per step the rank waited in collectives for the other ranks",
          "waited_for_others_ms", 0.001),
    Gauge("ddpwatch_waited_for_seconds", "time per step the other ranks waited for this rank (it arrived last)",
          "others_waited_ms", 0.001),
    Gauge("ddpwatch_all_reduce_seconds", "time per step in all-reduce calls (concurrent buckets each count)",
          "all_reduce_ms", 0.001),
)
#: Series each rank exposes at most: the step summary's 4, the gauges, all-reduce busbw, 4 memory
#: kinds, the device readings, 2 drop counters, the last step, silence, the statuses, a stall's culprit.
SERIES_PER_RANK = 4 + len(FIGURE_GAUGES) + 1 + 4 + len(DEVICE_READINGS) + 2 + 2 + len(RANK_STATUSES) + 1


def metric_families(session: Session, now: float, final: bool = False) -> list[Metric]:
    """Every family ``/metrics`` serves for ``session`` at ``now`` (the session's clock).
    ``final``: the recording is over; steps still waiting for a rank are counted, as the exports
    count them (live, only the folded ones: a fold pass per scrape would cost the listener)."""
    segment = session.segments[-1] if session.segments else None
    strategy = segment.strategy if segment is not None else ""
    figures = session.segment_figures(segment, include_pending=final, per_rank=True) if segment is not None else None
    per_rank = figures.per_rank if figures is not None else {}
    labels: dict[int, dict[str, str]] = {}  # one dict a rank, shared by its samples (a sample never changes it)
    for rank, state in sorted(session.ranks.items()):
        hello = state.hello
        labels[rank] = dict(zip(RANK_LABELS, (session.session_id, str(rank), str(hello.node_rank) if hello else "",
                                              hello.host if hello else "", strategy), strict=True))
    families: list[Metric] = [_step_seconds(per_rank, labels)]
    families += _figure_gauges(per_rank, labels)
    families += _rank_readings(session, labels, now)
    families += _session_families(session, figures, strategy, now)
    families += _watch_overhead(session, segment, strategy)
    return families


def _gauge(name: str, help_text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, labels=RANK_LABELS)


def _add(family: Metric, labels: dict[str, str], value: float, suffix: str = "") -> None:
    """One sample, its labels the dict given (not copied: prometheus_client's ``add_metric``
    makes a dict a sample, a third of the time the families take at 1,024 ranks)."""
    family.samples.append(Sample(family.name + suffix, labels, value))


def _step_seconds(per_rank: dict[int, Figures], labels: dict[int, dict[str, str]]) -> Metric:
    """A summary: the rank's step time quantiles over the segment's steps, their sum and count
    (``_sum / _count`` is the mean, ``summary.json``'s ``step_ms_mean``)."""
    family = Metric("ddpwatch_step_seconds", "the rank's step time (its window) over the segment's steps", "summary")
    for rank, f in per_rank.items():
        if rank not in labels:
            continue
        named = labels[rank]
        for quantile, value in zip(STEP_QUANTILES, (f.step_ms_p50, f.step_ms_p95), strict=True):
            family.add_sample("ddpwatch_step_seconds", {**named, "quantile": f"{quantile:g}"}, value / 1000.0)
        family.add_sample("ddpwatch_step_seconds_count", named, float(f.steps))
        family.add_sample("ddpwatch_step_seconds_sum", named, f.step_ms_mean * f.steps / 1000.0)
    return family


def _figure_gauges(per_rank: dict[int, Figures], labels: dict[int, dict[str, str]]) -> Iterable[Metric]:
    for gauge in FIGURE_GAUGES:
        family = _gauge(gauge.name, gauge.help)
        for rank, f in per_rank.items():
            if rank in labels:
                _add(family, labels[rank], float(getattr(f, gauge.field)) * gauge.scale)
        yield family
    busbw = _gauge("ddpwatch_busbw_bytes_per_second", "the rank's all-reduce bus bandwidth, median over the "
                   "segment's measurable calls (other kinds: ddpwatch_job_busbw_bytes_per_second)")
    for rank, f in per_rank.items():
        if rank in labels and f.busbw_gbps is not None:
            _add(busbw, {**labels[rank], "kind": "all_reduce"}, f.busbw_gbps * 1e9)
    yield busbw


def _rank_readings(session: Session, labels: dict[int, dict[str, str]], now: float) -> Iterable[Metric]:
    memory = _gauge("ddpwatch_memory_bytes", "bytes the rank held at its newest measured step end, by kind "
                    "(parameters, gradients, optimizer_state, peak)")
    devices = {name: _gauge(metric, help_text) for name, (metric, help_text, _) in DEVICE_READINGS.items()}
    dropped = CounterMetricFamily("ddpwatch_messages_dropped", "telemetry messages lost: discarded by the rank's "
                                  "own full queue (sender) or missing from its sequence (in_transit)", labels=RANK_LABELS)
    last_step = _gauge("ddpwatch_last_step", "the newest step the rank is known to have passed")
    silent = _gauge("ddpwatch_silence_seconds", "time since the listener last heard from the rank")
    status = _gauge("ddpwatch_rank_status", "1 for the status the rank is in (live, lost, or how its run ended)")
    for rank, state in sorted(session.ranks.items()):
        named = labels[rank]
        for kind, nbytes in sorted(state.memory.items()):
            _add(memory, {**named, "kind": kind}, float(nbytes))
        if state.devices:
            for name, value in state.devices[-1].readings.items():
                if name in DEVICE_READINGS:
                    _add(devices[name], named, value * DEVICE_READINGS[name][2])
        _add(dropped, {**named, "where": "sender"}, float(state.sender_dropped), "_total")
        _add(dropped, {**named, "where": "in_transit"}, float(state.lost_messages), "_total")
        _add(last_step, named, float(state.last_step))
        _add(silent, named, max(now - state.last_seen, 0.0))
        now_in = session.status(rank, now)
        for name in RANK_STATUSES:
            _add(status, {**named, "status": name}, 1.0 if name == now_in else 0.0)
    yield from (memory, *devices.values(), dropped, last_step, silent, status)


def _watch_overhead(session: Session, segment: Segment | None, strategy: str) -> Iterable[Metric]:
    """What watching costs the newest segment (``Session.watch_overhead``): its median and the
    90 % interval's ends (``estimate``), and the unwatched steps it is made of; absent before the
    segment's first unwatched block."""
    cost = session.watch_overhead(segment) if segment is not None else None
    ratio = GaugeMetricFamily("ddpwatch_watch_overhead_ratio", "what watching costs the run's steps, over an "
                              "unwatched step's wall: the median over its unwatched steps (estimate=median) and its "
                              "90 % interval (low, high)", labels=["session", "strategy", "estimate"])
    steps = GaugeMetricFamily("ddpwatch_unwatched_steps", "the unwatched steps ddpwatch_watch_overhead_ratio is "
                              "made of", labels=["session", "strategy"])
    if cost is not None:
        sid = session.session_id
        for estimate, pct in zip(("median", "low", "high"), (cost.pct, *cost.interval_pct), strict=True):
            ratio.add_metric([sid, strategy, estimate], pct / 100.0)
        steps.add_metric([sid, strategy], float(cost.unwatched_steps))
    yield from (ratio, steps)


def _session_families(session: Session, figures: SegmentFigures | None, strategy: str, now: float) -> Iterable[Metric]:
    """The run's own series: labelled ``session`` (and ``strategy`` or a kind), not by rank."""
    sid = session.session_id
    ranks = GaugeMetricFamily("ddpwatch_ranks", "the ranks the run's hellos name (its world size)", labels=["session"])
    ranks.add_metric([sid], float(session.world_size))
    job_busbw = GaugeMetricFamily("ddpwatch_job_busbw_bytes_per_second", "bus bandwidth of each collective kind, "
                                  "median over the segment's measurable calls of every rank",
                                  labels=["session", "strategy", "kind"])
    if figures is not None:
        if figures.busbw_gbps is not None:
            job_busbw.add_metric([sid, strategy, "all_reduce"], figures.busbw_gbps * 1e9)
        for kind, gbps in figures.other_busbw_gbps.items():
            job_busbw.add_metric([sid, strategy, kind], gbps * 1e9)
    desync = session.desync_range()
    desynced = CounterMetricFamily("ddpwatch_desynced_steps", "steps whose ranks issued different collectives "
                                   "(every segment's)", labels=["session"])
    desynced.add_metric([sid], float(desync.steps if desync is not None else 0))
    rejected = CounterMetricFamily("ddpwatch_rejected_messages", "messages the listener refused, by why",
                                   labels=["session", "reason"])
    for reason, count in sorted(session.rejected.items()):
        rejected.add_metric([sid, reason], float(count))
    watch = session.stall_watch
    current = watch.current
    stalls = CounterMetricFamily("ddpwatch_stalls", "stalls named: no rank finished a step for 3 p95 steps",
                                 labels=["session"])
    stalls.add_metric([sid], float(len(watch.stalls)))
    stalled = GaugeMetricFamily("ddpwatch_stalled_seconds", "how long the current stall has lasted, by what holds "
                                "it (behind, in_collective, desync, lost); absent while the run steps",
                                labels=["session", "kind"])
    culprits = GaugeMetricFamily("ddpwatch_stall_culprit", "1 for each rank the current stall names as holding "
                                 "the others; absent while the run steps", labels=["session", "rank"])
    if current is not None:
        stalled.add_metric([sid, current.verdict.kind], current.duration_s(now))
        for rank in current.verdict.culprits:
            culprits.add_metric([sid, str(rank)], 1.0)
    yield from (ranks, job_busbw, desynced, rejected, stalls, stalled, culprits)
