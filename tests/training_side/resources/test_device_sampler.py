"""Device readings: what the device cannot give is absent (never a made-up zero), units are
bytes, percent and watts, the GPU read is the rank's own (found by UUID or PCI bus id, never by
an index that CUDA_VISIBLE_DEVICES remaps), a CUDA rank without NVML says why, and the sampler
thread publishes in the background and stops."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from instrumented_ddp.resources.device_sampler import (
    CpuReader,
    CudaDeviceIdentity,
    DeviceSampler,
    NvmlReader,
    NvmlUnavailable,
    cuda_device_identity,
    make_reader,
)
from instrumented_ddp.wire.codec import decode, encode
from instrumented_ddp.wire.messages import DeviceSample
from launch import wait_for

GPU_KEYS = {"gpu_util_pct", "mem_util_pct", "mem_used_bytes", "mem_total_bytes"}
POWER_PCIE_KEYS = {"power_w", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"}
NVLINK_KEYS = {"nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s"}


def gpu_uuid(physical: int) -> str:
    """The UUID of physical GPU ``physical`` as CUDA/torch print it (no "GPU-" prefix)."""
    return f"{physical:08x}-1111-4222-8333-44445555666{physical}"


def gpu_bus_id(physical: int) -> str:
    return f"00000000:{0x18 + 0x20 * physical:02X}:00.0"  # 18, 38, 58, 78: as NVML writes them


class FakeNvml:
    """Enough of ``pynvml`` for ``NvmlReader``: physical GPUs 0..gpus-1 in NVML's numbering, each
    with its own UUID, PCI bus id and readings (GPU i: utilisation 10*(i+1) %, i+1 GiB used);
    each capability can be switched off as NotSupported."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    ERROR_TEXT = {3: "Not Supported", 6: "Not Found", 9: "Driver Not Loaded"}

    class NVMLError(Exception):
        def __init__(self, value: int = 3) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:  # pynvml's str() is NVML's error string
            return FakeNvml.ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")

    class NVMLError_NotSupported(NVMLError):
        def __init__(self) -> None:
            super().__init__(3)

    def __init__(self, power: bool = True, pcie: bool = True, nvlink: str = "ok", gpus: int = 4,
                 mig: dict[str, int] | None = None) -> None:
        self.power, self.pcie, self.nvlink = power, pcie, nvlink  # nvlink: "ok", "raise" or "status"
        self.initialised = 0
        self.handles = [SimpleNamespace(physical=i) for i in range(gpus)]
        self.by_uuid = {f"GPU-{gpu_uuid(i)}": h for i, h in enumerate(self.handles)}
        self.by_uuid.update({f"MIG-{u}": self.handles[i] for u, i in (mig or {}).items()})
        self.by_bus_id = {gpu_bus_id(i): h for i, h in enumerate(self.handles)}
        self.lookups: list[tuple[str, Any]] = []
        self.nvlink_kib = {138: 1000, 139: 3000}  # NVML's NVLink data counters, in KiB

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # NVML's numbering: every physical GPU
        self.lookups.append(("index", index))
        return self.handles[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes | str) -> object:
        return self._lookup("uuid", uuid, self.by_uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: bytes | str) -> object:
        return self._lookup("pci_bus_id", bus_id, self.by_bus_id)

    def _lookup(self, kind: str, key: bytes | str, table: Mapping[str, object]) -> object:
        """NVML's lookups take bytes or str and raise NotFound for an id they do not know."""
        self.lookups.append((kind, key))
        assert self.initialised
        text = key.decode() if isinstance(key, bytes) else key
        if text not in table:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return table[text]

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        assert handle in self.handles
        return SimpleNamespace(gpu=10 * (handle.physical + 1), memory=41)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        used = (handle.physical + 1) * 2**30
        return SimpleNamespace(total=80 * 2**30, used=used, free=80 * 2**30 - used)

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


