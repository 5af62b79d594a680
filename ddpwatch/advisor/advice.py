"""The bucket-size advisor's reading of a session: the backward it replays, the cost model it
fits, and the sweep it returns. Pure (no torch, no UI): the dashboard's panel and ``ddpwatch
tune`` both call ``advise``.

From a step report: backward starts where the backward span holding the gradient-ready marks
starts; a ``p<i>`` mark gives parameter i's ready time, a ``b<i>`` mark bucket i's, whose members
come from the hello's ``bucket_layout`` or, where a run sends none (DDP's own buckets), are
taken in reverse module order until the mark's bytes are covered (DDP's rebuilt order is the
order gradients became ready, which for a model run layer by layer is that). Inside a bucket
the gradients are spread from the previous mark to this one in proportion to their bytes: the
one approximation here, since a bucket's earlier gradients are not marked. The step's other
time (data, forward, optimizer, gaps) is what is left of the step once backward and the
communication after it are taken out, held fixed at every cap.

No bucket's all-reduce can start before every rank has its gradients, so the backward replayed
is not the first rank's alone: in each step the rank whose backward ended last is found, its
ready times are put on the first rank's clock (``metrics.ClockAlignment``), and each tensor is
ready at the later of the two: read from the first rank alone, a later rank's backward would be
invisible, and the first rank's wait for it would go missing from the step predicted.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from instrumented_ddp.wire.bucket_plan import DDP_DEFAULT_FIRST_BUCKET_BYTES, TensorSize
from instrumented_ddp.wire.messages import Hello, StepReport
from instrumented_ddp.wire.kinds import READY_KIND, is_barrier_wait
from instrumented_ddp.wire.step_figures import call_times, counted

from ddpwatch.advisor.dtypes import ITEM_BYTES
from ddpwatch.advisor.bucket_sim import MIB, BackwardProfile, Prediction, best, cap_grid, describe, simulate, sweep
from ddpwatch.figures.compute_slowdown import NO_COMMUNICATION, CommunicationClock, SlowdownFit, communicating_backward, fit_slowdown, quiet_time
from ddpwatch.figures.cost_model import CostModel, StepCollectives, TransferMemory, TransferSample, call_sizes, fit_cost_model, transfer_samples_of
from ddpwatch.figures.cross_rank import Groups, all_reduce_ranks
from ddpwatch.figures.metrics import ClockAlignment
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.segments import Segment

#: Recent steps of the segment whose ready times (per tensor, the median) make the profile: enough
#: that steps spread by ±20 % from one to the next (two CPU ranks) do not move the prediction.
#: ``ddpwatch tune`` predicts after 10 counted steps a cap, so it uses them all.
PROFILE_STEPS = 20
FIT_STEPS = 40  # recent complete steps whose collectives fit the cost model
ADVISED_STRATEGIES = ("bucket", "ddp")
KEEP_BEST_WITHIN = 0.01  # a best shown stays while predicted within 1 % of the fastest (``keep_shown_best``)


def layout_tensors(parameter_layout: Sequence[tuple[str, int, str]]) -> tuple[TensorSize, ...]:
    return tuple(TensorSize(numel * ITEM_BYTES.get(dtype, 4), dtype) for _, numel, dtype in parameter_layout)


def ready_times(report: StepReport, tensors: Sequence[TensorSize], bucket_layout: Sequence[Sequence[int]] = (),
                lost_share: float = 0.0) -> tuple[list[float], float] | None:
    """Each tensor's gradient-ready time from the start of the backward that communicated, and
    that start on the rank's clock; None when the report has no marks or leaves a tensor out.
    ``lost_share``: of backward's compute, the share lost while an all-reduce ran beside it
    (``compute_slowdown``), taken out of each mark: the times backward would have had alone."""
    found = communicating_backward(report)
    if found is None:
        return None
    origin = found[0]
    marks = sorted((s for s in report.spans if s.kind == READY_KIND), key=lambda s: s.start)
    ready: list[float | None] = [None] * len(tensors)
    unmarked = list(reversed(range(len(tensors))))  # DDP's order, where no layout says otherwise
    previous = 0.0
    clock = CommunicationClock(report.spans) if lost_share > 0 else NO_COMMUNICATION
    for mark in marks:
        at = quiet_time(mark.start - origin, clock, origin, lost_share)
        number = int(mark.tag[1:]) if mark.tag[1:].isdigit() else -1
        if mark.tag.startswith("p") and 0 <= number < len(tensors):
            members = [number]
        elif mark.tag.startswith("b") and number < len(bucket_layout):
            members = list(bucket_layout[number])
        elif mark.tag.startswith("b"):
            members, covered = [], 0
            while unmarked and covered < mark.nbytes:
                index = unmarked.pop(0)
                if ready[index] is None:
                    members.append(index)
                    covered += tensors[index].nbytes
        else:
            return None
        total = sum(tensors[i].nbytes for i in members) or 1
        done = 0
        for index in members:
            done += tensors[index].nbytes
            ready[index] = previous + (at - previous) * done / total
        previous = at
    if any(t is None for t in ready):
        return None
    return [float(t) for t in ready], origin  # type: ignore[arg-type]


def backward_profile(steps: Sequence[Mapping[int, StepReport]], tensors: Sequence[TensorSize],
                     bucket_layout: Sequence[Sequence[int]] = (), reference: int | None = None,
                     offsets: Mapping[int, float] | None = None, groups: Groups | None = None,
                     lost_share: float = 0.0) -> BackwardProfile | None:
    """The median over ``steps`` (each a step's reports by rank) of each tensor's ready time, of
    the end of backward's compute (the last gradient) and of the step's other time, all read on
    ``reference``'s clock (default: each step's lowest rank), each rank's time put on it by
    ``offsets`` (seconds to add; none: the ranks share a clock, as on one host). A tensor is
    ready when both the reference and the rank whose backward ended last have it: that rank's
    last buckets are the ones left exposed; finding that rank is one pass over each report's
    spans, not a read of every rank's marks. With ``groups`` (who meets whom) that rank is looked for in the
    reference's own group: a bucket's all-reduce waits for the ranks it joins, not for a slow
    rank of another group. A step the reference did not report, or whose reference report has
    no marks, is left out. ``lost_share``: the ready times are those of backward alone
    (``ready_times``), and the profile carries it for the simulator to slow them again."""
    offsets = offsets or {}
    per_step: list[list[float]] = []
    others: list[float] = []
    for reports in steps:
        own = reference if reference is not None else min(reports, default=None)
        if own is None or own not in reports:
            continue
        report = reports[own]
        found = ready_times(report, tensors, bucket_layout, lost_share)
        if found is None:
            continue
        ready, origin = found
        tail = [max(span.start for span in report.spans if span.kind == READY_KIND)] + [s.end for s in report.spans if s.end > origin and (
            s.kind == "all_reduce" or (s.kind == "wait" and not is_barrier_wait(s)))]  # a barrier's wait: the loop's, fixed
        others.append(max(0.0, (report.end - report.start) - (max(tail) - origin)))
        group = next((members for members in groups or () if own in members), None)
        meeting = reports if group is None else {rank: reports[rank] for rank in group if rank in reports}
        last = _last_backward_rank(meeting, own, offsets)
        theirs = ready_times(reports[last], tensors, bucket_layout, lost_share) if last is not None else None
        if last is not None and theirs is not None:
            shift = theirs[1] + offsets.get(last, 0.0) - (origin + offsets.get(own, 0.0))
            ready = [max(mine, shift + t) for mine, t in zip(ready, theirs[0], strict=True)]
        per_step.append(ready)
    if not per_step:
        return None
    ready_s = tuple(statistics.median(times) for times in zip(*per_step, strict=True))
    return BackwardProfile(tuple(tensors), ready_s, max(ready_s), statistics.median(others), lost_share)


def _last_backward_rank(reports: Mapping[int, StepReport], own: int, offsets: Mapping[int, float]) -> int | None:
    """The rank other than ``own`` whose last gradient-ready mark is the latest on one clock."""
    latest: tuple[float, int] | None = None
    for rank, report in reports.items():
        if rank == own:
            continue
        marks = [span.start for span in report.spans if span.kind == READY_KIND]
        if marks:
            last_mark = max(marks) + offsets.get(rank, 0.0)
            if latest is None or last_mark > latest[0]:
                latest = (last_mark, rank)
    return latest[1] if latest is not None else None


def step_collectives(reports: Mapping[int, StepReport]) -> StepCollectives:
    """A step's collectives read from full reports (a test's steps, a replayed file's); a kept
    step's as the session holds them: ``Session.step_collectives``."""
    sized = next((report for report in reports.values() if len(report.spans)), None)
    return StepCollectives({rank: call_times(report) for rank, report in reports.items()},
                           call_sizes(sized) if sized is not None else {})


