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

The ``canonical_*`` twins take canonical input (any function's output here) and skip the
merge the public functions begin with: a step's figures chain a dozen of these operations,
and re-canonicalising what is canonical already would be most of their cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import chain

TimeRange = tuple[float, float]

__all__ = ["TimeRange", "canonical_clip", "canonical_intersect", "canonical_length", "canonical_subtract", "clip",
           "intersect", "merge", "subtract", "total_length", "union"]


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
    return canonical_length(merge(ranges))


def canonical_length(ranges: list[TimeRange]) -> float:
    """``total_length`` of canonical ranges."""
    return sum([end - start for start, end in ranges])


def union(*groups: Iterable[TimeRange]) -> list[TimeRange]:
    return merge(chain.from_iterable(groups))


def intersect(a: Iterable[TimeRange], b: Iterable[TimeRange]) -> list[TimeRange]:
    """Time covered by both; a two-pointer sweep keeps it linear in the number of spans."""
    return canonical_intersect(merge(a), merge(b))


def canonical_intersect(left: list[TimeRange], right: list[TimeRange]) -> list[TimeRange]:
    """``intersect`` of canonical ranges."""
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
    return canonical_subtract(merge(a), merge(b))


def canonical_subtract(keep: list[TimeRange], cut: list[TimeRange]) -> list[TimeRange]:
    """``subtract`` of canonical ranges."""
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


def canonical_clip(ranges: list[TimeRange], lo: float, hi: float) -> list[TimeRange]:
    """``clip`` of canonical ranges: trimming only shortens the first and last range kept, so
    what remains is canonical without a merge."""
    if not lo < hi:  # empty, reversed or NaN
        return []
    return [(s if s > lo else lo, e if e < hi else hi) for s, e in ranges if s < hi and e > lo]
