"""One rank's figures for one step: the ground the ranks and ddpwatch both stand on.

A rank computes its own step figures from its spans (``summarize``, on its sender thread) and
sends them in a ``StepSummary``; the dashboard computes the same figures from full spans when it
has them. One function, imported by both sides, is what makes the two equal. Like ``protocol``,
this module needs only the standard library: the training side never loads the dashboard's
dependencies, and the dashboard never loads torch.

Conventions (see also ``ddpwatch.figures.metrics``): a percentage of an empty whole is 0.0; bandwidths
are None when nothing measurable happened; counts, durations and bandwidths use each span's raw,
unclipped duration, and only the timeline percentages are clipped to the step window.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from instrumented_ddp.wire.time_ranges import (canonical_clip, canonical_intersect, canonical_length, canonical_subtract,
                                               clip, merge)
from instrumented_ddp.wire.kinds import COMM_KINDS as WIRE_COMM_KINDS
from instrumented_ddp.wire.kinds import COMPUTE_KINDS as WIRE_COMPUTE_KINDS
from instrumented_ddp.wire.messages import MAX_PAUSED_FOR, StepReport, StepSummary
from instrumented_ddp.wire.kinds import LOOP_COMPUTE_KIND, is_barrier_wait
from instrumented_ddp.wire.packed_floats import pack_floats, unpack_floats

COMPUTE_KINDS = frozenset(WIRE_COMPUTE_KINDS)  # the model's phases and the loop's marked compute
COMM_KINDS = frozenset(WIRE_COMM_KINDS)  # the wire schema's collectives, as a set
# A blocking span of one of these kinds means the main thread sat waiting on the
# network; if it happened inside e.g. a backward hook, it is not compute.
BLOCKING_KINDS = COMM_KINDS | {"wait"}
_BYTES_PER_GB = 1e9  # nccl-tests reports decimal GB/s
_INF = math.inf


class SpanLike(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def blocking(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def tag(self) -> str: ...


class StepRecordLike(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def spans(self) -> Sequence[SpanLike]: ...
    @property
    def samples(self) -> int: ...
    @property
    def tokens(self) -> int: ...


def _length(start: float, end: float) -> float:
    """Raw duration; faulty (reversed or non-finite) times count as no time at all."""
    d = end - start
    return d if math.isfinite(d) and d > 0 else 0.0


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def _start(span: SpanLike) -> float:
    return span.start


def all_reduces(record: StepRecordLike) -> list[SpanLike]:
    """In issue order: the fallback that lines calls up across ranks when they carry no tag."""
    return sorted([s for s in record.spans if s.kind == "all_reduce"], key=_start)


def _by_kind(spans: Iterable[SpanLike]) -> dict[str, list[SpanLike]]:
    """The spans of each kind, in their order, the kinds in the order first seen: one pass over
    a step's spans, which every figure then reads by kind."""
    groups: dict[str, list[SpanLike]] = {}
    for span in spans:
        group = groups.get(span.kind)
        if group is None:
            groups[span.kind] = [span]
        else:
            group.append(span)
    return groups


def float_array(values: Iterable[float]) -> array[float]:
    """Durations and bandwidths are kept as C doubles: a listener holds a step's 300 all-reduces
    for 1,024 ranks and 120 steps (as Python floats in tuples, ~2 GiB; as arrays, 8 bytes each)."""
    return array("d", values)


class CallTimes(NamedTuple):
    """One rank's all-reduces of one step, in issue order: what pairing calls across ranks needs
    (waits, the straggler, a desync), and all a ``StepSummary`` carries of its collectives."""

    tags: tuple[str, ...]
    seconds: array[float]  # raw durations (``_length``)
    #: Each one's start, seconds after the step's, kept only where two of them ran at once (gloo's
    #: two workers), or one ran beside a reduce-scatter or an all-gather (HSDP on a GPU): two
    #: waiting for the same late rank then wait once (``cross_rank.waits_both_ways``, ``step_waits``).
    #: None where none overlap, whose waits the durations alone give, and from an older sender.
    starts: array[float] | None = None


def call_times(record: StepRecordLike) -> CallTimes:
    """The step's all-reduces as ``figures_and_calls`` gives them (their starts kept where one
    overlapped a reduce-scatter or an all-gather too)."""
    return _calls_of_both_kinds(all_reduces(record), sharded_collectives(record), record.start)[0]