@dataclass(frozen=True)
class MeasuredCap:
    """A segment the run actually trained at a cap: its median step time."""

    strategy: str
    cap_bytes: int
    step_s: float
    steps: int
    #: A 90 % interval for that median (``order_statistics``): how far apart two caps' points
    #: must be before the steps tell them apart. None: not known (a hand-made point).
    interval_s: tuple[float, float] | None = None


@dataclass(frozen=True)
class Advice:
    strategy: str  # the rule simulated: the current segment's strategy
    workers: int  # collectives the backend runs at once (NCCL 1, gloo 2)
    current: Prediction
    default: Prediction  # PyTorch's 25 MB
    best: Prediction
    predictions: tuple[Prediction, ...]  # the grid, 1 KB to 2 GB
    model: CostModel
    measured: tuple[MeasuredCap, ...]
    words: str  # what limits the step at the current cap
    remembered: int = 0  # of the model's samples, those of sizes only earlier steps issued
    #: How the all-reduces slow backward, fitted over the caps run (None: not yet two caps apart).
    slowdown: SlowdownFit | None = None

    @property
    def gain(self) -> float:
        """The predicted step time saved by the best cap, as a share of the current one."""
        return 1.0 - self.best.step_s / self.current.step_s if self.current.step_s > 0 else 0.0


