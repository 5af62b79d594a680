"""What the dashboard's pilot tests share: every message of a static feed drawn in one frame."""

from __future__ import annotations

from ddpwatch.dashboard.app import DashboardApp


async def draw_every_message(app: DashboardApp, pilot) -> None:  # noqa: ANN001
    """The static feed's messages all queued (its thread joined), folded and drawn in one frame,
    whatever the machine's load (the frame timer folds for at most 60 ms a frame)."""
    app.feed.stop()
    app.ingest_arrived()
    app.refresh_frame()
    await pilot.pause()
