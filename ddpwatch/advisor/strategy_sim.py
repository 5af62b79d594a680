"""What each of the nine strategies, at K micro-steps, would make of this run's step. Pure.

The run measured one strategy; what another changes is *where* its collectives go and *which*
it issues, not the model's compute. So a step is replayed (``replay_clock``) from the parts
every strategy shares (``StepParts``: forward, backward with each gradient's ready time, the
optimizer, the data) and each strategy's calls placed where its class issues them
(``instrumented_ddp.strategies``), each costing what its kind's model says (``kind_costs``):

* ``simple``: after every micro-step's backward, an all-reduce per parameter, one after another,
  each waited for; ``ga`` the same after the last micro-step only;
* ``hook``: each parameter's all-reduce issued and waited for inside backward, as its gradient
  is ready; ``async`` issues them there and waits once after backward;
* ``bucket``: buckets planned by the strategy's rule, each launched once full and every earlier
  one launched, waited for after backward; ``ddp`` the same with DDP's plan (its buckets in the
  order gradients became ready);
* ``zero1``: ``bucket``'s all-reduces over buckets padded to a multiple of the world, the
  optimizer stepping one shard of each, then an all-gather per bucket, waited for;
* ``zero2``: reduce-scatters in place of those all-reduces, then the same all-gathers;
* ``fsdp``: per unit (the decoder layers, then the root of every other parameter), an
  all-gather before its forward and before its backward, the next unit's gathered one ahead in
  backward (and in forward too where the backend runs them on a stream of their own, NCCL), and
  a reduce-scatter as each unit's backward ends; the optimizer steps each rank's rows.

Under K micro-steps each strategy communicates in the last alone (``simple`` in every one, and
``fsdp`` gathers in every one). The global batch is held fixed, so a micro-step of B/K samples
computes for 1/K of the run's per-sample compute, plus the fixed cost every micro-step pays
whatever its samples (``micro_fixed_s``, measured where the run ran two Ks). Compute beside a transfer runs slower by the run's measured ``lost_share``.
Whatever the parts leave out of the measured step (the gaps between phases, the division of
gradients) is ``other_s``, held fixed for every strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from instrumented_ddp.wire.bucket_plan import TensorSize, plan_bucket_strategy, plan_ddp

from ddpwatch.advisor.dtypes import ITEM_BYTES
from ddpwatch.advisor.replay_clock import ReplayClock
from ddpwatch.figures.kind_costs import KindCost

STRATEGIES = ("simple", "ga", "hook", "async", "bucket", "ddp", "zero1", "zero2", "fsdp")


@dataclass(frozen=True)
class StepParts:
    """One optimizer step of the run in the parts every strategy shares, at the run's own K
    (``measured_k``): each as one micro-step's, but ``data_s``, ``optimizer_s`` and ``other_s``,
    which are the step's."""

    tensors: tuple[TensorSize, ...]  # the trainable parameters, module order
    ready_s: tuple[float, ...]  # one micro-step's backward alone: each gradient ready, from its start
    backward_s: float  # one micro-step's backward compute
    forward_s: float  # one micro-step's forward compute
    optimizer_s: float  # the optimizer stepping every parameter (a sharded run's, scaled up by its share)
    data_s: float = 0.0  # the step's data loading
    other_s: float = 0.0  # the rest of the step the parts leave out, held fixed
    measured_k: int = 1
    world_size: int = 2
    workers: int = 2  # collectives the backend runs at once (NCCL 1, gloo 2: ``advice.workers_of``)
    on_streams: bool = False  # collectives run on streams of their own (NCCL): a synchronous one need not hold the host
    lost_share: float = 0.0  # compute lost beside a transfer (``compute_slowdown``)
    units: tuple[tuple[int, ...], ...] = ()  # fsdp's units, tensors by index, the root last (``fsdp_units``)
    rows: tuple[int, ...] = ()  # each tensor's dim 0 (fsdp shards rows); () or 0: numel, a 1-D tensor
    #: Of one micro-step's forward and backward, the seconds that do not shrink with its samples
    #: (the Python and the launches of each call): measured where the run ran two Ks, else 0.
    micro_fixed_s: float = 0.0


@dataclass(frozen=True)
class StrategyPrediction:
    strategy: str
    grad_accum: int
    step_s: float
    exposed_s: float  # the main thread waiting for communication
    calls: Mapping[str, int]  # collectives issued a step, by kind
    comm_s: Mapping[str, float]  # their transfer time, by kind, unmerged
    notes: tuple[str, ...] = field(default=())  # what was modelled rather than measured


