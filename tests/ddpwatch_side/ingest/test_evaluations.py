"""What the run's evaluations measured, kept and drawn (``ddpwatch.ingest.evaluations``), hand-worked."""

from __future__ import annotations

import math

from ddpwatch.ingest import evaluations
from ddpwatch.ingest.evaluations import Evaluations, markdown_lines, metric_names, series_label
from instrumented_ddp.wire.messages import Evaluation


def test_each_step_keeps_the_lowest_ranks_evaluation_whatever_order_they_come_in() -> None:
    """A gathered evaluation gives every rank the same numbers; a loop that evaluated each rank's
    own shard does not, and rank 0's stand for the step, as its log would."""
    kept = Evaluations()
    kept.add(Evaluation(1, 10, {"eval_loss": 0.52}))
    kept.add(Evaluation(0, 10, {"eval_loss": 0.50}))
    kept.add(Evaluation(1, 10, {"eval_loss": 0.99}))  # rank 1 again: rank 0's stays
    kept.add(Evaluation(1, 20, {"eval_loss": 0.40}))
    assert {step: (e.rank, e.metrics) for step, e in kept.by_step.items()} == {10: (0, {"eval_loss": 0.50}),
                                                                                 20: (1, {"eval_loss": 0.40})}
    assert kept.changes == 3  # what was kept: rank 1's at 10, rank 0's at 10, rank 1's at 20


def test_only_the_newest_evaluations_are_kept(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(evaluations, "KEPT_EVALUATIONS", 3)
    kept = Evaluations()
    for step in (40, 10, 30, 20):  # 4 steps, 3 kept: the oldest step (10) goes, not the first heard
        kept.add(Evaluation(0, step, {"eval_loss": 1.0}))
    assert sorted(kept.by_step) == [20, 30, 40] and kept.dropped == 1


def test_losses_come_first_then_the_metrics_in_the_order_first_heard() -> None:
    assert metric_names([{"eval_accuracy": 0.8, "eval_loss": 0.5}, {"eval_f1": 0.7, "eval_accuracy": 0.9},
                         {"eval_mlm_loss": 2.0}]) == ["eval_loss", "eval_mlm_loss", "eval_accuracy", "eval_f1"]


def test_a_series_per_metric_in_step_order_leaving_out_what_cannot_be_drawn() -> None:
    kept = Evaluations()
    kept.add(Evaluation(0, 20, {"eval_loss": math.nan, "eval_accuracy": 0.7}))  # diverged at 20: no point
    kept.add(Evaluation(0, 10, {"eval_loss": 0.9, "eval_accuracy": 0.5}))
    kept.add(Evaluation(0, 30, {"eval_loss": 0.4}))  # accuracy not measured at 30
    assert kept.series() == [("eval_loss", (10, 30), (0.9, 0.4)), ("eval_accuracy", (10, 20), (0.5, 0.7))]
    assert series_label("eval_loss", (10, 30)) == "eval_loss (2 evaluations, the last after step 30)"
    assert series_label("eval_loss", (10,)) == "eval_loss (1 evaluation, the last after step 10)"


def test_summary_md_has_a_row_per_evaluation_and_a_column_per_metric_up_to_six() -> None:
    listed = [{"step": 10, "rank": 0, "metrics": {"eval_accuracy": 0.5, "eval_loss": 0.91234}},
              {"step": 20, "rank": 0, "metrics": {"eval_loss": None}}]  # NaN, as summary.json holds it
    assert markdown_lines(listed) == [
        "", "Evaluations, after the step each followed:", "",
        "| after step | eval_loss | eval_accuracy |", "|---|---|---|",
        "| 10 | 0.9123 | 0.5 |",
        "| 20 | not finite | — |",
    ]
    many = [{"step": 5, "rank": 0, "metrics": {f"m{i}": float(i) for i in range(8)}}]
    lines = markdown_lines(many)
    assert lines[1] == "Evaluations, after the step each followed (2 more metrics in summary.json):"
    assert lines[3] == "| after step | m0 | m1 | m2 | m3 | m4 | m5 |" and lines[5] == "| 5 | 0 | 1 | 2 | 3 | 4 | 5 |"
    assert markdown_lines([]) == []
