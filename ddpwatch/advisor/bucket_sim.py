"""What another bucket cap would do to this run's step: backward replayed, buckets re-planned.

The article's simulation (its fourth post, "step time vs bucket size") with the run's own numbers: each
gradient becomes ready when the run measured it, buckets are planned with the exact rule of the
strategy (``instrumented_ddp.wire.bucket_plan``), a bucket launches when its last gradient is ready
and every earlier bucket has launched, and its all-reduce costs what the run's fitted
``CostModel`` says, on the backend's FIFO workers (NCCL: one stream; gloo: its worker threads).
Too small a cap pays the latency per call many times; too large a cap leaves one large
all-reduce exposed after backward. Pure: no torch, no UI.

Communication also slows the compute it overlaps, where the two share a resource (two CPU ranks
on two cores: gloo's threads take the cores backward runs on; a GPU: NCCL's kernels take SMs).
The profile says by how much, as the share of backward's compute lost while an all-reduce runs
(``BackwardProfile.lost_share``, measured from the run's own caps: ``compute_slowdown``):
backward is replayed as compute done at a rate lowered while transfers run, so a small cap that
hides its all-reduces inside backward also lengthens backward.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from instrumented_ddp.wire.bucket_plan import TensorSize, plan_bucket_strategy, plan_ddp

from ddpwatch.figures.cost_model import CostModel

MIB = 1024 * 1024
DDP_DEFAULT_CAP_BYTES = 25 * MIB
GRID_MIN_BYTES, GRID_MAX_BYTES = 1024, 2 * 1024**3


@dataclass(frozen=True)
class BackwardProfile:
    """One step as the run measured it, the part the cap does not change held fixed."""

    tensors: tuple[TensorSize, ...]  # the trainable parameters, module order
    ready_s: tuple[float, ...]  # per tensor, when its gradient was ready, from backward's start
    backward_s: float  # backward's compute, start to last gradient, with nothing all-reduced beside it
    other_s: float = 0.0  # the rest of the step (data, forward, optimizer)
    #: The share of backward's compute lost while an all-reduce runs beside it (0: communication
    #: does not slow compute; ``ready_s`` and ``backward_s`` are then as measured).
    lost_share: float = 0.0


@dataclass(frozen=True)
class Prediction:
    cap_bytes: int
    step_s: float
    exposed_s: float  # communication still running after backward's compute ended
    calls: int
    bucket_bytes: tuple[int, ...]  # in launch order
    extrapolated: bool  # a bucket size the cost model never saw
    backward_s: float = 0.0  # backward's compute as replayed at this cap, slowed by the transfers beside it
    slowed_s: float = 0.0  # of that, what the transfers beside it added (``BackwardProfile.lost_share``)

    @property
    def cap_mb(self) -> float:
        return self.cap_bytes / MIB


def simulate(profile: BackwardProfile, model: CostModel, cap_bytes: int, *, rule: str = "bucket",
             workers: int = 1, first_cap_bytes: int | None = None) -> Prediction:
    """The step at ``cap_bytes``. ``rule``: ``bucket`` (our strategy) or ``ddp`` (planned in the
    order gradients became ready, its first bucket capped by ``first_cap_bytes``, the cap itself
    when None, as DDP does when ``bucket_cap_mb`` is given). ``workers``: collectives the backend
    runs at once (NCCL 1, gloo 2)."""
    if rule == "bucket":
        plan = plan_bucket_strategy(profile.tensors, cap_bytes)
    elif rule == "ddp":
        order = sorted(range(len(profile.tensors)), key=lambda i: (profile.ready_s[i], -i))
        plan = plan_ddp(profile.tensors, order, cap_bytes, cap_bytes if first_cap_bytes is None else first_cap_bytes)
    else:
        raise ValueError(f"rule must be 'bucket' or 'ddp', not {rule!r}")
    free_at = [0.0] * max(1, workers)
    backward = SlowedBackward(profile.lost_share)
    comm_end = 0.0
    sizes = []
    for bucket in plan:
        nbytes = sum(profile.tensors[i].nbytes for i in bucket)
        sizes.append(nbytes)
        launched = backward.reach(max(profile.ready_s[i] for i in bucket))  # in order, once all its gradients are
        start = max(launched, heapq.heappop(free_at))
        end = start + model.seconds(nbytes)
        heapq.heappush(free_at, end)
        backward.transfer(start, end)
        comm_end = max(comm_end, end)
    backward_end = backward.reach(profile.backward_s)
    exposed = max(0.0, comm_end - backward_end)
    return Prediction(cap_bytes, profile.other_s + backward_end + exposed, exposed, len(plan), tuple(sizes),
                      any(model.extrapolated(n) for n in sizes), backward_end, max(0.0, backward_end - profile.backward_s))


class SlowedBackward:
    """Backward's clock: compute done (in seconds of undisturbed backward) against wall time, at
    ``1 - lost_share`` of full speed while any transfer runs beside it, so a transfer of 10 ms
    wholly inside backward delays every gradient after it by ``lost_share`` · 10 ms. With nothing
    lost, wall time is compute time. Calls must ask for compute in order (``reach``), as buckets
    launch in order."""

    def __init__(self, lost_share: float = 0.0) -> None:
        self.lost_share = lost_share
        self.wall_s = 0.0
        self.done_s = 0.0
        self._transfers: list[tuple[float, float]] = []  # start, end

    def transfer(self, start_s: float, end_s: float) -> None:
        if self.lost_share > 0 and end_s > start_s:
            self._transfers.append((start_s, end_s))

    def reach(self, compute_s: float) -> float:
        """The wall time at which backward has done ``compute_s`` of its compute (or now, where
        it has already)."""
        while self.done_s < compute_s:
            self._transfers = [t for t in self._transfers if t[1] > self.wall_s]  # those ended no longer slow it
            running = any(start <= self.wall_s for start, _ in self._transfers)
            speed = 1.0 - self.lost_share if running else 1.0
            change = min((edge for start, end in self._transfers for edge in (start, end) if edge > self.wall_s),
                         default=math.inf)
            if self.wall_s + (compute_s - self.done_s) / speed <= change:
                self.wall_s += (compute_s - self.done_s) / speed
                self.done_s = compute_s
            else:
                self.done_s += (change - self.wall_s) * speed
                self.wall_s = change
        return self.wall_s


def cap_grid(current_cap_bytes: int | None = None) -> list[int]:
    """1 KB to 2 GB in steps of √2 (43 caps), plus the current cap and PyTorch's 25 MB."""
    steps = round(2 * math.log2(GRID_MAX_BYTES / GRID_MIN_BYTES))
    caps = {round(GRID_MIN_BYTES * 2 ** (k / 2)) for k in range(steps + 1)} | {DDP_DEFAULT_CAP_BYTES}
    if current_cap_bytes:
        caps.add(current_cap_bytes)
    return sorted(caps)


