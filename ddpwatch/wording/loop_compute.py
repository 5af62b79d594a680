"""The compute a loop marked as its own (``watch.computing``: an average of the weights, a
teacher's forward), in words: what it is and what it costs a step.

Why: unmarked, that work reads as data loading (before a forward) or idle time (between a
forward and its backward); marked, it is compute, and the next question is what it costs beside
the step. Pure: a segment's figures in, a line out; the dashboard's notes and summary.md say the
same line.
"""

from __future__ import annotations

from collections.abc import Sequence


def loop_compute_text(segment: str, loop_compute_ms: float, names: Sequence[str], step_ms_p50: float) -> str | None:
    """The line for ``segment`` (its name as the reader knows it), or None where it marked none.
    ``loop_compute_ms``: a step's on a rank, the mean (``Figures.loop_compute_ms``); ``names``:
    what the loop said it computed (``Figures.loop_computed``)."""
    if loop_compute_ms <= 0:
        return None
    named = f" ({', '.join(names)})" if names else ""
    return (f"{segment}: the loop's own compute, marked with watch.computing{named}: {loop_compute_ms:.1f} ms a step "
            f"(mean of ranks) of a {step_ms_p50:.0f} ms step (p50), in Compute%, not data loading")
