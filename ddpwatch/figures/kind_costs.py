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
    """One kind's model; ``derived_from``: "" where fitted on calls of its own, else the fit it
    was made from ("all_reduce", or "every kind" for the joint fit)."""

    kind: str
    model: CostModel
    derived_from: str = ""

    @property
    def derived(self) -> bool:
        return bool(self.derived_from)

    def seconds(self, nbytes: int) -> float:
        return self.model.seconds(nbytes)

    @property
    def source(self) -> str:
        """Where the model comes from, in words, for the table that shows it."""
        if self.derived_from:
            fit = "the all-reduce fit" if self.derived_from == "all_reduce" else f"the fit over {self.derived_from}"
            return f"derived from {fit} (bus factor {self.model.factor:.3g})"
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
               all_reduce_samples: Sequence[TransferSample] | None = None) -> dict[str, KindCost]:
    """Each kind's model: fitted where the run's calls of it tell latency from bandwidth (two
    sizes or more, time growing with size); else derived from the all-reduce fit, or, where that
    cannot be made either, from the fit over every kind's calls at once, each put in all-reduce
    bytes by the ratio of the bus factors (one link, whatever the kind: a bucketed run's calls
    of each kind may all be about one size, but its kinds' sizes differ). ``all_reduce_samples``:
    the all-reduce transfers to fit (the bucket advisor's, its remembered sizes included); None:
    those of ``steps``. {} where nothing could be fitted."""
    samples = {kind: kind_samples(steps, kind) for kind in KINDS}
    if all_reduce_samples is not None:
        samples["all_reduce"] = list(all_reduce_samples)
    fitted: dict[str, CostModel] = {}
    for kind in KINDS:
        if (model := fit_cost_model(samples[kind], world_size, kind)) is not None:
            fitted[kind] = model
    base, source = fitted.get("all_reduce"), "all_reduce"
    if base is None:
        reference = bus_factor("all_reduce", world_size) or 1.0
        joint = [TransferSample(round(s.nbytes * (bus_factor(kind, world_size) or 0.0) / reference), s.seconds)
                 for kind in KINDS for s in samples[kind]]
        base, source = fit_cost_model(joint, world_size), "every kind"
    if base is None:
        base, source = next(((model, kind) for kind, model in fitted.items()), (None, ""))
    costs: dict[str, KindCost] = {}
    for kind in KINDS:
        if kind in fitted:
            costs[kind] = KindCost(kind, fitted[kind])
        elif base is not None and (made := derived_model(base, kind)) is not None:
            costs[kind] = KindCost(kind, made, source)
    return costs
