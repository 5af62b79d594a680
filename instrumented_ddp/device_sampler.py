"""Sample this rank's device in the background: NVML for its GPU, psutil where there is none.

Kept apart from everything else (as nvitop keeps its NVML layer apart from its UI): a reader
returns a dict of readings, and a reading the device cannot give is absent rather than zero,
so the dashboard never shows a made-up 0 %.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .protocol import DeviceSample

SAMPLE_EVERY_S = 0.2


class CpuReader:
    """Process CPU% (may pass 100 with several threads) and RSS, and the host's CPU%."""

    kind = "cpu"

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)

    def read(self) -> dict[str, float]:
        readings = {
            "process_cpu_pct": self._process.cpu_percent(None),
            "host_cpu_pct": self._psutil.cpu_percent(None),
        }
        try:
            readings["rss_bytes"] = float(self._process.memory_info().rss)
        except self._psutil.Error:
            pass
        return readings


class NvmlReader:
    """GPU utilisation, memory, power, PCIe and NVLink throughput through ``pynvml``."""

    kind = "gpu"

    def __init__(self, device_index: int, nvml: Any | None = None) -> None:
        if nvml is None:
            import pynvml as nvml  # provided by nvidia-ml-py
        self._nvml = nvml
        nvml.nvmlInit()
        self._handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        self._nvlink_last: dict[int, tuple[float, float]] = {}  # field -> (KiB so far, when)

    def read(self) -> dict[str, float]:
        nvml, handle = self._nvml, self._handle
        readings: dict[str, float] = {}

        def attempt(name: str, read: Callable[[], float]) -> None:
            try:
                readings[name] = float(read())
            except nvml.NVMLError:  # NotSupported, NoPermission, ...: absent, not zero
                pass

        attempt("gpu_util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        attempt("mem_util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).memory)
        attempt("mem_used_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used)
        attempt("mem_total_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total)
        attempt("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        attempt("pcie_tx_bytes_per_s", lambda: nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024.0)
        attempt("pcie_rx_bytes_per_s", lambda: nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024.0)
        attempt("nvlink_tx_bytes_per_s", lambda: self._nvlink_throughput(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX))
        attempt("nvlink_rx_bytes_per_s", lambda: self._nvlink_throughput(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX))
        return readings

    def _nvlink_throughput(self, field_id: int) -> float:
        """NVML's NVLink throughput fields are running KiB totals: the rate is their difference
        over time, so the first read has no rate yet (absent)."""
        (value,) = self._nvml.nvmlDeviceGetFieldValues(self._handle, [field_id])
        if value.nvmlReturn != self._nvml.NVML_SUCCESS:
            raise self._nvml.NVMLError(value.nvmlReturn)
        total_kib, now = float(value.value.ullVal), time.monotonic()
        previous = self._nvlink_last.get(field_id)
        self._nvlink_last[field_id] = (total_kib, now)
        if previous is None or now <= previous[1]:
            raise self._nvml.NVMLError(self._nvml.NVML_ERROR_NOT_SUPPORTED)
        return (total_kib - previous[0]) * 1024.0 / (now - previous[1])


def make_reader(device_type: str, device_index: int | None) -> CpuReader | NvmlReader:
    """NVML for a CUDA device when pynvml works; otherwise the CPU readings."""
    if device_type == "cuda":
        try:
            return NvmlReader(device_index or 0)
        except Exception:  # no pynvml, no driver: fall back, do not fail training
            pass
    return CpuReader()


class DeviceSampler:
    """A daemon thread that samples at ~5 Hz and hands each sample to ``publish``."""

    def __init__(self, rank: int, reader: CpuReader | NvmlReader, publish: Callable[[DeviceSample], None], every_s: float = SAMPLE_EVERY_S) -> None:
        self.rank, self.reader, self.publish, self.every_s = rank, reader, publish, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ddpwatch-sampler-{rank}", daemon=True)

    def start(self) -> DeviceSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.every_s)

    def sample(self) -> DeviceSample:
        return DeviceSample(self.rank, time.perf_counter(), self.reader.kind, self.reader.read())

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.publish(self.sample())
            except Exception:  # a sampler must never take training down
                continue
