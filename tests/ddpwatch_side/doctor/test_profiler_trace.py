"""Reading a torch.profiler trace (``ddpwatch/doctor/profiler_trace.py``): kernel kinds, categories old
and new, plain and gzipped files. The checks built on it are in ``test_profile_check.py``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ddpwatch.doctor.profiler_trace import collective_kind, load_trace, parse_trace
from profiled_run import ALL_REDUCE, BROADCAST, standard_trace


@pytest.mark.parametrize(("name", "collective_name", "kind"), [
    (ALL_REDUCE, None, "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", None, "all_reduce"),
    (BROADCAST, None, "broadcast"),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclWorkElem)", None, "broadcast"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", None, "reduce_scatter"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", None, "all_gather"),
    ("ncclDevKernel_Reduce_Sum_f32_RING_LL(...)", None, "reduce"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", None, "send_recv"),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", None, "nccl"),
    # PyTorch's own name for the operation wins over a kernel name that may not tell it (NVIDIA/nccl#2196).
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "allreduce", "all_reduce"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)", "_allgather_base", "all_gather"),
    ("void at::native::vectorized_elementwise_kernel<4>(...)", None, None),
    ("ampere_sgemm_128x64_nn", "allreduce", None),  # not an NCCL kernel, whatever its args say
])
def test_collective_kind_from_the_kernel_name(name: str, collective_name: str | None, kind: str | None) -> None:
    assert collective_kind(name, collective_name) == kind


def test_parse_reads_current_and_older_categories() -> None:
    """Older traces capitalise categories (Kernel, Runtime, Memcpy) and mark steps as cpu_op;
    CUPTI names may keep their _vNNNN suffix; a GPU-side ProfilerStep annotation is GPU time."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#3", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 5.0, "dur": 500.0},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel_v7000", "ts": 10.0, "dur": 2.0, "args": {"correlation": 5}},
        {"ph": "X", "cat": "Kernel", "name": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "ts": 20.0, "dur": 30.0,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "Runtime", "name": "cudaStreamSynchronize_v3020", "ts": 60.0, "dur": 9.0},
        {"ph": "X", "cat": "Memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 61.0, "dur": 1.0},
        {"ph": "M", "name": "process_name", "args": {"name": "python"}},
        {"ph": "X", "cat": "kernel", "name": "broken", "ts": "soon", "dur": 1.0},
    ]}
    parsed = parse_trace(trace)
    assert parsed.steps == {3: (0.0, 100.0)}
    (kernel,) = parsed.kernels
    assert (kernel.collective, kernel.start_us, kernel.end_us, kernel.launched_us) == ("all_reduce", 20.0, 50.0, 10.0)
    assert [s.name for s in parsed.syncs] == ["cudaStreamSynchronize"]  # a pinned DtoH copy is not a sync by itself


def test_load_trace_reads_plain_and_gzipped_files(tmp_path: Path) -> None:
    plain, zipped = tmp_path / "rank0.1.pt.trace.json", tmp_path / "rank0.1.pt.trace.json.gz"
    plain.write_text(json.dumps(standard_trace()))
    with gzip.open(zipped, "wt", encoding="utf-8") as file:
        json.dump(standard_trace(), file)
    assert load_trace(plain) == load_trace(zipped) == parse_trace(standard_trace())
