"""The run's evaluations: held-out loss, accuracy, … after the steps they followed.

Why: the Loss tab drew the training loss alone, and a Trainer's ``eval_loss`` (or a loop's own
held-out loss) was in its log only; the question "is the run still learning?" sits beside "why
is the step slow?". Ranks send what they measured (``messages.Evaluation``: the Trainer callback
from ``on_evaluate``, a loop through ``record_evaluation``); a distributed evaluation gathers its
metrics, so ranks agree, and where they do not (a loop that evaluated each rank's own shard) the
lowest rank's stand for the step, as rank 0's log would.

Pure (no torch, no UI): the session keeps an ``Evaluations``; the dashboard draws its
``series`` and the exporters write ``as_list`` and ``markdown_lines``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from instrumented_ddp.wire.messages import Evaluation

#: Evaluations kept, the newest: one every 10 steps of a million-step run is 100,000, and a
#: sender could make any number.
KEPT_EVALUATIONS = 4096
#: Metric columns summary.md shows (summary.json keeps them all).
MARKDOWN_METRICS = 6

#: One metric over the run: its name, the steps its evaluations followed, and its values there.
MetricSeries = tuple[str, tuple[int, ...], tuple[float, ...]]


@dataclass
class Evaluations:
    """Each evaluated step's metrics, from the lowest rank that sent them."""

    by_step: dict[int, Evaluation] = field(default_factory=dict)
    dropped: int = 0  # the oldest, past ``KEPT_EVALUATIONS``
    changes: int = 0  # how many were kept: what a view drawn from them compares

    def add(self, evaluation: Evaluation) -> None:
        kept = self.by_step.get(evaluation.step)
        if kept is not None and kept.rank <= evaluation.rank:
            return
        self.by_step[evaluation.step] = evaluation
        self.changes += 1
        if len(self.by_step) > KEPT_EVALUATIONS:
            del self.by_step[min(self.by_step)]
            self.dropped += 1

    def __bool__(self) -> bool:
        return bool(self.by_step)

    def series(self) -> list[MetricSeries]:
        """(name, steps, values) per metric, oldest first: the finite values only (a NaN cannot
        be drawn; the exports keep it)."""
        out = []
        for name in metric_names(self.by_step[step].metrics for step in sorted(self.by_step)):
            points = [(step, float(value)) for step in sorted(self.by_step)
                      if (value := self.by_step[step].metrics.get(name)) is not None and math.isfinite(value)]
            if points:
                out.append((name, tuple(step for step, _ in points), tuple(value for _, value in points)))
        return out

    def as_list(self) -> list[dict[str, Any]]:
        """summary.json's ``evaluations``: one entry per evaluated step, oldest first."""
        return [{"step": step, "rank": e.rank, "metrics": dict(e.metrics)}
                for step, e in sorted(self.by_step.items())]


def series_label(name: str, steps: tuple[int, ...]) -> str:
    """The caption of a metric's series: its name and when it was measured."""
    count = len(steps)
    return f"{name} ({count} evaluation{'s' if count != 1 else ''}, the last after step {steps[-1]})"


def metric_names(metrics: Iterable[Mapping[str, float]]) -> list[str]:
    """Every metric's name in evaluations given oldest first: losses first (the one to read beside
    the training loss), then in the order first heard."""
    seen: dict[str, None] = {}
    for named in metrics:
        seen.update(dict.fromkeys(named))
    return sorted(seen, key=lambda name: "loss" not in name.lower())


def markdown_lines(evaluations: list[dict[str, Any]]) -> list[str]:
    """summary.md's table of evaluations (summary.json's ``evaluations``, oldest first): a row per
    evaluated step, a column per metric (``metric_cell``), losses first, up to ``MARKDOWN_METRICS``
    columns."""
    if not evaluations:
        return []
    names = metric_names(e["metrics"] for e in evaluations)
    shown = names[:MARKDOWN_METRICS]
    more = f" ({len(names) - len(shown)} more metrics in summary.json)" if len(names) > len(shown) else ""
    lines = ["", f"Evaluations, after the step each followed{more}:", "",
             "| after step | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 1)]
    for evaluation in evaluations:
        cells = [metric_cell(evaluation["metrics"], name) for name in shown]
        lines.append(f"| {evaluation['step']} | " + " | ".join(cells) + " |")
    return lines


def metric_cell(metrics: Mapping[str, Any], name: str) -> str:
    """A metric as summary.md shows it: "—" where the evaluation did not measure it, "not finite"
    where it measured NaN or an infinity (summary.json, strict JSON, holds it as null): a
    diverged evaluation, said, not blank."""
    if name not in metrics:
        return "—"
    value = metrics[name]
    return "not finite" if value is None or not math.isfinite(value) else f"{value:.4g}"
