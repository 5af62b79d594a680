"""Many ranks said in one short line: ``0-3, 17, 45-47, … (+12 more)``.

A warning about 300 of 1,024 ranks must fit on one line and still say which: runs of consecutive
ranks collapse to a range, and past ``limit`` pieces the rest is counted, not listed.
"""

from __future__ import annotations

from collections.abc import Iterable

FEW_RANKS = 3  # up to this many, a warning is said once per rank


def rank_runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, distinct ranks as (first, last) runs of consecutive ranks."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return runs


def ranks_text(ranks: Iterable[int], limit: int = 8) -> str:
    """``limit`` runs at most, then how many ranks are left unnamed."""
    return runs_text(rank_runs(ranks), limit)


def runs_text(runs: list[tuple[int, int]], limit: int = 8) -> str:
    """Sorted (first, last) runs, of ranks or of steps, said as ``ranks_text`` says ranks."""
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return ", ".join(shown) + (f", … (+{rest} more)" if rest else "")
