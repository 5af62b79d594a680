"""A run that leaves steps unwatched: those steps are in no figure but samples/s, and what watching
costs (their walls against the watched ones around them) reaches summary.json, summary.md and the
dashboard's header. The watched steps here cost 5 % more than the unwatched ones."""

from __future__ import annotations

import pytest
from msgspec.structs import replace
from textual.geometry import Region

from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.dashboard.widgets.timeline_view import TimelineView
from ddpwatch.export import exporters
from ddpwatch.export.prometheus_metrics import metric_families
from ddpwatch.export.step_scalars import WATCH_OVERHEAD_TAG, segment_row
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import encode
from instrumented_ddp.wire.messages import Goodbye, Message, StepReport
from dashboard_pilot import draw_every_message
from synthetic_session import hello, step_report

UNWATCHED = (5, 6, 15, 16)  # --unwatched 10:2
COST = 1.05  # a watched step's wall over an unwatched one's


def unwatched_report(rank: int, step: int) -> StepReport:
    """The step's window alone, 5 % shorter than a watched step's (0.170 s)."""
    watched = step_report(rank, step, "bucket")
    return replace(watched, spans=[], end=watched.start + (watched.end - watched.start) / COST, unwatched=True)


def messages(steps: int = 20, measured: bool = True) -> list[bytes]:
    out: list[bytes] = []
    seq = {0: 0, 1: 0}

    def add(rank: int, message: Message) -> None:
        out.append(encode(message, seq[rank], 0))
        seq[rank] += 1

    for rank in (0, 1):
        add(rank, replace(hello(rank, strategy="bucket"), unwatched_every=10 if measured else 0,
                          unwatched_steps=2 if measured else 0, total_steps=steps))
    for step in range(1, steps + 1):
        for rank in (0, 1):
            add(rank, unwatched_report(rank, step) if measured and step in UNWATCHED else step_report(rank, step, "bucket"))
    for rank in (0, 1):
        add(rank, Goodbye(rank, steps))
    return out


def test_unwatched_steps_are_in_no_figure_and_their_cost_reads_five_percent() -> None:
    session, plain = Session(), Session()
    ingest(session, messages())
    ingest(plain, messages(measured=False))
    assert exporters.summary(session)["unwatched_blocks"] == {"every": 10, "steps": 2}
    assert exporters.summary(plain)["unwatched_blocks"] is None
    [segment] = exporters.summary(session)["segments"]
    [all_watched] = exporters.summary(plain)["segments"]
    assert (segment["first_step"], segment["last_step"]) == (1, 20)  # one segment, its unwatched steps inside it
    assert segment["steps"] == 20 - len(UNWATCHED) and all_watched["steps"] == 20
    assert segment["step_ms_mean"] == pytest.approx(all_watched["step_ms_mean"])  # the watched steps alone
    # every step's samples over the same wall: the unwatched steps trained too
    assert segment["samples_per_s"] == pytest.approx(all_watched["samples_per_s"])
    cost = segment["watch_overhead"]
    assert cost["pct"] == pytest.approx(5.0, abs=0.01) and cost["unwatched_steps"] == 4
    assert cost["interval_pct"][0] <= cost["pct"] <= cost["interval_pct"][1]
    assert all_watched["watch_overhead"] is None
    markdown = exporters.summary_markdown(exporters.summary(session))
    assert "- segment 0: ddpwatch costs this run 5.0 % (90 % interval 5.0 to 5.0 %), from 4 unwatched steps" in markdown


def test_prometheus_and_the_segment_scalars_carry_it() -> None:
    session = Session()
    ingest(session, messages())
    families = {family.name: family for family in metric_families(session, now=0.0, final=True)}
    ratios = {sample.labels["estimate"]: sample.value for sample in families["ddpwatch_watch_overhead_ratio"].samples}
    assert ratios == pytest.approx({"median": 0.05, "low": 0.05, "high": 0.05}, abs=1e-4)
    assert [sample.value for sample in families["ddpwatch_unwatched_steps"].samples] == [4.0]
    assert segment_row(session, session.segments[0], final=True)[WATCH_OVERHEAD_TAG] == pytest.approx(5.0, abs=0.01)
    plain = Session()
    ingest(plain, messages(measured=False))
    families = {family.name: family for family in metric_families(plain, now=0.0, final=True)}
    assert families["ddpwatch_watch_overhead_ratio"].samples == [] and families["ddpwatch_unwatched_steps"].samples == []
    assert WATCH_OVERHEAD_TAG not in segment_row(plain, plain.segments[0], final=True)


async def test_the_dashboard_header_says_what_watching_costs_the_run() -> None:
    app = DashboardApp(StaticFeed(messages()), export_on_exit=False)
    async with app.run_test(size=(200, 50)) as pilot:
        await draw_every_message(app, pilot)
        cost = app.snapshot.header.watch_overhead
        assert cost is not None and cost.pct == pytest.approx(5.0, abs=0.01)
        text = app.header_bar.query_one("#header-text")
        second = text.render_lines(Region(0, 0, text.size.width, 2))[1].text
        assert "samples/s · ddpwatch costs 5.0 % (5.0 to 5.0, 4 unwatched steps) · bucket_mb=1.0" in second, second
        # the samples/s beside it counts the unwatched steps' samples: as the all-watched run's
        rate = app.snapshot.header.samples_per_s
        await pilot.press("left", "left", "left", "left")  # 19, 18, 17, then over 16 and 15 to 14
        await pilot.pause(0.2)
        assert app.query_one(TimelineView).data.step == 14
    plain = DashboardApp(StaticFeed(messages(measured=False)), export_on_exit=False)
    async with plain.run_test(size=(200, 50)) as pilot:
        await draw_every_message(plain, pilot)
        assert plain.snapshot.header.watch_overhead is None
        assert rate == pytest.approx(plain.snapshot.header.samples_per_s)