def _call_times(collectives: Sequence[SpanLike], step_start: float, kind_in_tag: bool = False,
                keep_starts: bool = False) -> CallTimes:
    """``kind_in_tag``: each tag names its kind too (``all_gather:u0``), so that calls of several
    kinds pair across ranks only with their own kind (``StepFigures.sharded_calls``).
    ``keep_starts``: even where none of these overlap (one of them overlapped a call of another kind)."""
    tags = tuple([f"{s.kind}:{getattr(s, 'tag', '') or ''}" for s in collectives] if kind_in_tag
                 else [getattr(s, "tag", "") or "" for s in collectives])
    # _length of each, inline: a positive finite duration as it is, anything else (NaN fails both) 0
    seconds = [d if 0.0 < d < _INF else 0.0 for d in [s.end - s.start for s in collectives]]
    calls = CallTimes(tags, array("d", seconds), array("d", [s.start - step_start for s in collectives]))
    return calls if keep_starts or _overlapping(calls) else calls._replace(starts=None)


#: The collectives the sharded strategies issue in place of all-reduces; like an all-reduce,
#: every rank of the group joins each one, so the first to arrive waits for the last.
SHARDED_KINDS = ("reduce_scatter", "all_gather")
_SHARDED_KIND_SET = frozenset(SHARDED_KINDS)


def sharded_collectives(record: StepRecordLike) -> list[SpanLike]:
    """A step's reduce-scatters and all-gathers in issue order (``all_reduces``' twin), and the
    waits of the barriers the loop issued (``kinds.is_barrier_wait``): every rank joins a
    barrier as it joins these, so the last to arrive is the one the others sat there for, and
    the straggler rule pairs it across ranks with them (``StepFigures.sharded_calls``)."""
    spans = list(record.spans)
    return _sharded_collectives(spans, _by_kind(spans))


def _sharded_collectives(spans: Sequence[SpanLike], kinds: dict[str, list[SpanLike]]) -> list[SpanLike]:
    """``sharded_collectives`` of a step's spans and their ``_by_kind``."""
    if _SHARDED_KIND_SET.isdisjoint(kinds):  # most steps: only the waits could be barriers'
        return sorted([s for s in kinds.get("wait", ()) if is_barrier_wait(s)], key=_start)
    # the kind first: a step of an FSDP model holds hundreds of spans, few of them waits
    return sorted([s for s in spans if s.kind in _SHARDED_KIND_SET or (s.kind == "wait" and is_barrier_wait(s))], key=_start)


#: A step's sharded calls where it made none (most steps): one object shared, not one per report
#: (at 1,024 ranks and 120 kept steps, 123k of them).
NO_CALLS = CallTimes((), array("d"))
_OTHER_KINDS = frozenset(WIRE_COMM_KINDS) - {"all_reduce"}


def _overlapping(calls: CallTimes) -> bool:
    """Whether any two of a rank's all-reduces ran at once (in issue order, which is start
    order: a call starts before the last one's end). Never on NCCL, whose stream runs a group's
    collectives one after another; on gloo's two workers, often."""
    if calls.starts is None:
        return False
    reached = float("-inf")
    for start, seconds in zip(calls.starts, calls.seconds, strict=True):
        if start < reached:
            return True
        reached = max(reached, start + seconds)
    return False


def counted(record: Any) -> bool:
    """Whether a report may enter any figure. Excluded steps (native DDP's first iteration, a
    wrap-time broadcast) are not representative; unresolved ones hold only the spans whose marks
    resolved, so their percentages, waits and call counts would be false (a missing collective
    would even read as a desync). One rule, so every figure leaves out the same reports."""
    return not getattr(record, "excluded", False) and not getattr(record, "unresolved", False)



# --- bandwidth (nccl-tests definitions, see nccl-tests doc/PERFORMANCE.md) -------------


def issued_by_the_loop(tag: str) -> bool:
    """``l<k>``: the k-th collective an attached loop issued itself in the step, between the
    model's phases (a loss all-reduced for the log, the Trainer's gathers), timed where it was
    issued (``instrumented_ddp.timing.collective_stand_ins``). Such a call counts among its kind's calls
    and time, and in the waits; not in the all-reduces' busbw, which says what the gradients'
    all-reduces get from the link: a 4-byte loss all-reduce is all latency, and beside one
    bucket it halved the step's median (2 CPU ranks, 8 MB in one bucket: 1.03 GB/s read 0.16)."""
    return tag[:1] == "l" and tag[1:].isdigit()


