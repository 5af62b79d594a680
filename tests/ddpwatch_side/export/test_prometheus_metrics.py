"""``--prometheus``'s families (``export.prometheus_metrics``) and endpoint
(``export.prometheus_endpoint``), scraped over HTTP and read back with prometheus_client's own
parser, on the fixed two-rank session (``synthetic_session``): each rank's series are its
figures in summary.json's newest segment, labelled as documented and bounded per rank. A real
Prometheus server scrapes a recorded train.py run in ``record/test_prometheus_scrape.py``."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddpwatch.export.exporters import summary
from ddpwatch.export import prometheus_endpoint
from ddpwatch.export.prometheus_endpoint import LISTENER_SHARE, PUBLISH_EVERY_S, PrometheusEndpoint, endpoint_address
from ddpwatch.export.prometheus_metrics import RANK_LABELS, SERIES_PER_RANK
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from launch import REPO_ROOT
from synthetic_session import session_messages, waiting_ranks


@pytest.fixture
def endpoint() -> Iterator[PrometheusEndpoint]:
    served = PrometheusEndpoint("127.0.0.1:0")
    try:
        yield served
    finally:
        served.close()


def scraped(endpoint: PrometheusEndpoint) -> dict[str, list[Any]]:
    """The samples of each metric name (``_sum``, ``_count`` and the like by their own names)."""
    with urllib.request.urlopen(endpoint.url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[str, list[Any]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append(sample)
    return samples


def by_rank(samples: list[Any], **match: str) -> dict[int, float]:
    return {int(s.labels["rank"]): s.value for s in samples if all(s.labels.get(k) == v for k, v in match.items())}


def recorded(steps: int = 10, goodbye: bool = True) -> Session:
    session = Session()
    ingest(session, session_messages(steps=steps, goodbye=goodbye, edit=waiting_ranks(30.0)))
    return session


def test_each_ranks_series_are_its_figures_of_the_newest_segment_in_summary_json(endpoint: PrometheusEndpoint) -> None:
    """Steps 6-10 are the bucket segment's; rank 1 starts its first all-reduce 30 ms early each
    step, so it waits for rank 0, and what the others waited for is put down to rank 0."""
    session = recorded()
    endpoint.publish(session, now=0.0, final=True)
    got = scraped(endpoint)
    newest = summary(session)["segments"][-1]
    assert newest["strategy"] == "bucket"
    figures = {int(rank): f for rank, f in newest["per_rank"].items()}
    assert by_rank(got["ddpwatch_step_seconds_count"]) == {rank: f["steps"] for rank, f in figures.items()} == {0: 5, 1: 5}
    assert by_rank(got["ddpwatch_step_seconds_sum"]) == pytest.approx(
        {rank: f["step_ms_mean"] * f["steps"] / 1000 for rank, f in figures.items()}, rel=1e-12)
    assert by_rank(got["ddpwatch_step_seconds"], quantile="0.5") == pytest.approx(
        {rank: f["step_ms_p50"] / 1000 for rank, f in figures.items()})
    for metric, field in (("compute", "compute_pct"), ("non_compute", "non_compute_pct"), ("idle", "idle_pct"),
                          ("overlap", "overlap_pct"), ("data_wait", "data_wait_pct")):
        assert by_rank(got[f"ddpwatch_{metric}_ratio"]) == pytest.approx({r: f[field] / 100 for r, f in figures.items()})
    waited, waited_for = by_rank(got["ddpwatch_waited_seconds"]), by_rank(got["ddpwatch_waited_for_seconds"])
    assert waited[1] == pytest.approx(0.030, abs=1e-6) and waited[0] == 0.0
    assert waited_for[0] == pytest.approx(0.030, abs=1e-6) and waited_for[1] == 0.0
    assert by_rank(got["ddpwatch_busbw_bytes_per_second"], kind="all_reduce") == pytest.approx(
        {r: f["busbw_gbps"] * 1e9 for r, f in figures.items()})
    assert by_rank(got["ddpwatch_process_cpu_ratio"]) == pytest.approx({0: 0.90, 1: 0.91})  # step 10's reading
    assert by_rank(got["ddpwatch_rank_status"], status="finished") == {0: 1.0, 1: 1.0}
    assert by_rank(got["ddpwatch_rank_status"], status="live") == {0: 0.0, 1: 0.0}
    assert by_rank(got["ddpwatch_last_step"]) == {0: 10, 1: 10}
    assert [s.value for s in got["ddpwatch_ranks"]] == [2]
    assert [s.value for s in got["ddpwatch_desynced_steps_total"]] == [0]


def test_every_per_rank_series_has_the_five_labels_and_no_step_and_each_rank_a_bounded_count(
        endpoint: PrometheusEndpoint) -> None:
    session = recorded()
    endpoint.publish(session, now=0.0)
    per_rank: dict[str, int] = defaultdict(int)
    for name, samples in scraped(endpoint).items():
        for sample in samples:
            if "rank" in sample.labels and "host" in sample.labels:
                assert set(RANK_LABELS) <= set(sample.labels), name
                assert set(sample.labels) - set(RANK_LABELS) <= {"kind", "quantile", "where", "status"}, name
                assert sample.labels["session"] == "fixed-session" and sample.labels["host"] == "node-a"
                assert sample.labels["strategy"] == "bucket" and sample.labels["node"] == "0"
                per_rank[sample.labels["rank"]] += 1
    assert set(per_rank) == {"0", "1"}
    assert all(0 < count <= SERIES_PER_RANK for count in per_rank.values()), per_rank


def test_a_live_session_serves_only_folded_steps_and_the_families_are_replaced_whole(endpoint: PrometheusEndpoint) -> None:
    """Before any publish, /metrics is empty, not an error; ``look`` sooner than ``every_s``
    after the last publish makes nothing new (a scrape reads what was made)."""
    assert scraped(endpoint) == {}
    session = recorded(steps=8, goodbye=False)
    endpoint.look(session, now=100.0)
    first = endpoint.collector.families
    assert by_rank(scraped(endpoint)["ddpwatch_rank_status"], status="finished") == {0: 0.0, 1: 0.0}
    assert endpoint.every_s >= PUBLISH_EVERY_S
    endpoint.look(session, now=100.0 + endpoint.every_s * 0.9)
    assert endpoint.collector.families is first
    endpoint.look(session, now=100.0 + endpoint.every_s)
    assert endpoint.collector.families is not first


def test_families_slow_to_make_are_made_less_often_keeping_the_listeners_share(
        endpoint: PrometheusEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Families that take 50 ms to make are made every 2.5 s at most (50 ms is 2 % of it)."""
    def slow(session: Session, now: float, final: bool = False) -> list[Any]:
        time.sleep(0.05)
        return []

    monkeypatch.setattr(prometheus_endpoint, "metric_families", slow)
    endpoint.publish(recorded(steps=2), now=0.0)
    assert endpoint.every_s >= 0.05 / LISTENER_SHARE == pytest.approx(2.5)


