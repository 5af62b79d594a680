"""What the dashboard's pilot tests share: every message of a feed drawn in one frame."""

from __future__ import annotations

import time

from ddpwatch.dashboard.app import DashboardApp


async def draw_every_message(app: DashboardApp, pilot) -> None:  # noqa: ANN001
    """The static feed's messages all queued (its thread joined), folded and drawn in one frame,
    whatever the machine's load (the frame timer folds for at most 60 ms a frame)."""
    app.feed.stop()
    app.ingest_arrived()
    app.refresh_frame()
    await pilot.pause()


async def draw_the_whole_replay(app: DashboardApp, pilot, within_s: float) -> None:  # noqa: ANN001
    """A replay's every message read (its feed ended within ``within_s``), folded and drawn in one frame."""
    deadline = time.monotonic() + within_s
    while not app.feed.ended:
        assert time.monotonic() < deadline, "the replay did not end"
        await pilot.pause(0.02)
    app.ingest_arrived()
    app.refresh_frame()
    await pilot.pause()
