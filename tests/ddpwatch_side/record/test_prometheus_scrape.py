"""``ddpwatch record --prometheus`` scraped by a real Prometheus server through a 2-rank train.py
run: PromQL over its HTTP API gives, for each rank, the step time and Overlap% of summary.json,
and every query of the Grafana dashboard in docs/grafana is one Prometheus answers."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator

import pytest

from launch import QUICK_EVAL, REPO_ROOT, Recorder, describe_failure, run_ranks
from prometheus_server import PrometheusServer, prometheus_binary

GRAFANA_DASHBOARD = REPO_ROOT / "docs" / "grafana" / "ddpwatch-dashboard.json"
#: Panels whose series a CPU run has none of: NVML's readings.
GPU_ONLY = ("ddpwatch_device_",)
#: Series that exist only while something is wrong (a stall), or counters a clean run leaves at
#: zero, whose increase is then 0: a valid query with no series, or series of 0.
ONLY_WHEN_WRONG = ("ddpwatch_stalled_seconds", "ddpwatch_stall_culprit", "ddpwatch_rejected_messages_total")


class ScrapedRun:
    def __init__(self, prometheus: PrometheusServer, summary: dict) -> None:
        self.prometheus = prometheus
        self.summary = summary


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScrapedRun]:
    """Prometheus scraping ``ddpwatch record`` every second from before the ranks start until
    after the recording's end (``--prometheus-linger``), when its final figures are served."""
    prometheus_binary()
    tmp_path = tmp_path_factory.mktemp("scraped")
    out = tmp_path / "session"
    with Recorder(out, "--idle-exit", "20", "--prometheus", "127.0.0.1:0", "--prometheus-linger", "60") as recorder:
        (notice,) = recorder.notices
        target = re.search(r"http://(\S+)/metrics", notice)
        assert target is not None, notice
        prometheus = PrometheusServer(tmp_path / "prometheus", target.group(1))
        try:
            _wait_for_up(prometheus)
            ranks = run_ranks(REPO_ROOT / "train.py", [*QUICK_EVAL, "--steps", "8", "--batch-size", "8", "--strategy", "bucket",
                                                       "--bucket-mb", "1", "--watch", recorder.address])
            assert all(rank.returncode == 0 for rank in ranks), describe_failure(ranks)
            summary_file = out / "summary.json"
            deadline = time.monotonic() + 60
            while not summary_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            summary = json.loads(summary_file.read_text())  # written before the final figures are served
            yield ScrapedRun(prometheus, summary)
        finally:
            prometheus.close()
            recorder.kill(signal.SIGINT)  # ends the lingering


def _wait_for_up(prometheus: PrometheusServer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if [item["value"][1] for item in prometheus.query('up{job="ddpwatch"}')] == ["1"]:
            return
        time.sleep(0.25)
    raise AssertionError("Prometheus never scraped ddpwatch's /metrics")


def test_promql_gives_each_ranks_step_time_and_overlap_of_summary_json(scraped_run: ScrapedRun) -> None:
    prometheus, summary = scraped_run.prometheus, scraped_run.summary
    (segment,) = summary["segments"]
    figures = {int(rank): f for rank, f in segment["per_rank"].items()}
    assert sorted(figures) == [0, 1] and all(f["steps"] == 7 for f in figures.values())  # step 1 left out
    # the final figures are in once a scrape after the goodbyes says every rank finished
    prometheus.wait_for('ddpwatch_rank_status{status="finished"}', lambda got: got == {0: 1.0, 1: 1.0})
    step_s = prometheus.by_rank("ddpwatch_step_seconds_sum / ddpwatch_step_seconds_count")
    assert step_s == pytest.approx({rank: f["step_ms_mean"] / 1000 for rank, f in figures.items()}, rel=1e-12)
    overlap = prometheus.by_rank("ddpwatch_overlap_ratio")
    assert overlap == pytest.approx({rank: f["overlap_pct"] / 100 for rank, f in figures.items()}, rel=1e-12)
    assert all(value > 0 for value in overlap.values())  # bucket overlaps its all-reduces with backward
    p50 = prometheus.by_rank('ddpwatch_step_seconds{quantile="0.5"}')
    assert p50 == pytest.approx({rank: f["step_ms_p50"] / 1000 for rank, f in figures.items()}, rel=1e-12)
    labels = {item["metric"]["rank"]: item["metric"] for item in prometheus.query("ddpwatch_overlap_ratio")}
    hosts = {rank["rank"]: rank["host"] for rank in summary["ranks"]}
    for rank, metric in labels.items():
        assert (metric["session"], metric["strategy"], metric["node"]) == (summary["session"], "bucket", "0")
        assert metric["host"] == hosts[int(rank)]
    # the run was watched live too: the step count rose scrape by scrape before the end
    counts = prometheus.query("count_over_time(ddpwatch_step_seconds_count[5m])")
    assert all(int(item["value"][1]) >= 3 for item in counts), counts


def grafana_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_query_of_the_grafana_dashboard_is_answered_by_prometheus(scraped_run: ScrapedRun) -> None:
    """Grafana cannot run here; its dashboard's PromQL is held against the real server instead,
    with the template's ``$session`` (every run) and ``$__rate_interval`` filled in as Grafana
    fills them."""
    prometheus = scraped_run.prometheus
    prometheus.wait_for('ddpwatch_rank_status{status="finished"}', lambda got: got == {0: 1.0, 1: 1.0})
    queries = grafana_queries()
    assert len(queries) >= 14
    empty = []
    for title, expr in queries:
        promql = expr.replace("$session", ".*").replace("$__rate_interval", "1m")
        if not prometheus.query(promql) and not any(name in expr for name in GPU_ONLY + ONLY_WHEN_WRONG):
            empty.append((title, expr))
    assert empty == []
