"""ddpwatch's GPU figures held against torch.profiler's own CUDA kernel times of the same run.

``ddpwatch doctor`` runs a short NCCL run of ``train.py`` that both streams step reports and writes
a ``torch.profiler`` trace per rank (``train.py --profile``: ProfilerStep#3-#7, i.e. steps 4-8).
This module takes one rank's trace (read by ``profiler_trace``), lines it up with that rank's ``StepReport`` list and checks:

* **collectives per step** - the ``all_reduce``/``broadcast`` spans of each compared step against
  the NCCL kernels of that step, per kind: exact equality;
* **collective duration** - each ddpwatch collective span paired with its kernel: within 20 %;
* **Compute% and Overlap%** - ddpwatch's own step figures (``step_figures.step_figures``) against the
  same function fed with kernels (C = union of non-NCCL kernels, M = union of NCCL kernels, both
  clipped to the step window K): within 5 points;
* **device syncs per step** - ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/
  ``cudaEventSynchronize``/synchronous ``cudaMemcpy*`` calls and DtoH copies to pageable memory
  in each profiled iteration: 0 for a pass. Given the trace of the same script run unwatched,
  **the syncs ddpwatch adds**: each iteration's syncs minus those of the same unwatched
  iteration, 0 for a pass (a model that syncs on its own, as transformers does to check a
  padding mask, is not ddpwatch's to answer for, and is named in the detail).

How the two records are lined up (which iteration a kernel belongs to, and the offset between
the two clocks) is ``clock_pairing``'s; what this module adds to it:

* An NCCL kernel launched in an iteration but run entirely outside ddpwatch's step window (e.g.
  train.py's per-step switch broadcast, issued before ``begin_step``) is not ddpwatch's to report;
  it is counted apart (``StepRow.outside_calls``) and named in the notes.
* Syncs are counted per ProfilerStep window (the whole iteration, boundary work included: a sync
  that ddpwatch's own hooks cause between steps costs every step too). The profiler's own
  ``cudaDeviceSynchronize`` at stop (``torch.autograd.profiler.profile.__exit__``) runs after the
  last window closes and is not counted. One ``.item()`` shows as a ``cudaStreamSynchronize``; a
  blocking copy to pageable memory may show as both a sync call and a pageable DtoH memcpy: the
  count is of events, and the check only asks whether it is zero.

The names and categories the trace is read by are cited in ``profiler_trace``.

Pure: standard library, ``clock_pairing``, ``profiler_trace`` and ``instrumented_ddp.wire`` only.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ddpwatch.doctor.clock_pairing import (US_PER_S, ClockOffset, by_kind_in_end_order, collective_spans, estimate_offset,
                                           kernel_kind, launched_in, paired_kind)
from ddpwatch.doctor.profiler_trace import Kernel, ProfilerTrace
from instrumented_ddp.wire.messages import Span, StepReport
from instrumented_ddp.wire.kinds import is_barrier_wait
from instrumented_ddp.wire.step_figures import step_figures

__all__ = [
    "Check", "PairedCollective", "RankComparison", "StepRow", "all_passed", "compare_rank", "format_table",
    "render_checks", "render_steps", "syncs_per_iteration", "value_text",
]

# --- the comparison ------------------------------------------------------------------------


#: A span end this many µs inside its kernel's still holds it (``PairedCollective.wait_at_one_end_us``):
#: paired ends agree within ±12 µs, most within 3 (H100, H200).
ONE_END_EDGE_US = 10.0


@dataclass(frozen=True)
class PairedCollective:
    """One ddpwatch collective span and the kernel it was paired with (``index``: 1-based, in
    order of end within its step and kind)."""

    step: int
    kind: str
    index: int
    ddpwatch_ms: float
    profiler_ms: float
    end_difference_us: float  # kernel end - shifted span end, under the step's offset
    start_difference_us: float = 0.0  # kernel start - shifted span start: NCCL's launch lead, a late start

    @property
    def error(self) -> float:
        """Relative to the profiler's duration; infinite against a zero-length kernel."""
        if self.profiler_ms > 0:
            return (self.ddpwatch_ms - self.profiler_ms) / self.profiler_ms
        return 0.0 if self.ddpwatch_ms == self.profiler_ms else math.inf

    def within(self, tolerance: float, floor_us: float) -> bool:
        """The duration check's rule for one collective: within ``tolerance`` of the kernel's, or
        ``floor_us`` of it (NCCL's start event leads a short kernel by tens of µs)."""
        return abs(self.error) <= tolerance or abs(self.ddpwatch_ms - self.profiler_ms) * 1e3 <= floor_us

    def wait_at_one_end_us(self) -> float | None:
        """How far the span reaches past its kernel at one end, where it holds its kernel (neither
        end inside the kernel's by more than ``ONE_END_EDGE_US``) and the other end's excess is
        under a tenth of that: the kernel began late in a span that ended with it (its stream had
        reached ddpwatch's start mark, then the GPU ran something else first: where ranks share a
        GPU, another process's time slice), or the span's end mark was reached late. None
        otherwise (a span shifted, or inside its kernel, or late at both ends)."""
        early, late = self.start_difference_us, -self.end_difference_us  # excess before and after the kernel
        if min(early, late) < -ONE_END_EDGE_US:
            return None
        wait, other = max(early, late), min(early, late)
        return wait if wait > ONE_END_EDGE_US and max(other, 0.0) < wait / 10 else None


