"""A fake GPU with streams, CUDA events and NCCL works that behave as PyTorch's do.

Written from PyTorch's source, not from what we would like it to do:

- ``ProcessGroupNCCL::collective`` (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``) makes
  the NCCL stream wait for the current (compute) stream (``syncStream``), launches the kernel on
  the NCCL stream, records the work's end event there (and its start event before the kernel
  when timing is on), then, under a guard making the NCCL stream current, creates the work's
  future and calls ``future_->markCompleted(...)``: the future is complete at *enqueue*, long
  before the GPU runs the collective. The NCCL stream is one per device and group: collectives
  run one after another, in issue order.
- ``WorkNCCL::getDuration``: ``TORCH_CHECK(timing_enabled, "getDuration only works if timing was
  enabled, ...")`` and ``TORCH_CHECK(end_event->query(), "getDuration only works after the work
  has completed")``, then ``start.elapsed_time(end)`` in milliseconds. Timing is on with
  ``TORCH_NCCL_ENABLE_TIMING=1`` or ``ProcessGroup._enable_collectives_timing()``.
  ``WorkNCCL::isCompleted`` queries the end event without blocking.
- ``torch.futures.Future.then`` (``torch/futures/__init__.py``; ``ivalue::Future::then`` and
  ``invokeCallback`` in ``ATen/core/ivalue_inl.h``): on a completed future the callback runs at
  once, on the calling thread, with a fresh pool stream made current that first waits for the
  future's CUDA events (``synchronizeWithCurrentStreams``). An event recorded in the callback
  therefore happens on the GPU after the collective ends.
- ``WorkNCCL::wait`` makes the *current stream* wait for the end event; the host does not wait.
  A synchronous call (``async_op=False``) is the same work, waited at once by ``distributed_c10d``.
- ``torch.cuda.Event.record`` records on the given stream, else the current one; ``query()`` is
  False until the GPU has reached the event; ``elapsed_time`` needs both events completed.
- ``torch.cuda.current_stream()`` builds a new ``Stream`` object each call (``torch/cuda/__init__.py``);
  ``torch._C._cuda_getCurrentRawStream(device)`` returns the current stream's ``cudaStream_t``
  as an int (``torch/csrc/cuda/Module.cpp``), the same for as long as that stream is current.

Times are milliseconds on the fake GPU's clock. The host enqueues at ``gpu.host_ms`` (the test
moves it); work on a stream starts at the later of that moment and the stream's tail. The GPU
has finished everything up to ``gpu.done_ms`` (the test moves it; 0 at first, as a GPU behind
its host): events after it have not happened yet.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


class FakeStream:
    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu, self.name = gpu, name
        gpu.streams_made += 1
        self.handle = gpu.streams_made  # a cudaStream_t: unique among live streams
        self.tail_ms = 0.0  # when everything enqueued so far will have run

    def position(self) -> float:
        """Where a new item on this stream would run."""
        return max(self.tail_ms, self.gpu.host_ms)

    def run(self, duration_ms: float) -> tuple[float, float]:
        """Enqueue a kernel; returns its (start, end)."""
        start = self.position()
        self.tail_ms = start + duration_ms
        return start, self.tail_ms

    def wait_until(self, at_ms: float) -> None:
        """``cudaStreamWaitEvent``: later items on this stream start after ``at_ms``."""
        self.tail_ms = max(self.tail_ms, at_ms)


class FakeGpu:
    def __init__(self) -> None:
        self.streams_made = 0
        self.stream_objects_built = 0  # torch.cuda.current_stream() calls
        self.host_ms = 0.0
        self.done_ms = 0.0  # the GPU lags the host: nothing has run until the test says so
        self.compute = FakeStream(self, "compute")
        self.nccl = FakeStream(self, "nccl")
        self.current = self.compute
        self.pool_streams = 0
        self.synchronizations = 0  # host waits for the device: must stay 0 in a watched step
        self.queries_before_completion = 0

    def torch(self) -> SimpleNamespace:
        """What ``CudaEventClock`` uses of torch: ``torch.cuda.Event``, ``current_stream``,
        ``current_device``, ``torch._C._cuda_getCurrentRawStream``, ``torch.empty``."""
        return SimpleNamespace(cuda=SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(self, enable_timing),
                                                    current_stream=self.current_stream_object,
                                                    current_device=lambda: 0),
                               _C=SimpleNamespace(_cuda_getCurrentRawStream=lambda device: self.current.handle),
                               empty=lambda shape, dtype=None, pin_memory=False: FakeHostTensor(self, pin_memory))

    def current_stream_object(self) -> FakeStream:
        self.stream_objects_built += 1
        return self.current


class FakeEvent:
    def __init__(self, gpu: FakeGpu, enable_timing: bool = False) -> None:
        assert enable_timing, "events must be created with enable_timing=True"
        self.gpu = gpu
        self.at_ms: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        """On ``stream`` (else the current one), at the point the stream has reached."""
        stream = stream or self.gpu.current
        self.at_ms = stream.position()
        stream.tail_ms = self.at_ms

    def record_at(self, at_ms: float) -> FakeEvent:
        self.at_ms = at_ms
        return self

    def query(self) -> bool:
        assert self.at_ms is not None, "query() on an event never recorded"
        return self.at_ms <= self.gpu.done_ms

    def elapsed_time(self, other: FakeEvent) -> float:
        if not (self.query() and other.query()):
            raise RuntimeError("CUDAEvent: Both events must be completed before calculating elapsed time.")
        assert self.at_ms is not None and other.at_ms is not None  # query() holds both
        return other.at_ms - self.at_ms

    def synchronize(self) -> None:
        self.gpu.synchronizations += 1


class FakeFuture:
    """A NCCL work's future: complete from the start; callbacks run at once, inline, on a pool
    stream that waits for the collective's end."""

    def __init__(self, gpu: FakeGpu, end_ms: float) -> None:
        self.gpu, self.end_ms = gpu, end_ms

    def done(self) -> bool:
        return True

    def then(self, callback: Callable[[FakeFuture], Any]) -> FakeFuture:
        pool = FakeStream(self.gpu, f"pool{self.gpu.pool_streams}")
        self.gpu.pool_streams += 1
        pool.wait_until(self.end_ms)
        previous, self.gpu.current = self.gpu.current, pool
        try:
            callback(self)  # an exception here goes into the returned future; nobody reads it
        except Exception:
            pass
        finally:
            self.gpu.current = previous
        return FakeFuture(self.gpu, self.end_ms)

    def add_done_callback(self, callback: Callable[[FakeFuture], Any]) -> None:
        self.then(callback)

    def wait(self) -> None:
        self.gpu.current.wait_until(self.end_ms)


