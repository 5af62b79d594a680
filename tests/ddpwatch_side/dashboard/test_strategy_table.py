"""The advisor tab's strategy table: fed the recorded two-rank session (async, tiny model), it
lists every strategy with its predicted step and memory, the run's own marked and measured;
``B`` switches to the fastest that fits the budget; a run that cannot switch is told the code."""

from __future__ import annotations

from pathlib import Path

from ddpwatch.advisor.strategy_advice import StrategyAdvice, StrategyRow
from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.dashboard.widgets.strategy_table import render_strategies
from ddpwatch.ingest.session_file import read_session_file
from instrumented_ddp.wire.messages import SwitchCommand
from dashboard_pilot import draw_every_message

RECORDED = Path(__file__).parents[2] / "support" / "fixtures" / "recorded-session" / "session.ddpwatch"
ROWS = (StrategyRow("ddp", 1, 300.0, 36.8, 580.0, measured_ms=305.0, measured_held_mib=36.8, measured_peak_mib=579.0),
        StrategyRow("zero2", 1, 290.0, 23.0, 600.0), StrategyRow("fsdp", 1, 280.0, 18.4, 700.0, notes=("fsdp: forward split by parameter bytes",)))


def made_up(budget_mib: float | None) -> StrategyAdvice:
    return StrategyAdvice("ddp", 1, ROWS, {}, budget_mib, "zero2 is the fastest within 0.635 GiB")


async def test_the_recorded_run_gets_a_row_a_strategy_with_its_own_measured_beside() -> None:
    feed = StaticFeed([data for _, data in read_session_file(RECORDED)])
    app = DashboardApp(feed, export_on_exit=False)
    async with app.run_test(size=(200, 50)) as pilot:
        await draw_every_message(app, pilot)
        app.side_tabs.active = "advisor-tab"
        await pilot.pause(0.4)
        app.refresh_frame()
        await pilot.pause(0.2)
        shown = str(app.strategy_table.render())
        assert "Which strategy" in shown, shown
        for strategy in ("simple", "ga", "hook", "async", "bucket", "ddp", "zero1", "zero2", "fsdp"):
            assert f" {strategy} " in shown, (strategy, shown)
        own = next(line for line in shown.splitlines() if line.startswith("▶"))
        assert own.split()[1] == "async" and " ms" in own  # the run's own, with what it measured
        assert "is the fastest" in shown


def test_the_fastest_that_fits_is_named_with_its_key_or_its_code() -> None:
    text = render_strategies(made_up(650.0)).plain
    assert "B switches the run to zero2" in text  # fsdp's 700 MiB peak is over the 650 MiB budget
    assert text.index(" fsdp ") < text.index(" zero2 ") < text.index(" ddp ")  # fastest first
    assert "305.0 ms, 36.8 held, 579 peak" in text and "fsdp: forward split by parameter bytes" in text
    attached = render_strategies(made_up(None), switchable=False).plain
    assert "to train fsdp: fully_shard(layer) for each layer, then fully_shard(model)" in attached
    assert "B switches" not in attached


async def test_b_switches_to_the_fastest_that_fits() -> None:
    feed = StaticFeed([])
    sent: list[SwitchCommand] = []
    feed.request_switch = sent.append  # type: ignore[method-assign, assignment]
    app = DashboardApp(feed, export_on_exit=False)
    async with app.run_test(size=(160, 40)):
        app.builder.strategies = lambda now: made_up(650.0)  # type: ignore[method-assign]
        app.snapshot = None
        app.action_apply_strategy()
    assert [(c.strategy, c.grad_accum) for c in sent] == [("zero2", 1)]