def padded(numel: int, world_size: int) -> int:
    """A flat bucket's elements once padded to a multiple of the world (zero1, zero2)."""
    return -(-numel // world_size) * world_size


def rows_per_rank(rows: int, world_size: int) -> int:
    """Rows of one rank's dim-0 shard, padded: ceil(rows / W) (torch.chunk's first chunk)."""
    return -(-rows // world_size)


def simulate_strategy(parts: StepParts, costs: Mapping[str, KindCost], strategy: str, grad_accum: int = 1,
                      cap_bytes: int = 25 * 1024 * 1024) -> StrategyPrediction:
    """``strategy`` at ``grad_accum`` micro-steps (and ``cap_bytes`` for the bucketed ones)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be 1 or more, not {grad_accum}")
    notes: list[str] = []

    def cost(kind: str, nbytes: int) -> float:
        if parts.world_size < 2 or nbytes <= 0:
            return 0.0
        model = costs.get(kind)
        if model is None:
            raise ValueError(f"no cost model for {kind}")
        if model.derived and f"{kind} derived" not in notes:
            notes.append(f"{kind} derived")
        return model.seconds(nbytes)

    clock = ReplayClock(cost, parts.workers, parts.lost_share)
    counts: dict[str, int] = {}
    forward_s, backward_s = micro_step_compute(parts, grad_accum)
    ready = [t * backward_s / parts.backward_s if parts.backward_s > 0 else 0.0 for t in parts.ready_s]

    def issue(kind: str, nbytes: int) -> float:
        counts[kind] = counts.get(kind, 0) + 1
        return clock.issue(kind, nbytes)

    def call(kind: str, nbytes: int) -> None:
        clock.wait(issue(kind, nbytes))

    clock.compute(parts.data_s)
    share = 1.0
    for micro in range(grad_accum):
        synced = micro == grad_accum - 1
        if strategy == "fsdp":
            share = _fsdp_micro_step(parts, clock, issue, forward_s, backward_s, ready, synced, notes)
            continue
        clock.compute(forward_s)
        if strategy in ("simple", "ga"):
            clock.compute(backward_s)
            if strategy == "simple" or synced:
                for tensor in parts.tensors:
                    call("all_reduce", tensor.nbytes)
        elif not synced:
            clock.compute(backward_s)
        elif strategy in ("hook", "async"):
            origin, ends = clock.computed_s, []
            for index in sorted(range(len(parts.tensors)), key=lambda i: (ready[i], -i)):
                clock.compute_to(origin, ready[index])
                ends.append(issue("all_reduce", parts.tensors[index].nbytes))
                if strategy == "hook":  # inside the gradient's hook: backward goes on once it returns
                    clock.wait(ends[-1])
            clock.compute_to(origin, backward_s)
            clock.wait(max(ends, default=0.0))
        else:
            share = _bucketed_backward(parts, clock, issue, strategy, cap_bytes, ready, backward_s)
    clock.compute(parts.optimizer_s * share)
    if strategy in ("zero1", "zero2"):
        ends = [issue("all_gather", padded(_numel(parts, bucket), parts.world_size) * _item(parts, bucket))
                for bucket in plan_bucket_strategy(parts.tensors, cap_bytes)]
        clock.wait(max(ends, default=0.0))
    clock.compute(parts.other_s)
    return StrategyPrediction(strategy, grad_accum, clock.now, clock.exposed_s, counts, dict(clock.comm_s), tuple(notes))


def micro_step_compute(parts: StepParts, grad_accum: int) -> tuple[float, float]:
    """One micro-step's forward and backward at ``grad_accum`` micro-steps: its fixed part as
    measured (``micro_fixed_s``, shared between the two in their proportion), the rest that of
    its samples, ``measured_k / grad_accum`` of the run's micro-step."""
    both = parts.forward_s + parts.backward_s
    if both <= 0:
        return 0.0, 0.0
    fixed = min(max(parts.micro_fixed_s, 0.0), both)
    scale = parts.measured_k / grad_accum
    fixed_forward, fixed_backward = fixed * parts.forward_s / both, fixed * parts.backward_s / both
    return (fixed_forward + (parts.forward_s - fixed_forward) * scale,
            fixed_backward + (parts.backward_s - fixed_backward) * scale)


def _bucketed_backward(parts: StepParts, clock: ReplayClock, issue: Callable[[str, int], float], strategy: str,
                       cap_bytes: int, ready: Sequence[float], backward_s: float) -> float:
    """bucket, ddp, zero1 and zero2's synced backward: buckets launched in order once full;
    returns the share of the optimizer's work each rank steps."""
    if strategy == "ddp":
        order = sorted(range(len(parts.tensors)), key=lambda i: (ready[i], -i))
        plan = plan_ddp(parts.tensors, order, cap_bytes, cap_bytes)
    else:
        plan = plan_bucket_strategy(parts.tensors, cap_bytes)
    origin, ends = clock.computed_s, []
    for bucket in plan:
        clock.compute_to(origin, max(ready[i] for i in bucket))
        numel = _numel(parts, bucket)
        if strategy in ("zero1", "zero2"):
            numel = padded(numel, parts.world_size)
        kind = "reduce_scatter" if strategy == "zero2" else "all_reduce"
        ends.append(issue(kind, numel * _item(parts, bucket)))
    clock.compute_to(origin, backward_s)
    clock.wait(max(ends, default=0.0))
    if strategy in ("zero1", "zero2"):
        total = sum(t.nbytes for t in parts.tensors) or 1
        return sum(padded(_numel(parts, b), parts.world_size) // parts.world_size * _item(parts, b) for b in plan) / total
    return 1.0


def _fsdp_micro_step(parts: StepParts, clock: ReplayClock, issue: Callable[[str, int], float], forward_s: float,
                     backward_s: float, ready: Sequence[float], synced: bool, notes: list[str]) -> float:
    """One fsdp micro-step; returns the share of the optimizer's work each rank steps."""
    units = parts.units or (tuple(range(len(parts.tensors))),)
    if not parts.units and "fsdp: one unit" not in notes:
        notes.append("fsdp: one unit")
    world = parts.world_size
    unit_bytes = [world * _shard_elements(parts, unit) * _item(parts, unit) for unit in units]
    total = sum(t.nbytes for t in parts.tensors) or 1
    weights = [sum(parts.tensors[i].nbytes for i in unit) / total for unit in units]
    if "fsdp: forward split by parameter bytes" not in notes:
        notes.append("fsdp: forward split by parameter bytes")
    root, layers = len(units) - 1, list(range(len(units) - 1))
    # Forward: the root, then each layer, each gathered before it computes; one ahead on streams.
    order = [root, *layers]
    gathered = {order[0]: issue("all_gather", unit_bytes[order[0]])}
    for position, unit in enumerate(order):
        if parts.on_streams and position + 1 < len(order):
            gathered[order[position + 1]] = issue("all_gather", unit_bytes[order[position + 1]])
        clock.wait(gathered.pop(unit) if unit in gathered else issue("all_gather", unit_bytes[unit]))
        clock.compute(forward_s * weights[unit])
    # Backward: the root is still gathered; each layer, last first, gathered one ahead.
    unit_end = [max((ready[i] for i in unit), default=0.0) for unit in units]
    origin = clock.computed_s
    pending = {layers[-1]: issue("all_gather", unit_bytes[layers[-1]])} if layers else {}
    scatters = []
    for unit in reversed(layers):
        clock.wait(pending.pop(unit))
        if unit - 1 >= 0:
            pending[unit - 1] = issue("all_gather", unit_bytes[unit - 1])
        clock.compute_to(origin, unit_end[unit])
        if synced:
            end = issue("reduce_scatter", unit_bytes[unit])
            if not parts.on_streams:
                clock.wait(end)
            scatters.append(end)
    clock.compute_to(origin, backward_s)
    if synced:
        scatters.append(issue("reduce_scatter", unit_bytes[root]))
    clock.wait(max(scatters, default=0.0))
    stepped = sum(_shard_elements(parts, unit) * _item(parts, unit) for unit in units)
    return stepped / total


def fsdp_units(names: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """fsdp's units from the parameters' names: the children of the first module list (the first
    name with a numbered part, ``model.layers.3.``), one unit each in order, then the root holding
    every other parameter. One unit of all where no name has a numbered part."""
    prefix = None
    for name in names:
        parts = name.split(".")
        numbered = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if numbered is not None:
            prefix = parts[:numbered]
            break
    if prefix is None:
        return (tuple(range(len(names))),)
    layers: dict[str, list[int]] = {}
    root: list[int] = []
    for index, name in enumerate(names):
        parts = name.split(".")
        if parts[:len(prefix)] == prefix and len(parts) > len(prefix) and parts[len(prefix)].isdigit():
            layers.setdefault(parts[len(prefix)], []).append(index)
        else:
            root.append(index)
    return (*(tuple(members) for members in layers.values()), tuple(root))


def _numel(parts: StepParts, members: Sequence[int]) -> int:
    return sum(parts.tensors[i].nbytes // _item(parts, [i]) for i in members)


def _item(parts: StepParts, members: Sequence[int]) -> int:
    """Bytes an element of these tensors (a bucket or a unit holds one dtype)."""
    return ITEM_BYTES.get(parts.tensors[members[0]].key, 4) if members else 4


def _shard_elements(parts: StepParts, unit: Sequence[int]) -> int:
    """One rank's padded elements of a unit: each tensor's rows split over the world, padded."""
    total = 0
    for i in unit:
        numel = parts.tensors[i].nbytes // _item(parts, [i])
        rows = parts.rows[i] if i < len(parts.rows) and parts.rows[i] > 0 else numel
        total += rows_per_rank(rows, parts.world_size) * (numel // rows if rows else 0)
    return total
