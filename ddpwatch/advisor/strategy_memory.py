"""What each strategy holds per rank: parameters, gradients and optimizer state, by arithmetic on
the hello's parameter layout, the staircase from DP to ZeRO-3. Pure.

Exact where the rank's own figures are (``instrumented_ddp.resources.memory.held_memory``: each
storage once, padding included, after ``zero_grad(set_to_none=False)``), for AdamW, which holds
two moments of each stepped tensor's shape and a 4-byte ``step`` scalar:

* ``simple`` … ``ddp``: every parameter, its gradient, its two moments (DDP's own bucket buffers
  are not counted there: they are the peak's, ``transient_bytes``);
* ``zero1``: each bucket's flat buffer of parameters and of gradients padded to a multiple of the
  world; one shard of each bucket stepped, its moments ``pad(n)/W`` elements;
* ``zero2``: as zero1, but of the gradients only each bucket's shard stays between steps;
* ``fsdp``: each parameter's rows split over the world, ``ceil(rows/W)`` rows each, padded; the
  gradients each unit's flat shard of those; the moments of the rank's unpadded rows (the last
  ranks may hold fewer, or none).

The peak is what is held plus what a step allocates and frees: the activations, the same for
every strategy, and each strategy's own buffers (``transient_bytes``, a stated rule). The peak
measured for the strategy that ran gives the rest (``predicted_peak``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from instrumented_ddp.wire.bucket_plan import TensorSize, plan_bucket_strategy

from ddpwatch.advisor.dtypes import ITEM_BYTES
from ddpwatch.advisor.strategy_sim import STRATEGIES, fsdp_units, padded, rows_per_rank

STEP_SCALAR_BYTES = 4  # AdamW's ``step``: a 0-d float32 tensor of its own, per stepped tensor
MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq

Layout = Sequence[tuple[str, int, str]]  # the hello's (name, numel, dtype) of each trainable parameter


@dataclass(frozen=True)
class HeldMemory:
    """Bytes one rank holds between steps, as its memory samples count them."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def held_memory(strategy: str, layout: Layout, world_size: int, cap_bytes: int = 25 * 1024 * 1024,
                rank: int = 0, rows: Sequence[int] = ()) -> HeldMemory:
    """What ``rank`` holds under ``strategy`` (see the module docstring). ``rows``: each
    parameter's dim 0 (``Hello.parameter_rows``); without them fsdp's rows are taken as its
    elements, exact wherever the world divides a parameter's dim 0."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    items = [ITEM_BYTES.get(dtype, 4) for _, _, dtype in layout]
    numels = [numel for _, numel, _ in layout]
    full = sum(n * s for n, s in zip(numels, items, strict=True))
    if strategy in ("zero1", "zero2"):
        plan = plan_bucket_strategy([TensorSize(n * s, dtype) for (_, n, dtype), s in zip(layout, items, strict=True)], cap_bytes)
        buckets = [(padded(sum(numels[i] for i in bucket), world_size), items[bucket[0]]) for bucket in plan]
        flat = sum(n * s for n, s in buckets)
        shards = sum(n // world_size * s for n, s in buckets)
        state = sum(MOMENTS * n // world_size * s + STEP_SCALAR_BYTES for n, s in buckets)
        return HeldMemory(flat, flat if strategy == "zero1" else shards, state)
    if strategy == "fsdp":
        given = len(rows) == len(layout)
        shard, state = 0, 0
        for index, (numel, item) in enumerate(zip(numels, items, strict=True)):
            dim0 = rows[index] if given and rows[index] > 0 else numel
            per_row = numel // dim0 if dim0 else 0
            chunk = rows_per_rank(dim0, world_size)
            shard += chunk * per_row * item
            own = max(0, min(chunk, dim0 - rank * chunk))  # torch.chunk: the last ranks may get fewer rows
            state += MOMENTS * own * per_row * item + STEP_SCALAR_BYTES
        return HeldMemory(shard, shard, state)
    return HeldMemory(full, full, MOMENTS * full + STEP_SCALAR_BYTES * len(layout))


def transient_bytes(strategy: str, layout: Layout, world_size: int, grad_accum: int = 1,
                    cap_bytes: int = 25 * 1024 * 1024, rows: Sequence[int] = (), device_peak: bool = True) -> int:
    """A stated rule for what a step of ``strategy`` allocates beyond what it holds, at its peak:

    * ``ddp``: its reducer's bucket buffers, a copy of every gradient, held for good;
    * ``zero2``: every bucket's full padded gradient buffer during backward (gloo settles them
      all at its end; NCCL may free some earlier, the rule takes the worst); under K > 1, the
      full gradients the unsynced micro-steps accumulate;
    * ``fsdp``: the root unit gathered through forward and backward, the two largest other units
      gathered at once (one computing, the next prefetched), and the largest unit's unsharded
      gradients as the reduce-scatter's input; under K > 1, the full gradients accumulated;
    * the others: nothing beyond what they hold (their gradients are the held ones).

    ``device_peak``: the peak is the device's high-water mark (CUDA). On the CPU the rank's
    figure is its resident memory at the end of the step, where freed buffers are back with the
    system: only what is held for good (DDP's buckets) counts."""
    items = [ITEM_BYTES.get(dtype, 4) for _, _, dtype in layout]
    full = sum(numel * item for (_, numel, _), item in zip(layout, items, strict=True))
    if strategy == "ddp":
        return full
    if not device_peak:
        return 0
    accumulated = full if grad_accum > 1 else 0
    if strategy == "zero2":
        plan = plan_bucket_strategy([TensorSize(n * s, dtype) for (_, n, dtype), s in zip(layout, items, strict=True)], cap_bytes)
        return sum(padded(sum(layout[i][1] for i in bucket), world_size) * items[bucket[0]] for bucket in plan) + accumulated
    if strategy == "fsdp":
        given = len(rows) == len(layout)
        gathered = []
        for unit in fsdp_units([name for name, _, _ in layout]):
            size = 0
            for i in unit:
                numel, item = layout[i][1], items[i]
                dim0 = rows[i] if given and rows[i] > 0 else numel
                size += world_size * rows_per_rank(dim0, world_size) * (numel // dim0 if dim0 else 0) * item
            gathered.append(size)
        root, layers = gathered[-1], sorted(gathered[:-1], reverse=True)
        return root + sum(layers[:2]) + (max(gathered) if gathered else 0) + accumulated
    return 0


def predicted_peak(strategy: str, layout: Layout, world_size: int, measured_strategy: str, measured_peak: int,
                   grad_accum: int = 1, measured_k: int = 1, cap_bytes: int = 25 * 1024 * 1024,
                   measured_cap_bytes: int = 25 * 1024 * 1024, rows: Sequence[int] = (), device_peak: bool = True) -> int:
    """``strategy``'s peak from the peak measured under ``measured_strategy``: what that peak holds
    beyond its strategy's held memory and transient buffers (the activations, the process) is
    the same under any strategy."""
    def own(name: str, k: int, cap: int) -> int:
        return held_memory(name, layout, world_size, cap, rows=rows).total + \
            transient_bytes(name, layout, world_size, k, cap, rows, device_peak)

    rest = measured_peak - own(measured_strategy, measured_k, measured_cap_bytes)
    return max(0, rest) + own(strategy, grad_accum, cap_bytes)
