"""What a rank holds, measured from the tensors it holds: the staircase DDP -> ZeRO-1 -> ZeRO-2 -> FSDP.

Bytes are counted per storage, once: a parameter that is a view of a flat buffer (``zero1``),
a gradient that is a view of a bucket (``bucket``), a shard's gradient that is a slice of it,
all count the buffer once. A ``DTensor`` counts its local shard. Padding a strategy adds to
make shards equal is held, so it is counted. ``peak`` is what the allocator saw at its highest
since the strategy was wrapped (``torch.cuda.max_memory_allocated``) on a GPU, and the resident
set of the process on a CPU (the allocator keeps no peak there; ``allocation_peak`` reads one
from the profiler's allocation records, for a bench, not for every step).
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch


class MemoryHeld(NamedTuple):
    parameters: int
    gradients: int
    optimizer_state: int
    peak: int  # bytes; see the module docstring for what it is on each device


class HoldsTrainingState(Protocol):
    """What ``held_memory`` reads: a strategy (``strategies.base``), or an attached user's model
    (``attachment.Attachment``)."""

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...

    def held_parameters(self) -> list[torch.Tensor]: ...


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` and empty ones hold nothing)."""
    seen: set[int] = set()
    total = 0
    for tensor in held_tensors(tensors):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


_COMPRESSED_INDICES = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
                       torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def held_tensors(tensors: Iterable[torch.Tensor | None]) -> Iterable[torch.Tensor]:
    """The strided tensors that hold the bytes of ``tensors``: a DTensor's local shard, a sparse
    tensor's indices and values (a sparse embedding's gradient, under DDP's ``sparse=True``: it has no
    storage of its own, and asking for one raises)."""
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard (read by name: no DTensor import)
        if tensor.layout == torch.sparse_coo:
            yield from (tensor._indices(), tensor._values())
        elif tensor.layout in _COMPRESSED_INDICES:
            compressed, plain = _COMPRESSED_INDICES[tensor.layout]
            yield from (getattr(tensor, compressed)(), getattr(tensor, plain)(), tensor.values())
        else:
            yield tensor


def held_memory(strategy: HoldsTrainingState) -> MemoryHeld:
    """This rank's bytes of parameters, gradients and optimizer state, and its peak."""
    parameters = strategy.held_parameters()
    gradients = [p.grad for p in parameters]  # the shards' too: ``held_parameters`` includes them
    state = [tensor for optimizer in strategy.optimizers for tensor in optimizer_state(optimizer)]
    return MemoryHeld(storage_bytes(parameters), storage_bytes(gradients), storage_bytes(state),
                      peak_bytes(parameters[0].device if parameters else torch.device("cpu")))


def optimizer_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state, and of the one it steps where it is PyTorch's
    ``ZeroRedundancyOptimizer``, which keeps its shard's state there (``.optim``), none in its own
    (Accelerate's wrapper ``attach`` has already looked through: ``innermost_optimizer``)."""
    optimizers = (optimizer, getattr(optimizer, "optim", None))
    return [value for held in optimizers if isinstance(held, torch.optim.Optimizer)
            for entries in held.state.values() for value in entries.values() if isinstance(value, torch.Tensor)]


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resident_bytes()


def reset_peak(device: torch.device) -> None:
    """A new strategy starts a new peak (a switch would otherwise inherit the last one's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def resident_bytes() -> int:
    """The process's resident set now, from ``/proc/self/statm``; the lifetime peak elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemorySampler:
    """``held_memory`` for the step reports, every ``every`` steps of a strategy: the count walks
    every parameter, gradient and state tensor, so not every step. A strategy's first reading is
    at its second step, the first one its segment counts (the first carries the wrap-time
    broadcast, or DDP's first iteration, and is left out of the figures)."""

    def __init__(self, every: int = 10) -> None:
        self.every = every
        self._strategy: HoldsTrainingState | None = None
        self._steps = 0
        self.unmeasurable: str | None = None  # why held_memory failed, once it has: no more tries

    def sample(self, strategy: HoldsTrainingState) -> dict[str, int] | None:
        if strategy is not self._strategy:
            self._strategy, self._steps = strategy, 0
        self._steps += 1
        if self._steps % self.every != 2 % self.every or self.unmeasurable is not None:
            return None
        try:
            return held_memory(strategy)._asdict()
        except (RuntimeError, NotImplementedError) as error:  # a tensor kind not counted yet: telemetry never stops training
            self.unmeasurable = f"{type(error).__name__}: {error}".splitlines()[0]
            print(f"ddpwatch: the memory this rank holds cannot be measured ({self.unmeasurable}): "
                  "its memory columns stay empty; training goes on", file=sys.stderr, flush=True)
            return None


@dataclass
class AllocationPeak:
    """Where a run of allocations rose highest above where it began: ``rise`` bytes at ``at``,
    with ``alive`` (address -> bytes) the allocations of the run still held then."""

    rise: int = 0
    at: int = 0
    alive: dict[int, int] = field(default_factory=dict)


def allocation_peak(records: Iterable[tuple[int, int, int]]) -> AllocationPeak:
    """The peak of ``(time, bytes, address)`` allocation records (a free: negative bytes, the
    address it frees), taken in time order, as ``torch.profiler``'s ``profile_memory`` records
    them. What was allocated before the first record is the baseline, and freeing it lowers the
    rise below zero (``bench/memory_staircase.py --step-peak``: a step's peak and what sets it)."""
    ordered = sorted(records)
    rise = highest = 0
    peak_index = -1
    for index, (_at, size, _address) in enumerate(ordered):
        rise += size
        if rise > highest:
            highest, peak_index = rise, index
    if peak_index < 0:
        return AllocationPeak()
    alive: dict[int, int] = {}  # replayed up to the peak, not copied at every new high
    for _at, size, address in ordered[: peak_index + 1]:
        if size > 0:
            alive[address] = size
        else:
            alive.pop(address, None)
    return AllocationPeak(highest, ordered[peak_index][0], alive)
