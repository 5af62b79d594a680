"""One rank's step replayed as compute on the main thread and collectives on the backend's workers:
the clock the strategy simulator (``strategy_sim``) places each strategy's calls on. Pure.

* ``compute(s)``: the main thread computes for ``s`` seconds of undisturbed compute; while a
  transfer runs beside it, at ``1 - lost_share`` of its speed (the advisor's measured slowdown:
  ``compute_slowdown``), so hiding a collective behind compute also lengthens the compute.
* ``issue(kind, nbytes)``: a collective issued now, started on the first worker free (NCCL runs a
  group's collectives one at a time, gloo two at once: ``workers``), in issue order, costing what
  the kind's model says; it returns when it ends. Issuing costs the main thread nothing.
* ``wait(end)``: the main thread blocks until ``end`` (a synchronous call, a wait for a work):
  the time it sits there is *exposed* communication.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class ReplayClock:
    """Wall time of one replayed step (see the module docstring); ``now`` is the main thread's."""

    def __init__(self, cost: Callable[[str, int], float], workers: int = 1, lost_share: float = 0.0) -> None:
        self._cost = cost
        self._free_at = [0.0] * max(1, workers)
        self.lost_share = lost_share
        self.now = 0.0
        self.exposed_s = 0.0  # time the main thread sat waiting for communication
        self.slowed_s = 0.0  # what transfers beside compute added to it
        self.calls = 0
        self.computed_s = 0.0  # undisturbed compute done so far (what ``compute`` was asked for)
        self.comm_s: dict[str, float] = {}  # each kind's total transfer time, unmerged
        self._transfers: list[tuple[float, float]] = []  # (start, end) of those that may still slow compute
        self._last_start = 0.0

    def compute(self, seconds: float) -> float:
        """Compute ``seconds`` of undisturbed compute from now; returns the new now."""
        left = max(0.0, seconds)
        self.computed_s += left
        while left > 0:
            self._transfers = [t for t in self._transfers if t[1] > self.now]
            running = self.lost_share > 0 and any(start <= self.now for start, _ in self._transfers)
            speed = 1.0 - self.lost_share if running else 1.0
            change = min((edge for start, end in self._transfers for edge in (start, end) if edge > self.now), default=math.inf)
            if self.lost_share <= 0 or self.now + left / speed <= change:
                self.slowed_s += left / speed - left
                self.now += left / speed
                left = 0.0
            else:
                done = (change - self.now) * speed
                self.slowed_s += (change - self.now) - done
                left -= done
                self.now = change
        return self.now

    def issue(self, kind: str, nbytes: int) -> float:
        """A collective of ``kind`` moving ``nbytes`` issued now; when it ends. Collectives start in
        the order issued, each on the first worker free."""
        free = heapq.heappop(self._free_at)
        start = max(self.now, free, self._last_start)
        end = start + self._cost(kind, nbytes)
        heapq.heappush(self._free_at, end)
        self._last_start = start
        self.calls += 1
        self.comm_s[kind] = self.comm_s.get(kind, 0.0) + (end - start)
        if self.lost_share > 0 and end > start:
            self._transfers.append((start, end))
        return end

    def wait(self, end: float) -> float:
        """Block the main thread until ``end``; returns the new now."""
        if end > self.now:
            self.exposed_s += end - self.now
            self.now = end
        return self.now

    def compute_to(self, origin_s: float, compute_s: float) -> float:
        """Compute on until ``compute_s`` has been done since ``computed_s`` read ``origin_s`` (a
        phase replayed from its marks: each gradient ready ``compute_s`` into backward), or stay
        where that is done already."""
        behind = origin_s + compute_s - self.computed_s
        return self.compute(behind) if behind > 0 else self.now

    def call(self, kind: str, nbytes: int) -> float:
        """A synchronous collective: issued now and waited for."""
        return self.wait(self.issue(kind, nbytes))
