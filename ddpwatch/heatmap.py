"""Ranks × recent steps as one grid of values: which rank is hot, and since when, at any size.

Pure (no Textual): the dashboard's heatmap tab draws it. A row is one rank, or one node
collapsed (its ranks' worst value per step: a hot rank must not be averaged away among its
node's seven healthy ones); a column is one step, oldest first. Values come from the figures
the session already keeps, so they are the ranks table's and the exports' own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ddpwatch.metrics import StepFigures

#: metric -> what a cell holds, as the heatmap's title says it. Higher is worse for all three.
HEATMAP_METRICS: dict[str, str] = {
    "exposed": "exposed communication, % of the step (Non_Compute%)",
    "step": "step time, ms",
    "wait": "ms waited in all-reduces for other ranks",
}


@dataclass(frozen=True)
class HeatRow:
    label: str
    node: int
    ranks: tuple[int, ...]  # one rank, or every rank of a collapsed node
    values: tuple[float | None, ...]  # per step; None: no counted report from these ranks


@dataclass(frozen=True)
class Heatmap:
    metric: str
    steps: tuple[int, ...]
    rows: tuple[HeatRow, ...]
    low: float  # the lowest and highest value shown: the colour scale's ends
    high: float
    collapsible: bool = False  # nodes can be opened and closed (not every rank was given a row)


def cell_value(metric: str, figures: StepFigures | None, waited_ms: float | None) -> float | None:
    if figures is None:
        return None
    if metric == "exposed":
        return figures.non_compute_pct
    if metric == "step":
        return figures.step_ms
    if metric == "wait":
        return waited_ms
    raise ValueError(f"unknown heatmap metric {metric!r}; one of {', '.join(HEATMAP_METRICS)}")


def build_heatmap(metric: str, steps: Sequence[int], figures_by_step: Mapping[int, Mapping[int, StepFigures]],
                  waits_by_step: Mapping[int, Mapping[int, float]], node_of: Mapping[int, int],
                  expanded: Collection[int] | None = None) -> Heatmap:
    """Rows in (node, rank) order over the ranks in ``node_of``. ``expanded``: the nodes shown
    a row per rank; None shows every rank (a small job), an empty set one row per node."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(node_of, key=lambda r: (node_of[r], r)):
        by_node.setdefault(node_of[rank], []).append(rank)

    def value(rank: int, step: int) -> float | None:
        waits = waits_by_step.get(step, {})
        return cell_value(metric, figures_by_step.get(step, {}).get(rank), waits.get(rank))

    rows: list[HeatRow] = []
    for node, ranks in by_node.items():
        if expanded is None or node in expanded:
            rows += [HeatRow(f"r{rank}", node, (rank,), tuple(value(rank, s) for s in steps)) for rank in ranks]
        else:
            worst = []
            for step in steps:
                known = [v for v in (value(rank, step) for rank in ranks) if v is not None]
                worst.append(max(known) if known else None)
            rows.append(HeatRow(f"node {node} ×{len(ranks)}", node, tuple(ranks), tuple(worst)))
    shown = [v for row in rows for v in row.values if v is not None]
    return Heatmap(metric, tuple(steps), tuple(rows), min(shown, default=0.0), max(shown, default=0.0),
                   collapsible=expanded is not None)


def level(value: float, low: float, high: float, levels: int) -> int:
    """Which of ``levels`` colours a value gets, linearly from ``low`` (0) to ``high``
    (``levels - 1``); everything one colour when the values do not differ."""
    if high <= low:
        return 0
    return min(levels - 1, max(0, int((value - low) / (high - low) * levels)))
