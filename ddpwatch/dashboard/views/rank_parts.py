"""The per-rank parts of a snapshot: the ranks table's rows and each rank's device series.

Each is kept while nothing it shows changes, and a large job's (above ``SMALL_JOB_MAX_RANKS``
ranks) are remade at most every ``LARGE_JOB_ROWS_REFRESH_S``: most of a large job's ranks show
the same from one frame to the next.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ddpwatch.dashboard.views.rank_rows import RankRow, rows_by_node
from ddpwatch.dashboard.views.snapshot_parts import (DEVICE_REFRESH_S, LARGE_JOB_ROWS_REFRESH_S, SMALL_JOB_MAX_RANKS,
                                                     TREND_POINTS, DeviceSeries)
from ddpwatch.ingest.session import Session
from ddpwatch.wording.figure_text import held_text
from instrumented_ddp.wire.step_figures import StepFigures


@dataclass
class _KeptSeries:
    """A rank's device series as last made, and how many samples it had taken in."""
    key: str  # the reading drawn: GPU utilization, or process CPU where there is no GPU
    values: deque[float]
    received: int = 0
    made_at: float = -math.inf
    series: DeviceSeries | None = None


@dataclass
class RankPartsBuilder:
    """Makes the ranks table's rows and the devices tab's series; keeps what they were made from."""

    session: Session
    _devices: dict[int, _KeptSeries] = field(default_factory=dict)
    _rank_rows: dict[int, tuple[tuple[Any, ...], RankRow]] = field(default_factory=dict)  # rank -> (what it showed, row)
    _ranks_made: tuple[float, Any, tuple[RankRow, ...]] = (0.0, None, ())  # (made at, (step, nodes opened), rows)
    _devices_made: tuple[float, tuple[DeviceSeries, ...]] = (0.0, ())  # (made at, series): large jobs

    def rows(self, step: int | None, figures: dict[int, StepFigures], waits: dict[int, float],
             open_nodes: Collection[int], now: float, heard: float, recording_ended: bool) -> tuple[RankRow, ...]:
        """A row per rank up to ``SMALL_JOB_MAX_RANKS`` ranks; above, a row per node, its ranks'
        rows below it where the user opened it (``rank_rows.rows_by_node``), remade at most
        every ``LARGE_JOB_ROWS_REFRESH_S``."""
        large = len(self.session.ranks) > SMALL_JOB_MAX_RANKS
        made_at, made_for, kept = self._ranks_made
        view = (step, frozenset(open_nodes))
        if large and made_for == view and now - made_at < LARGE_JOB_ROWS_REFRESH_S:
            return kept
        rows = tuple(self._rank_row(rank, figures.get(rank), waits.get(rank), heard, recording_ended)
                     for rank in sorted(self.session.ranks))
        if not large:
            return rows
        grouped = rows_by_node(rows, open_nodes)
        self._ranks_made = (now, view, grouped)
        return grouped

    def _rank_row(self, rank: int, figures: StepFigures | None, waited_s: float | None, heard: float,
                  recording_ended: bool) -> RankRow:
        """Kept while nothing it shows changed: in a large job most rows are the same from one
        frame to the next. Its figures and hello are compared by identity (a new step's
        figures, a repeated hello: made anew), since comparing them field by field costs more
        than making the row."""
        state = self.session.ranks[rank]
        hello = state.hello
        status = self.session.status(rank, heard, recording_ended)
        key = (figures, hello, (waited_s, status, state.devices_received, state.last_step,
                                state.sender_dropped + state.lost_messages, state.memory_step))
        kept = self._rank_rows.get(rank)
        if kept is not None and kept[0][0] is figures and kept[0][1] is hello and kept[0][2] == key[2]:
            return kept[1]
        sample = state.devices[-1] if state.devices else None
        utilization, memory = describe_device(sample.readings if sample else {}, sample.kind if sample else "")
        row = RankRow(
            rank=rank, node=hello.node_rank if hello else None, host=hello.host if hello else "?", device=hello.device if hello else "?",
            status=status, step=state.last_step,
            step_ms=figures.step_ms if figures else None, compute_pct=figures.compute_pct if figures else None,
            non_compute_pct=figures.non_compute_pct if figures else None, overlap_pct=figures.overlap_pct if figures else None,
            waited_ms=waited_s, utilization=utilization, memory=memory,
            dropped=state.sender_dropped + state.lost_messages, held=held_text(state.memory),
        )
        self._rank_rows[rank] = (key, row)
        return row

    def device_series(self, now: float) -> tuple[DeviceSeries, ...]:
        """Every rank's series; a large job's remade at most every ``LARGE_JOB_ROWS_REFRESH_S``."""
        ranks = sorted(self.session.ranks)
        made_at, kept = self._devices_made
        if len(ranks) > SMALL_JOB_MAX_RANKS and len(kept) == len(ranks) and now - made_at < LARGE_JOB_ROWS_REFRESH_S:
            return kept
        series = tuple(self._device_series(rank, now) for rank in ranks)
        self._devices_made = (now, series)
        return series

    def _device_series(self, rank: int, now: float) -> DeviceSeries:
        """Remade when the rank sent a new sample, at most every ``DEVICE_REFRESH_S``, from the
        samples new since the last time: a rank samples at 5 Hz, and remaking every series every
        frame, or from all its points, would take a large job's frames."""
        state = self.session.ranks[rank]
        kept = self._devices.get(rank)
        if kept is not None and kept.series is not None and (kept.received == state.devices_received
                                                             or now - kept.made_at < DEVICE_REFRESH_S):
            return kept.series
        devices = state.devices
        gpu = bool(devices) and devices[-1].kind == "gpu"
        key = "gpu_util_pct" if gpu else "process_cpu_pct"
        if kept is None or kept.key != key:
            kept = self._devices[rank] = _KeptSeries(key, deque(maxlen=TREND_POINTS))
        new = min(state.devices_received - kept.received, TREND_POINTS, len(devices))
        for sample in list(islice(reversed(devices), new))[::-1]:
            if key in sample.readings:
                kept.values.append(sample.readings[key])
        kept.received, kept.made_at = state.devices_received, now
        series = kept.series = DeviceSeries(rank, "GPU util %" if gpu else "CPU % (no GPU)", tuple(kept.values))
        return series


def describe_device(readings: dict[str, float], kind: str) -> tuple[str, str]:
    """(utilization, memory) as the ranks table shows them; what is not measured is '—'."""
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
