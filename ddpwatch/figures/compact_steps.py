"""Compact forms of what a session keeps for long: a rank's reported steps as runs, a report's
spans as plain tuples, the tag sequences every rank and step share. At 64 to 1,024 ranks these
are most of the dashboard's memory and of what its cycle collector would otherwise scan."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from sys import intern
from typing import overload

from instrumented_ddp.wire.messages import Span

MAX_TAG_SEQUENCES = 256  # distinct all-reduce tag sequences shared before starting over (see ``TagSequences``)


class StepSet:
    """The steps one rank has reported, as sorted runs of consecutive steps.

    A true duplicate must be told from a late report even after the session forgot the step, and a
    rank reports its steps nearly in order, so a long run is a handful of runs, not a set of
    every step number.
    """

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[list[int]] = []  # [first, last], sorted, disjoint, never adjacent

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        index = bisect.bisect_right(self._runs, [step, float("inf")]) - 1
        return index >= 0 and self._runs[index][0] <= step <= self._runs[index][1]

    def add(self, step: int) -> None:
        index = bisect.bisect_right(self._runs, [step, float("inf")])  # runs before it start at or before step
        before = self._runs[index - 1] if index > 0 else None
        after = self._runs[index] if index < len(self._runs) else None
        if before is not None and before[0] <= step <= before[1]:
            return
        if before is not None and before[1] == step - 1:
            before[1] = step
            if after is not None and after[0] == step + 1:
                before[1] = after[1]
                del self._runs[index]
        elif after is not None and after[0] == step + 1:
            after[0] = step
        else:
            self._runs.insert(index, [step, step])

    def forget_below(self, step: int) -> None:
        """Drop the steps before ``step``: a listener that no longer keeps them has no use for
        them, and sampled steps' spans (one run every 25th step) would otherwise grow without
        bound over a long run."""
        index = bisect.bisect_left(self._runs, [step, -1])
        del self._runs[:max(index - 1, 0)]
        if self._runs and self._runs[0][1] < step:
            del self._runs[0]
        elif self._runs and self._runs[0][0] < step:
            self._runs[0][0] = step

    @property
    def runs(self) -> int:
        return len(self._runs)

    def ranges(self) -> list[tuple[int, int]]:
        """The steps as sorted (first, last) runs."""
        return [(first, last) for first, last in self._runs]

    def __len__(self) -> int:
        return sum(last - first + 1 for first, last in self._runs)


class PackedSpans(Sequence[Span]):
    """A kept report's spans as plain tuples, handed out as ``Span`` on reading.

    Python's cycle collector can stop tracking a plain tuple of numbers and strings, but never a
    named tuple. A large job's dashboard keeps hundreds of thousands of spans: tracked, every full
    collection would scan them all and drop frames; plain, they cost it nothing.
    """

    __slots__ = ("_rows",)
    _rows: tuple[tuple[str, float, float, bool, int, str, str], ...]  # Span's fields, in order

    def __init__(self, spans: Iterable[Span]) -> None:
        if isinstance(spans, PackedSpans):  # packed already (by the dashboard's receiver process)
            self._rows = spans._rows
            return
        # Kinds, tags and dtypes repeat in every report of every rank: one string object each.
        self._rows = tuple([(intern(kind), start, end, blocking, nbytes, intern(tag), intern(dtype))
                            for kind, start, end, blocking, nbytes, tag, dtype in spans])

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> Span: ...
    @overload
    def __getitem__(self, index: slice) -> list[Span]: ...
    def __getitem__(self, index: int | slice) -> Span | list[Span]:
        if isinstance(index, slice):
            return [Span._make(row) for row in self._rows[index]]
        return Span._make(self._rows[index])

    def __iter__(self) -> Iterator[Span]:
        return map(Span._make, self._rows)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"PackedSpans({list(self)!r})"


NO_SPANS = PackedSpans(())


class TagSequences:
    """One tuple for every rank and step that issued the same calls: a 1,024-rank job's 300 tags
    would otherwise be held 1,024 times a step, pairing calls across ranks then compares a tuple
    with itself, and the dashboard's receiver process pickles a batch's shared tuple once.
    Bounded: a job issues few distinct sequences of calls."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[str, ...], tuple[str, ...]] = {}

    def shared(self, tags: Sequence[str]) -> tuple[str, ...]:
        tags = tuple(tags)
        shared = self._known.setdefault(tags, tags)
        if len(self._known) > MAX_TAG_SEQUENCES:
            self._known.clear()
        return shared
