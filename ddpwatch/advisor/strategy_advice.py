"""Which strategy should this job use: every strategy and accumulation predicted from the current
segment, with what the session measured of each beside it, and the fastest that fits a memory
budget, in words. Reads the session; the figures are the pure simulator's (``strategy_sim``) and
the memory arithmetic's (``strategy_memory``).

The parts a step is replayed from are read from the segment's recent steps, on its lowest rank:

* forward, backward and the optimizer: each phase's time less the collectives and waits that
  blocked inside it (an fsdp gather, DDP's wait for its buckets), per micro-step; the optimizer's
  scaled up by the share of the model the run's strategy steps on a rank;
* the gradients' ready times from the run's marks (``advice.backward_profile``) where it has them
  and they are not delayed by calls blocking between them (async, bucket, ddp, zero1, zero2);
  otherwise (simple, ga, hook, fsdp) backward is split over the parameters by their bytes, the
  last in module order ready first, and the table says so;
* a micro-step's fixed cost, what its forward and backward take whatever its samples, from the
  strategies the session ran at two Ks (``micro_step_fixed_s``); none before;
* what none of these hold (the gaps between phases) is the measured median step less the
  strategy's own replay: the model's error on the strategy that ran, carried to every other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from instrumented_ddp.wire.messages import Hello, Span, StepReport
from instrumented_ddp.wire.step_figures import BLOCKING_KINDS, counted

from ddpwatch.advisor.advice import FIT_STEPS, backward_profile, layout_tensors, recent_profile_steps, workers_of
from ddpwatch.advisor.bucket_sim import MIB
from ddpwatch.advisor.strategy_memory import held_memory, predicted_peak
from ddpwatch.advisor.strategy_sim import STRATEGIES, StepParts, fsdp_units, simulate_strategy
from ddpwatch.figures.compute_slowdown import fit_slowdown
from ddpwatch.figures.cost_model import transfer_samples_of
from ddpwatch.figures.cross_rank import all_reduce_ranks
from ddpwatch.figures.kind_costs import KindCost, kind_costs
from ddpwatch.ingest.segments import Segment
from ddpwatch.ingest.session import Session

MARKED = ("async", "bucket", "ddp", "zero1", "zero2")  # whose ready marks are backward's own
SPLIT_NOTE = "backward split by parameter bytes"
EARLIER_NOTE = "the link's model from an earlier segment (this one's calls could not fit one)"
FIXED_NOTE = "micro-steps as their share of the batch (no strategy run at two Ks yet)"


@dataclass(frozen=True)
class StrategyRow:
    strategy: str
    grad_accum: int
    predicted_ms: float
    predicted_held_mib: float  # parameters, gradients and optimizer state, the most on any rank
    predicted_peak_mib: float | None  # None: the run measured no peak to start from
    measured_ms: float | None = None  # the median step of a segment the session ran it in
    measured_held_mib: float | None = None
    measured_peak_mib: float | None = None
    notes: tuple[str, ...] = ()

    def fits(self, budget_mib: float | None) -> bool:
        """Whether its predicted peak (or, without one, what it holds) is within ``budget_mib`` (None: any)."""
        return budget_mib is None or (self.predicted_peak_mib or self.predicted_held_mib) <= budget_mib


@dataclass(frozen=True)
class StrategyAdvice:
    run_strategy: str
    run_grad_accum: int
    rows: tuple[StrategyRow, ...]
    costs: dict[str, KindCost]
    budget_mib: float | None
    words: str  # the fastest that fits the budget, against the run's strategy
    refused: tuple[str, ...] = ()  # choices not predicted, each with why


def strategy_advice(session: Session, strategies: Sequence[str] = STRATEGIES, grad_accums: Sequence[int] = (1,),
                    budget_mib: float | None = None, earlier_costs: dict[str, KindCost] | None = None) -> StrategyAdvice | str:
    """The table for ``strategies`` x ``grad_accums`` from the session's current segment, or a
    line saying what is missing. ``budget_mib``: the memory a rank may hold at its peak (None:
    the device's, where the ranks' samples say it). ``earlier_costs``: the models an earlier
    advice fitted, used where the segment's calls cannot be (a run whose strategies all issue
    calls of about one size, on a noisy link), and said so in each row's notes."""
    if not session.segments:
        return "waiting for the run's first steps"
    segment = session.segments[-1]
    hello = next((state.hello for _, state in sorted(session.ranks.items()) if state.hello), None)
    if hello is None or not hello.parameter_layout:
        return "waiting for the ranks' hello (the model's parameter layout)"
    recent = recent_profile_steps(session, segment)  # read once: the parts and the link's models share them
    parts = step_parts(session, segment, hello, recent)
    if isinstance(parts, str):
        return parts
    costs, earlier = session_costs(session, recent[0]), False
    if not costs and earlier_costs:
        costs, earlier = earlier_costs, True
    if not costs:
        return ("no cost model yet: the run's collectives have not come in sizes far enough apart "
                "to tell latency from bandwidth")
    run_k = int(segment.settings.get("grad_accum") or 1)
    cap = max(1, int(float(segment.settings.get("bucket_mb") or 25.0) * MIB))
    figures = session.segment_figures(segment, per_rank=False)
    if not figures.steps:
        return "waiting for the segment's counted steps"
    own = simulate_strategy(parts, costs, segment.strategy, run_k, cap)
    parts = replace(parts, other_s=figures.step_ms_p50 / 1e3 - own.step_s)
    measured_peak = figures.memory.get("peak")
    device_peak = hello.device.startswith("cuda")
    rows, refused = [], []
    for strategy in strategies:
        for k in grad_accums:
            if hello.global_batch and hello.global_batch % (session.world_size * k):
                refused.append(f"{strategy} at K={k}: {k} micro-steps do not divide the batch of "
                               f"{hello.global_batch} over {session.world_size} ranks")
                continue
            predicted = simulate_strategy(parts, costs, strategy, k, cap)
            held = held_memory(strategy, hello.parameter_layout, session.world_size, cap, 0, hello.parameter_rows).total  # rank 0 holds the most
            peak = (predicted_peak(strategy, hello.parameter_layout, session.world_size, segment.strategy, measured_peak, k, run_k,
                                   cap, cap, hello.parameter_rows, device_peak) if measured_peak else None)
            measured = _measured(session, strategy, k)
            notes = predicted.notes + ((SPLIT_NOTE,) if segment.strategy not in MARKED else ())
            if k != run_k and parts.micro_fixed_s <= 0:
                notes += (FIXED_NOTE,)
            if earlier:
                notes += (EARLIER_NOTE,)
            rows.append(StrategyRow(strategy, k, predicted.step_s * 1e3, held / MIB, peak / MIB if peak else None, *measured, notes))
    budget = budget_mib if budget_mib is not None else device_memory_mib(session)
    return StrategyAdvice(segment.strategy, run_k, tuple(rows), costs, budget, fastest_words(rows, segment.strategy, run_k, budget),
                          tuple(refused))


