"""Many ranks said in one short line: ``0-3, 17, 45-47, … (+12 more)``.

A warning about 300 of 1,024 ranks must fit on one line and still say which: runs of consecutive
ranks collapse to a range, and past ``limit`` pieces the rest is counted, not listed.
"""

from __future__ import annotations

from collections import Counter
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


def failed_ranks_lines(failures: dict[int, tuple[int, str]]) -> list[str]:
    """Ranks whose goodbye said their training failed, ``{rank: (steps done, why)}``: a line each
    for a few, one line for many (a dead peer fails every other rank's next collective too), with
    the most common reason."""
    if len(failures) <= FEW_RANKS:
        return [f"rank {rank} failed after step {steps}: {why}" for rank, (steps, why) in sorted(failures.items())]
    reasons = Counter(why for _, why in failures.values())
    steps = [steps for steps, _ in failures.values()]
    after = f"step {min(steps)}" if min(steps) == max(steps) else f"steps {min(steps)}-{max(steps)}"
    return [f"{len(failures)} ranks failed after {after}: ranks {ranks_text(failures)}; "
            f"most often: {reasons.most_common(1)[0][0]}"]
