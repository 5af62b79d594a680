"""``ddpwatch record --prometheus --tensorboard --wandb`` through one 2-rank train.py run, each
output read back by its own tool: a real Prometheus server's PromQL gives, for each rank, the
step time and Overlap% of summary.json, and answers every query of the Grafana dashboard in
docs/grafana; tensorboard's reader and the W&B offline run file give each step and the segment's
figures of summary.json."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import wandb_offline
from launch import QUICK_EVAL, REPO_ROOT, Recorder, describe_failure, run_ranks
from prometheus_server import PrometheusServer, prometheus_binary

GRAFANA_DASHBOARD = REPO_ROOT / "docs" / "grafana" / "ddpwatch-dashboard.json"
STEPS = 8
#: Panels whose series a CPU run has none of: NVML's readings.
GPU_ONLY = ("ddpwatch_device_",)
#: Series that exist only while something is wrong (a stall), or counters a clean run has none of.
ONLY_WHEN_WRONG = ("ddpwatch_stalled_seconds", "ddpwatch_stall_culprit", "ddpwatch_rejected_messages_total")


class RecordedRun(NamedTuple):
    prometheus: PrometheusServer
    at: float  # a time (Unix s) when Prometheus had scraped the final figures
    summary: dict
    out: Path  # the recording's folder: W&B's run is in it
    tensorboard: Path


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordedRun]:
    """Prometheus scraping the recorder every second from before the ranks start until after
    the recording's end (``--prometheus-linger``), when its final figures are served; then the
    recorder stopped, so TensorBoard's and W&B's files are closed."""
    prometheus_binary()
    tmp_path = tmp_path_factory.mktemp("outputs")
    out, board = tmp_path / "session", tmp_path / "board"
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "ddpwatch-e2e"}
    with Recorder(out, "--idle-exit", "20", "--prometheus", "127.0.0.1:0", "--prometheus-linger", "60",
                  "--tensorboard", str(board), "--wandb", env=env) as recorder:
        target = re.search(r"http://(\S+)/metrics", "".join(recorder.notices))
        assert target is not None, recorder.notices
        prometheus = PrometheusServer(tmp_path / "prometheus", target.group(1))
        try:
            _wait_for_up(prometheus)
            ranks = run_ranks(REPO_ROOT / "train.py", [*QUICK_EVAL, "--steps", str(STEPS), "--batch-size", "8",
                                                       "--strategy", "bucket", "--bucket-mb", "1", "--watch", recorder.address])
            assert all(rank.returncode == 0 for rank in ranks), describe_failure(ranks)
            summary_file = out / "summary.json"
            deadline = time.monotonic() + 60
            while not summary_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            summary = json.loads(summary_file.read_text())  # written before the final figures are served
            prometheus.wait_for('ddpwatch_rank_status{status="finished"}', lambda got: got == {0: 1.0, 1: 1.0})
            at = time.time()
            recorder.kill(signal.SIGINT)  # ends the lingering: every output closes
            try:
                recorder.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError("ddpwatch record did not exit after Ctrl-C") from None
            yield RecordedRun(prometheus, at, summary, out, board)
        finally:
            prometheus.close()


def _wait_for_up(prometheus: PrometheusServer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if [item["value"][1] for item in prometheus.query('up{job="ddpwatch"}')] == ["1"]:
            return
        time.sleep(0.25)
    raise AssertionError("Prometheus never scraped ddpwatch's /metrics")


def per_rank_figures(run: RecordedRun) -> dict[int, dict]:
    (segment,) = run.summary["segments"]
    return {int(rank): f for rank, f in segment["per_rank"].items()}


def test_promql_gives_each_ranks_step_time_and_overlap_of_summary_json(recorded_run: RecordedRun) -> None:
    prometheus, at, figures = recorded_run.prometheus, recorded_run.at, per_rank_figures(recorded_run)
    assert sorted(figures) == [0, 1] and all(f["steps"] == STEPS - 1 for f in figures.values())  # step 1 left out
    step_s = prometheus.by_rank("ddpwatch_step_seconds_sum / ddpwatch_step_seconds_count", at)
    assert step_s == pytest.approx({rank: f["step_ms_mean"] / 1000 for rank, f in figures.items()}, rel=1e-12)
    overlap = prometheus.by_rank("ddpwatch_overlap_ratio", at)
    assert overlap == pytest.approx({rank: f["overlap_pct"] / 100 for rank, f in figures.items()}, rel=1e-12)
    assert all(value > 0 for value in overlap.values())  # bucket overlaps its all-reduces with backward
    p50 = prometheus.by_rank('ddpwatch_step_seconds{quantile="0.5"}', at)
    assert p50 == pytest.approx({rank: f["step_ms_p50"] / 1000 for rank, f in figures.items()}, rel=1e-12)
    hosts = {rank["rank"]: rank["host"] for rank in recorded_run.summary["ranks"]}
    for item in prometheus.query("ddpwatch_overlap_ratio", at):
        metric = item["metric"]
        assert (metric["session"], metric["strategy"], metric["node"]) == (recorded_run.summary["session"], "bucket", "0")
        assert metric["host"] == hosts[int(metric["rank"])]
    # the run was watched live too: scrapes while both ranks trained read them live
    assert prometheus.by_rank('max_over_time(ddpwatch_rank_status{status="live"}[5m])', at) == {0: 1.0, 1: 1.0}


def test_every_query_of_the_grafana_dashboard_is_answered_by_prometheus(recorded_run: RecordedRun) -> None:
    """Grafana cannot run here; its dashboard's PromQL is held against the real server instead,
    with the template's ``$session`` (every run) and ``$__rate_interval`` filled in as Grafana
    fills them."""
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    queries = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= 14
    empty = []
    for title, expr in queries:
        promql = expr.replace("$session", ".*").replace("$__rate_interval", "1m")
        if not recorded_run.prometheus.query(promql, recorded_run.at) and not any(
                name in expr for name in GPU_ONLY + ONLY_WHEN_WRONG):
            empty.append((title, expr))
    assert empty == []


def counted_steps(run: RecordedRun) -> list[int]:
    """The steps the figures count: step 1, which carries bucket's state broadcast, is excluded."""
    (segment,) = run.summary["segments"]
    assert segment["excluded_steps"] == [1]
    return [step for step in range(1, STEPS + 1) if step not in segment["excluded_steps"]]