def step_parts(session: Session, segment: Segment, hello: Hello,
               recent: tuple[list[dict[int, StepReport]], dict[int, float]]) -> StepParts | str:
    """The parts of the segment's recent steps (``advice.recent_profile_steps``: each step's
    reports by rank, and the offsets that put them on one clock; see the module docstring)."""
    steps, offsets = recent
    reference = [reports[min(reports)] for reports in steps if reports and min(reports) in reports]
    reference = [report for report in reference if report.spans]
    if not reference:
        return "waiting for steps with their spans (the advisor asks the ranks for them)"
    k = int(segment.settings.get("grad_accum") or 1)
    tensors = layout_tensors(hello.parameter_layout)
    forward = statistics.median(quiet_s(r, "forward") for r in reference) / k
    backward = statistics.median(quiet_s(r, "backward") for r in reference) / k
    data = statistics.median(sum(s.end - s.start for s in r.spans if s.kind == "data") for r in reference)
    full_state = held_memory("ddp", hello.parameter_layout, session.world_size).optimizer_state
    own_state = held_memory(segment.strategy, hello.parameter_layout, session.world_size,
                            max(1, int(float(segment.settings.get("bucket_mb") or 25.0) * MIB)), 0, hello.parameter_rows).optimizer_state
    optimizer = statistics.median(quiet_s(r, "optimizer") for r in reference) * full_state / max(1, own_state)
    slowdown = fit_slowdown(session.slowdown_memory.by_segment())
    lost = slowdown.lost_share if slowdown is not None else 0.0
    profile = (backward_profile(steps, tensors, hello.bucket_layout, offsets=offsets, groups=session.all_reduce_groups(),
                                lost_share=lost) if segment.strategy in MARKED else None)
    if profile is not None:
        ready, backward = profile.ready_s, profile.backward_s
    else:
        ready = tuple(split_by_bytes([t.nbytes for t in tensors], backward))
    fixed = micro_step_fixed_s(session)
    return StepParts(tensors, tuple(ready), backward, forward, optimizer, data, 0.0, k, session.world_size,
                     workers_of(hello.backend), "nccl" in hello.backend, lost,
                     fsdp_units([name for name, _, _ in hello.parameter_layout]), tuple(hello.parameter_rows),
                     fixed if fixed is not None else 0.0)


def micro_step_fixed_s(session: Session) -> float | None:
    """What a micro-step's forward and backward cost whatever its samples: for each strategy the
    session ran at two Ks or more (its segments whose steps it still holds), the growth of a
    step's forward and backward per micro-step added, T(K2) − T(K1) over K2 − K1; the median over
    those strategies. None where none ran at two Ks."""
    by_strategy: dict[str, dict[int, list[float]]] = {}
    for segment in session.segments:
        k = int(segment.settings.get("grad_accum") or 1)
        for step in range(segment.first_step, segment.last_step + 1):
            reports = session.reports.get(step)
            if not reports:
                continue
            report = reports[min(reports)]
            if report.spans and counted(report):
                by_strategy.setdefault(segment.strategy, {}).setdefault(k, []).append(quiet_s(report, "forward") + quiet_s(report, "backward"))
    slopes = []
    for per_k in by_strategy.values():
        if len(per_k) >= 2:
            low, high = min(per_k), max(per_k)
            slopes.append((statistics.median(per_k[high]) - statistics.median(per_k[low])) / (high - low))
    return max(0.0, statistics.median(slopes)) if slopes else None


