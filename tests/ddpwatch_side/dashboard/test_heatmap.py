"""The ranks × steps heatmap's grid, hand-worked."""

from __future__ import annotations

from array import array

import pytest

from ddpwatch.dashboard.views.heatmap import build_heatmap, cell_value, level
from instrumented_ddp.wire.step_figures import StepFigures, StepTimes


def fig(rank: int, step: int, exposed: float, step_ms: float) -> StepFigures:
    return StepFigures(rank=rank, step=step, step_ms=step_ms, compute_pct=100 - exposed, non_compute_pct=exposed,
                       idle_pct=0.0, overlap_pct=0.0, comm_overhead_pct=exposed, all_reduce_calls=1, all_reduce_ms=1.0,
                       algbw_gbps=array("d"), busbw_gbps=None, samples=1, tokens=1, times=StepTimes(0.0, step_ms / 1000, None))


# 4 ranks on 2 nodes (0, 1 on node 0; 2, 3 on node 1), steps 7 and 8. Rank 3 sent nothing for step 8.
FIGURES = {7: {0: fig(0, 7, 10, 100), 1: fig(1, 7, 30, 110), 2: fig(2, 7, 5, 100), 3: fig(3, 7, 50, 120)},
           8: {0: fig(0, 8, 20, 100), 1: fig(1, 8, 15, 100), 2: fig(2, 8, 40, 130)}}
WAITS = {7: {0: 2.0, 1: 0.0, 2: 4.0, 3: 1.0}, 8: {0: 1.0, 1: 3.0, 2: 0.0}}
NODES = {0: 0, 1: 0, 2: 1, 3: 1}


def test_every_rank_a_row_when_nothing_is_collapsed() -> None:
    grid = build_heatmap("exposed", [7, 8], FIGURES, WAITS, NODES)
    assert [(r.label, r.values) for r in grid.rows] == [
        ("r0", (10, 20)), ("r1", (30, 15)), ("r2", (5, 40)), ("r3", (50, None))]
    assert (grid.low, grid.high) == (5, 50)


def test_a_collapsed_node_shows_its_worst_rank_per_step() -> None:
    # node 0 collapsed: max(10, 30) = 30 at step 7, max(20, 15) = 20 at step 8; node 1 open
    grid = build_heatmap("exposed", [7, 8], FIGURES, WAITS, NODES, expanded={1})
    assert [(r.label, r.ranks, r.values) for r in grid.rows] == [
        ("node 0 ×2", (0, 1), (30, 20)), ("r2", (2,), (5, 40)), ("r3", (3,), (50, None))]
    # every node collapsed: node 1 at step 8 has only rank 2's 40
    grid = build_heatmap("exposed", [7, 8], FIGURES, WAITS, NODES, expanded=set())
    assert [r.values for r in grid.rows] == [(30, 20), (50, 40)]


def test_step_time_and_wait_metrics() -> None:
    assert build_heatmap("step", [7], FIGURES, WAITS, NODES, expanded=set()).rows[1].values == (120,)
    grid = build_heatmap("wait", [7, 8], FIGURES, WAITS, NODES)
    assert [r.values for r in grid.rows] == [(2.0, 1.0), (0.0, 3.0), (4.0, 0.0), (1.0, None)]
    with pytest.raises(ValueError, match="unknown heatmap metric 'x'"):
        cell_value("x", FIGURES[7][0], None)


def test_levels_split_the_shown_range_evenly() -> None:
    # 5 to 50 over 6 colours: each 7.5 wide
    assert [level(v, 5, 50, 6) for v in (5, 12.4, 12.5, 49.9, 50)] == [0, 0, 1, 5, 5]
    assert level(3.0, 3.0, 3.0, 6) == 0  # nothing differs: one colour


def test_only_a_grid_with_nodes_to_open_is_collapsible() -> None:
    assert not build_heatmap("exposed", [7], FIGURES, WAITS, NODES).collapsible
    assert build_heatmap("exposed", [7], FIGURES, WAITS, NODES, expanded={0}).collapsible
