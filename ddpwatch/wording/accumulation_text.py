"""An accumulating step that all-reduces gradients before its last micro-step, in words: where,
how much, and what skips those all-reduces. The figures are ``figures.accumulation``'s; the
dashboard's note and summary.md say the same line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ddpwatch.wording.rank_lists import runs_text

#: What skips the early reductions, by the strategies of the steps found (``()``: any other).
#: FSDP2 (``attach`` on a sharded model, and the ``fsdp`` strategy) reduce-scatters every micro-step
#: too, which saves memory; what the note finds there is HSDP's all-reduce across replicas.
SKIPPED_BY = {
    (): "DDP's no_sync() around the others skips them",
    ("simple",): ("DDP's no_sync() around the others skips them (simple reduces in every micro-step on purpose, "
                  "the first rung of the strategy ladder; ga is simple with no_sync)"),
    ("fsdp",): ("HSDP's model.set_requires_all_reduce(False) before the others skips them, keeping the reduce-scatters "
                "(set_requires_gradient_sync(False) skips both)"),
}


def early_reductions_text(ranges: list[tuple[int, int]], figures: Mapping[str, float], strategies: Iterable[str] = ()) -> str:
    """One line: where, how much, and what skips it. ``ranges``: the steps found, as runs;
    ``figures``: ``EarlyReductions.figures()``; ``strategies``: of the steps it names (a user's
    DDP reads as ``ddp``; train.py's ``simple`` does it by design, and says so)."""
    strategies = set(strategies)
    count = sum(b - a + 1 for a, b in ranges)
    return (f"gradients were all-reduced in {figures['reducing_micro_steps']:g} of {figures['micro_steps']:g} "
            f"micro-steps a step ({count} step{'s' if count != 1 else ''}: {runs_text(ranges)}): "
            f"{figures['early_all_reduces']:g} all-reduces a step before the last micro-step, "
            f"{figures['early_all_reduce_ms']:.1f} ms of wall time ({figures['early_all_reduce_pct']:.0f} % of the step). "
            "Accumulating, only the last micro-step needs them: " + SKIPPED_BY.get(tuple(sorted(strategies)), SKIPPED_BY[()]))