def segment_expected(run: RecordedRun, name: str) -> float:
    (segment,) = run.summary["segments"]
    return float(segment[name])


def test_tensorboards_reader_gives_each_step_and_the_segments_figures(recorded_run: RecordedRun) -> None:
    (board,) = list(recorded_run.tensorboard.iterdir())
    assert board.name == recorded_run.summary["session"]
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("step/time_ms")] == counted_steps(recorded_run)
    assert all(e.value > 0 for e in events.Scalars("step/time_ms"))
    (mean,) = events.Scalars("segment/step_ms_mean")
    assert mean.step == STEPS and mean.value == pytest.approx(segment_expected(recorded_run, "step_ms_mean"), rel=1e-6)
    (steps,) = events.Scalars("segment/steps")
    assert steps.value == STEPS - 1


def test_the_wandb_offline_run_file_holds_each_step_and_the_segments_figures(recorded_run: RecordedRun) -> None:
    (run_file,) = recorded_run.out.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_offline.run_names(run_file) == ("ddpwatch-e2e", recorded_run.summary["session"])
    logged = wandb_offline.history(run_file)
    assert [step for step, _ in logged] == counted_steps(recorded_run)
    final = wandb_offline.summary(run_file)
    for tag, name in (("segment/step_ms_mean", "step_ms_mean"), ("segment/overlap_pct", "overlap_pct")):
        assert final[tag] == pytest.approx(segment_expected(recorded_run, name), rel=1e-12)
