"""``--prometheus HOST:PORT``: an HTTP ``/metrics`` endpoint that Prometheus scrapes.

The listener (the dashboard's frame, ``record``'s loop) makes the families from its session
(``prometheus_metrics``) once every ``PUBLISH_EVERY_S``, or less often where making them takes
more than ``LISTENER_SHARE`` of its time (a job of a thousand ranks), and swaps them in whole;
the HTTP thread prometheus_client starts only reads the newest list, so a scrape never touches
the session while the listener folds into it (it writes the text in the listener's process, on
that thread). The ranks never see it.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric

from ddpwatch.export.prometheus_metrics import metric_families
from ddpwatch.ingest.session import Session

#: How often the families are made again: a scrape interval is rarely under 5 s, and making them
#: at 1,024 ranks takes tens of ms of the listener's time.
PUBLISH_EVERY_S = 1.0
#: The most of the listener's time the families may take: at 1,024 ranks they take ~0.1-0.2 s,
#: so they are made every 5-10 s there, still inside a 15 s scrape interval.
LISTENER_SHARE = 0.02


def endpoint_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6; a bare ``PORT`` is ``127.0.0.1:PORT``; port 0: one
    the system picks, ``PrometheusEndpoint.url`` says which) as
    (host, port), or a ``ValueError`` in one line saying what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", text
    host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"--prometheus {text!r}: give HOST:PORT, with a port from 1 to 65535 or 0 for a free one "
                         "(e.g. 127.0.0.1:9400)")
    if not host:
        raise ValueError(f"--prometheus {text!r}: give the host to listen on (0.0.0.0 for every interface)")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"--prometheus {text!r}: {host} is not an IPv6 address (write it as [::1]:9400)") from None
    return host, int(port_text)


class SnapshotCollector:
    """A prometheus_client collector that yields the families last handed to it."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)  # one reference read: the list is replaced whole, never changed


class PrometheusEndpoint:
    """``/metrics`` on ``address`` (``endpoint_address``), served from a thread of its own until
    ``close``. A port that cannot be bound is an ``OSError`` naming the address, at start."""

    name = "--prometheus"

    def __init__(self, address: str) -> None:
        self.host, self.port = endpoint_address(address)
        self.collector = SnapshotCollector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)  # a collector is anything with collect()
        try:
            self._server, self._thread = start_http_server(self.port, self.host, registry=registry)
        except OSError as error:
            raise OSError(f"--prometheus {address}: cannot listen there ({error.strerror or error})") from None
        self.port = self._server.server_address[1]  # port 0: the one the system chose
        self._published_at = float("-inf")
        self.every_s = PUBLISH_EVERY_S  # how often ``look`` makes them: PUBLISH_EVERY_S, or longer (LISTENER_SHARE)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def look(self, session: Session, now: float) -> None:
        """Makes the families again once ``every_s`` has passed since the last time."""
        if now - self._published_at >= self.every_s:
            self.publish(session, now)

    def publish(self, session: Session, now: float, final: bool = False) -> None:
        """Makes the families now (``final``: the recording is over; see ``metric_families``)."""
        began = time.perf_counter()
        self.collector.families = metric_families(session, now, final)
        self.every_s = max(PUBLISH_EVERY_S, (time.perf_counter() - began) / LISTENER_SHARE)
        self._published_at = now

    def finish(self, session: Session, now: float) -> None:
        """The run is over: its final figures, served until ``close`` (or the next run's)."""
        self.publish(session, now, final=True)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