def algbw_gbps(nbytes: int, seconds: float) -> float | None:
    """S/t.  None for an empty payload or a non-positive time, which measure no link, and for a
    time so short (subnormal) that S/t overflows: an infinite bandwidth made a rank's summary one
    the wire schema rejects, and its busbw NaN at one rank (inf × 0)."""
    if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
        return None
    gbps = nbytes / seconds / _BYTES_PER_GB
    return gbps if math.isfinite(gbps) else None


def bus_factor(kind: str, world_size: int) -> float | None:
    """Turns algbw into the per-link rate so that numbers compare across world sizes.

    all_reduce moves 2(n-1)/n of the payload over each link (ring lower bound); reduce_scatter
    and all_gather, whose payload is the whole (unsharded) tensor, (n-1)/n, as do all_to_all
    (all a rank sends), gather and scatter (the root's whole list); broadcast and reduce (to one
    rank) move it once.  One rank gives 0 for all but broadcast and reduce, as nccl-tests does.
    None for an unknown kind or a world size below 1.
    """
    if world_size < 1:
        return None
    if kind == "all_reduce":
        return 2.0 * (world_size - 1) / world_size
    if kind in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (world_size - 1) / world_size
    if kind in ("broadcast", "reduce"):
        return 1.0
    return None


def busbw_gbps(nbytes: int, seconds: float, world_size: int, kind: str = "all_reduce") -> float | None:
    alg, factor = algbw_gbps(nbytes, seconds), bus_factor(kind, world_size)
    return None if alg is None or factor is None else alg * factor



# --- one rank, one step ----------------------------------------------------------------


class StepTimes(NamedTuple):
    """What aligning ranks needs from one rank's step, on that rank's own clock."""

    start: float
    end: float
    anchor: float | None  # end of the step's last all-reduce: every rank leaves it at the same moment
    paused: float = 0.0  # seconds the loop paused training just before ``start`` (``StepReport.paused_s``)


def step_times(record: StepRecordLike) -> StepTimes:
    """The same times ``step_figures`` keeps, for a caller that has only the record."""
    ends = [s.end for s in record.spans if s.kind == "all_reduce" and math.isfinite(s.end)]
    return StepTimes(record.start, record.end, max(ends) if ends else None, getattr(record, "paused_s", 0.0))


@dataclass(frozen=True)
class StepFigures:
    """One rank's step, kept whole so segments aggregate from it rather than re-scan spans.
    Not slotted: the dashboard's receiver process pickles them, and a slotted frozen dataclass
    unpickles through ``dataclasses._dataclass_setstate``, a Python loop over its fields (15 % of
    the UI's time at 1,024 ranks), where a plain one restores its ``__dict__`` in C."""

    rank: int
    step: int
    step_ms: float
    compute_pct: float
    non_compute_pct: float  # exposed communication
    idle_pct: float
    overlap_pct: float
    comm_overhead_pct: float  # merged communication wall clock
    all_reduce_calls: int
    all_reduce_ms: float  # sum of raw durations; concurrent buckets each count
    algbw_gbps: array[float]  # per measurable all_reduce, in issue order
    busbw_gbps: float | None  # median over this step; None without a world size
    samples: int
    tokens: int
    times: StepTimes  # window and alignment anchor, so aligning ranks never reads the spans again
    #: Calls of each collective kind this step (``all_reduce`` included, kinds with none left out).
    calls_by_kind: dict[str, int] = field(default_factory=dict)
    #: Bytes this rank held at the step's end, when it measured them (``StepReport.memory``).
    memory: dict[str, int] = field(default_factory=dict)
    #: Per measurable collective of each other kind (reduce-scatter, all-gather, broadcast), in
    #: issue order: ``algbw_gbps`` over the whole tensor's bytes, as nccl-tests counts them.
    other_algbw_gbps: dict[str, array[float]] = field(default_factory=dict)
    #: The step's reduce-scatters and all-gathers, in issue order, tagged with their kind: waits
    #: and the straggler pair them across ranks as they do the all-reduces, for ``zero1``,
    #: ``zero2`` and FSDP, which issue few or none (a ``StepSummary`` carries them as
    #: ``sharded_tags``, ``sharded_seconds`` and ``sharded_starts``). The waits of the loop's
    #: barriers go among them (``wait:barrier``): a rank that sat in a barrier waited for the
    #: last to arrive, as in a reduce-scatter (``sharded_collectives``).
    sharded_calls: CallTimes = field(default_factory=lambda: NO_CALLS)
    #: The share of the window in ``data`` spans with no compute or communication beside them and
    #: not blocked in a wait (a barrier, the loop's wait for its own collective): the part of Idle%
    #: the rank spent waiting for its next batch (a loader that cannot keep up, or the loop's own
    #: work between steps). Data loaded while the device still computes is not counted.
    data_wait_pct: float = 0.0
    #: The collectives the loop issued itself and ddpwatch timed (``issued_by_the_loop``): how
    #: many, and their summed ms (the Trainer's gathers, a loss all-reduce; a wait in them for a
    #: slower rank included).
    loop_collectives: int = 0
    loop_collective_ms: float = 0.0
    #: The loop's own compute the step marked (``loop`` spans: ``Attachment.computing``): its ms
    #: in the window, merged, and what the loop said it computed, each once, in the order first
    #: marked ("ema, teacher forward"): what an average of the weights or a teacher costs a step.
    loop_compute_ms: float = 0.0
    loop_computed: str = ""


