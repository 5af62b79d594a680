"""A real Prometheus server (Debian's ``prometheus`` package, which ``.ci/run`` installs) on a
free loopback port, scraping one target every second, queried through its HTTP API; stopped
and its storage removed on exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from launch import free_port

SCRAPE_INTERVAL_S = 1


def prometheus_binary() -> str:
    """The server's path; without one, a skip where CI is not running, a failure where it is."""
    found = shutil.which("prometheus")
    if found is None:
        message = "no prometheus binary: apt-get install prometheus (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class PrometheusServer:
    def __init__(self, storage: Path, target: str) -> None:
        """``target``: HOST:PORT whose ``/metrics`` it scrapes, as job ``ddpwatch``."""
        storage.mkdir(parents=True, exist_ok=True)
        config = storage / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n  scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
                          f"scrape_configs:\n  - job_name: ddpwatch\n    static_configs:\n      - targets: ['{target}']\n")
        self.address = f"127.0.0.1:{free_port()}"
        self.log = storage / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={storage / 'data'}",
                 f"--web.listen-address={self.address}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in {timeout_s:g} s: {self.log.read_text()[-2000:]}")

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector (``/api/v1/query``), at ``at`` (Unix seconds; None:
        now); an error response fails the test."""
        asked = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode(asked)
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", (promql, answer)
        return answer["data"]["result"]

    def by_rank(self, promql: str, at: float | None = None) -> dict[int, float]:
        return {int(item["metric"]["rank"]): float(item["value"][1]) for item in self.query(promql, at)}

    def wait_for(self, promql: str, holds: Any, timeout_s: float = 30.0) -> dict[int, float]:
        """``by_rank(promql)`` once ``holds`` of it is true, polled for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, float] = {}
        while time.monotonic() < deadline:
            got = self.by_rank(promql)
            if holds(got):
                return got
            time.sleep(0.25)
        raise AssertionError(f"{promql} never held: last {got}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
