"""When a run stalls, how long, and what holds it: the session's record of its stalls.

A run is stalled once no rank has finished a step for ``stalls.stall_after_s`` (three times the
segment's p95 step, at least 3 s), on the session's clock, so that a replay names the same stalls
at the same moments as the live run did. The verdict (``stalls.classify``) is taken again at
every look while the stall lasts: the ranks' probes arrive a heartbeat apart, and a verdict
may sharpen as they do, and its waits grow (``changes`` counts each look that named, updated
or ended a stall, for whoever writes it out). A stall
ends when a step is finished again; a marked pause or a compile is no stall at all.
"""

from __future__ import annotations

from typing import Any

from ddpwatch.figures.order_statistics import percentiles_and_median_interval
from ddpwatch.figures.stalls import RankView, Stall, classify, excused, stall_after_s
from ddpwatch.ingest.rank_liveness import RankLiveness
from ddpwatch.ingest.segments import Segment

LOOK_EVERY_S = 0.5  # at most this often on the session's clock: a look pairs every rank's probe


class StallWatch:
    """The stalls of one session, oldest first; the last is ``current`` while it lasts."""

    def __init__(self, liveness: RankLiveness, segments: list[Segment]) -> None:
        self._liveness = liveness
        self._segments = segments
        self.stalls: list[Stall] = []
        self.changes = 0  # bumped at every stall named, changed or ended
        self._looked_at = float("-inf")

    @property
    def current(self) -> Stall | None:
        return self.stalls[-1] if self.stalls and self.stalls[-1].ended_at is None else None

    def p95_step_s(self) -> float | None:
        """The newest segment's p95 step, over its folded steps (None before any)."""
        folded = self._segments[-1].folded if self._segments else None
        if folded is None:
            return None
        walls_ms = folded.overall.walls_ms.values()
        return percentiles_and_median_interval(walls_ms, (95,))[0][0] / 1000.0 if len(walls_ms) else None

    def look(self, now: float, force: bool = False) -> None:
        """Name, update or end the current stall from what the ranks last said (at most every
        ``LOOK_EVERY_S`` unless ``force``); ranks that said goodbye take no part."""
        if not force and self._looked_at <= now < self._looked_at + LOOK_EVERY_S:
            return  # (a clock read before the last look's, another caller's, looks again)
        self._looked_at = now
        training = {r: state for r, state in self._liveness.ranks.items() if state.hello is not None and state.goodbye is None}
        stepped = [state.last_step_at for state in training.values() if state.last_step > 0]
        current = self.current
        if not training or len(stepped) < len(training):  # before every rank's first step: a start, not a stall
            if current is not None and not training:
                self._end(current, now)
            return
        since = max(stepped)
        if current is not None and since > current.since:
            self._end(current, since)
            current = None
        views = {r: RankView(state.phase, state.probe, self._liveness.status(r, now) == "lost", state.pausing)
                 for r, state in training.items()}
        if now - since < stall_after_s(self.p95_step_s()) or excused(views):
            return
        verdict = classify(views)
        probes = {r: state.probe for r, state in training.items() if state.probe is not None}
        phases = {r: state.phase for r, state in training.items() if state.phase}
        step = max((state.probe.in_step for state in training.values() if state.probe is not None), default=0) \
            or max(state.last_step for state in training.values()) + 1
        if current is not None:
            current.looked_at = now
        if current is None:
            self.stalls.append(Stall(step, since, now, verdict, probes, phases))
            self.changes += 1
        else:  # its waits and stalled time grow at every look, whether or not the verdict sharpened
            current.verdict, current.probes, current.phases, current.step = verdict, probes, phases, step
            self.changes += 1

    def step_finished(self, now: float) -> None:
        """A rank finished a step at ``now``: the current stall, if any, ends then (said at once,
        not at the next look: the run may end a moment later)."""
        current = self.current
        if current is not None:
            self._end(current, now)

    def _end(self, stall: Stall, at: float) -> None:
        stall.ended_at = at
        self.changes += 1

    def as_list(self) -> list[dict[str, Any]]:
        return [stall.as_dict() for stall in self.stalls]