def marked_names(marked: Iterable[SpanLike]) -> str:
    """``StepFigures.loop_computed`` of the step's ``loop`` spans: their tags, each once, in order."""
    return ", ".join(dict.fromkeys(s.tag for s in marked if s.tag))[:MAX_PAUSED_FOR]


def _sharded_calls(sharded: Sequence[SpanLike], step_start: float, keep_starts: bool = False) -> CallTimes:
    """``StepFigures.sharded_calls`` from the step's reduce-scatters and all-gathers, in issue order."""
    return _call_times(sharded, step_start, kind_in_tag=True, keep_starts=keep_starts) if sharded else NO_CALLS


def _calls_of_both_kinds(ars: Sequence[SpanLike], sharded: Sequence[SpanLike], step_start: float) -> tuple[CallTimes, CallTimes]:
    """The all-reduces' and the sharded calls' ``CallTimes``, each with its starts where its own
    calls overlapped, and both with theirs where a call of one overlapped a call of the other:
    on a GPU, HSDP's all-reduce across replicas runs on FSDP2's own stream beside the next unit's
    reduce-scatter, and two waiting at once must count once (``cross_rank.step_waits``)."""
    calls, sharded_calls = _call_times(ars, step_start), _sharded_calls(sharded, step_start)
    if calls.seconds and sharded_calls.seconds and (calls.starts is None or sharded_calls.starts is None) \
            and _kinds_overlap(ars, sharded):
        calls, sharded_calls = _call_times(ars, step_start, keep_starts=True), _sharded_calls(sharded, step_start, keep_starts=True)
    return calls, sharded_calls


def _kinds_overlap(ars: Sequence[SpanLike], sharded: Sequence[SpanLike]) -> bool:
    """Whether an all-reduce ran at once with a reduce-scatter or an all-gather (each list in
    start order): one sweep, as ``time_ranges.intersect`` walks two lists, stopping at the first
    overlap. ``bool(intersect(...))`` gives the same answer but merges and copies both lists
    first: 33 µs against 4 at 57 calls of each kind, asked of every ``zero1`` step."""
    j = 0
    for a in ars:
        while j < len(sharded) and sharded[j].end <= a.start:
            j += 1
        if j < len(sharded) and sharded[j].start < a.end:
            return True
    return False


def _other_algbw(others: Sequence[SpanLike]) -> dict[str, array[float]]:
    """``StepFigures.other_algbw_gbps`` of the step's other collectives, in issue order: each
    kind but the all-reduce, kinds with none left out."""
    by_kind: dict[str, array[float]] = {}
    for s in others:
        alg = algbw_gbps(s.nbytes, _length(s.start, s.end))
        if alg is not None:
            by_kind.setdefault(s.kind, float_array(())).append(alg)
    return by_kind


def step_figures(record: StepRecordLike, world_size: int | None = None) -> StepFigures:
    return figures_and_calls(record, world_size)[0]