def workers_of(backend: str) -> int:
    """NCCL runs a group's collectives one at a time on its stream; gloo on its 2 worker threads.
    A group of several backends names each by device (``cpu:gloo,cuda:nccl``): a model's buckets
    are on its CUDA device, so NCCL's."""
    return 1 if "nccl" in backend else 2


def advise(*, strategy: str, cap_mb: float, backend: str, world_size: int, profile_steps: Sequence[Mapping[int, StepReport]],
           fit_steps: Sequence[StepCollectives], parameter_layout: Sequence[tuple[str, int, str]],
           bucket_layout: Sequence[Sequence[int]] = (), measured: Sequence[MeasuredCap] = (),
           caps: Sequence[int] | None = None, offsets: Mapping[int, float] | None = None,
           groups: Groups | None = None, memory: TransferMemory | None = None, switchable: bool = True,
           first_bucket_mb: float | None = None, slowdown: SlowdownFit | None = None) -> Advice | str:
    """The sweep for the run as it is now, or a line saying what is missing. ``profile_steps``:
    recent steps' reports by rank, read on their lowest rank's clock (``offsets``: see
    ``backward_profile``). ``groups``: who meets whom in the all-reduces (None, the world): the
    transfers are paired within each group, busbw's bus factor is over a group's ranks, and the
    backward simulated waits for the slowest rank of the reference's group. ``memory``: the
    run's earlier transfers; the sizes ``fit_steps`` did not issue are fitted from it.
    ``switchable``: the run can be switched to another cap (else it is told to restart with one).
    ``first_bucket_mb``: the run's DDP caps its first bucket below the rest (``bucket_cap_mb`` not
    given: 1 MiB), simulated at the run's own cap; any other cap is one a run given it would take,
    every bucket alike, but PyTorch's default, which is 25 MB after a first bucket of 1 MiB.
    ``slowdown``: how the run's all-reduces slow backward (``compute_slowdown``); without it,
    backward is replayed as measured."""
    if strategy not in ADVISED_STRATEGIES:
        return f"the advisor predicts bucket and ddp runs; this segment is {strategy}: switch to bucket to see it"
    tensors = layout_tensors(parameter_layout)
    if not tensors:
        return "waiting for the ranks' hello (the model's parameter layout)"
    profile = backward_profile(profile_steps, tensors, bucket_layout, offsets=offsets, groups=groups,
                               lost_share=slowdown.lost_share if slowdown is not None else 0.0)
    if profile is None:
        return "waiting for a step with gradient-ready marks (steps after the first of a segment)"
    samples = transfer_samples_of(fit_steps, world_size, groups)
    meeting = all_reduce_ranks(groups, world_size)
    remembered = memory.samples(meeting, besides={s.nbytes for s in samples}) if memory is not None else []
    samples += remembered
    model = fit_cost_model(samples, meeting)
    if model is None:
        return no_model_reason(samples, meeting, cap_mb, switchable)
    current_bytes = max(1, int(cap_mb * MIB))
    options: dict[str, Any] = {"rule": strategy, "workers": workers_of(backend)}
    predictions = sweep(profile, model, caps or cap_grid(current_bytes), **options)
    by_cap = {p.cap_bytes: p for p in predictions}
    if strategy == "ddp" and first_bucket_mb:  # DDP's own first bucket, where the run's cap was not given
        current = simulate(profile, model, current_bytes, first_cap_bytes=max(1, int(first_bucket_mb * MIB)), **options)
    else:
        current = by_cap.get(current_bytes) or sweep(profile, model, [current_bytes], **options)[0]
    # PyTorch's default: 25 MB, and under DDP a first bucket of 1 MiB (a cap given is every bucket's)
    default = (simulate(profile, model, 25 * MIB, first_cap_bytes=DDP_DEFAULT_FIRST_BUCKET_BYTES, **options) if strategy == "ddp"
               else by_cap.get(25 * MIB) or sweep(profile, model, [25 * MIB], **options)[0])
    top = best(predictions)
    words = describe(current, model)
    if current.step_s <= top.step_s * 1.01:
        words = f"the current cap is within 1 % of the predicted best; {words}"
    return Advice(strategy, options["workers"], current, default, top, tuple(predictions), model, tuple(measured), words,
                  len(remembered), slowdown)


