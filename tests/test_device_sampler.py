"""Device readings: what the device cannot give is absent (never a made-up zero), units are
bytes, percent and watts, and the sampler thread publishes in the background and stops."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from instrumented_ddp.device_sampler import CpuReader, DeviceSampler, NvmlReader, make_reader
from instrumented_ddp.protocol import DeviceSample, decode, encode
from launch import wait_for

GPU_KEYS = {"gpu_util_pct", "mem_util_pct", "mem_used_bytes", "mem_total_bytes"}
POWER_PCIE_KEYS = {"power_w", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"}
NVLINK_KEYS = {"nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s"}


class FakeNvml:
    """Enough of ``pynvml`` for ``NvmlReader``; each capability can be switched off as NotSupported."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

    class NVMLError(Exception):
        def __init__(self, value: int = 3) -> None:
            super().__init__(value)
            self.value = value

    class NVMLError_NotSupported(NVMLError):
        def __init__(self) -> None:
            super().__init__(3)

    def __init__(self, power: bool = True, pcie: bool = True, nvlink: str = "ok") -> None:
        self.power, self.pcie, self.nvlink = power, pcie, nvlink  # nvlink: "ok", "raise" or "status"
        self.initialised = False
        self.handle = object()
        self.nvlink_kib = {138: 1000, 139: 3000}  # NVML's NVLink data counters, in KiB

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        assert self.initialised and index == 0
        return self.handle

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Any:
        assert handle is self.handle
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> Any:
        return SimpleNamespace(total=80 * 2**30, used=12 * 2**30, free=68 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        if not self.power:
            raise self.NVMLError_NotSupported()
        return 312_500  # milliwatts

    def nvmlDeviceGetPcieThroughput(self, handle: object, counter: int) -> int:
        if not self.pcie:
            raise self.NVMLError_NotSupported()
        return {self.NVML_PCIE_UTIL_TX_BYTES: 2000, self.NVML_PCIE_UTIL_RX_BYTES: 500}[counter]  # KB/s

    def nvmlDeviceGetFieldValues(self, handle: object, field_ids: list[int]) -> list[Any]:
        if self.nvlink == "raise":
            raise self.NVMLError_NotSupported()
        status = self.NVML_SUCCESS if self.nvlink == "ok" else self.NVML_ERROR_NOT_SUPPORTED
        return [
            SimpleNamespace(fieldId=f, nvmlReturn=status, value=SimpleNamespace(ullVal=self.nvlink_kib[f] if status == 0 else 0))
            for f in field_ids
        ]


@pytest.mark.parametrize("nvlink", ["raise", "status"], ids=["field-call-raises", "field-status-not-supported"])
def test_unsupported_power_pcie_and_nvlink_are_absent_not_zero(nvlink: str) -> None:
    reader = NvmlReader(0, nvml=FakeNvml(power=False, pcie=False, nvlink=nvlink))
    readings = reader.read()
    assert reader.kind == "gpu"
    assert set(readings) == GPU_KEYS
    assert readings["gpu_util_pct"] == 87.0 and readings["mem_util_pct"] == 41.0  # percent
    assert readings["mem_used_bytes"] == 12 * 2**30 and readings["mem_total_bytes"] == 80 * 2**30  # bytes
    assert all(type(value) is float for value in readings.values())


def test_everything_supported_gives_every_reading_in_its_unit() -> None:
    reader = NvmlReader(0, nvml=FakeNvml())
    reader.read()  # a rate may need a previous reading
    readings = reader.read()
    assert set(readings) == GPU_KEYS | POWER_PCIE_KEYS | NVLINK_KEYS
    assert readings["power_w"] == pytest.approx(312.5)  # NVML gives milliwatts
    assert readings["pcie_tx_bytes_per_s"] == 2000 * 1024 and readings["pcie_rx_bytes_per_s"] == 500 * 1024  # KB/s
    assert readings["nvlink_tx_bytes_per_s"] >= 0 and readings["nvlink_rx_bytes_per_s"] >= 0


def test_idle_nvlink_counter_reads_as_no_throughput() -> None:
    nvml = FakeNvml()
    reader = NvmlReader(0, nvml=nvml)
    reader.read()
    readings = reader.read()  # the counters did not move: nothing crossed NVLink
    assert readings.get("nvlink_tx_bytes_per_s", 0.0) == 0.0
    assert readings.get("nvlink_rx_bytes_per_s", 0.0) == 0.0


def test_cpu_reader_gives_process_and_host_cpu_and_rss() -> None:
    reader = CpuReader()
    sum(i * i for i in range(20_000))  # a little work between the two cpu_percent calls
    readings = reader.read()
    assert reader.kind == "cpu"
    assert {"process_cpu_pct", "host_cpu_pct", "rss_bytes"} <= set(readings)
    assert readings["process_cpu_pct"] >= 0 and 0 <= readings["host_cpu_pct"] <= 100
    assert readings["rss_bytes"] > 0


def test_make_reader_for_cpu_is_a_cpu_reader() -> None:
    assert isinstance(make_reader("cpu", None), CpuReader)


def test_make_reader_falls_back_to_cpu_when_nvml_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FakeNvml()

    def refuse() -> None:
        raise broken.NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    broken.nvmlInit = refuse  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert isinstance(make_reader("cuda", 0), CpuReader)


def test_make_reader_uses_nvml_when_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    assert isinstance(make_reader("cuda", 0), NvmlReader)


class ListReader:
    kind = "cpu"

    def __init__(self, fail_first: int = 0) -> None:
        self.calls = 0
        self.fail_first = fail_first

    def read(self) -> dict[str, float]:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("sensor glitch")
        return {"process_cpu_pct": float(self.calls)}


def test_sampler_publishes_device_samples_and_stops() -> None:
    published: list[DeviceSample] = []
    lock = threading.Lock()

    def publish(sample: DeviceSample) -> None:
        with lock:
            published.append(sample)

    sampler = DeviceSampler(rank=2, reader=CpuReader(), publish=publish, every_s=0.01).start()
    try:
        assert wait_for(lambda: len(published) >= 3, seconds=5.0)
    finally:
        sampler.stop()
    assert wait_for(lambda: not sampler._thread.is_alive(), seconds=1.0)
    with lock:
        count = len(published)
        samples = list(published)
    assert all(isinstance(s, DeviceSample) and s.rank == 2 and s.kind == "cpu" for s in samples)
    assert all("rss_bytes" in s.readings for s in samples)
    assert [s.time for s in samples] == sorted(s.time for s in samples)
    assert decode(encode(samples[0])).message == samples[0]  # what it publishes travels the wire
    time.sleep(0.05)
    assert len(published) == count  # nothing after stop


def test_sampler_survives_a_reader_that_raises() -> None:
    published: list[DeviceSample] = []
    reader = ListReader(fail_first=2)
    sampler = DeviceSampler(rank=0, reader=reader, publish=published.append, every_s=0.01).start()
    try:
        assert wait_for(lambda: len(published) >= 2, seconds=5.0)
    finally:
        sampler.stop()
    assert published[0].readings == {"process_cpu_pct": 3.0}

