"""ddpwatch.figures.accumulation: an accumulating step's all-reduces before its last micro-step, hand-worked."""

import pytest

from ddpwatch.figures.accumulation import EarlyReductions, MicroStepReduction, micro_step_reduction
from instrumented_ddp.wire.messages import Span

MS = 1e-3


def spans(forwards: list[float], all_reduces: list[tuple[float, float]], end: float) -> list[Span]:
    """A step in ms: each forward 2 ms, a backward after it, the all-reduces given, the optimizer ending at ``end``."""
    made = [Span("data", 0.0, forwards[0] * MS)]
    for begins in forwards:
        made += [Span("forward", begins * MS, (begins + 2) * MS), Span("backward", (begins + 2) * MS, (begins + 6) * MS)]
    made += [Span("all_reduce", a * MS, b * MS, tag=f"b{i}") for i, (a, b) in enumerate(all_reduces)]
    return [*made, Span("optimizer", (end - 2) * MS, end * MS)]


def test_a_step_reducing_in_every_micro_step_is_read_whole() -> None:
    """Micro-steps begin at 1, 11 and 21 ms. All-reduces 4-7 and 5-8 (the first), 14-16 (the
    second), 24-27 (the last). Before the last forward (21 ms): three, whose wall time merges to
    4-8 and 14-16: 4 + 2 = 6 ms. Every micro-step reduced: 3. The step: 0 to 30 ms."""
    reduction = micro_step_reduction(spans([1, 11, 21], [(4, 7), (5, 8), (14, 16), (24, 27)], end=30))
    assert reduction is not None
    assert reduction.micro_steps == 3 and reduction.reducing == 3 and reduction.early_calls == 3
    assert reduction.early_s == pytest.approx(6 * MS) and reduction.step_s == pytest.approx(30 * MS)


def test_a_reduction_belongs_to_the_micro_step_it_started_in() -> None:
    """An all-reduce started at 10 ms, in the first micro-step, ends at 13, inside the second (11 ms
    on): it is the first's, and the second, which started none, is not reducing: 2 of 3."""
    reduction = micro_step_reduction(spans([1, 11, 21], [(10, 13), (24, 27)], end=30))
    assert reduction is not None and (reduction.reducing, reduction.early_calls) == (2, 1)
    assert reduction.early_s == pytest.approx(3 * MS)


@pytest.mark.parametrize(("forwards", "all_reduces"), [
    ([1, 11], [(14, 16), (15, 17)]),  # no_sync before the last: every all-reduce after its forward
    ([1], [(4, 7), (5, 8)]),  # one micro-step: no accumulation
    ([1, 11], []),  # nothing reduced at all (one rank)
])
def test_nothing_is_said_where_only_the_last_micro_step_reduces(forwards: list[float], all_reduces: list[tuple[float, float]]) -> None:
    assert micro_step_reduction(spans(forwards, all_reduces, end=30)) is None


def test_the_note_gives_the_steps_and_the_medians() -> None:
    """Steps 3, 4, 5 and 9 (step 4 twice: a second rank's reading is not counted again). Medians
    over the four: micro-steps 4; reducing 4; all-reduces 27 (27, 27, 18, 27); wall time of
    (60, 70, 50, 80) = 65 ms; step (130, 140, 120, 150) = 135 ms; 65 / 135 = 48 %."""
    notes = EarlyReductions()
    assert not notes
    for step, early_calls, early_ms, step_ms in [(3, 27, 60, 130), (4, 27, 70, 140), (4, 9, 1, 1), (5, 18, 50, 120), (9, 27, 80, 150)]:
        notes.note(step, MicroStepReduction(4, 4, early_calls, early_ms * MS, step_ms * MS))
    notes.note(10, None)
    assert notes.figures() == {"micro_steps": 4, "reducing_micro_steps": 4, "early_all_reduces": 27,
                               "early_all_reduce_ms": pytest.approx(65.0), "early_all_reduce_pct": pytest.approx(48.15)}
    assert notes.text() == ("gradients were all-reduced in 4 of 4 micro-steps a step (4 steps: 3-5, 9): 27 all-reduces a step "
                            "before the last micro-step, 65.0 ms of wall time (48 % of the step). Accumulating, only the last "
                            "micro-step needs them: DDP's no_sync() around the others skips them")
    notes.strategies = {"simple"}  # train.py's baseline, on purpose
    assert notes.text().endswith("skips them (simple reduces in every micro-step on purpose, the first rung of the strategy ladder; "
                                 "ga is simple with no_sync)")
    notes.strategies = {"fsdp"}  # HSDP's all-reduces across replicas
    assert notes.text().endswith("HSDP's model.set_requires_all_reduce(False) before the others skips them, keeping the "
                                 "reduce-scatters (set_requires_gradient_sync(False) skips both)")