def figures_and_calls(record: StepRecordLike, world_size: int | None = None) -> tuple[StepFigures, CallTimes]:
    """``step_figures`` and ``call_times`` from one pass over the all-reduces: a receiver or a
    rank's sender needs both of every report, and the call count and all-reduce time are then
    read from the very durations a ``StepSummary`` carries."""
    lo, hi = record.start, record.end
    window = _length(lo, hi)
    spans = list(record.spans)
    kinds = _by_kind(spans)
    present = kinds.keys()
    comm_kinds = [kind for kind in kinds if kind in COMM_KINDS]  # in the order first seen
    # each list canonical once (time_ranges' merge), the rest on canonical ranges
    blocked = merge([(s.start, s.end) for kind in BLOCKING_KINDS & present for s in kinds[kind] if s.blocking])
    compute = merge([(s.start, s.end) for kind in COMPUTE_KINDS & present for s in kinds[kind]])
    c = canonical_clip(canonical_subtract(compute, blocked), lo, hi)  # "blocked is not busy"
    m = canonical_clip(merge([(s.start, s.end) for kind in comm_kinds for s in kinds[kind]]), lo, hi)
    c_len, m_len = canonical_length(c), canonical_length(m)
    busy_ranges = merge(c + m)
    busy = canonical_length(busy_ranges)
    data = clip([(s.start, s.end) for s in kinds.get("data", ())], lo, hi)

    marked = kinds.get(LOOP_COMPUTE_KIND, [])
    ars = sorted(kinds.get("all_reduce", ()), key=_start)
    loop = [s for s in spans if s.tag[:1] == "l" and s.kind in COMM_KINDS and issued_by_the_loop(s.tag)]
    # every other collective, in issue order: most steps have none
    others = sorted([s for s in spans if s.kind in _OTHER_KINDS], key=_start) if not _OTHER_KINDS.isdisjoint(present) else []
    calls, sharded_calls = _calls_of_both_kinds(ars, _sharded_collectives(spans, kinds), lo)
    in_loop = {id(s) for s in loop}
    # algbw_gbps of each, inline (the seconds are _length's already: finite, positive where measured)
    alg = array("d", [g for g in [s.nbytes / seconds / _BYTES_PER_GB for s, seconds in zip(ars, calls.seconds, strict=True)
                                  if s.nbytes > 0 and seconds > 0.0 and id(s) not in in_loop]
                      if g < _INF])
    factor = bus_factor("all_reduce", world_size) if world_size is not None else None
    figures = StepFigures(
        rank=record.rank,
        step=record.step,
        step_ms=1000.0 * window,
        compute_pct=_pct(c_len, window),
        non_compute_pct=_pct(busy - c_len, window),
        idle_pct=_pct(max(window - busy, 0.0), window),
        overlap_pct=_pct(canonical_length(canonical_intersect(c, m)), m_len),
        comm_overhead_pct=_pct(m_len, window),
        all_reduce_calls=len(calls.seconds),
        all_reduce_ms=1000.0 * sum(calls.seconds),
        algbw_gbps=alg,
        busbw_gbps=float(statistics.median(alg)) * factor if alg and factor is not None else None,
        samples=max(int(record.samples), 0),
        tokens=max(int(record.tokens), 0),
        times=StepTimes(record.start, record.end, max([s.end for s in ars if -_INF < s.end < _INF], default=None),
                        getattr(record, "paused_s", 0.0)),
        calls_by_kind={kind: len(kinds[kind]) for kind in comm_kinds},
        memory=dict(getattr(record, "memory", None) or {}),
        other_algbw_gbps=_other_algbw(others),
        sharded_calls=sharded_calls,
        data_wait_pct=_pct(canonical_length(canonical_subtract(data, merge(busy_ranges + canonical_clip(blocked, lo, hi)))),
                           window) if data else 0.0,
        loop_collectives=len(loop),
        loop_collective_ms=1000.0 * sum(_length(s.start, s.end) for s in loop),
        loop_compute_ms=1000.0 * canonical_length(clip([(s.start, s.end) for s in marked], lo, hi)) if marked else 0.0,
        loop_computed=marked_names(marked) if marked else "",
    )
    return figures, calls


# --- at the edge: a rank's step as a summary, and back ------------------------------------