def keep_shown_best(advice: Advice, shown_cap: int | None, within: float = KEEP_BEST_WITHIN) -> Advice:
    """``advice`` with the best cap shown before kept while it is still predicted within
    ``within`` of the fastest. Why: the profile is a median over the last 20 steps, and two caps
    a point apart trade places from one refresh to the next; a best that flips tells the user
    nothing, and ``b`` applies what is shown."""
    if shown_cap is None or shown_cap == advice.best.cap_bytes:
        return advice
    kept = next((p for p in advice.predictions if p.cap_bytes == shown_cap), None)
    if kept is None or kept.step_s > advice.best.step_s * (1.0 + within):
        return advice
    return replace(advice, best=kept)


def no_model_reason(samples: Sequence[TransferSample], meeting: int, cap_mb: float | None = None, switchable: bool = True) -> str:
    """Why no cost model could be fitted; ``meeting``: how many ranks each all-reduce spans;
    ``cap_mb``: the cap running now. Where the one size seen is under the cap, another cap above
    that size gives the same buckets again (25 MB and 12.5 MB both make one 9.2 MB bucket of
    every gradient): it says to go under it. A run that cannot switch (``attach``: the user's own
    DDP) is told where to set the cap on its restart, not a dashboard key that does nothing there."""
    if meeting < 2:
        return "one rank in each all-reduce: no transfer to model"
    sizes = sorted({s.nbytes for s in samples})

    def restart(cap: str) -> str:
        return (f"restart with DistributedDataParallel(..., bucket_cap_mb={cap}) "
                f"(a Trainer: TrainingArguments(ddp_bucket_cap_mb={cap}))")

    if len(sizes) == 1 and cap_mb is not None and cap_mb * MIB >= sizes[0]:
        under = f"{sizes[0] / MIB:.3g}"
        how = f"run a cap under {under} MB (-)" if switchable else restart(f"{sizes[0] / 2 / MIB:.3g}")  # half that size
        return (f"needs all-reduces of two sizes or more to fit the cost model: every one seen was {under} MB, "
                f"under the cap: {how} to cut them smaller")
    another = "run another cap (+ / -)" if switchable else restart(f"{cap_mb / 2:.3g}" if cap_mb else "another cap")
    if len(sizes) < 2:
        return f"needs all-reduces of two sizes or more to fit the cost model: {another}"
    return (f"the all-reduces of {sizes[0] / MIB:.3g}-{sizes[-1] / MIB:.3g} MB did not take longer as they grew "
            f"(too narrow a range, or ranks sharing cores): {another} to widen it")


