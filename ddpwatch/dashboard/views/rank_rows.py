"""The ranks table's rows: one per rank, and a large job's one per node, opened on demand.

Pure (no Textual). A node's row stands for its ranks and shows their worst — the laggard's
step, the slowest step time, the least compute and overlap, the most exposed communication and
waiting, every dropped message — so one hot rank is not averaged away among its node's healthy
ones (the heatmap collapses nodes by the same rule). An opened node keeps its row as a header,
followed by a row per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class RankRow:
    """One line of the ranks table: a rank's, or a node's standing for its ranks (``group``)."""

    rank: int
    node: int | None
    host: str
    device: str
    status: str
    step: int
    step_ms: float | None
    compute_pct: float | None
    non_compute_pct: float | None
    overlap_pct: float | None
    waited_ms: float | None
    utilization: str
    memory: str
    dropped: int
    held: str = ""  # parameters/gradients/optimizer state the rank holds (``held_text``)
    group: tuple[int, ...] = ()  # a node's row: the ranks it stands for (empty: one rank's row)
    opened: bool = False  # a node's row whose ranks are shown below it


#: Worst first: a node with one failed or lost rank reads so, one still running reads live, one
#: whose end a recording does not hold (``Session.status``'s ``cut``) reads cut.
STATUS_ORDER = {"failed": 6, "lost": 5, "interrupted": 4, "detached": 3, "cut": 2, "live": 1, "finished": 0}

T = TypeVar("T", int, float)


def _worst(values: Sequence[T | None], pick: Callable[[Sequence[T]], T]) -> T | None:
    known = [v for v in values if v is not None]
    return pick(known) if known else None


def _shared(values: Sequence[str], plural: str) -> str:
    distinct = set(values)
    return values[0] if len(distinct) == 1 else f"{len(distinct)} {plural}"


def node_row(node: int, members: Sequence[RankRow], opened: bool) -> RankRow:
    """The row of ``node`` standing for ``members`` (its ranks' rows, in rank order)."""
    return RankRow(
        rank=members[0].rank, node=node,
        host=_shared([m.host for m in members], "hosts"), device=_shared([m.device for m in members], "devices"),
        status=max((m.status for m in members), key=lambda s: STATUS_ORDER.get(s, 1)),
        step=min(m.step for m in members),
        step_ms=_worst([m.step_ms for m in members], max), compute_pct=_worst([m.compute_pct for m in members], min),
        non_compute_pct=_worst([m.non_compute_pct for m in members], max),
        overlap_pct=_worst([m.overlap_pct for m in members], min), waited_ms=_worst([m.waited_ms for m in members], max),
        utilization="", memory="", dropped=sum(m.dropped for m in members),
        group=tuple(m.rank for m in members), opened=opened,
    )


def rows_by_node(rows: Sequence[RankRow], open_nodes: Collection[int]) -> tuple[RankRow, ...]:
    """Nodes in order (a rank whose hello has not come yet counts as node 0), each one row, or
    its row then its ranks' rows where it is in ``open_nodes``."""
    by_node: dict[int, list[RankRow]] = {}
    for row in sorted(rows, key=lambda r: (r.node or 0, r.rank)):
        by_node.setdefault(row.node or 0, []).append(row)
    out: list[RankRow] = []
    for node, members in by_node.items():
        opened = node in open_nodes
        out.append(node_row(node, members, opened))
        if opened:
            out.extend(members)
    return tuple(out)