@pytest.mark.parametrize(("text", "expected"), [("127.0.0.1:9400", ("127.0.0.1", 9400)), ("9400", ("127.0.0.1", 9400)),
                                                ("0.0.0.0:1", ("0.0.0.0", 1)), ("[::1]:9400", ("::1", 9400))])
def test_an_address_is_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert endpoint_address(text) == expected


@pytest.mark.parametrize(("text", "says"), [("localhost:", "port from 1 to 65535 or 0"), ("host:70000", "port from 1 to 65535 or 0"),
                                            (":9400", "give the host"), ("[fe::zz]:9400", "not an IPv6 address"),
                                            ("nine", "port from 1 to 65535 or 0")])
def test_a_wrong_address_is_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as refused:
        endpoint_address(text)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"--prometheus {text!r}")


def test_a_port_in_use_is_one_line_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"--prometheus 127.0.0.1:{port}: cannot listen there"):
            PrometheusEndpoint(f"127.0.0.1:{port}")


def test_the_docs_tables_name_every_metric_served_and_no_other(endpoint: PrometheusEndpoint) -> None:
    endpoint.publish(recorded(), now=0.0)
    with urllib.request.urlopen(endpoint.url, timeout=10) as response:
        served = {family.name for family in text_string_to_metric_families(response.read().decode())}
    page = (REPO_ROOT / "docs" / "guide" / "prometheus.md").read_text()
    documented = {name.removesuffix("_total") for name in re.findall(r"^\| `(ddpwatch_\w+)` \|", page, re.MULTILINE)}
    assert documented == served
    assert len(served) == 29
