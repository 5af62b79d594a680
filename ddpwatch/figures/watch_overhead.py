"""What watching costs the run, measured by the run: its unwatched steps against the watched ones
around them.

Now and then every rank runs a short block of steps unwatched, timing the step's window alone
(``instrumented_ddp.timing.unwatched_blocks``). For each unwatched step of a rank, the reference
is the median wall time of that rank's counted watched steps around the block: up to
``NEIGHBOURS`` just before it and as many just after it, of the same strategy and settings. The
step's cost is reference / its wall − 1. The ranks meet at every collective, so one step's walls
agree across ranks: a step's cost is the mean of its ranks', one value per unwatched step. The
run's figure is the median of those values, with the 90 % interval of
``median_interval.median_with_interval``; a block's steps share a reference, so the interval is
a little narrower than independent steps would give.

A watched step that costs 5 ms more than it would unwatched, on 100 ms steps, reads 5 %.

Pure: the session feeds it every report's window (``Session``); the dashboard, the recorder and
the doctor read the same figure.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from instrumented_ddp.wire.median_interval import median_with_interval

#: Watched steps on each side of a block that make its reference: as many as a block holds, so a
#: block is held against the steps of its own stretch of the run, not a minute earlier.
NEIGHBOURS = 4


@dataclass(frozen=True)
class WatchOverhead:
    """What watching costs, in % of an unwatched step's wall time, and how far it is known."""

    pct: float
    interval_pct: tuple[float, float]
    unwatched_steps: int

    def as_json(self) -> dict[str, Any]:
        """``summary.json``'s ``watch_overhead``."""
        return {"pct": round(self.pct, 3), "interval_pct": [round(self.interval_pct[0], 3), round(self.interval_pct[1], 3)],
                "unwatched_steps": self.unwatched_steps}

    def sentence(self) -> str:
        """``ddpwatch costs this run 0.6 % (90 % interval -0.2 to 1.4 %), from 40 unwatched steps``."""
        low, high = self.interval_pct
        steps = f"{self.unwatched_steps} unwatched step{'s' if self.unwatched_steps != 1 else ''}"
        return f"ddpwatch costs this run {self.pct:.1f} % (90 % interval {low:.1f} to {high:.1f} %), from {steps}"

    def short(self) -> str:
        """The dashboard header's: ``ddpwatch costs 0.6 % (-0.2 to 1.4, 40 unwatched steps)``."""
        low, high = self.interval_pct
        return f"ddpwatch costs {self.pct:.1f} % ({low:.1f} to {high:.1f}, {self.unwatched_steps} unwatched steps)"


def watch_overhead_from(saved: dict[str, Any]) -> WatchOverhead:
    """``WatchOverhead.as_json``'s dict read back (``summary.json``)."""
    low, high = saved["interval_pct"]
    return WatchOverhead(float(saved["pct"]), (float(low), float(high)), int(saved["unwatched_steps"]))


SegmentKey = tuple[str, dict[str, Any]]


def segment_key(strategy: str, settings: dict[str, Any]) -> SegmentKey:
    """What a step must share with its neighbours to be held against them: its strategy and
    settings, compared with ``==`` (never hashed), so made for every report at no cost."""
    return strategy, settings


@dataclass
class _Block:
    """One rank's run of unwatched steps and the watched steps it is held against."""

    key: SegmentKey
    before: list[float]
    unwatched: list[tuple[int, float]] = field(default_factory=list)  # (step, wall)
    after: list[float] = field(default_factory=list)

    def costs(self) -> list[tuple[int, float]]:
        """(step, cost ratio) of each unwatched step; none without a watched neighbour."""
        around = self.before + self.after
        if not around:
            return []
        reference = statistics.median(around)
        return [(step, reference / wall - 1.0) for step, wall in self.unwatched if wall > 0]


class WatchOverheadPairing:
    """Each rank's recent watched walls and blocks of unwatched ones, paired into cost ratios."""

    def __init__(self) -> None:
        self._recent: dict[int, tuple[SegmentKey, deque[float]]] = {}  # rank: the key and its newest watched walls
        self._open: dict[int, _Block] = {}  # rank: its block still waiting for watched steps after it
        self._costs: dict[int, list[float]] = {}  # unwatched step: its ranks' cost ratios, from closed blocks
        #: Changes whenever ``overhead`` may answer differently: a reader caches on it.
        self.version = 0

    def add_watched(self, rank: int, step: int, wall: float, key: SegmentKey) -> None:
        """A counted watched step of ``rank``, in the order the rank sent its steps."""
        block = self._open.get(rank)
        if block is not None:
            self.version += 1
            if block.key == key:
                block.after.append(wall)
            if block.key != key or len(block.after) >= NEIGHBOURS:
                self._close(rank)
        held = self._recent.get(rank)
        if held is None or held[0] != key:
            held = (key, deque(maxlen=NEIGHBOURS))
            self._recent[rank] = held
        held[1].append(wall)

    def add_unwatched(self, rank: int, step: int, wall: float, key: SegmentKey) -> None:
        """A counted unwatched step of ``rank``: it joins the rank's open block, or begins one."""
        block = self._open.get(rank)
        if block is not None and (block.key != key or block.after):
            self._close(rank)
            block = None
        if block is None:
            held = self._recent.get(rank)
            before = list(held[1]) if held is not None and held[0] == key else []
            block = self._open[rank] = _Block(key, before)
            self._recent.pop(rank, None)  # the steps after the block begin the next one's neighbours
        block.unwatched.append((step, wall))
        self.version += 1

    def _close(self, rank: int) -> None:
        block = self._open.pop(rank)
        for step, cost in block.costs():
            self._costs.setdefault(step, []).append(cost)

    def overhead(self, first_step: int, last_step: int) -> WatchOverhead | None:
        """The cost over the unwatched steps from ``first_step`` to ``last_step`` (a segment's),
        blocks still waiting for their watched steps after them included with those they have;
        None where there is none."""
        costs = {step: list(ratios) for step, ratios in self._costs.items() if first_step <= step <= last_step}
        for block in self._open.values():
            for step, cost in block.costs():
                if first_step <= step <= last_step:
                    costs.setdefault(step, []).append(cost)
        if not costs:
            return None
        per_step = [100.0 * statistics.fmean(ratios) for ratios in costs.values()]
        pct, low, high = median_with_interval(per_step)
        return WatchOverhead(pct, (low, high), len(per_step))
