"""A bounded, uniform sample of floats: what a segment's step-time percentiles and median
bandwidths are taken over, in memory that does not grow with the run. Pure."""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Iterable

import numpy as np

RESERVOIR = 4096  # step times and bandwidths kept per segment for percentiles: memory stays bounded


class FloatReservoir:
    """A uniform sample of at most ``size`` of the values added, as C doubles, for an order-free
    statistic (a median, a percentile) over all of them: the k-th value added is kept with
    probability size/k, in the place of one held (Algorithm R), so every value has the same
    chance. Uniform, not the last ``size`` values: a step's bandwidths are added rank by rank,
    and the last ones would be the last few ranks'. C doubles, not a deque of Python floats,
    which takes four times the memory. Seeded, so the same values give the same figures (a
    replay, its exports). Holds every value, in order, until it is full; grows as filled."""

    def __init__(self, size: int = RESERVOIR) -> None:
        self.size = size
        self._values = np.empty(min(size, 64))
        self._count = 0  # values ever added
        self._random: random.Random | None = None  # made once full: most never fill
        self._weight = 1.0  # Algorithm L's, once full
        self._next_kept = 0  # the index, among every value added, of the next one kept once full

    def __len__(self) -> int:
        return min(self._count, self.size)

    def append(self, value: float) -> None:
        """One value, written in place where the buffer has room: each rank's step time, 2,048 a
        step at 1,024 ranks."""
        if self._count < len(self._values):
            self._values[self._count] = value
            self._count += 1
        else:
            self.extend((value,))

    def extend(self, values: Iterable[float]) -> None:
        """``values`` in order; an ``array('d')`` (a step's bandwidths) is read as the buffer it is.
        Once full, Algorithm L: the distance to the next value kept is drawn at once, so values
        passed over cost nothing."""
        new = np.asarray(values, dtype=float) if isinstance(values, array) else np.fromiter(values, dtype=float)
        if not len(new):
            return
        held = len(self)
        if held + len(new) > len(self._values) and len(self._values) < self.size:  # grow
            grown = np.empty(min(self.size, max(2 * len(self._values), held + len(new))))
            grown[:held] = self._values[:held]
            self._values = grown
        room = min(len(new), self.size - held)
        self._values[held:held + room] = new[:room]
        self._count += room
        if room == len(new):
            return
        if self._random is None:  # just full: the first value to keep after it
            self._random, self._weight, self._next_kept = random.Random(0), 1.0, self.size - 1
            self._draw_next_kept()
        end = self._count + len(new) - room
        while self._next_kept < end:
            self._values[self._random.randrange(self.size)] = new[room + self._next_kept - self._count]
            self._draw_next_kept()
        self._count = end

    def _draw_next_kept(self) -> None:
        """Algorithm L's step (Li, 1994): the weight shrinks by a factor drawn as the largest of
        ``size`` uniforms, and the values until the next one kept are geometric in it."""
        assert self._random is not None
        self._weight *= math.exp(math.log(1.0 - self._random.random()) / self.size)
        skip = math.floor(math.log(1.0 - self._random.random()) / math.log1p(-self._weight)) if self._weight < 1.0 else 0
        self._next_kept += skip + 1

    def values(self) -> np.ndarray:
        """The values held: every one added, in order, until it is full; then a uniform sample."""
        return self._values[:len(self)].copy()
