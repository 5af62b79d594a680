"""A made-up profiled run: ddpwatch's step reports and torch.profiler's trace of the same steps.

Every step of the standard run below is 10 ms long and starts 20 ms after the previous one
(ddpwatch step s starts at 100 s + 20 ms × (s − 4), on ddpwatch's clock). Times in the helpers
are written in milliseconds into the step; the profiler's clock is ddpwatch's shifted by
123.456 s (profiler µs = ddpwatch s × 1e6 + 123 456 000).

One standard step, on both sides (ms into the step):

    ddpwatch spans      forward [0, 2], backward [2, 6], all_reduce [4, 7], all_reduce [7, 8]
    profiler kernels    compute [0, 1.5], [1.5, 4], [3.5, 6] (union [0, 6]),
                        NCCL AllReduce [4, 7] and [7, 8]

    K = 10 ms, C = [0, 6] = 6 ms, M = [4, 8] = 4 ms, C ∩ M = [4, 6] = 2 ms
    Compute% = 100 × 6 / 10 = 60, Overlap% = 100 × 2 / 4 = 50 (on both sides)
    durations: 3 ms and 1 ms (both sides)

Each iteration (ProfilerStep#(s − 1), CPU window [−1, 11] ms) also launches train.py's
per-step switch broadcast, a 10 µs NCCL Broadcast kernel at [−0.4, −0.39] ms: before
ddpwatch's step starts, so not ddpwatch's to report. Kernels of step 3 (before the first
window) and step 9 (after the last), and the profiler's own cudaDeviceSynchronize at stop,
are in the trace too and must all be ignored.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpwatch.doctor.profile_check import (
    Check,
    RankComparison,
    compare_rank,
)
from ddpwatch.doctor.profiler_trace import parse_trace
from instrumented_ddp.wire.messages import Span, StepReport

OFFSET_US = 123_456_000.0
STEPS = range(4, 9)
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
BROADCAST = "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
CHECKS = ("profiled steps reported", "collectives per step", "collective duration", "Compute%", "Overlap%",
          "device syncs per step")


def t0(step: int) -> float:
    """ddpwatch's start of a step, in seconds."""
    return 100.0 + 0.020 * (step - 4)


def sec(step: int, ms: float) -> float:
    """ddpwatch's clock, ``ms`` into the step."""
    return t0(step) + ms / 1e3


def us(step: int, ms: float) -> float:
    """The profiler's clock, ``ms`` into the step."""
    return sec(step, ms) * 1e6 + OFFSET_US


def standard_spans(step: int, shift_ms: float = 0.0) -> list[Span]:
    s = lambda ms: sec(step, ms + shift_ms)  # noqa: E731
    return [Span("forward", s(0), s(2)), Span("backward", s(2), s(6)),
            Span("all_reduce", s(4), s(7), nbytes=4_000_000, tag="b0", dtype="float32"),
            Span("all_reduce", s(7), s(8), nbytes=1_000_000, tag="b1", dtype="float32")]


def report(step: int, spans: list[Span] | None = None, shift_ms: float = 0.0, unresolved: bool = False) -> StepReport:
    return StepReport(rank=0, step=step, strategy="bucket", settings={}, start=sec(step, shift_ms), end=sec(step, 10 + shift_ms),
                      spans=standard_spans(step, shift_ms) if spans is None else spans, samples=4, tokens=512,
                      unresolved=unresolved)


class Trace:
    """A kineto-shaped trace: complete events, launches linked to kernels by ``correlation``."""

    def __init__(self, link_launches: bool = True) -> None:
        self.events: list[dict] = []
        self.next_correlation = 1
        self.link = link_launches

    def _launch(self, name: str, at_us: float, category: str = "cuda_runtime") -> int:
        correlation = self.next_correlation
        self.next_correlation += 1
        self.events.append({"ph": "X", "cat": category, "name": name, "pid": 7, "tid": 7, "ts": at_us, "dur": 4.0,
                            "args": {"cbid": 211, "correlation": correlation}})
        return correlation

    def kernel(self, name: str, start_us: float, end_us: float, launch_us: float | None = None,
               via: str = "cudaLaunchKernel", category: str = "cuda_runtime") -> None:
        args: dict = {"device": 0, "stream": 7}
        if launch_us is not None:
            correlation = self._launch(via, launch_us, category)
            if self.link:
                args["correlation"] = correlation
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start_us,
                            "dur": end_us - start_us, "args": args})

    def call(self, name: str, at_us: float) -> None:
        self._launch(name, at_us)

    def memcpy(self, name: str, start_us: float, end_us: float, launch_us: float, via: str = "cudaMemcpyAsync") -> None:
        correlation = self._launch(via, launch_us)
        self.events.append({"ph": "X", "cat": "gpu_memcpy", "name": name, "pid": 0, "tid": 7, "ts": start_us,
                            "dur": end_us - start_us, "args": {"device": 0, "correlation": correlation}})

    def profiler_step(self, number: int, start_us: float, end_us: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 7, "tid": 7,
                            "ts": start_us, "dur": end_us - start_us, "args": {"External id": number}})

    def as_dict(self) -> dict:
        return {"schemaVersion": 1, "baseTimeNanoseconds": 1_790_857_026_000_000_000, "traceEvents": self.events}


def standard_iteration(trace: Trace, step: int, windowed: bool = True) -> None:
    """One iteration's kernels (see the module docstring), each launched 50-100 µs before it runs."""
    if windowed:
        trace.profiler_step(step - 1, us(step, -1), us(step, 11))
    trace.kernel(BROADCAST, us(step, -0.4), us(step, -0.39), us(step, -0.5), "cuLaunchKernelEx", "cuda_driver")
    for name, (a, b) in [("void at::native::vectorized_elementwise_kernel<4>(...)", (0, 1.5)),
                         ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", (1.5, 4)),
                         ("void at::native::reduce_kernel<512, 1>(...)", (3.5, 6))]:
        trace.kernel(name, us(step, a), us(step, b), us(step, a - 0.05))
    trace.kernel(ALL_REDUCE, us(step, 4), us(step, 7), us(step, 3.9), "cuLaunchKernelEx", "cuda_driver")
    trace.kernel(ALL_REDUCE, us(step, 7), us(step, 8), us(step, 3.95), "cuLaunchKernelEx", "cuda_driver")


def standard_trace(edit: Callable[[Trace], None] | None = None, link_launches: bool = True) -> dict:
    trace = Trace(link_launches)
    standard_iteration(trace, 3, windowed=False)  # warm-up: before ProfilerStep#3, not profiled
    for step in STEPS:
        standard_iteration(trace, step)
    standard_iteration(trace, 9, windowed=False)  # after ProfilerStep#7: not profiled either
    trace.call("cudaDeviceSynchronize", us(9, 12))  # torch.autograd.profiler.profile.__exit__, after the last window
    if edit is not None:
        edit(trace)
    return trace.as_dict()


def standard_reports() -> list[StepReport]:
    return [report(step) for step in [1, 2, 3, *STEPS, 9, 10]]


def compare(trace: dict | None = None, reports: list[StepReport] | None = None, **kw) -> RankComparison:
    return compare_rank(parse_trace(trace if trace is not None else standard_trace()),
                        reports if reports is not None else standard_reports(), **kw)


def checks(comparison: RankComparison) -> dict[str, Check]:
    return {check.name: check for check in comparison.checks}


def failed(comparison: RankComparison) -> set[str]:
    return {check.name for check in comparison.checks if not check.passed}


def replace_report(reports: list[StepReport], new: StepReport) -> list[StepReport]:
    return [new if r.step == new.step else r for r in reports]