@dataclass(frozen=True)
class StepRow:
    """One compared step: ddpwatch's figures and the profiler's side by side."""

    step: int
    profiler_step: int
    offset_us: float
    window_ms: float
    ddpwatch_calls: Mapping[str, int]
    profiler_calls: Mapping[str, int]
    outside_calls: Mapping[str, int]  # NCCL kernels of this iteration run outside ddpwatch's step window
    pairs: int
    worst_duration_error: float | None
    ddpwatch_compute_pct: float
    profiler_compute_pct: float
    ddpwatch_overlap_pct: float
    profiler_overlap_pct: float
    syncs: tuple[str, ...]  # names, in order, of the syncs in this iteration
    syncs_in_step_window: int  # of those, the ones whose CPU time falls in ddpwatch's shifted window (approximate)
    untimed_calls: int = 0  # collectives the rank counted and did not time (``StepReport.untimed_collectives``)
    #: Barriers the rank timed as waits (``kinds.BARRIER_TAG``): a kernel each on NCCL (an
    #: all-reduce of one element), with no span of a collective's kind to pair it with.
    barrier_calls: int = 0


@dataclass(frozen=True)
class Check:
    """One check of one rank. ``unit``: ``""`` (a count), ``"ms"``, ``"%"`` or ``"x"`` (a ratio)."""

    name: str
    ddpwatch: float | None
    profiler: float | None
    tolerance: str
    passed: bool
    unit: str = ""
    detail: str = ""


