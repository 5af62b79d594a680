"""A large job's ranks table: a row per node showing its ranks' worst, opened to its ranks."""

from ddpwatch.dashboard.views.rank_rows import RankRow, node_row, rows_by_node


def rank_row(rank: int, node: int, **changes: object) -> RankRow:
    fields = dict(rank=rank, node=node, host=f"host-{node}", device=f"cuda:{rank % 2}", status="live", step=10,
                  step_ms=100.0, compute_pct=80.0, non_compute_pct=5.0, overlap_pct=60.0, waited_ms=1.0,
                  utilization="90 %", memory="10 GiB", dropped=0)
    fields.update(changes)
    return RankRow(**fields)  # type: ignore[arg-type]


def test_a_nodes_row_shows_its_ranks_worst() -> None:
    members = [rank_row(8, 1), rank_row(9, 1, step_ms=130.0, compute_pct=61.5, waited_ms=None, dropped=2),
               rank_row(10, 1, step=9, status="lost", non_compute_pct=12.0, overlap_pct=None, dropped=1)]
    row = node_row(1, members, opened=False)
    assert (row.rank, row.node, row.group, row.opened) == (8, 1, (8, 9, 10), False)
    assert (row.host, row.device) == ("host-1", "2 devices")  # one host; cuda:0 and cuda:1
    assert row.status == "lost" and row.step == 9  # a lost rank and the laggard's step
    assert (row.step_ms, row.compute_pct, row.non_compute_pct, row.overlap_pct, row.waited_ms) == (130.0, 61.5, 12.0, 60.0, 1.0)
    assert row.dropped == 3 and row.utilization == row.memory == ""


def test_a_node_with_nothing_known_shows_nothing() -> None:
    row = node_row(0, [rank_row(0, 0, step_ms=None, status="finished"), rank_row(1, 0, step_ms=None, status="finished")], True)
    assert row.step_ms is None and row.status == "finished" and row.opened


def test_a_node_shows_its_worst_rank_status_a_recording_cut_among_them() -> None:
    """Worst first: failed, lost, interrupted, cut (a replay's end before the rank's goodbye), live, finished."""
    def worst(*statuses: str) -> str:
        return node_row(0, [rank_row(rank, 0, status=status) for rank, status in enumerate(statuses)], False).status
    assert worst("finished", "cut", "live") == "cut"
    assert worst("cut", "interrupted") == "interrupted"
    assert worst("lost", "cut", "failed") == "failed"


def test_rows_by_node_open_only_the_opened_nodes() -> None:
    rows = [rank_row(rank, rank // 2) for rank in range(6)]
    grouped = rows_by_node(rows, {1})
    assert [(r.group, r.rank) for r in grouped] == [((0, 1), 0), ((2, 3), 2), ((), 2), ((), 3), ((4, 5), 4)]
    assert [r.opened for r in grouped if r.group] == [False, True, False]
    no_hello = rows_by_node([rank_row(0, None), rank_row(1, 0)], ())  # type: ignore[arg-type]
    assert [r.group for r in no_hello] == [(0, 1)]  # a rank not yet placed counts as node 0
