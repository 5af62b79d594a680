"""The snapshot a frame draws and its parts, and the sizes and paces they are made at.

Plain data: the builders (``snapshot.SnapshotBuilder``, ``header_builder``, ``rank_parts``) fill
them from the session, and each widget draws only its part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpwatch.advisor.strategy_advice import StrategyAdvice
from ddpwatch.advisor.advice import Advice
from ddpwatch.dashboard.views.heatmap import Heatmap
from ddpwatch.dashboard.views.rank_rows import RankRow
from ddpwatch.dashboard.views.timeline_lanes import TimelineData
from ddpwatch.figures.watch_overhead import WatchOverhead
from ddpwatch.ingest.evaluations import MetricSeries
from ddpwatch.wording.data_wait import data_wait_text
from ddpwatch.wording.loop_compute import loop_compute_text

SEGMENT_REFRESH_S = 1.0  # the running segment's figures, and the header's rate, are remade at most this often
HEATMAP_REFRESH_S = 1.0
ADVICE_REFRESH_S = 1.0  # the advisor's sweep is remade at most this often
STRATEGIES_REFRESH_S = 5.0  # ... and the strategy table (nine replays and the memory of each)
TREND_POINTS = 120  # the points a trend or a device series holds
DEVICE_REFRESH_S = 1.0  # a rank's device series is remade at most this often
#: Above ``SMALL_JOB_MAX_RANKS`` ranks the per-rank parts (ranks table, device series, warnings)
#: are remade at most this often, and at once when the step shown or the opened nodes change:
#: walking every rank each frame to find what changed would take much of the frame.
LARGE_JOB_ROWS_REFRESH_S = 0.5
HEATMAP_STEPS = 60  # recent steps the heatmap holds; it draws as many as fit
HEATMAP_RANK_ROWS_MAX = 32  # ranks; a larger job's heatmap starts one row per node
TOP_STRAGGLERS = 8  # ranks listed in the stragglers tab
#: Ranks; a job above it is large: its timeline draws the slowest, the fastest and the selected
#: rank (a smaller one's draws every rank, and scrolls), its ranks table a row per node.
SMALL_JOB_MAX_RANKS = 64
RATE_STEPS = 20  # the header's samples/s is over this many recent complete steps


@dataclass(frozen=True)
class HeaderData:
    session: str
    world_size: int
    strategy: str
    settings: str
    step: int
    total_steps: int
    eta_s: float | None
    samples_per_s: float | None  # None until two complete steps give a rate
    following: bool  # the latest step, or a step the user chose
    switchable: bool = True  # False: a run ddpwatch did not start (``attach``), whose loop cannot re-wrap
    finished: bool = False  # every rank said goodbye: the run is over, whatever step is shown
    failed: bool = False  # a rank's goodbye said its training raised (``Session.failed_ranks``)
    interrupted: bool = False  # ... or that a signal stopped it (``Session.interrupted_ranks``)
    stalled_s: float | None = None  # how long no rank has finished a step, while the run is stalled
    #: What watching costs the current segment, from its unwatched steps (``watch_overhead``);
    #: None before its first block, or where the ranks leave no step unwatched.
    watch_overhead: WatchOverhead | None = None


@dataclass(frozen=True)
class DeviceSeries:
    rank: int
    label: str  # says what is measured: "GPU util %" (NVML) or "CPU % (no GPU)"
    values: tuple[float, ...]


@dataclass(frozen=True)
class SegmentRow:
    label: str  # ``session.strategy_label``: the strategy and its settings, in full
    short_label: str  # ``session.short_strategy_label``: the same, as the segments table's column has room for
    steps: str  # the segment's step range
    #: Its steps that count in the figures (``Figures.steps``): none yet in a segment a switch has
    #: just opened, or whose steps were all excluded; its figures are then no measurement at all.
    counted_steps: int
    compute_pct: float
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float
    comm_overhead_pct: float
    all_reduce_calls: float
    all_reduce_ms: float
    step_ms_p50: float
    samples_per_s: float
    hidden_comm_pct: float = 0.0  # the part of Compute% that communication ran beside (the bars)
    other_calls: str = "—"  # reduce-scatters, all-gathers, broadcasts per rank per step (``figure_text.kinds_text``)
    held: str = "—"  # the most a rank held, parameters/gradients/optimizer state (``figure_text.held_text``)
    busbw: str = "—"  # each collective kind's busbw (``figure_text.busbw_text``)
    data_wait_pct: float = 0.0  # the part of Idle% spent waiting for the next batch (``data_wait``)
    #: The most collectives of its own a rank's loop issued in a step's data time, of the whole
    #: session (``Session.untimed_in_data``), where any of the segment's steps had some, else 0:
    #: the data wait holds them (``StepReport.untimed_in_data``).
    untimed_in_data_most: int = 0
    #: The loop's own compute it marked, ms a step (mean), and what it said it was (``loop_compute``).
    loop_compute_ms: float = 0.0
    loop_computed: tuple[str, ...] = ()
    #: Each rank's Data wait%, where they are known (``Session.segment_data_wait_by_rank``): the line
    #: names the rank that waited most where the ranks are uneven (``data_wait.uneven_text``).
    data_wait_by_rank: tuple[tuple[int, float], ...] = ()  # (rank, %), rank order


def segment_notes(rows: tuple[SegmentRow, ...]) -> tuple[str, ...]:
    """``data_wait.data_wait_text`` of each segment whose counted steps waited on their data,
    and ``loop_compute.loop_compute_text`` of each whose loop marked compute of its own."""
    lines = (data_wait_text(f"{row.short_label} (steps {row.steps})", row.data_wait_pct, row.idle_pct, row.step_ms_p50,
                            row.untimed_in_data_most, dict(row.data_wait_by_rank))
             for row in rows if row.counted_steps)
    marked = (loop_compute_text(f"{row.short_label} (steps {row.steps})", row.loop_compute_ms, row.loop_computed,
                                row.step_ms_p50) for row in rows if row.counted_steps)
    return tuple(line for line in (*lines, *marked) if line is not None)


@dataclass(frozen=True)
class StragglerRow:
    rank: int
    node: int
    waited_for_ms: float  # by the other ranks together, per step, over first_step..last_step
    share_pct: float  # of those steps' wall time
    first_step: int
    last_step: int
    waited_ms: float = 0.0  # the rank itself, for the others, per step: ranks that wait by turns show both
    named: bool = False  # the straggler rule names it (the warning's rank)


@dataclass(frozen=True)
class Snapshot:
    header: HeaderData
    timeline: TimelineData | None
    ranks: tuple[RankRow, ...]
    devices: tuple[DeviceSeries, ...]
    loss: tuple[float, ...]
    step_ms: tuple[float, ...]
    segments: tuple[SegmentRow, ...]
    warnings: tuple[str, ...]  # errors and warnings: a desync first
    notes: tuple[str, ...] = ()  # worth knowing, not wrong: late reports, why a device is read as it is
    heatmap: Heatmap | None = None  # ranks (or nodes) x recent steps
    stragglers: tuple[StragglerRow, ...] = ()  # the ranks the others waited for longest, recently
    advice: Advice | str | None = None  # the bucket advisor's sweep, or what it still needs
    strategies: StrategyAdvice | str | None = None  # the strategy table, or what it still needs
    #: What the run's evaluations measured: (metric, the steps each followed, values) per metric
    #: (``evaluations.Evaluations.series``), drawn under the loss.
    evaluations: tuple[MetricSeries, ...] = ()
    #: The current stall as ``stalls.json`` holds it (``figures.stalls.Stall.as_dict``), and in
    #: words (``wording.stall_text``); None and "" while the run is not stalled.
    stall: dict[str, Any] | None = None
    stall_text: str = ""
