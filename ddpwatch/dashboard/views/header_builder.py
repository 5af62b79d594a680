"""The header's part of a snapshot: which run, its strategy, its progress and its recent rate."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddpwatch.dashboard.views.snapshot_parts import RATE_STEPS, SEGMENT_REFRESH_S, HeaderData
from ddpwatch.dashboard.views.step_digest import StepDigest
from ddpwatch.figures import metrics
from ddpwatch.figures.watch_overhead import WatchOverhead
from ddpwatch.ingest.session import Session


@dataclass
class HeaderBuilder:
    """Makes the ``HeaderData`` of a frame; keeps the rate and the clock alignment it is read on."""

    session: Session
    _rate: tuple[float, tuple[StepDigest, ...], tuple[float | None, float | None]] = (0.0, (), (None, None))  # (made at, from, result)
    _rate_clocks: tuple[int, metrics.ClockAlignment, set[int]] | None = None  # (window, its alignment, steps in it)
    _overhead: tuple[tuple[int, int, int, int], WatchOverhead | None] = ((-1, -1, -1, -1), None)  # (asked of, answer)

    def header(self, step: int | None, following: bool, trend: list[StepDigest], now: float) -> HeaderData:
        session = self.session
        hello = next((s.hello for _, s in sorted(session.ranks.items()) if s.hello), None)
        current = session.segments[-1] if session.segments else None
        strategy = current.strategy if current else (hello.strategy if hello else "—")
        settings = current.label.removeprefix(strategy).strip(" ()") if current else ""
        rate, step_s = self._recent_rate(trend, now)
        total = hello.total_steps if hello else 0
        done = max((s.last_step for s in session.ranks.values()), default=0)
        eta = (total - done) * step_s if step_s and total else None
        return HeaderData(session.session_id or "waiting for a run…", session.world_size, strategy, settings,
                          step or 0, total, eta, rate, following, hello.switchable if hello else True, session.finished,
                          bool(session.failed_ranks), bool(session.interrupted_ranks),
                          watch_overhead=self._watch_overhead())

    def _watch_overhead(self) -> WatchOverhead | None:
        """The current segment's ``Session.watch_overhead``, remade only when a report changed it."""
        session = self.session
        if not session.segments:
            return None
        current = session.segments[-1]
        asked = (current.index, current.first_step, current.last_step, session.overhead_pairing.version)
        if asked != self._overhead[0]:
            self._overhead = (asked, session.watch_overhead(current))
        return self._overhead[1]

    def _recent_rate(self, trend: list[StepDigest], now: float, window: int = RATE_STEPS) -> tuple[float | None, float | None]:
        """Global samples/s and seconds per step over the last ``window`` complete steps (None and
        None before two of them: no rate is shown as if measured), the samples over the wall time
        from the first one's start to the last one's end, ranks on one clock
        (``metrics.ClockAlignment``, as the segments' samples/s, offsets over the last ``window``
        steps), so the time between steps counts but the loop's pauses of training in it (an
        evaluation) do not, the least any rank paused, as there; the seconds per step, for the
        ETA, keep them (they will recur). Remade when those steps changed, at most once a second
        (like the running segment's figures); each step is aligned once, when it first enters
        the window."""
        complete = tuple(s for s in trend[-window:] if s.ranks >= self.session.world_size)
        made_at, made_from, result = self._rate
        same = len(made_from) == len(complete) and all(a is b for a, b in zip(made_from, complete, strict=True))
        if same or (result[1] is not None and now - made_at < SEGMENT_REFRESH_S):
            return result
        result = (None, None)
        if len(complete) >= 2:
            if self._rate_clocks is None or self._rate_clocks[0] != window:
                self._rate_clocks = (window, metrics.ClockAlignment(keep=window), set())
            _, clocks, aligned = self._rate_clocks
            for digest in complete:
                if digest.step not in aligned:
                    clocks.add_step(digest.times)
                    aligned.add(digest.step)
            aligned.intersection_update(range(complete[0].step, complete[-1].step + 1))
            offsets = clocks.offsets()
            starts = [t.start + offsets[r] for r, t in complete[0].times.items() if r in offsets and math.isfinite(t.start)]
            ends = [t.end + offsets[r] for r, t in complete[-1].times.items() if r in offsets and math.isfinite(t.end)]
            wall = max(ends) - min(starts) if starts and ends else 0.0
            paused = min((sum(s.times[r].paused for s in complete[1:] if r in s.times) for r in offsets), default=0.0)
            if wall - paused > 0:
                unwatched = sum(samples for step, samples in self.session.unwatched_samples.items()
                                if complete[0].step < step < complete[-1].step)  # their time is in the wall too
                result = ((sum(s.samples for s in complete) + unwatched) / (wall - paused), wall / len(complete))
        self._rate = (now, complete, result)
        return result
