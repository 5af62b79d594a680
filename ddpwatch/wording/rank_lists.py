"""Many ranks said in one short line: ``0-3, 17, 45-47, … (+12 more)``.

A warning about 300 of 1,024 ranks must fit on one line and still say which: runs of consecutive
ranks collapse to a range, and past ``limit`` pieces the rest is counted, not listed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

FEW_RANKS = 3  # up to this many, a warning is said once per rank


def step_range_text(low: int, high: int) -> str:
    """``step 6``, or ``steps 5-6``: where ranks were, from the earliest to the latest."""
    return f"step {low}" if low == high else f"steps {low}-{high}"


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


def rank_list(ranks: Collection[int]) -> str:
    """``rank 1``, or ``ranks 0-2, 5`` (``ranks_text``)."""
    return f"rank {next(iter(ranks))}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"


def runs_text(runs: list[tuple[int, int]], limit: int = 8) -> str:
    """Sorted (first, last) runs, of ranks or of steps, said as ``ranks_text`` says ranks."""
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return ", ".join(shown) + (f", … (+{rest} more)" if rest else "")


def failed_ranks_lines(failures: dict[int, tuple[int, str]], first: int | None = None) -> list[str]:
    """Ranks whose goodbye said their training failed, ``{rank: (steps done, why)}``: a line each
    for a few, one line for many (a dead peer fails every other rank's next collective too).
    ``first``: the rank whose failure was heard first (``Session.first_failed_rank``), named
    first: one rank's out-of-memory error makes every other rank's next collective fail on a
    dead peer, so the most common reason is the consequence and the first one the cause."""
    first = first if first in failures and len(failures) > 1 else None
    if len(failures) <= FEW_RANKS:
        said_first = [f"rank {first} failed first, after step {failures[first][0]}: {failures[first][1]}"] if first is not None else []
        return said_first + [f"rank {rank} failed after step {steps}: {why}"
                             for rank, (steps, why) in sorted(failures.items()) if rank != first]
    reasons = Counter(why for _, why in failures.values())
    steps = [steps for steps, _ in failures.values()]
    after = step_range_text(min(steps), max(steps))
    line = f"{len(failures)} ranks failed after {after}: ranks {ranks_text(failures)}"
    commonest = reasons.most_common(1)[0][0]
    if first is None:
        return [f"{line}; most often: {commonest}"]
    first_steps, first_why = failures[first]
    then = f"; then most often: {commonest}" if commonest != first_why else ""
    return [f"{line}; first rank {first}, after step {first_steps}: {first_why}{then}"]


def lost_ranks_lines(silent: dict[int, float]) -> list[str]:
    """Ranks nothing has been heard from past ``rank_liveness.LOST_AFTER_S``, ``{rank: seconds silent}``:
    a line each for a few, one line for many (a node gone takes eight at once)."""
    if len(silent) <= FEW_RANKS:
        return [f"rank {rank} lost: nothing heard from it for {s:.1f} s" for rank, s in sorted(silent.items())]
    return [f"{len(silent)} ranks lost: nothing heard from them for {min(silent.values()):.0f}-"
            f"{max(silent.values()):.0f} s: ranks {ranks_text(silent)}"]


def held_by_lost_lines(held: dict[int, int], lost: dict[int, float], heard: float) -> list[str]:
    """One line for the live ranks that lost ranks hold in a collective (``Session.ranks_held_by_lost``:
    ``{rank: step it is at}``, and ``{lost rank: when last heard}``), at ``heard``: still
    heartbeating, so not lost, but passing no step; read as a slow step, the job would look alive
    until the process group's timeout."""
    if not held or not lost:
        return []
    who = f"rank {next(iter(held))} has" if len(held) == 1 else f"{len(held)} ranks ({ranks_text(held)}) have"
    them = rank_list(lost)
    steps = sorted(set(held.values()))
    return [f"{who} passed no step since {them} went silent {heard - min(lost.values()):.0f} s ago (at "
            f"{step_range_text(steps[0], steps[-1])}): waiting for {'it' if len(lost) == 1 else 'them'} in a collective, "
            "until the process group's timeout (by default 10 min on NCCL, 30 min on gloo) unless the launcher stops the job"]


def interrupted_ranks_lines(interruptions: dict[int, tuple[int, str]]) -> list[str]:
    """Ranks whose goodbye said a signal stopped them, ``{rank: (steps done, which signal)}``: a
    line per signal (one, at the usual Ctrl-C or torchrun's stop of every rank), its ranks and
    steps in short. Not a failure: the run was stopped, not broken, and no rank is its cause."""
    lines = []
    for signal in sorted(set(why for _, why in interruptions.values())):
        ranks = {rank: steps for rank, (steps, why) in interruptions.items() if why == signal}
        low, high = min(ranks.values()), max(ranks.values())
        after = step_range_text(low, high)
        who = rank_list(ranks)
        lines.append(f"{who} interrupted after {after}: {signal}")
    return lines


def detached_ranks_lines(detachments: dict[int, tuple[int, str]]) -> list[str]:
    """Ranks whose goodbye said ddpwatch stopped watching them while they trained on,
    ``{rank: (steps done, why)}``: a line per reason, its ranks and steps in short. Not a fault
    of the training: its steps after those are not in the figures."""
    lines = []
    for why in sorted(set(why for _, why in detachments.values())):
        ranks = {rank: steps for rank, (steps, said) in detachments.items() if said == why}
        after = step_range_text(min(ranks.values()), max(ranks.values()))
        who = rank_list(ranks)
        lines.append(f"{who} no longer watched after {after}, training on unwatched: {why}")
    return lines


def heard_until_text(last_steps: dict[int, int]) -> str:
    """Ranks and the last step each was heard at, ``{rank: step}``, in short: ``rank 3 (last heard
    at step 6)``, ``8 ranks (0-7; last heard at steps 5-6)``. Said of ranks a record ends without
    a goodbye from: where each was is all it holds of them."""
    low, high = min(last_steps.values()), max(last_steps.values())
    at = step_range_text(low, high)
    if len(last_steps) == 1:
        return f"rank {next(iter(last_steps))} (last heard at {at})"
    return f"{len(last_steps)} ranks ({ranks_text(last_steps)}; last heard at {at})"