class FakeCUuuid:
    """Like torch's ``_CUuuid``: ``str()`` is the bare lower-case UUID, without NVML's "GPU-"."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def fake_torch(visible: list[int], uuid: bool = True, pci: bool = True) -> Any:
    """A torch whose CUDA devices are the physical GPUs ``visible`` (CUDA_VISIBLE_DEVICES=2,3 gives
    [2, 3]: cuda:0 is physical GPU 2); ``uuid``/``pci``: whether its properties carry them."""

    def get_device_properties(index: int) -> Any:
        physical = visible[index]  # IndexError for an index CUDA does not have
        props = SimpleNamespace(name="Fake H100", total_memory=80 * 2**30)
        if uuid:
            props.uuid = FakeCUuuid(gpu_uuid(physical))
        if pci:
            props.pci_domain_id, props.pci_bus_id, props.pci_device_id = 0, 0x18 + 0x20 * physical, 0
        return props

    return SimpleNamespace(cuda=SimpleNamespace(get_device_properties=get_device_properties, current_device=lambda: 1))


def physical(i: int) -> CudaDeviceIdentity:
    """The identity of the CUDA device that is physical GPU ``i`` (no remapping)."""
    return CudaDeviceIdentity(i, gpu_uuid(i), gpu_bus_id(i))


@pytest.mark.parametrize("nvlink", ["raise", "status"], ids=["field-call-raises", "field-status-not-supported"])
def test_unsupported_power_pcie_and_nvlink_are_absent_not_zero(nvlink: str) -> None:
    reader = NvmlReader(physical(0), nvml=FakeNvml(power=False, pcie=False, nvlink=nvlink))
    readings = reader.read()
    assert reader.kind == "gpu"
    assert set(readings) == GPU_KEYS
    assert readings["gpu_util_pct"] == 10.0 and readings["mem_util_pct"] == 41.0  # percent
    assert readings["mem_used_bytes"] == 2**30 and readings["mem_total_bytes"] == 80 * 2**30  # bytes
    assert all(type(value) is float for value in readings.values())


def test_everything_supported_gives_every_reading_in_its_unit() -> None:
    reader = NvmlReader(physical(0), nvml=FakeNvml())
    reader.read()  # a rate may need a previous reading
    readings = reader.read()
    assert set(readings) == GPU_KEYS | POWER_PCIE_KEYS | NVLINK_KEYS
    assert readings["power_w"] == pytest.approx(312.5)  # NVML gives milliwatts
    assert readings["pcie_tx_bytes_per_s"] == 2000 * 1024 and readings["pcie_rx_bytes_per_s"] == 500 * 1024  # KB/s
    assert readings["nvlink_tx_bytes_per_s"] >= 0 and readings["nvlink_rx_bytes_per_s"] >= 0


def test_idle_nvlink_counter_reads_as_no_throughput() -> None:
    nvml = FakeNvml()
    reader = NvmlReader(physical(0), nvml=nvml)
    reader.read()
    readings = reader.read()  # the counters did not move: nothing crossed NVLink
    assert readings.get("nvlink_tx_bytes_per_s", 0.0) == 0.0
    assert readings.get("nvlink_rx_bytes_per_s", 0.0) == 0.0


# Which GPU: CUDA_VISIBLE_DEVICES=2,3 makes physical GPU 2 torch's cuda:0 and GPU 3 its cuda:1.


@pytest.mark.parametrize("cuda_index,expected", [(0, 2), (1, 3)])
def test_reader_reads_the_physical_gpu_behind_a_remapped_cuda_index(cuda_index: int, expected: int) -> None:
    nvml = FakeNvml(gpus=4)
    identity = cuda_device_identity(fake_torch(visible=[2, 3]), cuda_index)
    reader, note = make_reader("cuda", identity, nvml=nvml)
    assert note == "" and isinstance(reader, NvmlReader)
    readings = reader.read()
    assert readings["gpu_util_pct"] == 10.0 * (expected + 1)  # GPU 2's readings, not GPU 0's
    assert readings["mem_used_bytes"] == (expected + 1) * 2**30
    assert reader.found_by == "uuid"
    assert nvml.lookups == [("uuid", f"GPU-{gpu_uuid(expected)}".encode())]  # never by index


def test_identity_carries_torchs_uuid_and_nvmls_bus_id_form() -> None:
    identity = cuda_device_identity(fake_torch(visible=[2, 3]), 0)
    assert identity == CudaDeviceIdentity(0, gpu_uuid(2), "00000000:58:00.0")
    assert cuda_device_identity(fake_torch(visible=[2, 3]), None).index == 1  # the current device
    props = SimpleNamespace(uuid=FakeCUuuid("GPU-ABCDEF01-2345-6789-ABCD-EF0123456789"),
                            pci_domain_id=0x1, pci_bus_id=0x3B, pci_device_id=0x1F)
    torch_like = SimpleNamespace(cuda=SimpleNamespace(get_device_properties=lambda i: props))
    assert cuda_device_identity(torch_like, 5) == CudaDeviceIdentity(5, "GPU-abcdef01-2345-6789-abcd-ef0123456789", "00000001:3B:1F.0")


def test_identity_is_none_where_torch_cannot_tell() -> None:
    assert cuda_device_identity(fake_torch(visible=[2], uuid=False, pci=False), 0) == CudaDeviceIdentity(0, None, None)
    assert cuda_device_identity(fake_torch(visible=[2]), 7) == CudaDeviceIdentity(7, None, None)  # torch raises
    odd = SimpleNamespace(uuid=FakeCUuuid("00000000-0000-0000-0000-000000000000"), pci_bus_id="3b")
    torch_like = SimpleNamespace(cuda=SimpleNamespace(get_device_properties=lambda i: odd))
    assert cuda_device_identity(torch_like, 0) == CudaDeviceIdentity(0, None, None)


def test_reader_finds_the_gpu_by_pci_bus_id_when_torch_gives_no_uuid() -> None:
    nvml = FakeNvml(gpus=4)
    identity = cuda_device_identity(fake_torch(visible=[2, 3], uuid=False), 0)
    assert identity.uuid is None
    reader = NvmlReader(identity, nvml=nvml)
    assert reader.found_by == "pci_bus_id" and reader.read()["gpu_util_pct"] == 30.0  # GPU 2
    assert nvml.lookups == [("pci_bus_id", gpu_bus_id(2).encode())]


def test_reader_falls_back_to_pci_bus_id_when_nvml_does_not_know_the_uuid() -> None:
    nvml = FakeNvml(gpus=4)
    nvml.by_uuid.clear()
    reader = NvmlReader(physical(3), nvml=nvml)
    assert reader.found_by == "pci_bus_id" and reader.read()["gpu_util_pct"] == 40.0
    assert [kind for kind, _ in nvml.lookups] == ["uuid", "uuid", "pci_bus_id"]  # GPU-, MIG-, then bus id


def test_a_mig_instance_is_found_by_its_mig_uuid() -> None:
    mig = "deadbeef-0000-4000-8000-00000000abcd"  # CUDA reports a MIG instance's own UUID
    nvml = FakeNvml(gpus=4, mig={mig: 1})
    reader = NvmlReader(CudaDeviceIdentity(0, mig, gpu_bus_id(1)), nvml=nvml)
    assert reader.found_by == "uuid"
    assert nvml.lookups == [("uuid", f"GPU-{mig}".encode()), ("uuid", f"MIG-{mig}".encode())]


# Why not NVML: a CUDA rank that sends CPU readings says so in one line.


def assert_cpu_with_note(result: tuple[Any, str], *fragments: str) -> str:
    reader, note = result
    assert isinstance(reader, CpuReader)
    assert note and "\n" not in note
    assert "sending CPU readings instead" in note
    for fragment in fragments:
        assert fragment in note
    return note


def test_make_reader_for_cpu_is_a_cpu_reader_without_a_note() -> None:
    reader, note = make_reader("cpu")
    assert isinstance(reader, CpuReader) and note == ""


def test_make_reader_uses_nvml_when_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    reader, note = make_reader("cuda", physical(0))
    assert isinstance(reader, NvmlReader) and note == ""


def test_note_when_pynvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert_cpu_with_note(make_reader("cuda", physical(0)), "cuda:0", "pynvml cannot be imported", "pip install nvidia-ml-py")


def test_note_when_nvml_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FakeNvml()

    def refuse() -> None:
        raise broken.NVMLError(broken.NVML_ERROR_DRIVER_NOT_LOADED)

    broken.nvmlInit = refuse  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert_cpu_with_note(make_reader("cuda", physical(1)), "cuda:1", "nvmlInit failed: Driver Not Loaded")


def test_note_when_nvml_has_no_such_device() -> None:
    nvml = FakeNvml(gpus=2)  # the rank's GPU is not one NVML sees (another container's, say)
    note = assert_cpu_with_note(make_reader("cuda", physical(3), nvml=nvml), "cuda:3", "Not Found",
                                f"UUID GPU-{gpu_uuid(3)}", f"PCI bus id {gpu_bus_id(3)}")
    assert note.startswith("NVML not used for cuda:3 (NVML has no device with")
    assert nvml.initialised == 0  # the nvmlInit was balanced by an nvmlShutdown
    assert all(kind != "index" for kind, _ in nvml.lookups)  # not even as a last resort


def test_note_when_torch_gives_no_uuid_or_bus_id() -> None:
    assert_cpu_with_note(make_reader("cuda", CudaDeviceIdentity(0, None, None), nvml=FakeNvml()),
                         "cuda:0", "neither a UUID nor a PCI bus id")


def test_note_when_no_identity_is_given() -> None:
    assert_cpu_with_note(make_reader("cuda", None, nvml=FakeNvml()), "no device identity")


def test_note_when_nvml_fails_in_an_unexpected_way() -> None:
    nvml = FakeNvml()

    def explode(uuid: bytes | str) -> object:
        raise OSError("libnvidia-ml.so: cannot open\nshared object file")

    nvml.nvmlDeviceGetHandleByUUID = explode  # type: ignore[method-assign]
    assert_cpu_with_note(make_reader("cuda", physical(0), nvml=nvml), "OSError", "cannot open shared object file")


def test_real_pynvml_without_the_device_falls_back_with_a_note() -> None:
    """The installed pynvml (a core dependency): with no driver nvmlInit fails; on a GPU box no
    GPU has this made-up UUID and bus id. Either way: CPU readings and a note, no exception."""
    pytest.importorskip("pynvml")
    identity = CudaDeviceIdentity(0, "feedface-0000-4000-8000-000000000000", "0000FFFF:FF:1F.0")
    assert_cpu_with_note(make_reader("cuda", identity), "cuda:0")


def test_nvml_reader_raises_nvml_unavailable_itself() -> None:
    with pytest.raises(NvmlUnavailable, match="NVML has no device"):
        NvmlReader(physical(5), nvml=FakeNvml(gpus=4))


def test_cpu_reader_gives_process_and_host_cpu_and_rss() -> None:
    reader = CpuReader()
    sum(i * i for i in range(20_000))  # a little work between the two cpu_percent calls
    readings = reader.read()
    assert reader.kind == "cpu"
    assert {"process_cpu_pct", "host_cpu_pct", "rss_bytes"} <= set(readings)
    assert readings["process_cpu_pct"] >= 0 and 0 <= readings["host_cpu_pct"] <= 100
    assert readings["rss_bytes"] > 0


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



def test_a_listener_can_ask_for_fewer_samples_never_more() -> None:
    from instrumented_ddp.resources.device_sampler import SAMPLE_EVERY_S, CpuReader, DeviceSampler

    sampler = DeviceSampler(0, CpuReader(), lambda sample: None)  # not started: no thread
    sampler.sample_every(1.0)
    assert sampler.every_s == 1.0
    sampler.sample_every(0.01)
    assert sampler.every_s == SAMPLE_EVERY_S
    sampler.sample_every(0.0)  # the listener's default: the rank's own rate
    assert sampler.every_s == SAMPLE_EVERY_S
