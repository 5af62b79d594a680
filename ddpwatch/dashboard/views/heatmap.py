"""Ranks × recent steps as one grid of values: which rank is hot, and since when, at any size.

Pure (no Textual): the dashboard's heatmap tab draws it. A row is one rank, or one node
collapsed (its ranks' worst value per step: a hot rank must not be averaged away among its
node's seven healthy ones); a column is one step, oldest first. Values come from the figures
the session already keeps, so they are the ranks table's and the exports' own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from instrumented_ddp.wire.step_figures import StepFigures

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


@dataclass(frozen=True)
class RowLayout:
    """A row's place in the grid before any value: its label, node and ranks."""
    label: str
    node: int
    ranks: tuple[int, ...]


def row_layout(node_of: Mapping[int, int], expanded: Collection[int] | None = None) -> tuple[RowLayout, ...]:
    """Rows in (node, rank) order over the ranks in ``node_of``. ``expanded``: the nodes shown
    a row per rank; None shows every rank (a small job), an empty set one row per node."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(node_of, key=lambda r: (node_of[r], r)):
        by_node.setdefault(node_of[rank], []).append(rank)
    rows: list[RowLayout] = []
    for node, ranks in by_node.items():
        if expanded is None or node in expanded:
            rows += [RowLayout(f"r{rank}", node, (rank,)) for rank in ranks]
        else:
            rows.append(RowLayout(f"node {node} ×{len(ranks)}", node, tuple(ranks)))
    return tuple(rows)


def heat_column(metric: str, layout: Sequence[RowLayout], figures: Mapping[int, StepFigures],
                waits: Mapping[int, float]) -> tuple[float | None, ...]:
    """One step's cell per row: a rank's value, or a collapsed node's worst. A finished step's
    column does not change, so the dashboard keeps it and computes only the new steps'."""
    column: list[float | None] = []
    for row in layout:
        known = [v for v in (cell_value(metric, figures.get(rank), waits.get(rank)) for rank in row.ranks) if v is not None]
        column.append(max(known) if known else None)
    return tuple(column)


def assemble_heatmap(metric: str, steps: Sequence[int], layout: Sequence[RowLayout],
                     columns: Sequence[Sequence[float | None]], collapsible: bool) -> Heatmap:
    """The grid from one column per step (in ``steps`` order), rows in ``layout`` order."""
    rows = tuple(HeatRow(row.label, row.node, row.ranks, tuple(values))
                 for row, values in zip(layout, zip(*columns, strict=True) if columns else ((),) * len(layout), strict=True))
    shown = [v for column in columns for v in column if v is not None]
    return Heatmap(metric, tuple(steps), rows, min(shown, default=0.0), max(shown, default=0.0), collapsible=collapsible)


def build_heatmap(metric: str, steps: Sequence[int], figures_by_step: Mapping[int, Mapping[int, StepFigures]],
                  waits_by_step: Mapping[int, Mapping[int, float]], node_of: Mapping[int, int],
                  expanded: Collection[int] | None = None) -> Heatmap:
    """Rows in (node, rank) order over the ranks in ``node_of``. ``expanded``: the nodes shown
    a row per rank; None shows every rank (a small job), an empty set one row per node."""
    layout = row_layout(node_of, expanded)
    columns = [heat_column(metric, layout, figures_by_step.get(step, {}), waits_by_step.get(step, {})) for step in steps]
    return assemble_heatmap(metric, steps, layout, columns, collapsible=expanded is not None)


def level(value: float, low: float, high: float, levels: int) -> int:
    """Which of ``levels`` colours a value gets, linearly from ``low`` (0) to ``high``
    (``levels - 1``); everything one colour when the values do not differ."""
    if high <= low:
        return 0
    return min(levels - 1, max(0, int((value - low) / (high - low) * levels)))
