"""One rank's torch.profiler trace as the doctor reads it: kernels (compute or NCCL, each with the
CPU time of the call that launched it), host-device syncs, and the ``ProfilerStep#N`` windows.

Kept apart from ``profile_check``, which holds these against ddpwatch's reports: what a trace
holds and how its names are read is one question (answered from kineto's and NCCL's sources,
below), how the two records are lined up and judged another.

Sources checked for names and categories (pytorch/kineto at 114171d, torch 2.13)
------------------------------------------------------------------------------
* kineto ``libkineto/include/ActivityType.h``: categories ``kernel``, ``gpu_memcpy``,
  ``cuda_runtime``, ``cuda_driver``, ``cpu_op``, ``user_annotation``, ``gpu_user_annotation``.
  The TensorBoard plugin (kineto ``tb_plugin/torch_tb_profiler/profiler/trace.py``, removed in
  ce32f50e) lowercases categories and also maps the older ``Kernel``/``Memcpy``/``Runtime``/
  ``Operator`` (its tests hold ``"cat": "Kernel"`` with ``ncclKernel_AllReduce_RING_LL_Sum_float``
  and ``ncclKernel_Broadcast_RING_LL_Sum_int8_t``): so do we.
* kineto ``libkineto/src/output_json.cpp``: activities are ``"ph": "X"`` events with ``ts``/``dur``
  in microseconds (ns precision), ``ts`` relative to the top-level ``baseTimeNanoseconds``; a
  kernel linked to PyTorch's ``record_param_comms`` op gets ``args["Collective name"]``.
* kineto ``CuptiActivity.h``/``cupti_strings.cpp``: memcpy names are
  ``"Memcpy {DtoH|HtoD|...} ({Pageable|Pinned|Device} -> ...)"``; runtime/driver names are CUPTI
  callback names with a ``_vNNNN`` suffix stripped (stripped here too); kernels, runtime and
  driver calls carry ``args["correlation"]``. ``CuptiCbidRegistry.cpp`` records
  ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, the ``cudaMemcpy*`` range and driver
  launches ``cuLaunchKernel``/``cuLaunchKernelEx`` (NCCL launches through
  ``cudaLaunchKernelExC`` or ``cuLaunchKernelEx``: kineto PR #788, pytorch PR #99571).
* NCCL kernel names ``ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)``
  (NCCL >= 2.19), ``ncclKernel_AllReduce_RING_LL_Sum_float(...)`` (older), ``ncclDevKernel_Generic``.
  NVIDIA/nccl#2196 (sjeaugey): a kernel's name need not name the operation it runs, so
  ``args["Collective name"]`` is preferred when present; a name that says nothing is kind ``nccl``.
* torch 2.13 ``torch/profiler/profiler.py``: ``record_function("ProfilerStep#" + str(step_num))``;
  torch 2.13's traces show it as ``"cat": "user_annotation"`` (``cpu_op`` in older traces).
* PyTorch ``_local_scalar_dense_cuda`` (``.item()``) copies into pinned memory through
  ``c10::cuda::memcpy_and_sync`` = ``cudaMemcpyAsync`` + ``cudaStreamSynchronize``.

Pure: standard library and ``instrumented_ddp.wire.time_ranges`` only.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instrumented_ddp.wire.time_ranges import TimeRange

__all__ = ["SYNC_CALLS", "Kernel", "ProfilerTrace", "SyncCall", "collective_kind", "load_trace", "parse_trace"]

_KERNEL_CATS = frozenset({"kernel"})
_CALL_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_MEMCPY_CATS = frozenset({"gpu_memcpy", "memcpy"})
_STEP_CATS = frozenset({"user_annotation", "cpu_op", "operator"})  # never gpu_user_annotation: GPU time
_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)")
_VERSION_SUFFIX = re.compile(r"_v\d{4,}$")

#: Host calls that block the CPU until the device catches up.
SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaThreadSynchronize",
    "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyPeer",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
})

# Order matters: "allreduce" and "reducescatter" both contain "reduce".
_KIND_TOKENS = (
    ("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
    ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("sendrecv", "send_recv"),
    ("reduce", "reduce"), ("send", "send_recv"), ("recv", "send_recv"),
)


@dataclass(frozen=True)
class Kernel:
    """A GPU kernel on the profiler's clock (µs). ``collective``: the NCCL operation's kind, or
    None for a compute kernel. ``launched_us``: CPU time of the call that launched it, when the
    trace links them (it places the kernel in its iteration without any clock)."""

    name: str
    start_us: float
    end_us: float
    collective: str | None = None
    launched_us: float | None = None

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def midpoint_us(self) -> float:
        return 0.5 * (self.start_us + self.end_us)


@dataclass(frozen=True)
class SyncCall:
    """A host-device synchronisation: a blocking call, or a DtoH copy to pageable memory (which
    blocks the host although issued as async). ``at_us``: CPU time of the call (for a copy, of its
    launch call when linked, else the copy's GPU start)."""

    name: str
    at_us: float


@dataclass(frozen=True)
class ProfilerTrace:
    """What the checks need from one rank's trace. ``steps``: ProfilerStep#N -> CPU window (µs)."""

    kernels: tuple[Kernel, ...]
    syncs: tuple[SyncCall, ...]
    steps: Mapping[int, TimeRange]

    @property
    def collectives(self) -> tuple[Kernel, ...]:
        return tuple(k for k in self.kernels if k.collective is not None)


def collective_kind(kernel_name: str, collective_name: str | None = None) -> str | None:
    """The NCCL operation of a kernel, or None for a non-NCCL kernel.

    PyTorch's own ``Collective name`` (from ``record_param_comms``) wins over the kernel name,
    since NCCL may run an operation inside a kernel named after another (NVIDIA/nccl#2196).
    An NCCL kernel whose names tell nothing (``ncclDevKernel_Generic``) is kind ``"nccl"``.
    """
    if not kernel_name.lower().startswith("nccl"):
        return None
    for text in (collective_name, kernel_name):
        if not text:
            continue
        key = text.lower().replace("_", "")
        for token, kind in _KIND_TOKENS:
            if token in key:
                return kind
    return "nccl"


def _events(trace: Mapping[str, Any] | Sequence[Any]) -> list[Mapping[str, Any]]:
    """The event list: Chrome traces are ``{"traceEvents": [...]}`` or, in old exports, a bare list."""
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: traceEvents is not a list")
    return [e for e in events if isinstance(e, Mapping)]


def _timing(event: Mapping[str, Any]) -> TimeRange | None:
    """(start, end) in µs of a complete event; None for anything else (metadata, counters, flows)."""
    if event.get("ph", "X") != "X":
        return None
    ts, dur = event.get("ts"), event.get("dur", 0)
    if isinstance(ts, bool) or isinstance(dur, bool) or not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
        return None
    if not (math.isfinite(ts) and math.isfinite(dur)) or dur < 0:
        return None
    return float(ts), float(ts) + float(dur)


def _args(event: Mapping[str, Any]) -> Mapping[str, Any]:
    args = event.get("args")
    return args if isinstance(args, Mapping) else {}


def _correlation(args: Mapping[str, Any]) -> int | None:
    value = args.get("correlation")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_pageable_dtoh(name: str) -> bool:
    """``Memcpy DtoH (Device -> Pageable)``: the host waits for it even when issued async."""
    return "DtoH" in name and "Pageable" in name


def parse_trace(trace: Mapping[str, Any] | Sequence[Any]) -> ProfilerTrace:
    """Kernels (compute or NCCL, with their launch times), sync calls and ProfilerStep windows.

    Categories are compared in lower case, so older traces (``Kernel``, ``Runtime``, ``Memcpy``)
    read the same as current ones.
    """
    calls: dict[int, tuple[str, float]] = {}  # correlation -> (API name, CPU time of the call)
    kernel_events: list[tuple[str, TimeRange, Mapping[str, Any]]] = []
    memcpys: list[tuple[str, TimeRange, Mapping[str, Any]]] = []
    steps: dict[int, TimeRange] = {}
    syncs: list[SyncCall] = []
    for event in _events(trace):
        timing = _timing(event)
        if timing is None:
            continue
        category, name, args = str(event.get("cat", "")).lower(), str(event.get("name", "")), _args(event)
        if category in _KERNEL_CATS:
            kernel_events.append((name, timing, args))
        elif category in _CALL_CATS:
            api = _VERSION_SUFFIX.sub("", name)
            correlation = _correlation(args)
            if correlation is not None:
                calls[correlation] = (api, timing[0])
            if api in SYNC_CALLS:
                syncs.append(SyncCall(api, timing[0]))
        elif category in _MEMCPY_CATS:
            memcpys.append((name, timing, args))
        elif category in _STEP_CATS:
            match = _PROFILER_STEP.fullmatch(name)
            if match and (int(match[1]) not in steps or timing[1] - timing[0] > steps[int(match[1])][1] - steps[int(match[1])][0]):
                steps[int(match[1])] = timing
    kernels = []
    for name, (start, end), args in kernel_events:
        correlation = _correlation(args)
        call = calls.get(correlation) if correlation is not None else None
        collective_name = args.get("Collective name")
        kernels.append(Kernel(name, start, end, collective_kind(name, collective_name if isinstance(collective_name, str) else None),
                              call[1] if call else None))
    for name, (start, _end), args in memcpys:
        correlation = _correlation(args)
        call = calls.get(correlation) if correlation is not None else None
        if _is_pageable_dtoh(name) and not (call and call[0] in SYNC_CALLS):  # a blocking cudaMemcpy counts once
            syncs.append(SyncCall(name, call[1] if call else start))
    return ProfilerTrace(
        kernels=tuple(sorted(kernels, key=lambda k: (k.start_us, k.end_us))),
        syncs=tuple(sorted(syncs, key=lambda s: s.at_us)),
        steps=dict(sorted(steps.items())),
    )


def load_trace(path: str | Path) -> ProfilerTrace:
    """Read a trace file as ``tensorboard_trace_handler`` writes it (``.json``, or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        return parse_trace(json.load(file))