def sweep(profile: BackwardProfile, model: CostModel, caps: Sequence[int], **options: object) -> list[Prediction]:
    return [simulate(profile, model, cap, **options) for cap in caps]  # type: ignore[arg-type]


def best(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest step; among caps within 0.1 % of it, the one of fewest calls, and of those the
    smallest cap: above the model's bytes every cap is one bucket of it all, the same buckets,
    and the smallest such cap is the one worth naming (and ``tune`` running)."""
    fastest = min(p.step_s for p in predictions)
    return min((p for p in predictions if p.step_s <= fastest * 1.001), key=lambda p: (p.calls, p.cap_bytes))


def describe(prediction: Prediction, model: CostModel) -> str:
    """What limits the step at this cap, in words: the latency paid per call, or the last
    all-reduce left exposed after backward; and, where the all-reduces beside backward slow it
    by 1 % of the step or more, by how much (what hiding them costs)."""
    if not prediction.calls:
        return "no gradients to reduce"
    latency = prediction.calls * model.alpha_s
    mean_mb = sum(prediction.bucket_bytes) / prediction.calls / MIB
    slowed = (f"; the all-reduces beside backward slow it by {prediction.slowed_s * 1e3:.3g} ms"
              if prediction.slowed_s >= 0.01 * prediction.step_s else "")
    if prediction.exposed_s <= 0:
        return f"all communication hidden behind backward: {prediction.calls} calls of {mean_mb:.2g} MB{slowed}"
    last_mb = prediction.bucket_bytes[-1] / MIB
    if latency >= prediction.exposed_s:
        return (f"latency-bound: {prediction.calls} calls of {mean_mb:.2g} MB ({latency * 1e3:.3g} ms of per-call latency)"
                f"{slowed}")
    return f"one exposed {last_mb:.2g} MB all-reduce after backward ({prediction.exposed_s * 1e3:.3g} ms exposed){slowed}"