def summarize(report: StepReport, world_size: int) -> StepSummary:
    """What a rank sends instead of its spans: its own ``step_figures`` and its all-reduces'
    tags and durations, and their starts where two of them overlap (else the waits figured from
    durations alone are the same). ``summary_figures`` and ``summary_calls`` give back what
    ``step_figures`` and ``call_times`` give from the full report, bit for bit."""
    f, calls = figures_and_calls(report, world_size)
    return StepSummary(
        rank=report.rank, step=report.step, strategy=report.strategy, settings=report.settings,
        start=report.start, end=report.end, samples=f.samples, tokens=f.tokens,
        compute_pct=f.compute_pct, non_compute_pct=f.non_compute_pct, idle_pct=f.idle_pct,
        overlap_pct=f.overlap_pct, comm_overhead_pct=f.comm_overhead_pct, anchor=f.times.anchor,
        busbw_gbps=f.busbw_gbps, all_reduce_tags=list(calls.tags), all_reduce_seconds=pack_floats(calls.seconds),
        all_reduce_starts=pack_floats(calls.starts) if calls.starts is not None else b"",  # kept only where calls overlap
        algbw_gbps=pack_floats(f.algbw_gbps), loss=report.loss, excluded=report.excluded, unresolved=report.unresolved,
        unresolved_reason=report.unresolved_reason, calls_by_kind=f.calls_by_kind, memory=f.memory, update_skipped=report.update_skipped,
        compiling=report.compiling, untimed_collectives=report.untimed_collectives, untimed_in_data=report.untimed_in_data,
        nograd_forwards=report.nograd_forwards, paused_s=report.paused_s, paused_for=report.paused_for, other_algbw_gbps={kind: pack_floats(alg) for kind, alg in f.other_algbw_gbps.items()},
        sharded_tags=list(f.sharded_calls.tags), sharded_seconds=pack_floats(f.sharded_calls.seconds),
        sharded_starts=pack_floats(f.sharded_calls.starts) if f.sharded_calls.starts is not None else b"",
        data_wait_pct=f.data_wait_pct, loop_collectives=f.loop_collectives, loop_collective_ms=f.loop_collective_ms,
        loop_compute_ms=f.loop_compute_ms, loop_computed=f.loop_computed,
    )


def summary_calls(summary: StepSummary) -> CallTimes:
    return _unpacked_calls(summary.all_reduce_tags, summary.all_reduce_seconds, summary.all_reduce_starts)


def _unpacked_calls(tags: Sequence[str], seconds: bytes, starts: bytes) -> CallTimes:
    """Calls as ``summarize`` packs them; starts travel only where two calls overlapped, so none is None."""
    return CallTimes(tuple(tags), unpack_floats(seconds), unpack_floats(starts) if starts else None)


def summary_figures(summary: StepSummary, calls: CallTimes | None = None) -> StepFigures:
    calls = summary_calls(summary) if calls is None else calls
    return StepFigures(
        rank=summary.rank, step=summary.step, step_ms=1000.0 * _length(summary.start, summary.end),
        compute_pct=summary.compute_pct, non_compute_pct=summary.non_compute_pct, idle_pct=summary.idle_pct,
        overlap_pct=summary.overlap_pct, comm_overhead_pct=summary.comm_overhead_pct,
        all_reduce_calls=len(calls.seconds), all_reduce_ms=1000.0 * sum(calls.seconds),
        algbw_gbps=unpack_floats(summary.algbw_gbps), busbw_gbps=summary.busbw_gbps,
        samples=summary.samples, tokens=summary.tokens, times=StepTimes(summary.start, summary.end, summary.anchor, summary.paused_s),
        calls_by_kind=dict(summary.calls_by_kind) or ({"all_reduce": len(calls.seconds)} if calls.seconds else {}),
        memory=dict(summary.memory),
        other_algbw_gbps={kind: unpack_floats(alg) for kind, alg in summary.other_algbw_gbps.items()},
        sharded_calls=_unpacked_calls(summary.sharded_tags, summary.sharded_seconds, summary.sharded_starts)
        if summary.sharded_tags else NO_CALLS,
        data_wait_pct=summary.data_wait_pct, loop_collectives=summary.loop_collectives,
        loop_collective_ms=summary.loop_collective_ms, loop_compute_ms=summary.loop_compute_ms,
        loop_computed=summary.loop_computed,
    )


def report_without_spans(summary: StepSummary) -> StepReport:
    """The report a summary stands for, its spans not (yet) known: what the receiver keeps. By
    keyword: given by position, the memory once landed where ``update_skipped`` goes."""
    return StepReport(rank=summary.rank, step=summary.step, strategy=summary.strategy, settings=summary.settings,
                      start=summary.start, end=summary.end, spans=[], samples=summary.samples, tokens=summary.tokens,
                      loss=summary.loss, excluded=summary.excluded, unresolved=summary.unresolved,
                      update_skipped=summary.update_skipped, compiling=summary.compiling, memory=summary.memory,
                      unresolved_reason=summary.unresolved_reason, untimed_collectives=summary.untimed_collectives,
                      untimed_in_data=summary.untimed_in_data, nograd_forwards=summary.nograd_forwards, paused_s=summary.paused_s, paused_for=summary.paused_for)