@dataclass(frozen=True)
class RankComparison:
    """One rank's verdict: ``checks`` for the table, ``rows`` and ``pairs`` for the detail behind it
    (``missed``: the pairs outside the duration check's tolerance), ``notes`` for what the checks
    cannot show (the offset and how it was found, kernels set apart)."""

    rank: int
    offset: ClockOffset
    rows: tuple[StepRow, ...]
    pairs: tuple[PairedCollective, ...]
    checks: tuple[Check, ...]
    notes: tuple[str, ...] = field(default=())
    missed: tuple[PairedCollective, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


def _pair(spans: Sequence[Span], kernels: Sequence[Kernel], offset_us: float) -> list[tuple[Span, Kernel]]:
    """Equal counts: in order of end (exact). Otherwise nearest ends first, so one missing call
    leaves the other pairs right instead of shifting every later one."""
    if len(spans) == len(kernels):
        return list(zip(spans, kernels, strict=True))
    distances = sorted((abs(k.end_us - (s.end * US_PER_S + offset_us)), i, j)
                       for i, s in enumerate(spans) for j, k in enumerate(kernels))
    used_s: set[int] = set()
    used_k: set[int] = set()
    chosen: list[tuple[int, int]] = []
    for _, i, j in distances:
        if i not in used_s and j not in used_k:
            used_s.add(i)
            used_k.add(j)
            chosen.append((i, j))
    return [(spans[i], kernels[j]) for i, j in sorted(chosen)]


def _kernel_report(report: StepReport, kernels: Iterable[Kernel], offset_us: float) -> StepReport:
    """The kernels as a step record on ddpwatch's clock, so ``step_figures.step_figures`` computes the
    profiler's Compute% and Overlap% by the very definitions it uses for ddpwatch's: compute kernels
    become compute spans, NCCL kernels communication spans (their kind does not enter C or M)."""
    lo, hi = report.start * US_PER_S + offset_us, report.end * US_PER_S + offset_us
    spans = [Span("all_reduce" if k.collective else "forward", (k.start_us - offset_us) / US_PER_S,
                  (k.end_us - offset_us) / US_PER_S)
             for k in kernels if k.end_us > lo and k.start_us < hi]
    return StepReport(rank=report.rank, step=report.step, strategy=report.strategy, settings={}, start=report.start,
                      end=report.end, spans=spans, samples=0, tokens=0)


def _step_collectives(trace: ProfilerTrace, report: StepReport, number: int, offset_us: float) -> tuple[list[Kernel], list[Kernel]]:
    """(inside, outside) ddpwatch's shifted step window, of the NCCL kernels of this iteration:
    launched in its ProfilerStep window, or, with no launch link, centred in the shifted window."""
    lo, hi = report.start * US_PER_S + offset_us, report.end * US_PER_S + offset_us
    mine = launched_in(trace, number) + [k for k in trace.collectives if k.launched_us is None and lo <= k.midpoint_us <= hi]
    inside = [k for k in mine if lo <= k.midpoint_us <= hi]
    return inside, [k for k in mine if not lo <= k.midpoint_us <= hi]


def _compare_step(trace: ProfilerTrace, report: StepReport, number: int, offset_us: float) -> tuple[StepRow, list[PairedCollective]]:
    inside, outside = _step_collectives(trace, report, number, offset_us)
    spans = collective_spans(report)
    pairs: list[PairedCollective] = []
    for kind, (ss, ks) in sorted(by_kind_in_end_order(spans, inside).items()):
        for index, (span, kernel) in enumerate(_pair(ss, ks, offset_us), start=1):
            pairs.append(PairedCollective(report.step, kind, index, span.duration * 1e3, kernel.duration_us / 1e3,
                                          kernel.end_us - (span.end * US_PER_S + offset_us),
                                          kernel.start_us - (span.start * US_PER_S + offset_us)))
    ours = step_figures(report)
    theirs = step_figures(_kernel_report(report, trace.kernels, offset_us))
    window = trace.steps[number]
    syncs = [s for s in trace.syncs if window[0] <= s.at_us < window[1]]
    lo, hi = report.start * US_PER_S + offset_us, report.end * US_PER_S + offset_us
    row = StepRow(
        step=report.step, profiler_step=number, offset_us=offset_us, window_ms=ours.step_ms,
        ddpwatch_calls=dict(Counter(paired_kind(s.kind) for s in spans)),
        profiler_calls=dict(Counter(kernel_kind(k) for k in inside)),
        outside_calls=dict(Counter(kernel_kind(k) for k in outside)),
        pairs=len(pairs),
        worst_duration_error=max((p.error for p in pairs), key=abs, default=None),
        ddpwatch_compute_pct=ours.compute_pct, profiler_compute_pct=theirs.compute_pct,
        ddpwatch_overlap_pct=ours.overlap_pct, profiler_overlap_pct=theirs.overlap_pct,
        syncs=tuple(s.name for s in syncs), syncs_in_step_window=sum(lo <= s.at_us <= hi for s in syncs),
        untimed_calls=report.untimed_collectives,
        barrier_calls=sum(map(is_barrier_wait, report.spans)),
    )
    return row, pairs


def _signed(value: float) -> str:
    """One decimal with a sign, never "-0.0" for a difference that rounds to nothing."""
    return f"{round(value, 1) + 0.0:+.1f}"


def _calls_text(calls: Mapping[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(calls.items())) or "none"


def _steps_check(profiled: Sequence[int], compared: Sequence[int], unresolved: Sequence[int]) -> Check:
    """Every profiled step needs a usable report, or the other checks silently cover less."""
    missing = [s for s in profiled if s not in compared]
    detail = ""
    if missing:
        detail = "no usable report for step " + ", ".join(
            f"{s}{' (unresolved)' if s in unresolved else ''}" for s in missing)
    elif not profiled:
        detail = "no ProfilerStep window maps to a requested step"
    else:
        detail = "steps " + ", ".join(map(str, compared))
    return Check("profiled steps reported", len(compared), len(profiled), "all", bool(profiled) and not missing, "", detail)


def _counts_agree(row: StepRow) -> bool:
    """Exact per kind; where the rank counted collectives it issued and did not time (an attached
    script's own: ``StepReport.untimed_collectives``), the profiler has exactly that many more, of
    whatever kinds, and none fewer of any kind ddpwatch timed."""
    ours, theirs = row.ddpwatch_calls, row.profiler_calls
    unpaired = row.untimed_calls + row.barrier_calls  # a barrier's kernel is of no kind a span of ours has
    if not unpaired:
        return dict(ours) == dict(theirs)
    return (all(theirs.get(kind, 0) >= n for kind, n in ours.items())
            and sum(theirs.values()) - sum(ours.values()) == unpaired)


def _count_check(rows: Sequence[StepRow]) -> Check:
    """Exact per step and per kind: one call more or less is a desync or a lost span."""
    bad = [r for r in rows if not _counts_agree(r)]
    total_ours = sum(sum(r.ddpwatch_calls.values()) + r.untimed_calls + r.barrier_calls for r in rows)
    total_theirs = sum(sum(r.profiler_calls.values()) for r in rows)

    def untimed(row: StepRow) -> str:
        return (f" and {row.untimed_calls} untimed" if row.untimed_calls else "") + (
            f" and {row.barrier_calls} barrier(s)" if row.barrier_calls else "")

    if not rows:
        detail = "no step to compare"
    elif bad:
        detail = "; ".join(f"step {r.step}: ddpwatch {_calls_text(r.ddpwatch_calls)}{untimed(r)}, profiler {_calls_text(r.profiler_calls)}"
                           for r in bad[:3]) + (f" (+{len(bad) - 3} more steps)" if len(bad) > 3 else "")
    else:
        detail = "per step: " + "/".join(str(sum(r.profiler_calls.values())) for r in rows)
        if any(r.untimed_calls for r in rows):
            detail += (", of which issued outside what ddpwatch times (counted, not timed): "
                       + "/".join(str(r.untimed_calls) for r in rows))
        if any(r.barrier_calls for r in rows):
            detail += ", of which barriers (timed as waits): " + "/".join(str(r.barrier_calls) for r in rows)
    return Check("collectives per step", total_ours, total_theirs, "exact per step", bool(rows) and not bad, "", detail)


def _duration_check(pairs: Sequence[PairedCollective], missed: Sequence[PairedCollective], tolerance: float,
                    floor_us: float) -> Check:
    """Every pair, not a mean: one collective timed from its issue instead of its start is the fault.
    ``missed``: the pairs not ``within`` the tolerance and floor."""
    text = f"±{tolerance * 100:g} %" + (f" or {floor_us:g} µs" if floor_us > 0 else "")
    if not pairs:
        return Check("collective duration", None, None, text, False, "ms", "no collective to pair")
    worst = max(pairs, key=lambda p: abs(p.error))
    outside = len(missed)
    detail = (f"worst of {len(pairs)}: step {worst.step} {worst.kind} #{worst.index} ({_signed(worst.error * 100)} %)"
              + (f"; {outside} outside" if outside else ""))
    return Check("collective duration", worst.ddpwatch_ms, worst.profiler_ms, text, outside == 0, "ms", detail)


def _pct_check(name: str, rows: Sequence[StepRow], ours: str, theirs: str, tolerance: float) -> Check:
    """Per step, since both sides cover the very same window: a difference is systematic, not noise."""
    if not rows:
        return Check(name, None, None, f"±{tolerance:g} pts", False, "%", "no step to compare")
    worst = max(rows, key=lambda r: abs(getattr(r, ours) - getattr(r, theirs)))
    gap = getattr(worst, ours) - getattr(worst, theirs)
    mean_ours = statistics.fmean(getattr(r, ours) for r in rows)
    mean_theirs = statistics.fmean(getattr(r, theirs) for r in rows)
    detail = f"worst step {worst.step} ({_signed(gap)} pts); mean {mean_ours:.1f} vs {mean_theirs:.1f}"
    return Check(name, getattr(worst, ours), getattr(worst, theirs), f"±{tolerance:g} pts",
                 all(abs(getattr(r, ours) - getattr(r, theirs)) <= tolerance for r in rows), "%", detail)


def syncs_per_iteration(trace: ProfilerTrace) -> dict[int, tuple[str, ...]]:
    """ProfilerStep#N -> the names of the syncs in that iteration's window, in order."""
    return {number: tuple(s.name for s in trace.syncs if window[0] <= s.at_us < window[1])
            for number, window in trace.steps.items()}


def _sync_names(counts: Counter[str], sort: bool = False) -> str:
    """``cudaStreamSynchronize ×2, cudaEventSynchronize ×8``: in the order met, or by name."""
    return ", ".join(f"{name} ×{n}" for name, n in (sorted(counts.items()) if sort else counts.items()))


def _added_sync_check(rows: Sequence[StepRow], unwatched: Mapping[int, Sequence[str]]) -> Check:
    """Zero *added* syncs: each iteration against the same iteration of the same script run
    unwatched. A sync both runs make is the model's or the framework's (transformers' padding
    check, DDP's runtime logging over its first 10 iterations), named in the detail, not
    ddpwatch's; the unwatched run could only add one if ddpwatch removed it, never."""
    name = "device syncs ddpwatch adds per step"
    if not rows:
        return Check(name, None, None, "0", False, "", "no step to compare")
    added = {row.step: Counter(row.syncs) - Counter(unwatched.get(row.profiler_step, ())) for row in rows}
    worst = max(rows, key=lambda r: sum(added[r.step].values()))
    most = sum(added[worst.step].values())
    theirs: Counter[str] = Counter()
    for row in rows:
        theirs |= Counter(unwatched.get(row.profiler_step, ()))
    unwatched_text = ("the unwatched run makes " + _sync_names(theirs, sort=True)
                      + " in an iteration too (not ddpwatch's)") if theirs else "the unwatched run makes none"
    if not most:
        return Check(name, 0, sum(theirs.values()), "0", True, "", f"none in {len(rows)} iterations; {unwatched_text}")
    names = _sync_names(added[worst.step], sort=True)
    hit = sum(bool(added[r.step]) for r in rows)
    return Check(name, most, sum(theirs.values()), "0", False, "",
                 f"step {worst.step}: {names} more than unwatched; {hit} of {len(rows)} iterations; {unwatched_text}")


def _sync_check(rows: Sequence[StepRow]) -> Check:
    """Zero per iteration: one sync per step serialises host and device every step."""
    if not rows:
        return Check("device syncs per step", None, None, "0", False, "", "no step to compare")
    worst = max(rows, key=lambda r: len(r.syncs))
    if not worst.syncs:
        return Check("device syncs per step", None, 0, "0", True, "", f"none in {len(rows)} iterations")
    names = _sync_names(Counter(worst.syncs))
    hit = sum(bool(r.syncs) for r in rows)
    detail = (f"step {worst.step}: {names} ({worst.syncs_in_step_window} inside ddpwatch's step window); "
              f"{hit} of {len(rows)} iterations sync")
    return Check("device syncs per step", None, len(worst.syncs), "0", False, "", detail)


def compare_rank(
    trace: ProfilerTrace,
    reports: Sequence[StepReport],
    *,
    rank: int | None = None,
    steps: Iterable[int] | None = None,
    profiler_step_base: int = 1,
    duration_tolerance: float = 0.20,
    pct_tolerance: float = 5.0,
    duration_floor_us: float = 0.0,
    unwatched_syncs: Mapping[int, Sequence[str]] | None = None,
) -> RankComparison:
    """Hold one rank's reports against its trace.

    ``unwatched_syncs`` (``syncs_per_iteration`` of the same script's trace run unwatched): the
    sync check then counts the syncs watching *adds*; without it, every sync in an iteration.

    ``steps``: ddpwatch steps to compare (default: every step with a ProfilerStep window, i.e.
    ``N + profiler_step_base`` for each ProfilerStep#N in the trace). Reports marked ``unresolved``
    are not usable. Raises ``ValueError`` for a trace that cannot be checked at all (no
    ProfilerStep annotations, or no GPU kernel: CUDA activity was not profiled).
    """
    if not trace.steps:
        raise ValueError("the trace has no ProfilerStep#N annotations (was it written by torch.profiler with a schedule?)")
    if not trace.kernels:
        raise ValueError("the trace has no GPU kernel (was ProfilerActivity.CUDA profiled?)")
    wanted = set(steps) if steps is not None else None
    profiled = [n + profiler_step_base for n in trace.steps if wanted is None or n + profiler_step_base in wanted]
    usable = {r.step: r for r in reports if not r.unresolved}
    unresolved = [r.step for r in reports if r.unresolved]
    compared = [s for s in profiled if s in usable]
    rank = rank if rank is not None else (reports[0].rank if reports else -1)
    notes: list[str] = []

    chosen = [usable[s] for s in compared]
    offset = estimate_offset(trace, chosen, profiler_step_base) if chosen else ClockOffset(0.0, {}, 0, "none")
    rows: list[StepRow] = []
    pairs: list[PairedCollective] = []
    for report in chosen:
        row, step_pairs = _compare_step(trace, report, report.step - profiler_step_base, offset.for_step(report.step))
        rows.append(row)
        pairs.extend(step_pairs)

    if chosen:
        notes.append(f"clock offset {offset.offset_us:.1f} µs (profiler − ddpwatch), {offset.method} from {offset.pairs} "
                     f"collective ends; per-step offsets within {offset.spread_us:.1f} µs of it")
    outside: Counter[str] = Counter()
    for row in rows:
        outside.update(row.outside_calls)
    if outside:
        notes.append(f"NCCL kernels of the profiled iterations that ran outside ddpwatch's step windows, not compared: "
                     f"{_calls_text(outside)}")
    missed = tuple(p for p in pairs if not p.within(duration_tolerance, duration_floor_us))
    if note := _one_end_waits_note(missed):
        notes.append(note)
    unlinked = sum(k.launched_us is None for k in trace.collectives)
    if unlinked:
        notes.append(f"{unlinked} NCCL kernels have no launch call in the trace: placed in steps by the estimated clock")

    checks = (
        _steps_check(profiled, compared, unresolved),
        _count_check(rows),
        _duration_check(pairs, missed, duration_tolerance, duration_floor_us),
        _pct_check("Compute%", rows, "ddpwatch_compute_pct", "profiler_compute_pct", pct_tolerance),
        _pct_check("Overlap%", rows, "ddpwatch_overlap_pct", "profiler_overlap_pct", pct_tolerance),
        _sync_check(rows) if unwatched_syncs is None else _added_sync_check(rows, unwatched_syncs),
    )
    return RankComparison(rank, offset, tuple(rows), tuple(pairs), checks, tuple(notes), missed)


def _one_end_waits_note(missed: Sequence[PairedCollective]) -> str:
    """Of the durations that missed, those that are their kernel plus a wait at one end, said
    apart: the kernel waited for the GPU, not for the wire or a late rank. Not a pass: a span
    started early with a right end is also what a wrong start would look like."""
    waits = [w for p in missed if (w := p.wait_at_one_end_us()) is not None]
    if not waits:
        return ""
    share = "each" if len(waits) == len(missed) else f"{len(waits)} of the {len(missed)}"
    return (f"collective durations outside: {share} is its kernel plus {min(waits) / 1e3:.2f}-{max(waits) / 1e3:.2f} ms at "
            "one end (at the other under a tenth of that): the kernel waited for the GPU, not the wire (as when ranks "
            "sharing a GPU time-slice it)")


# --- rendering -----------------------------------------------------------------------------


def all_passed(comparisons: Iterable[RankComparison]) -> bool:
    """The doctor's exit status: every check of every rank held (and there was at least one rank)."""
    comparisons = list(comparisons)
    return bool(comparisons) and all(c.passed for c in comparisons)


def value_text(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:.3f} ms"
    if unit == "%":
        return f"{value:.1f}"
    if unit == "x":  # a ratio
        return f"{value:.3f}"
    return f"{value:.0f}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Fixed-width columns sized to their widest cell; the last column is left ragged."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            if i == len(cells) - 1:
                out.append(cell)
            else:
                out.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return [line(header), *(line(r) for r in rows)]


def render_checks(comparisons: RankComparison | Iterable[RankComparison]) -> str:
    """The checks of every rank as one plain-text table, then the verdict, then the notes."""
    comparisons = [comparisons] if isinstance(comparisons, RankComparison) else list(comparisons)
    rows = [[str(c.rank), ch.name, value_text(ch.ddpwatch, ch.unit), value_text(ch.profiler, ch.unit), ch.tolerance,
             "ok" if ch.passed else "FAIL", ch.detail] for c in comparisons for ch in c.checks]
    lines = format_table(["rank", "check", "ddpwatch", "profiler", "tolerance", "result", "detail"], rows, right={0, 2, 3})
    missed = [f"rank {c.rank} {ch.name}" for c in comparisons for ch in c.checks if not ch.passed]
    total = sum(len(c.checks) for c in comparisons)
    if not comparisons:
        lines.append("verdict: FAIL - no rank was compared")
    elif missed:
        lines.append(f"verdict: FAIL - {len(missed)} of {total} checks missed: " + ", ".join(missed))
    else:
        lines.append(f"verdict: PASS - all {total} checks held on {len(comparisons)} rank(s)")
    lines.extend(f"rank {c.rank}: {note}" for c in comparisons for note in c.notes)
    return "\n".join(lines)


def render_steps(comparison: RankComparison) -> str:
    """One rank's per-step rows, for when a check fails and the step matters."""
    def calls(row: StepRow) -> str:
        untimed = f"+{row.untimed_calls}" if row.untimed_calls else ""  # counted, not timed
        barriers = f"+{row.barrier_calls}b" if row.barrier_calls else ""  # timed as waits
        return f"{sum(row.ddpwatch_calls.values())}{untimed}{barriers}/{sum(row.profiler_calls.values())}"

    rows = [[str(r.step), f"#{r.profiler_step}", _signed(r.offset_us - comparison.offset.offset_us), f"{r.window_ms:.3f}",
             calls(r), str(sum(r.outside_calls.values())),
             "-" if r.worst_duration_error is None else _signed(r.worst_duration_error * 100),
             f"{r.ddpwatch_compute_pct:.1f}/{r.profiler_compute_pct:.1f}",
             f"{r.ddpwatch_overlap_pct:.1f}/{r.profiler_overlap_pct:.1f}", str(len(r.syncs))]
            for r in comparison.rows]
    header = ["step", "profiler", "offset ± µs", "K ms", "calls dd/prof", "outside", "worst dur %",
              "Compute% dd/prof", "Overlap% dd/prof", "syncs"]
    return "\n".join([f"rank {comparison.rank}", *format_table(header, rows, right=set(range(2, 10)))])