def advice_for_session(session: Session, caps: Sequence[int] | None = None,
                       profile: tuple[list[dict[int, StepReport]], dict[int, float]] | None = None,
                       slowed: bool = True) -> Advice | str:
    """``advise`` on what a session holds: the current segment's strategy and cap, its recent
    counted reports by rank for the profile (``recent_profile_steps``, unless ``profile`` gives
    them read another way: ``bench/advisor_replay.py``), the recent steps every rank reported
    for the cost model, each bucket/ddp segment's median step as a measured cap, and how the
    caps run so far slowed backward (``slowed=False``: backward as measured, not slowed by the
    all-reduces beside it: ``bench/advisor_replay.py --unslowed``)."""
    if not session.segments:
        return "waiting for the run's first steps"
    segment = session.segments[-1]
    hello = next((state.hello for _, state in sorted(session.ranks.items()) if state.hello), None)
    if hello is None:
        return "waiting for the ranks' hello (the model's parameter layout)"
    if segment.strategy not in ADVISED_STRATEGIES and not hello.switchable:
        return (f"the advisor predicts bucket and ddp runs; this run is {segment.strategy} and was not started by ddpwatch, "
                "so it cannot switch to one")
    if hook := segment.settings.get("comm_hook"):
        return (f"this run's DDP communicates through a hook of its own, {hook}, which the advisor does not model: "
                "it replays DDP's own all-reduce of each whole bucket")
    if not hello_matches_segment(hello, segment):
        cap = hello.settings.get("bucket_mb")
        return f"waiting for the run's first steps as {hello.strategy}{f' at {float(cap):g} MB' if cap else ''}, where it switched"
    profile_steps, offsets = profile if profile is not None else recent_profile_steps(session, segment)
    fit_steps = [session.step_collectives(step) for step in sorted(session.reports)[-FIT_STEPS:]]
    first_mb = segment.settings.get("first_bucket_mb")
    return advise(strategy=segment.strategy, cap_mb=float(segment.settings.get("bucket_mb") or 25.0),
                  first_bucket_mb=float(first_mb) if first_mb else None,
                  backend=hello.backend, world_size=session.world_size, profile_steps=profile_steps,
                  fit_steps=fit_steps, parameter_layout=hello.parameter_layout, bucket_layout=hello.bucket_layout,
                  measured=measured_caps(session), caps=caps, offsets=offsets, groups=session.all_reduce_groups(),
                  memory=session.transfer_memory, switchable=hello.switchable,
                  slowdown=fit_slowdown(session.slowdown_memory.by_segment()) if slowed else None)


def recent_profile_steps(session: Session, segment: Segment, count: int = PROFILE_STEPS
                         ) -> tuple[list[dict[int, StepReport]], dict[int, float]]:
    """The segment's last ``count`` steps its first rank counted, each with every rank's counted
    report, and the offsets that put each rank on the first rank's clock (aligned over those
    steps alone: ``count`` passes over the ranks, not the session's)."""
    steps = [step for step in sorted(session.reports) if segment.first_step <= step <= segment.last_step]
    first_rank = min((rank for step in steps for rank in session.reports[step]), default=0)
    profiled = [step for step in steps if first_rank in session.reports[step] and counted(session.reports[step][first_rank])]
    profiled = profiled[-count:]
    clocks = ClockAlignment(reference=first_rank)
    for step in profiled:
        clocks.add_step(session.step_times(step))
    return [{rank: report for rank, report in session.reports[step].items() if counted(report)} for step in profiled], clocks.offsets()


def hello_matches_segment(hello: Hello, segment: Segment) -> bool:
    """Whether the hello's bucket layout is the one the segment trained with: a switched rank
    sends its new hello before the new segment's first report, and the old segment's marks read
    with the new layout would put the wrong parameters in each bucket."""
    if hello.strategy != segment.strategy:
        return False
    ours, theirs = hello.settings.get("bucket_mb"), segment.settings.get("bucket_mb")
    return ours is None or theirs is None or float(ours) == float(theirs)


def measured_caps(session: Session) -> list[MeasuredCap]:
    """Every bucket or ddp segment with counted steps: its cap and its median step."""
    measured = []
    for segment in session.segments:
        cap_mb = segment.settings.get("bucket_mb")
        if segment.strategy not in ADVISED_STRATEGIES or not cap_mb:
            continue
        figures = session.segment_figures(segment, include_pending=False, per_rank=False)
        if figures.steps:
            low_ms, high_ms = figures.step_ms_p50_interval
            measured.append(MeasuredCap(segment.strategy, max(1, int(float(cap_mb) * MIB)), figures.step_ms_p50 / 1e3, figures.steps,
                                        (low_ms / 1e3, high_ms / 1e3)))
    return measured
