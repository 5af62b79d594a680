"""Sample this rank's device in the background: NVML for its GPU, psutil where there is none.

Kept apart from everything else (as nvitop keeps its NVML layer apart from its UI): a reader
returns a dict of readings, and a reading the device cannot give is absent rather than zero,
so the dashboard never shows a made-up 0 %.

Which GPU is "this rank's" is decided by identity, never by index. torch numbers the GPUs that
``CUDA_VISIBLE_DEVICES`` leaves visible (SLURM, Kubernetes and one-GPU-per-process launchers
remap it), while NVML numbers every physical GPU, so ``cuda:0`` may well be NVML's GPU 2. As
nvitop does, :func:`cuda_device_identity` asks torch (passed in, not imported here) for the
device's UUID and PCI bus id, and :class:`NvmlReader` finds NVML's handle by the UUID first,
then by the PCI bus id; the CUDA index only names the device in messages. :func:`make_reader`
falls back to CPU readings when NVML cannot be used, and then returns a one-line note saying
why, which the rank sends in its hello so the dashboard can show it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from instrumented_ddp.wire.messages import DeviceSample

SAMPLE_EVERY_S = 0.2

#: A UUID as CUDA and torch print it (8-4-4-4-12 hex), maybe with NVML's "GPU-"/"MIG-" prefix.
_UUID = re.compile(r"^(?:(GPU|MIG)-)?([0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12})$")


@dataclass(frozen=True)
class CudaDeviceIdentity:
    """Who a CUDA device is, in terms that survive ``CUDA_VISIBLE_DEVICES`` remapping.

    ``index``: torch's CUDA index (for messages only). ``uuid``: the device's UUID as CUDA
    reports it, lower-case 8-4-4-4-12 hex without NVML's ``GPU-`` prefix (a prefixed form is
    kept as given). ``pci_bus_id``: NVML's form ``DDDDDDDD:BB:DD.0`` (upper-case hex, as
    ``NVML_DEVICE_PCI_BUS_ID_FMT``). Either is None where torch does not give it.
    """

    index: int
    uuid: str | None
    pci_bus_id: str | None


def _uuid_text(raw: Any) -> str | None:
    """torch's ``_CUuuid`` prints as bare lower-case hex (no ``GPU-``); a str is taken too."""
    if raw is None:
        return None
    try:
        text = str(raw).strip()
    except Exception:
        return None
    match = _UUID.match(text)
    if match is None or set(match.group(2)) <= {"0", "-"}:  # absent, or an all-zero placeholder
        return None
    prefix, body = match.groups()
    return f"{prefix}-{body.lower()}" if prefix else body.lower()


def _pci_bus_id_text(properties: Any) -> str | None:
    """``pci_domain_id``, ``pci_bus_id``, ``pci_device_id`` (ints, cudaDeviceProp's fields) as
    NVML writes a bus id: ``%08X:%02X:%02X.0``."""
    try:
        domain, bus, device = (getattr(properties, name) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    except AttributeError:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (domain, bus, device)):
        return None
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def cuda_device_identity(torch_module: Any, index: int | None) -> CudaDeviceIdentity:
    """The UUID and PCI bus id torch gives for CUDA device ``index`` (None: the current one).

    Never raises: what torch cannot tell is None, and :func:`make_reader` says so in its note.
    """
    try:
        if index is None:
            index = int(torch_module.cuda.current_device())
        properties = torch_module.cuda.get_device_properties(index)
    except Exception:
        return CudaDeviceIdentity(index if index is not None else 0, None, None)
    return CudaDeviceIdentity(index, _uuid_text(getattr(properties, "uuid", None)), _pci_bus_id_text(properties))


class NvmlUnavailable(Exception):
    """Why NVML cannot read this device (one line, for the rank's hello)."""