def quiet_s(report: StepReport, kind: str) -> float:
    """The time of ``kind``'s spans less what blocking collectives and waits inside them took."""
    blocking = sorted((s.start, s.end) for s in report.spans if s.blocking and s.kind in BLOCKING_KINDS)
    total = 0.0
    for span in report.spans:
        if span.kind != kind:
            continue
        total += (span.end - span.start) - _covered(span, blocking)
    return max(0.0, total)


def _covered(span: Span, ranges: Sequence[tuple[float, float]]) -> float:
    covered, reached = 0.0, span.start
    for start, end in ranges:
        start, end = max(start, reached), min(end, span.end)
        if end > start:
            covered += end - start
            reached = end
    return covered


def split_by_bytes(nbytes: Sequence[int], backward_s: float) -> list[float]:
    """Each gradient's ready time where the run marked none: backward's compute spread over the
    parameters by their bytes, the last in module order first (the order backward reaches them)."""
    total = sum(nbytes) or 1
    ready, done = [0.0] * len(nbytes), 0
    for index in reversed(range(len(nbytes))):
        done += nbytes[index]
        ready[index] = backward_s * done / total
    return ready


def session_costs(session: Session, steps: Sequence[dict[int, StepReport]]) -> dict[str, KindCost]:
    """Each kind's model: the all-reduce fit as the bucket advisor makes it (the run's remembered
    sizes included), the other kinds from the segment's recent steps or derived from it."""
    fit_steps = [session.step_collectives(step) for step in sorted(session.reports)[-FIT_STEPS:]]
    groups = session.all_reduce_groups()
    samples = transfer_samples_of(fit_steps, session.world_size, groups)
    meeting = all_reduce_ranks(groups, session.world_size)
    samples += session.transfer_memory.samples(meeting, besides={s.nbytes for s in samples})
    return kind_costs(steps, meeting, samples)


def _measured(session: Session, strategy: str, k: int) -> tuple[float | None, float | None, float | None]:
    """The latest segment the session ran ``strategy`` at K micro-steps in: its median step, held and peak MiB."""
    for segment in reversed(session.segments):
        if segment.strategy == strategy and int(segment.settings.get("grad_accum") or 1) == k:
            figures = session.segment_figures(segment, include_pending=False, per_rank=False)
            if figures.steps:
                memory = figures.memory
                held = sum(memory.get(kind, 0) for kind in ("parameters", "gradients", "optimizer_state"))
                return figures.step_ms_p50, held / MIB if held else None, memory["peak"] / MIB if memory.get("peak") else None
    return None, None, None


def device_memory_mib(session: Session) -> float | None:
    """The smallest memory any rank's device has, from its samples (None before any)."""
    totals = [sample.readings["mem_total_bytes"] for state in session.ranks.values() for sample in list(state.devices)[-1:]
              if sample.readings.get("mem_total_bytes")]
    return min(totals) / MIB if totals else None


def fastest_words(rows: Sequence[StrategyRow], run: str, run_k: int, budget_mib: float | None) -> str:
    """The fastest predicted choice whose peak (or, without one, held memory) fits the budget,
    against the run's own: "zero2 holds 7.5 GiB less per rank for +4.0 ms a step"."""
    if not rows:
        return "no strategy predicted"
    fitting = [r for r in rows if r.fits(budget_mib)]
    if not fitting and budget_mib is not None:
        return f"no strategy fits {budget_mib / 1024:.3g} GiB a rank"
    best = min(fitting or rows, key=lambda r: r.predicted_ms)
    own = next((r for r in rows if (r.strategy, r.grad_accum) == (run, run_k)), None)
    name = f"{best.strategy}" + (f" at K={best.grad_accum}" if best.grad_accum > 1 else "")
    within = f" within {budget_mib / 1024:.3g} GiB" if budget_mib is not None else ""
    if own is None or own is best:
        return f"{name} is the fastest{within}: {best.predicted_ms:.1f} ms a step"
    less = own.predicted_held_mib - best.predicted_held_mib
    held = f"holds {_mib(abs(less))} {'less' if less >= 0 else 'more'} per rank"
    return f"{name} is the fastest{within}: {held} for {best.predicted_ms - own.predicted_ms:+.1f} ms a step against {run}"


def _mib(mib: float) -> str:
    return f"{mib / 1024:.3g} GiB" if mib >= 1024 else f"{mib:.3g} MiB"
