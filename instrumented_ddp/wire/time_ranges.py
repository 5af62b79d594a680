"""Arithmetic on time ranges: lists of ``(start, end)`` pairs on one clock.

Every figure ddpwatch shows is a length of some union, intersection or
difference of time ranges, so the rules for awkward input live here, once:

* Ranges are half-open ``[start, end)``.  Touching ranges therefore
  merge (``[0, 1) + [1, 2) == [0, 2)``) and never count their shared point
  twice or leave a gap of zero width in a timeline.
* Zero-length ranges are dropped: they have no measure, and keeping them
  would only leave empty slivers in the output.
* Reversed (``end < start``) and non-finite ranges are dropped, not
  swapped.  They come from clock or instrumentation faults; swapping would
  invent busy time in a place nobody measured.

Every function accepts any iterable of pairs in any order, possibly
overlapping or nested, and returns a *canonical* list: sorted, disjoint,
non-touching, positive-length ranges.  Inputs are never mutated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import chain

TimeRange = tuple[float, float]

__all__ = ["TimeRange", "clip", "intersect", "merge", "subtract", "total_length", "union"]


_INF = math.inf  # a range is usable where ``-_INF < start < end < _INF``: finite, positive in length


def merge(ranges: Iterable[TimeRange]) -> list[TimeRange]:
    """Canonicalise, so that lengths of overlapping or nested spans are never double counted."""
    ordered = sorted([(float(s), float(e)) for s, e in ranges if -_INF < s < e < _INF])
    out: list[TimeRange] = []
    for start, end in ordered:
        if out and start <= out[-1][1]:  # overlapping, nested or touching
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def total_length(ranges: Iterable[TimeRange]) -> float:
    """Wall-clock covered: merges first, so concurrent spans count once (0.0 for nothing)."""
    return sum(end - start for start, end in merge(ranges))


def union(*groups: Iterable[TimeRange]) -> list[TimeRange]:
    return merge(chain.from_iterable(groups))


def intersect(a: Iterable[TimeRange], b: Iterable[TimeRange]) -> list[TimeRange]:
    """Time covered by both; a two-pointer sweep keeps it linear in the number of spans."""
    left, right = merge(a), merge(b)
    out: list[TimeRange] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        if start < end:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[TimeRange], b: Iterable[TimeRange]) -> list[TimeRange]:
    """Time in ``a`` not covered by ``b``; a piece of ``a`` may be split into several."""
    keep, cut = merge(a), merge(b)
    out: list[TimeRange] = []
    j = 0
    for start, end in keep:
        cursor = start
        # Pieces of ``cut`` wholly before this range are before every later one too.
        while j < len(cut) and cut[j][1] <= cursor:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < end and cursor < end:
            cut_start, cut_end = cut[k]
            if cut_start > cursor:
                out.append((cursor, cut_start))
            cursor = max(cursor, cut_end)
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def clip(ranges: Iterable[TimeRange], lo: float, hi: float) -> list[TimeRange]:
    """Restrict to the window ``[lo, hi)``; an empty, reversed or NaN window yields ``[]``.

    Infinite bounds are allowed (``clip(x, -inf, inf)`` is just ``merge(x)``).
    """
    if math.isnan(lo) or math.isnan(hi) or hi <= lo:
        return []
    return merge([(max(s, lo), min(e, hi)) for s, e in ranges if -_INF < s < e < _INF])
