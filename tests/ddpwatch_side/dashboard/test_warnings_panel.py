"""The warnings panel: what fits shown whole, what does not counted, on a short terminal the first
warning and how many more."""
from __future__ import annotations

from msgspec.structs import replace


from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from instrumented_ddp.wire.messages import StepReport
from synthetic_session import (desync_at_3_4_and_a_straggler, session_messages)
from dashboard_pilot import draw_every_message


def rows_of(text: str, width: int) -> list[str]:
    """A wrap a reader can follow: ``width`` characters a row."""
    return [text[i:i + width] for i in range(0, len(text), width)] or [""]


def test_warnings_that_fit_are_shown_whole_each_mark_on_its_first_row() -> None:
    from ddpwatch.dashboard.widgets.warnings_panel import fitted_rows

    # width 12: the mark and a space take 2, so 10 characters a row; "desync at 3-4" is 13: two rows
    lines = [("!", "desync at 3-4"), ("i", "a note")]
    assert fitted_rows(lines, 12, 3, rows_of) == [("!", "desync at "), (" ", "3-4"), ("i", "a note")]


def test_warnings_that_do_not_fit_say_how_many_are_left_out() -> None:
    from ddpwatch.dashboard.widgets.warnings_panel import fitted_rows

    lines = [("!", "desync at 3-4"), ("!", "rank 1 lost"), ("i", "a note")]  # 2 + 2 + 1 rows at width 12
    # 3 rows: the desync whole (2), then no room for "rank 1 lost" before the last row: 2 left out
    assert fitted_rows(lines, 12, 3, rows_of) == [("!", "desync at "), (" ", "3-4"),
                                                  ("+", "2 more not shown: a taller terminal shows them")]
    # 2 rows: the desync does not fit whole before the last row: its first row cut with "…", 2 left out
    assert fitted_rows(lines, 12, 2, rows_of) == [("!", "desync at…"), ("+", "2 more not shown: a taller terminal shows them")]
    # 5 rows: all of them
    assert len(fitted_rows(lines, 12, 5, rows_of)) == 5


async def test_a_short_terminal_shows_the_first_warning_and_how_many_more_there_are() -> None:
    """At 80 x 24 the panel has two rows: a desync wrapped onto both, and a straggler and two
    unresolved steps after it were not shown, nor said to be there."""
    def three_warnings(report: StepReport) -> StepReport:
        report = desync_at_3_4_and_a_straggler(report)
        if report.rank == 1 and report.step in (6, 7):
            return replace(report, unresolved=True, spans=[s for s in report.spans if s.tag not in ("p3", "b1")])
        return report

    app = DashboardApp(StaticFeed(session_messages(edit=three_warnings)), export_on_exit=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await draw_every_message(app, pilot)
        assert len(app.snapshot.warnings) == 3
        shown = str(app.warnings_panel.render()).splitlines()
        assert len(shown) == 2 and app.warnings_panel.region.height == 2
        assert shown[0].startswith("! DESYNC at steps 3-4 (2 steps)") and shown[0].endswith("…")
        assert shown[1] == "+ 2 more not shown: a taller terminal shows them"
        await pilot.resize_terminal(80, 40)  # taller: every one, whole
        await pilot.pause()
        app.refresh_frame()
        await pilot.pause()
        taller = str(app.warnings_panel.render())
        assert "more not shown" not in taller and "straggler" in taller and "unresolved" in taller