class DeviceReader(Protocol):
    """What the sampler reads: ``CpuReader`` or ``NvmlReader`` (``make_reader`` picks)."""

    kind: str

    def read(self) -> dict[str, float]: ...


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

    def __init__(self, identity: CudaDeviceIdentity, nvml: Any | None = None) -> None:
        """Raises :class:`NvmlUnavailable` saying why when there is no NVML handle for it."""
        library: Any = nvml if nvml is not None else self._import_pynvml()
        self._nvml = library
        self.identity = identity
        try:
            library.nvmlInit()
        except library.NVMLError as error:
            raise NvmlUnavailable(f"nvmlInit failed: {error}") from error
        try:
            self._handle, self.found_by = self._find_handle(library, identity)
        except NvmlUnavailable:
            try:
                library.nvmlShutdown()  # balance the nvmlInit above
            except Exception:
                pass
            raise
        self._nvlink_last: dict[int, tuple[float, float]] = {}  # field -> (KiB so far, when)

    @staticmethod
    def _import_pynvml() -> Any:
        """The ``pynvml`` module, imported only when no NVML stand-in is passed in (the tests pass one)."""
        try:
            import pynvml  # provided by nvidia-ml-py
        except ImportError as error:
            raise NvmlUnavailable(f"pynvml cannot be imported ({error}); pip install nvidia-ml-py") from error
        return pynvml

    @staticmethod
    def _find_handle(nvml: Any, identity: CudaDeviceIdentity) -> tuple[Any, str]:
        """NVML's handle by UUID (``GPU-<uuid>``, then ``MIG-<uuid>`` for a MIG instance, as nvitop
        tries), else by PCI bus id; never by index. Returns the handle and what found it."""
        if identity.uuid is None and identity.pci_bus_id is None:
            raise NvmlUnavailable("torch gives neither a UUID nor a PCI bus id to find it by")
        misses: list[str] = []
        if identity.uuid is not None:
            candidates = [identity.uuid] if identity.uuid[:4] in ("GPU-", "MIG-") else [f"GPU-{identity.uuid}", f"MIG-{identity.uuid}"]
            errors: list[str] = []
            for candidate in candidates:
                try:
                    return nvml.nvmlDeviceGetHandleByUUID(candidate.encode()), "uuid"
                except nvml.NVMLError as error:
                    errors.append(str(error))
            misses.append(f"UUID {candidates[0]} ({'; '.join(dict.fromkeys(errors))})")
        if identity.pci_bus_id is not None:
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(identity.pci_bus_id.encode()), "pci_bus_id"
            except nvml.NVMLError as error:
                misses.append(f"PCI bus id {identity.pci_bus_id} ({error})")
        raise NvmlUnavailable("NVML has no device with " + " nor ".join(misses))

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


def make_reader(device_type: str, identity: CudaDeviceIdentity | None = None,
                nvml: Any | None = None) -> tuple[CpuReader | NvmlReader, str]:
    """The reader for this rank's device, and a note: "" when NVML reads a CUDA device (or the
    device is the CPU), else one line saying why NVML is not used and that CPU readings are
    sent instead. Never raises for NVML's sake: a sampler must not fail training."""
    if device_type != "cuda":
        return CpuReader(), ""
    label = f"cuda:{identity.index}" if identity is not None else "this CUDA device"
    try:
        if identity is None:
            raise NvmlUnavailable("no device identity was given to look it up by")
        return NvmlReader(identity, nvml=nvml), ""
    except NvmlUnavailable as error:
        reason = str(error)
    except Exception as error:  # a broken pynvml, an odd driver: still fall back, and say so
        reason = f"{type(error).__name__}: {error}"
    reason = " ".join(reason.split())  # one line
    return CpuReader(), f"NVML not used for {label} ({reason}); sending CPU readings instead"


class DeviceSampler:
    """A daemon thread that samples at ~5 Hz and hands each sample to ``publish``."""

    def __init__(self, rank: int, reader: DeviceReader, publish: Callable[[DeviceSample], None], every_s: float = SAMPLE_EVERY_S) -> None:
        self.rank, self.reader, self.publish, self.every_s = rank, reader, publish, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ddpwatch-sampler-{rank}", daemon=True)

    def start(self) -> DeviceSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.every_s)

    def sample_every(self, seconds: float) -> None:
        """As often as the listener asks (``SpanRequest.device_every_s``), never more often than
        the default; 0 puts the default back. Read by the thread at its next wait."""
        self.every_s = max(SAMPLE_EVERY_S, seconds)

    def sample(self) -> DeviceSample:
        return DeviceSample(self.rank, time.perf_counter(), self.reader.kind, self.reader.read())

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.publish(self.sample())
            except Exception:  # a sampler must never take training down
                continue
