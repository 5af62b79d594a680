"""A cost model for each collective kind a strategy issues: all-reduce, reduce-scatter, all-gather
and broadcast. Pure: no torch, no UI.

Each is ``cost_model.CostModel``'s line, t(S) = α + (S / busbw) · f(n), with nccl-tests' bus factor
f of its kind (``step_figures.bus_factor``: 2(n−1)/n for an all-reduce, (n−1)/n for a reduce-scatter
or an all-gather, whose S is the whole unsharded tensor, 1 for a broadcast). Where the run has issued
a kind at two sizes or more, its own transfers fit it: each call paired across ranks by kind, tag
and occurrence, its shortest duration over the ranks (the rest was waiting for the last to join).
Where it has not, the kind is *derived* from the all-reduce fit (from another kind's, in a run that
issued no all-reduce): the same latency and the same bus bandwidth, its own bus factor. The link is the same link; a ring reduce-scatter is half a ring
all-reduce. That is a model, not a measurement, and is marked so wherever it is shown.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.wire.step_figures import bus_factor

from ddpwatch.figures.cost_model import CostModel, TransferSample, fit_cost_model
from ddpwatch.figures.cross_rank import collective_key

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class KindCost:
    """One kind's model; ``derived``: made from the all-reduce fit, not from calls of its own."""

    kind: str
    model: CostModel
    derived: bool

    def seconds(self, nbytes: int) -> float:
        return self.model.seconds(nbytes)

    @property
    def source(self) -> str:
        """Where the model comes from, in words, for the table that shows it."""
        if self.derived:
            return f"derived from the all-reduce fit (bus factor {self.model.factor:.3g})"
        return f"fitted on {self.model.samples} calls, median error {self.model.relative_error:.1%}"


def kind_samples(steps: Sequence[Mapping[int, StepReport]], kind: str) -> list[TransferSample]:
    """The transfers of ``kind`` in ``steps`` (each a step's reports by rank): each call every rank
    made, keyed by its tag and occurrence, its bytes and its shortest duration over the ranks. A
    step with fewer than two ranks gives none (one rank has no transfer to tell from waiting)."""
    samples: list[TransferSample] = []
    for reports in steps:
        if len(reports) < 2:
            continue
        per_rank: list[dict[tuple[str, int], tuple[int, float]]] = []
        for report in reports.values():
            seen: Counter[str] = Counter()
            per_rank.append({collective_key(span.tag, seen): (span.nbytes, span.end - span.start)
                             for span in sorted(report.spans, key=lambda span: span.start) if span.kind == kind})
        for key in per_rank[0]:
            found = [calls[key] for calls in per_rank if key in calls]
            if len(found) == len(per_rank) and len({nbytes for nbytes, _ in found}) == 1:
                seconds = min(duration for _, duration in found)
                if seconds > 0:
                    samples.append(TransferSample(found[0][0], seconds))
    return samples


def derived_model(base: CostModel, kind: str) -> CostModel | None:
    """``kind``'s model made from another kind's fit: its α and busbw, ``kind``'s bus factor."""
    factor = bus_factor(kind, base.world_size)
    if not factor:
        return None
    return replace(base, factor=factor, samples=0)


def kind_costs(steps: Sequence[Mapping[int, StepReport]], world_size: int,
               all_reduce: CostModel | None = None) -> dict[str, KindCost]:
    """Each kind's model: fitted where the run issued it at two sizes or more (``all_reduce``: the
    run's all-reduce fit where the caller has one, from ``advice``, its remembered sizes
    included), else derived from the all-reduce fit, or, in a run that issued none (``fsdp``),
    from the first kind fitted; {} where nothing could be fitted."""
    fitted: dict[str, CostModel] = {}
    for kind in KINDS:
        model = all_reduce if kind == "all_reduce" and all_reduce is not None else \
            fit_cost_model(kind_samples(steps, kind), world_size, kind)
        if model is not None:
            fitted[kind] = model
    base = fitted.get("all_reduce") or next(iter(fitted.values()), None)
    costs: dict[str, KindCost] = {}
    for kind in KINDS:
        if kind in fitted:
            costs[kind] = KindCost(kind, fitted[kind], derived=False)
        elif base is not None and (made := derived_model(base, kind)) is not None:
            costs[kind] = KindCost(kind, made, derived=True)
    return costs
