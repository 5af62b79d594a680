"""The dashboard's ``--prometheus``: each frame hands the session to the endpoint, so a scrape
while it is open reads the ranks on screen, and the final figures once it closes."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.export.exporters import summary
from ddpwatch.export.live_outputs import LiveOutputs
from ddpwatch.export.prometheus_endpoint import PrometheusEndpoint
from dashboard_pilot import draw_every_message
from synthetic_session import session_messages


def step_counts(endpoint: PrometheusEndpoint) -> dict[str, float]:
    with urllib.request.urlopen(endpoint.url, timeout=10) as response:
        text = response.read().decode()
    return {sample.labels["rank"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "ddpwatch_step_seconds_count"}


async def test_a_scrape_reads_the_session_on_screen_and_its_final_figures_after_it_closes() -> None:
    endpoint = PrometheusEndpoint("127.0.0.1:0")
    try:
        app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False, outputs=LiveOutputs([endpoint]))
        async with app.run_test(size=(160, 50)) as pilot:
            await draw_every_message(app, pilot)
            endpoint.every_s = 0.0  # the next frame makes them again, with every message in
            await pilot.pause(0.3)
            assert set(step_counts(endpoint)) == {"0", "1"}
        expected = {rank: float(f["steps"]) for rank, f in summary(app.session)["segments"][-1]["per_rank"].items()}
        assert step_counts(endpoint) == expected == {"0": 5.0, "1": 5.0}
    finally:
        endpoint.close()
