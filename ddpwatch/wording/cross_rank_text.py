"""The straggler, the desync and all-reduce groups that contradict each other, in words: the one
sentence each that the dashboard's warnings and summary.md both print. The figures are
``figures.cross_rank``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def straggler_text(rank: int, first_step: int, last_step: int, waited_ms_per_step: float, share_pct: float) -> str:
    """A rank the others kept waiting for, over which steps, and by how much."""
    return (f"rank {rank} is a straggler: over steps {first_step}-{last_step} the others waited "
            f"{waited_ms_per_step:.1f} ms a step for it ({share_pct:.0f}% of step time)")


def desync_text(first_step: int, last_step: int, steps: int, kind: str, first_counts: Mapping[int, int],
                last_counts: Mapping[int, int]) -> str:
    """Desynchronised steps from ``first_step`` to ``last_step`` (``steps`` of them): the
    collective ``kind`` whose counts differ, and each rank's count at the first and the last."""
    name = kind.replace("_", "-")
    if first_step == last_step:
        return f"DESYNC at step {first_step}: the ranks issued different {name} counts ({counts_text(first_counts)})"
    return (f"DESYNC at steps {first_step}-{last_step} ({steps} steps): the ranks issued different "
            f"{name} counts (step {first_step}: {counts_text(first_counts)}; "
            f"step {last_step}: {counts_text(last_counts)})")


def counts_text(calls_per_rank: Mapping[int, int]) -> str:
    """``rank 0: 3, rank 1: 2``, by rank."""
    return ", ".join(f"rank {r}: {n}" for r, n in sorted(calls_per_rank.items()))


def overlapping_groups_text(rank: int, first: Sequence[int], second: Sequence[int]) -> str:
    """Why the ranks' hellos' all-reduce groups are not used: ``rank`` is in two of them."""
    return (f"the ranks' hellos name all-reduce groups that overlap (rank {rank} in "
            f"{{{', '.join(map(str, first))}}} and {{{', '.join(map(str, second))}}}): "
            "waits and busbw are figured over every rank")
