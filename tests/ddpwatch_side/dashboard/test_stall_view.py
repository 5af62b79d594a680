"""The dashboard while a run is stalled: a banner above the timeline naming who holds it, a header
that says how long no step has come instead of a rate and an ETA, and ``w``'s view of each
rank's phase, collective in flight, numbers and stack. Fed a made-up stall on the dashboard's
own clock: two ranks stepped every 0.1 s, then from 12 s ago rank 1 sleeps before its backward
while rank 0 waits in b0."""

from __future__ import annotations

import re
import time

from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.dashboard.screens.stall_screen import StallScreen, stall_view_text
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Heartbeat, Message
from instrumented_ddp.wire.stall_probe import InFlight, StallProbe
from synthetic_session import hello

B0 = InFlight("all_reduce", "b0", 4_194_304, "", seq=21, step=21)
SLEEPING = ["hang_probe.py:31 main: time.sleep(40)"]


def feed_a_stall(app: DashboardApp) -> None:
    base = time.monotonic() - 14.0  # step 20 ended 12 s ago, and the ranks beat on since
    seq = {0: 0, 1: 0}

    def send(message: Message, at: float) -> None:
        rank = message.rank
        app.session.ingest(Envelope(message, rank, seq[rank], 0), received_at=base + at)
        seq[rank] += 1

    for rank in (0, 1):
        send(hello(rank, world_size=2), 0.0)
    for step in range(1, 21):
        for rank in (0, 1):
            send(Heartbeat(rank, step * 0.1, step, "", "between"), step * 0.1)
    t = 2.0
    while t <= 13.5:
        idle = t - 2.0
        send(Heartbeat(0, t, 20, "", "backward", StallProbe(idle, 21, [B0._replace(waited_s=idle)], {"": 21}) if idle >= 1.5 else None), t)
        send(Heartbeat(1, t, 20, "", "after_forward", StallProbe(idle, 21, [], {"": 20}, SLEEPING) if idle >= 1.5 else None), t)
        t += 0.5


async def test_a_stalled_run_shows_a_banner_a_stalled_header_and_each_ranks_stack_on_w() -> None:
    app = DashboardApp(StaticFeed([]), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        feed_a_stall(app)
        app.refresh_frame()
        await pilot.pause()
        banner = str(app.stall_banner.render())
        assert banner.startswith("STALLED rank 1 has not reached all_reduce b0 (#21 on the default group) of step 21")
        assert "hang_probe.py:31" in banner and app.stall_banner.display
        header = str(app.header_bar.query_one("#header-text").render())
        stalled = re.search(r"stalled (\d+) s", header)  # 12 s, and what a loaded machine took since
        assert stalled is not None and int(stalled.group(1)) >= 12 and "ETA" not in header, header
        await pilot.press("w")
        await pilot.pause()
        assert isinstance(app.screen, StallScreen)
        text = str(app.screen.query_one("#stall-text").render())
        assert "rank 1  holds the others" in text and "rank 0  waits" in text
        assert "in flight: all_reduce b0 (#21 on the default group)" in text and "issued: 20 on default" in text
        assert "hang_probe.py:31 main: time.sleep(40)" in text and "phase: after forward" in text
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, StallScreen)


async def test_a_run_that_steps_shows_no_banner_and_w_says_there_is_no_stall() -> None:
    app = DashboardApp(StaticFeed([]), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        app.refresh_frame()
        await pilot.pause()
        assert not app.stall_banner.display
        assert "No stall" in str(stall_view_text(None, ""))


def test_the_view_shows_a_ranks_native_stack_or_why_there_is_none() -> None:
    stall = {"kind": "behind", "culprits": [1], "waiting": [0], "stacks": {"1": SLEEPING},
             "native_stacks": {"1": ["hang_probe.py:31 main", "libpython3.11.so.1.0:0 time_sleep", "libc.so.6:0 clock_nanosleep"]},
             "native_errors": {"0": "py-spy could not read this process: Permission Denied"}}
    text = str(stall_view_text(stall, "rank 1 holds rank 0"))
    assert "  native:\n    hang_probe.py:31 main\n    libpython3.11.so.1.0:0 time_sleep\n    libc.so.6:0 clock_nanosleep" in text
    assert "native: py-spy could not read this process: Permission Denied" in text