class FakeNcclWork:
    def __init__(self, gpu: FakeGpu, start_ms: float, end_ms: float, timing: bool) -> None:
        self.gpu, self.start_ms, self.end_ms, self.timing = gpu, start_ms, end_ms, timing
        self.future = FakeFuture(gpu, end_ms)
        self.early_duration_reads = 0

    def get_future(self) -> FakeFuture:
        return self.future

    def wait(self) -> None:
        """The current stream waits; the host does not."""
        self.gpu.current.wait_until(self.end_ms)

    def is_completed(self) -> bool:
        """``WorkNCCL::isCompleted``: a non-blocking query of the end event."""
        return self.end_ms <= self.gpu.done_ms

    def _get_duration(self) -> float:
        if not self.timing:
            raise RuntimeError("getDuration only works if timing was enabled, see ProcessGroup::_enable_collectives_timing")
        if self.end_ms > self.gpu.done_ms:
            self.early_duration_reads += 1
            raise RuntimeError("getDuration only works after the work has completed")
        return self.end_ms - self.start_ms


class FakeProcessGroupNccl:
    """Issues collectives as ProcessGroupNCCL does: the NCCL stream waits for the current
    stream, runs each collective after the previous one, and the work is returned complete.
    ``stream``: the group's NCCL stream (one per device and group); default the GPU's ``nccl``,
    so a second group given a stream of its own runs beside the first (HSDP's replicate group)."""

    def __init__(self, gpu: FakeGpu, timing: bool = False, stream: FakeStream | None = None) -> None:
        self.gpu, self.timing = gpu, timing
        self.stream = gpu.nccl if stream is None else stream
        self.works: list[FakeNcclWork] = []

    def _enable_collectives_timing(self) -> None:
        """``ProcessGroupNCCL::enableCollectivesTiming``: works issued from now on record their
        start events, so ``_get_duration`` can be read once they end."""
        self.timing = True

    def all_reduce(self, transfer_ms: float) -> FakeNcclWork:
        self.stream.wait_until(self.gpu.current.position())  # syncStream(current -> nccl)
        start, end = self.stream.run(transfer_ms)
        work = FakeNcclWork(self.gpu, start, end, self.timing)
        self.works.append(work)
        return work

    def all_reduce_synchronously(self, transfer_ms: float) -> None:
        """``dist.all_reduce(t, async_op=False)``: ``distributed_c10d.all_reduce`` issues the work
        and calls ``work.wait()`` itself, so the current stream waits for the end; it returns None."""
        self.all_reduce(transfer_ms).wait()


class FakeHostTensor:
    """Pinned host memory filled by a non-blocking device-to-host copy: reading it before the
    copy ran on the GPU would be a bug (and reading the CUDA tensor itself a synchronisation)."""

    def __init__(self, gpu: FakeGpu, pinned: bool) -> None:
        self.gpu, self.pinned = gpu, pinned
        self.value: float | None = None
        self.copied_at_ms: float | None = None

    def copy_(self, source: FakeCudaTensor, non_blocking: bool = False) -> FakeHostTensor:
        if not non_blocking or not self.pinned:
            self.gpu.synchronizations += 1
        self.copied_at_ms = self.gpu.current.run(0.0)[1]
        self.value = source.value
        return self

    def __float__(self) -> float:
        assert self.copied_at_ms is not None and self.copied_at_ms <= self.gpu.done_ms, "read before the copy ran"
        assert self.value is not None, "copied from a tensor that held nothing"
        return float(self.value)


class FakeCudaTensor:
    """A loss on the device: ``float()``/``.item()`` would make the host wait for the GPU."""

    is_cuda = True
    shape = ()
    dtype = "float32"

    def __init__(self, gpu: FakeGpu, value: float) -> None:
        self.gpu, self.value = gpu, value

    def detach(self) -> FakeCudaTensor:
        return self

    def __float__(self) -> float:
        self.gpu.synchronizations += 1
        return float(self.value)

    def item(self) -> float:
        return self.__float__()
