"""The product's figures, computed one way for the dashboard, the recorder and the exporter.

Keeping every definition in one pure module is what lets a number on the live
screen be compared with the same number in an exported report.  One rank's step
figures live in ``instrumented_ddp.step_figures`` (re-exported here), since the
ranks compute them too; this module adds everything across ranks and steps.
Spans and step records are duck-typed (see :class:`SpanLike`, :class:`StepRecordLike`).

Conventions, chosen so that no caller ever sees NaN or a ZeroDivisionError:

* A percentage of an empty whole is ``0.0``.  A step whose window has no
  positive, finite length therefore has all percentages 0 (not a 0/0/100
  split); elsewhere compute + non-compute + idle add up to 100.
* ``overlap_pct`` is 0 when the step had no communication: there was nothing
  to hide, so nothing was hidden.
* Bandwidths are ``None`` when nothing measurable happened (no all-reduce with
  bytes and a positive duration, or no valid world size): 0 GB/s would read as
  "a dead link", which is a different claim.
* Collective counts, durations and bandwidths use each span's raw, unclipped
  duration: a collective is one call whose size was moved in that whole time.
  Only the timeline percentages are clipped to the step window.
* ``all_reduce_calls`` always means calls per rank per step (a mean where
  ranks or steps differ); a total over ranks and steps is ``all_reduce_calls_total``.
* Throughput divides by wall time from a run of steps' first start to its last
  end with ranks on one clock (:class:`ClockAlignment`), never by a sum of step
  windows, which would leave out the time between steps.
"""

from __future__ import annotations

import copy
import math
import statistics
from array import array
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from instrumented_ddp.intervals import Interval, clip, intersect, merge, subtract, total_length, union
from instrumented_ddp.step_figures import (
    BLOCKING_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    CallTimes,
    SpanLike,
    StepFigures,
    StepRecordLike,
    StepTimes,
    _all_reduces,
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    call_times,
    counted,
    figures_and_calls,
    sharded_collectives,
    step_figures,
    step_times,
)

from .order_statistics import median_of, percentiles_and_median_interval

__all__ = [
    "BLOCKING_KINDS", "COMM_KINDS", "COMPUTE_KINDS", "CallTimes", "Groups", "STRAGGLER_SHARE", "STRAGGLER_STEPS", "ClockAlignment", "Desync",
    "DesyncRange", "Figures", "Interval", "SegmentAccumulator", "SegmentFigures", "SpanLike", "StepFigures",
    "StepRecordLike", "StepTimes", "StepWaits", "Straggler", "algbw_gbps", "all_reduce_ranks", "groups_of_the_world", "shard_groups", "shard_ranks", "step_waits", "bus_factor", "busbw_text", "busbw_gbps", "call_times", "calls_of", "calls_text",
    "clip", "collective_key", "counted", "cross_rank_waits", "figures_and_calls", "find_desync", "find_straggler", "intersect", "merge", "segment_figures",
    "sharded_collectives", "step_figures", "step_times", "straggler", "subtract", "total_length", "transfers", "union", "waited_for", "waiting_intervals",
    "waits_both_ways",
]

STRAGGLER_STEPS = 10  # a straggler is judged over this many complete steps: one step is noise
STRAGGLER_SHARE = 0.10  # ... and only when the others waited over this share of the step time for it
ALIGNMENT_STEPS = 512  # clock-offset samples kept per rank: a median over them, in bounded memory


def calls_text(calls_per_rank_per_step: float) -> str:
    """How a per-rank-per-step call count is written, on screen and in summary.md alike: a whole
    number as one ("57"), a mean that is not whole with up to two decimals ("56.5")."""
    text = f"{calls_per_rank_per_step:.2f}".rstrip("0").rstrip(".")
    return text if text not in ("", "-0") else "0"


#: How the segments table and summary.md name the collectives that are not all-reduces.
KIND_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC"}


def kinds_text(calls_by_kind: Mapping[str, float]) -> str:
    """Calls per rank per step of every kind but all-reduce (which has its own column), as
    ``RS 3 AG 5``; a dash when there are none."""
    parts = [f"{KIND_SHORT.get(kind, kind)} {calls_text(n)}" for kind, n in sorted(calls_by_kind.items())
             if kind != "all_reduce" and n > 0]
    return " ".join(parts) or "—"


def busbw_text(all_reduce_gbps: float | None, other_gbps: Mapping[str, float | None]) -> str:
    """Each collective kind's busbw, GB/s, the all-reduces' first, as ``AR 3.12 AG 0.32 RS 0.16``
    (``Figures.busbw_gbps``, ``SegmentFigures.other_busbw_gbps``); a dash without any."""
    by_kind = {"all_reduce": all_reduce_gbps, **dict(sorted(other_gbps.items()))}
    return " ".join(f"{KIND_SHORT.get(kind, kind)} {value:.2f}" for kind, value in by_kind.items() if value is not None) or "—"


def held_text(memory: Mapping[str, int]) -> str:
    """Parameters/gradients/optimizer state held, MiB, as ``9.3/9.3/18.6``: the seed's staircase
    (DDP, ZeRO-1, ZeRO-2, FSDP) read across a row; a dash before any measurement."""
    if not memory:
        return "—"
    return "/".join(f"{memory.get(kind, 0) / 2**20:.1f}" for kind in ("parameters", "gradients", "optimizer_state"))


# --- across ranks, one step ------------------------------------------------------------


def collective_key(tag: str, seen: Counter[str]) -> tuple[str, int]:
    """The k-th call carrying ``tag`` in issue order. A tag can repeat within a step (the
    baseline reduces every parameter after each micro-step); an empty tag keys by position
    among the untagged calls."""
    key = (tag, seen[tag])
    seen[tag] += 1
    return key


def calls_of(records_of_one_step: Mapping[int, StepRecordLike]) -> dict[int, CallTimes]:
    """Each rank's all-reduces read from its spans (a ``StepSummary`` carries them instead)."""
    return {rank: call_times(record) for rank, record in records_of_one_step.items()}


#: Who meets whom in the all-reduces, where not every rank meets every other: the groups the
#: ranks' hellos name (``Hello.all_reduce_group``: HSDP's replicas of one shard, a DDP on a
#: subgroup). None: the world, one group.
Groups = Sequence[Sequence[int]]


def groups_of_the_world(named: Iterable[Sequence[int]], world_size: int) -> tuple[Groups | None, str | None]:
    """The all-reduce groups the ranks' hellos name, made a partition of the world: the ranks no
    group names (whose hellos are not in yet, or name none) are one group of their own, so that
    no rank falls out of the waits. ``(None, why)`` where two named groups share a rank: hellos
    that contradict each other, so no pairing within them can be trusted and the figures are
    made over the world. ``(None, None)``: no group named, the world."""
    groups = sorted({tuple(sorted(group)) for group in named if group})
    if not groups:
        return None, None
    owner: dict[int, tuple[int, ...]] = {}
    for group in groups:
        for rank in group:
            if rank in owner:
                return None, (f"the ranks' hellos name all-reduce groups that overlap (rank {rank} in "
                              f"{{{', '.join(map(str, owner[rank]))}}} and {{{', '.join(map(str, group))}}}): "
                              "waits and busbw are figured over every rank")
            owner[rank] = group
    rest = [rank for rank in range(world_size) if rank not in owner]
    return [list(group) for group in groups] + ([rest] if rest else []), None


def all_reduce_ranks(groups: Groups | None, world_size: int) -> int:
    """How many ranks each all-reduce spans, the ``n`` of busbw's bus factor: the groups' size
    where they are all one size, else the world."""
    sizes = {len(group) for group in groups or ()}
    return sizes.pop() if len(sizes) == 1 else world_size


def shard_groups(groups: Groups | None) -> Groups | None:
    """Who meets whom in the reduce-scatters and all-gathers: every rank (None), or, where the
    hellos name all-reduce groups all of one size, the i-th rank of each. Such groups with
    sharded collectives beside them are HSDP's replicas of a shard on a 2-D mesh (replicas x
    shard), whose shard group takes one rank of each replica group: 2 x 2 on 4 ranks names
    {0, 2} and {1, 3}, whose shard groups are {0, 1} and {2, 3}."""
    if not groups or len({len(group) for group in groups}) != 1:
        return None
    return [list(shard) for shard in zip(*(sorted(group) for group in groups))]


def shard_ranks(groups: Groups | None, world_size: int) -> int:
    """How many ranks a reduce-scatter or an all-gather spans, the ``n`` of its bus factor: a
    shard group's (``shard_groups``), else the world. 2 x 4 on 8 ranks names four groups of 2
    ({0, 4}, ...), and each shard group spans 4."""
    shards = shard_groups(groups)
    return len(shards[0]) if shards else world_size


def step_waits(calls_of_one_step: Mapping[int, CallTimes], figures: Mapping[int, StepFigures],
               groups: Groups | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """:func:`waits_both_ways` of a step's all-reduces within ``groups``, plus that of its
    reduce-scatters and all-gathers (``StepFigures.sharded_calls``) within the shard groups,
    per rank: ``zero1``, ``zero2`` and FSDP issue few or no all-reduces, and their ranks wait
    for each other in those (before, every rank of an ``fsdp`` run read 0 ms waited, and no
    straggler could be named). Where both kinds ran at once on one rank (HSDP's all-reduce
    across replicas beside the next unit's reduce-scatter), their waiting is added, not merged."""
    waited, waited_on = waits_both_ways(calls_of_one_step, groups)
    sharded = {rank: f.sharded_calls for rank, f in figures.items() if f.sharded_calls.tags}
    if len(sharded) > 1:
        more, more_on = waits_both_ways(sharded, shard_groups(groups))
        for rank, ms in more.items():
            waited[rank] = waited.get(rank, 0.0) + ms
        for rank, ms in more_on.items():
            waited_on[rank] = waited_on.get(rank, 0.0) + ms
    return waited, waited_on


def _by_group(calls_of_one_step: Mapping[int, CallTimes], groups: Groups) -> list[dict[int, CallTimes]]:
    return [{rank: calls_of_one_step[rank] for rank in group if rank in calls_of_one_step} for group in groups]


def cross_rank_waits(calls_of_one_step: Mapping[int, CallTimes], groups: Groups | None = None) -> dict[int, float]:
    """Milliseconds each rank spent in all-reduces waiting for the others to arrive: the total
    length of its :func:`waiting_intervals`. Fewer than two ranks wait for nobody: all 0.0.
    ``groups``: who meets whom (``all_reduce_groups``; None: every rank)."""
    return waits_both_ways(calls_of_one_step, groups)[0]


def waited_for(calls_of_one_step: Mapping[int, CallTimes], groups: Groups | None = None) -> dict[int, float]:
    """Milliseconds the other ranks spent waiting for each rank (see :func:`waits_both_ways`)."""
    return waits_both_ways(calls_of_one_step, groups)[1]


def waits_both_ways(calls_of_one_step: Mapping[int, CallTimes],
                    groups: Groups | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """(:func:`cross_rank_waits`, what the others waited for each rank) from one pairing pass.
    In each all-reduce the rank with the shortest duration arrived last (ties: the lowest rank),
    and every other rank's waiting in that call is put down to it; so the second totals over
    ranks equal the first's. A rank's waiting is the wall time its calls' waiting covers
    (:func:`_waiting_covered_ms`): gloo runs two collectives at a time, and two calls waiting for
    the same late rank at once were counted twice (a 2-rank ``async`` CPU run: 65 ms a step
    summed, 48 covered); where they do, each call's share of what is put down to the rank it
    waited for is scaled alike, so the totals still agree. The usual step (every rank made the
    same calls) is one array operation over ranks x calls: at 1,024 ranks x 300 calls, a few
    milliseconds. With ``groups`` each group's calls are paired among its own ranks only: a
    rank waits only for those it all-reduces with."""
    if groups is not None:
        waited, waited_on = {}, {}
        for calls in _by_group(calls_of_one_step, groups):
            group_waited, group_waited_on = waits_both_ways(calls)
            waited.update(group_waited)
            waited_on.update(group_waited_on)
        return waited, waited_on
    waited = {rank: 0.0 for rank in calls_of_one_step}
    waited_on = dict(waited)
    paired = _paired_calls(calls_of_one_step)
    if paired is None:
        return waited, waited_on
    ranks, positions, seconds = paired
    if seconds.size == 0:
        return waited, waited_on
    in_call = 1000.0 * (seconds - seconds.min(axis=0))
    covered = _waiting_covered_ms(calls_of_one_step, ranks, positions, in_call)
    if covered is not None:  # some calls overlapped: each rank's calls count for what its total covers
        summed = in_call.sum(axis=1)
        in_call = in_call * np.divide(covered, summed, out=np.ones_like(summed), where=summed > 0)[:, None]
    # argmin takes the first of equals: ranks are sorted, so the lowest
    last = np.bincount(seconds.argmin(axis=0), weights=in_call.sum(axis=0), minlength=len(ranks))
    waited.update(zip(ranks, in_call.sum(axis=1).tolist()))  # one pass over rows, not 1,024 numpy calls
    waited_on.update(zip(ranks, last.tolist()))
    return waited, waited_on


def _waiting_covered_ms(calls_of_one_step: Mapping[int, CallTimes], ranks: list[int], positions: list[list[int]],
                        in_call: np.ndarray) -> np.ndarray | None:
    """Per rank (a row of ``in_call``, the ms each paired call waited), the ms of its own clock
    that its calls' waiting covers: each call waits from its start, so calls waiting at once
    count their common waiting once. None where no rank's calls overlapped (``CallTimes.starts``
    is kept only where they do: NCCL never, gloo often), whose waiting is the sum; a rank
    without starts among ranks with them keeps its sum."""
    known = [calls_of_one_step[rank].starts for rank in ranks]
    if all(starts is None for starts in known):
        return None
    covered = in_call.sum(axis=1)
    for row, (starts, indices) in enumerate(zip(known, positions)):
        if starts is not None:
            waiting = [(starts[i], starts[i] + ms / 1000.0) for i, ms in zip(indices, in_call[row].tolist())]
            covered[row] = 1000.0 * total_length(waiting)
    return covered


def transfers(calls_of_one_step: Mapping[int, CallTimes], groups: Groups | None = None) -> list[tuple[tuple[str, int], float]]:
    """Each call every rank made, keyed by its tag and occurrence (``collective_key``), with its
    transfer: its shortest duration over the ranks (:func:`_paired_calls`), the time the
    collective itself took once its last participant joined. [] with fewer than two ranks.
    Read from the durations alone, which a ``StepSummary`` carries too: at 1,024 ranks and 300
    calls, one array of C doubles and one ``min`` over it, no span read.

    With ``groups`` each group's call is a collective of its own, its transfer the shortest
    duration among the group's ranks (over the world, a slow group's transfers were lost behind
    a fast group's), and the call's is the mean over the groups that made it: one sample a call,
    however many groups (one per group and call, 512 groups of 2 ranks gave the cost model
    153,600 samples a step and took 153 ms; the line fitted through the means is the same)."""
    minima: list[tuple[tuple[str, ...], list[int], np.ndarray]] = []
    for calls in (_by_group(calls_of_one_step, groups) if groups is not None else (calls_of_one_step,)):
        paired = _paired_calls(calls)
        if paired is not None and paired[2].size:
            ranks, positions, seconds = paired
            minima.append((calls[ranks[0]].tags, positions[0], seconds.min(axis=0)))
    if not minima:
        return []
    tags = minima[0][0]
    if all(theirs == tags and len(positions) == len(tags) for theirs, positions, _ in minima):  # every group made every call
        return list(zip(_keys(tags), np.mean([shortest for *_, shortest in minima], axis=0).tolist()))
    sums: dict[tuple[str, int], list[float]] = {}  # key -> [sum over groups, groups]
    for theirs, positions, shortest in minima:
        keys = _keys(theirs)
        for index, seconds in zip(positions, shortest.tolist()):
            total = sums.setdefault(keys[index], [0.0, 0])
            total[0] += seconds
            total[1] += 1
    return [(key, total / groups_made) for key, (total, groups_made) in sums.items()]


def _keys(tags: Sequence[str]) -> list[tuple[str, int]]:
    seen: Counter[str] = Counter()
    return [collective_key(tag, seen) for tag in tags]


def waiting_intervals(calls_of_one_step: Mapping[int, CallTimes], records: Mapping[int, StepRecordLike],
                      groups: Groups | None = None,
                      collectives: Callable[[StepRecordLike], Sequence[SpanLike]] = _all_reduces) -> dict[int, list[Interval]]:
    """Per rank of ``records`` (those whose spans are at hand), the part of each all-reduce spent
    waiting for the others to arrive, on the rank's own clock, in issue order: from the call's
    start until its transfer (see :func:`_paired_calls`), which ends the call on every rank.
    The transfer is judged over every rank in ``calls_of_one_step`` (with ``groups``, over the
    rank's own group). With fewer than two ranks nobody waits. ``collectives``: the spans the
    calls were read from (``sharded_collectives`` for ``StepFigures.sharded_calls``)."""
    if groups is not None:
        waiting_by_group: dict[int, list[Interval]] = {}
        for calls in _by_group(calls_of_one_step, groups):
            waiting_by_group.update(waiting_intervals(calls, {rank: records[rank] for rank in calls if rank in records},
                                                      collectives=collectives))
        return {rank: waiting_by_group.get(rank, []) for rank in records}
    waiting: dict[int, list[Interval]] = {rank: [] for rank in records}
    paired = _paired_calls(calls_of_one_step)
    if paired is None:
        return waiting
    ranks, positions, seconds = paired
    transfer = seconds.min(axis=0) if seconds.size else seconds
    for row, rank in enumerate(ranks):
        if rank not in records:
            continue
        spans, out = collectives(records[rank]), waiting[rank]
        for column, index in enumerate(positions[row]):
            waited = float(seconds[row, column] - transfer[column])
            if waited > 0 and index < len(spans):
                out.append((spans[index].start, spans[index].start + waited))
    return waiting


def _paired_calls(calls_of_one_step: Mapping[int, CallTimes]) -> tuple[list[int], list[list[int]], np.ndarray] | None:
    """The ranks (sorted), and for the calls every rank made, in issue order, each rank's index
    of that call among its all-reduces and the call's duration on each rank (ranks x calls);
    None with fewer than two ranks.

    A collective cannot finish before its last participant joins, so the shortest duration of
    one call over ranks is taken as the pure transfer and the rest of each rank's duration as
    waiting. Calls are paired across ranks by their tag (``p<i>``, ``b<i>``, ...; the k-th call
    with that tag), not by position: one call missing on one rank (see :func:`find_desync`)
    would otherwise shift every later pair. Only calls every rank made are compared; untagged
    calls fall back to their position among the untagged.
    """
    if len(calls_of_one_step) < 2:
        return None
    ranks = sorted(calls_of_one_step)
    first = calls_of_one_step[ranks[0]].tags
    if all(calls_of_one_step[rank].tags == first for rank in ranks):  # the usual step: the same calls everywhere
        joined = b"".join(calls_of_one_step[rank].seconds for rank in ranks)  # C doubles: no float objects
        seconds = np.frombuffer(joined, dtype=np.float64).reshape(len(ranks), len(first))
        return ranks, [list(range(len(first)))] * len(ranks), seconds
    keyed: list[dict[tuple[str, int], int]] = []
    for rank in ranks:
        seen: Counter[str] = Counter()
        keyed.append({collective_key(tag, seen): index for index, tag in enumerate(calls_of_one_step[rank].tags)})
    common = sorted(set.intersection(*(set(k) for k in keyed)), key=lambda key: keyed[0][key])
    positions = [[k[key] for key in common] for k in keyed]
    seconds = np.array([[calls_of_one_step[rank].seconds[i] for i in row] for rank, row in zip(ranks, positions)],
                       dtype=float).reshape(len(ranks), len(common))
    return ranks, positions, seconds


def straggler(waits: Mapping[int, float], tolerance_ms: float = 0.0) -> int | None:
    """The rank everyone else waits for: the one that waited least (it always arrives last).

    None with fewer than two ranks, or when the spread of waits is within
    ``tolerance_ms`` (nobody is meaningfully late).  Ties go to the lowest rank.
    This names a candidate only; whether it is late enough to report is :func:`find_straggler`.
    """
    if len(waits) < 2 or max(waits.values()) - min(waits.values()) <= tolerance_ms:
        return None
    return min(waits, key=lambda rank: (waits[rank], rank))


class StepWaits(NamedTuple):
    """What the straggler rule needs from one complete step (every rank reported)."""

    step: int
    waits_ms: Mapping[int, float]  # cross_rank_waits of the step
    wall_ms: float  # the slowest rank's window: the step took that long for everyone


@dataclass(frozen=True)
class Straggler:
    """A rank the others kept waiting for, and by how much."""

    rank: int
    first_step: int
    last_step: int
    steps: int
    waited_ms_per_step: float  # the least any other rank of its group waited, less what it waited itself, per step
    share_pct: float  # that wait as a share of the steps' wall time

    def describe(self) -> str:
        """The one sentence the dashboard's warnings and summary.md both print."""
        return (f"rank {self.rank} is a straggler: over steps {self.first_step}-{self.last_step} the others waited "
                f"{self.waited_ms_per_step:.1f} ms a step for it ({self.share_pct:.0f}% of step time)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Straggler:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def find_straggler(complete_steps: Iterable[StepWaits], groups: Groups | None = None) -> Straggler | None:
    """The straggler rule, one function for the dashboard and the exports so they cannot disagree.

    Over the last ``STRAGGLER_STEPS`` of the given complete steps, within each group of ranks
    that all-reduce together (``groups``; None: the world), the candidate is the rank that waited
    least in total (:func:`straggler`); it is named only when every other rank of its group
    waited more than it did by over ``STRAGGLER_SHARE`` of those steps' wall time. Without that
    threshold, noise of a few microseconds would always name someone; without "more than it
    did", ranks that wait for each other by turns did (a balanced 2-rank ``async`` CPU run, 49
    and 65 ms a step waited: "rank 0 is a straggler ... 43 % of step time"), and without the
    groups a rank was said to keep waiting ranks that never all-reduce with it. Of several
    groups' stragglers, the one its group waited for longest.
    """
    window = sorted(complete_steps, key=lambda s: s.step)[-STRAGGLER_STEPS:]
    if not window:
        return None
    totals: dict[int, float] = defaultdict(float)
    wall_ms = 0.0
    for s in window:
        wall_ms += s.wall_ms
        for rank, waited in s.waits_ms.items():
            totals[rank] += waited
    found: tuple[float, int] | None = None  # (the others' excess, the rank)
    for members in groups if groups is not None else (list(totals),):
        waited = {rank: totals[rank] for rank in members if rank in totals}
        slow = straggler(waited)
        others = [w for r, w in waited.items() if r != slow]
        if slow is None or not others:
            continue
        excess = min(others) - waited[slow]
        if excess > STRAGGLER_SHARE * wall_ms and (found is None or excess > found[0]):
            found = (excess, slow)
    if found is None:
        return None
    excess, slow = found
    return Straggler(slow, window[0].step, window[-1].step, len(window), excess / len(window), 100.0 * excess / wall_ms)


@dataclass(frozen=True)
class Desync:
    """Kept per rank so the dashboard can point at the rank that skipped or added a call."""

    step: int
    calls_per_rank: dict[int, int]
    kind: str = "all_reduce"  # the collective whose counts differ (the first such, all_reduce first)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Desync:
        """From summary.json, whose keys are strings."""
        return cls(int(data["step"]), {int(r): int(n) for r, n in data["calls_per_rank"].items()},
                   str(data.get("kind", "all_reduce")))


def find_desync(calls_of_one_step: Mapping[int, CallTimes], step: int,
                kinds_of_one_step: Mapping[int, Mapping[str, int]] | None = None) -> Desync | None:
    """Ranks issuing different numbers of any collective in a step will hang or corrupt
    gradients: all-reduces (from ``calls_of_one_step``), then every other kind the ranks
    counted (``StepFigures.calls_by_kind``), by name."""
    calls = {rank: len(c.tags) for rank, c in sorted(calls_of_one_step.items())}
    if len(set(calls.values())) > 1:
        return Desync(step=step, calls_per_rank=calls)
    for kind in sorted({k for counts in (kinds_of_one_step or {}).values() for k in counts} - {"all_reduce"}):
        counts = {rank: int(c.get(kind, 0)) for rank, c in sorted((kinds_of_one_step or {}).items())}
        if len(set(counts.values())) > 1:
            return Desync(step=step, calls_per_rank=counts, kind=kind)
    return None


def _counts(desync: Desync) -> str:
    return ", ".join(f"rank {r}: {n}" for r, n in sorted(desync.calls_per_rank.items()))


def _kind_name(desync: Desync) -> str:
    return desync.kind.replace("_", "-")


@dataclass(frozen=True)
class DesyncRange:
    """Every desynchronised step of a segment or run, in one error that stays until the run ends:
    a desync is a fault of the run, not of the step on screen."""

    first_step: int
    last_step: int
    steps: int  # how many steps in that range were desynchronised
    first: Desync
    last: Desync

    @classmethod
    def of(cls, desync: Desync) -> DesyncRange:
        return cls(desync.step, desync.step, 1, desync, desync)

    def including(self, desync: Desync) -> DesyncRange:
        """This range with one more desynchronised step (steps may come in any order)."""
        first = desync if desync.step < self.first_step else self.first
        last = desync if desync.step > self.last_step else self.last
        return DesyncRange(first.step, last.step, self.steps + 1, first, last)

    @staticmethod
    def combine(ranges: Iterable[DesyncRange | None]) -> DesyncRange | None:
        """Disjoint ranges (one per segment) as one: their counts add up."""
        present = [r for r in ranges if r is not None]
        if not present:
            return None
        first = min(present, key=lambda r: r.first_step).first
        last = max(present, key=lambda r: r.last_step).last
        return DesyncRange(first.step, last.step, sum(r.steps for r in present), first, last)

    def describe(self) -> str:
        """The one sentence the dashboard's warnings and summary.md both print."""
        if self.first_step == self.last_step:
            return (f"DESYNC at step {self.first_step}: the ranks issued different {_kind_name(self.first)} counts "
                    f"({_counts(self.first)})")
        return (f"DESYNC at steps {self.first_step}-{self.last_step} ({self.steps} steps): the ranks issued different "
                f"{_kind_name(self.first)} counts (step {self.first_step}: {_counts(self.first)}; "
                f"step {self.last_step}: {_counts(self.last)})")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DesyncRange:
        """From summary.json, whose keys are strings."""
        return cls(int(data["first_step"]), int(data["last_step"]), int(data["steps"]),
                   Desync.from_dict(data["first"]), Desync.from_dict(data["last"]))


# --- putting ranks on one clock ---------------------------------------------------------


class ClockAlignment:
    """Offsets that put every rank on a reference rank's clock, and the wall time the steps cover.

    Hosts' clocks differ, but no rank can leave an all-reduce before every rank joined it, so all
    ranks leave a step's last all-reduce together: per rank, the offset is the median over the
    steps it shares with the reference of (reference's anchor − its anchor); the median shrugs off
    a step whose completion was stamped late. A rank without all-reduces is aligned by step starts
    instead. The Chrome trace, the timeline and throughput all use this one rule.
    """

    def __init__(self, reference: int | None = None, keep: int | None = ALIGNMENT_STEPS) -> None:
        """``reference``: the rank whose clock the others are put on (default: the lowest rank of
        the first step added). ``keep``: offset samples kept per rank (None: all)."""
        self.reference = reference
        self._keep = keep
        self._anchor_deltas: dict[int, deque[float]] = {}
        self._start_deltas: dict[int, deque[float]] = {}
        self._first_start: dict[int, float] = {}  # each rank's own clock
        self._last_end: dict[int, float] = {}

    def add_step(self, times: Mapping[int, StepTimes]) -> None:
        """One step's times of every rank that reported it (steps may come in any order)."""
        if not times:
            return
        if self.reference is None:
            self.reference = min(times)
        ref = times.get(self.reference)
        for rank, t in times.items():
            if math.isfinite(t.start) and math.isfinite(t.end):
                self._first_start[rank] = min(self._first_start.get(rank, t.start), t.start)
                self._last_end[rank] = max(self._last_end.get(rank, t.end), t.end)
            if ref is None or rank == self.reference:
                continue
            if ref.anchor is not None and t.anchor is not None:
                self._anchor_deltas.setdefault(rank, deque(maxlen=self._keep)).append(ref.anchor - t.anchor)
                self._start_deltas.pop(rank, None)  # never used once an anchor is known
            elif rank not in self._anchor_deltas and math.isfinite(ref.start - t.start):
                self._start_deltas.setdefault(rank, deque(maxlen=self._keep)).append(ref.start - t.start)

    def offsets(self) -> dict[int, float]:
        """Seconds to add to each rank's clock to land on the reference's; a rank that never shared
        a step with the reference has no offset (it is left out, not guessed)."""
        if self.reference is None:
            return {}
        out = {self.reference: 0.0}
        for rank in set(self._anchor_deltas) | set(self._start_deltas):
            deltas = self._anchor_deltas.get(rank) or self._start_deltas.get(rank)
            if deltas:
                out[rank] = float(statistics.median(deltas))
        return out

    def own_wall_s(self, rank: int) -> float:
        """One rank's first step start to its last step end, on its own clock."""
        if rank not in self._first_start:
            return 0.0
        return max(self._last_end[rank] - self._first_start[rank], 0.0)

    def wall_s(self) -> float:
        """First step start to last step end over every aligned rank: the time the steps took,
        the time between steps included."""
        offsets = self.offsets()
        ranks = [r for r in self._first_start if r in offsets]
        if not ranks:
            return 0.0
        first = min(self._first_start[r] + offsets[r] for r in ranks)
        last = max(self._last_end[r] + offsets[r] for r in ranks)
        return max(last - first, 0.0)


# --- a run of steps under one strategy -------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """Aggregates over a set of (rank, step) records; "mean" is per rank per step."""

    steps: int  # distinct steps
    compute_pct: float  # mean over records with a positive window
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float  # mean over records that communicated at all
    comm_overhead_pct: float
    hidden_comm_pct: float  # mean of 100*|C ∩ M|/K: communication hidden behind compute, in window terms
    all_reduce_calls: float  # per rank per step (mean over records)
    all_reduce_calls_total: int  # over every rank and step
    all_reduce_ms: float  # mean
    step_ms_p50: float  # over each step's wall time (max window over ranks), linear interp.
    step_ms_p95: float
    #: A distribution-free 90 % interval for the median step time (``order_statistics``):
    #: whether two segments' medians differ by more than their steps' spread. (0, 0) without steps.
    step_ms_p50_interval: tuple[float, float]
    wall_s: float  # first step start to last step end, ranks aligned (ClockAlignment)
    samples_per_s: float  # samples of every rank / wall_s
    tokens_per_s: float
    busbw_gbps: float | None  # median over every measurable all_reduce
    waited_for_others_ms: float  # mean
    calls_by_kind: dict[str, float]  # per rank per step, every collective kind
    #: The most any rank held at a measured step end (``StepReport.memory``), per memory kind.
    memory: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SegmentFigures(Figures):
    """Whole-segment figures; ``per_rank`` holds the same figures restricted to one rank."""

    world_size: int
    per_rank: dict[int, Figures]
    straggler_rank: int | None  # find_straggler over the segment's last complete steps
    straggler: Straggler | None
    desyncs: tuple[Desync, ...]  # the first 100, each with its counts
    desync: DesyncRange | None  # all of them
    #: busbw of each other collective kind the segment issued (reduce-scatter, all-gather,
    #: broadcast): the median over its measurable calls times its bus factor over the ranks it
    #: spans (``shard_ranks``). Over the whole segment only, not per rank.
    other_busbw_gbps: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["desyncs"] = list(out["desyncs"])
        return out


RESERVOIR = 4096  # step times and bandwidths kept per segment for percentiles: memory stays bounded


class FloatRing:
    """The last ``size`` values added, as C doubles, for an order-free statistic (a median, a
    percentile). A deque of Python floats costs four times the memory: at 1,024 ranks and 300
    all-reduces a step, each segment's per-rank bandwidths took 130 MiB. Grows as filled."""

    def __init__(self, size: int = RESERVOIR) -> None:
        self.size = size
        self._values = np.empty(min(size, 64))
        self._count = 0  # values ever added

    def __len__(self) -> int:
        return min(self._count, self.size)

    def append(self, value: float) -> None:
        """One value, written in place where the buffer has room or is full size (a ring): each
        rank's step time, 2,048 a step at 1,024 ranks."""
        if len(self) < len(self._values) or len(self._values) == self.size:
            self._values[self._count % len(self._values)] = value
            self._count += 1
        else:
            self.extend((value,))

    def extend(self, values: Iterable[float]) -> None:
        """``values`` in order; an ``array('d')`` (a step's bandwidths) is read as the buffer it is."""
        new = (np.asarray(values, dtype=float) if isinstance(values, array) else np.fromiter(values, dtype=float))[-self.size:]
        if not len(new):
            return
        held = len(self)
        if held + len(new) > len(self._values) and len(self._values) < self.size:  # grow, oldest first
            grown = np.empty(min(self.size, max(2 * len(self._values), held + len(new))))
            grown[:held] = self.values()
            self._values, self._count = grown, held
        start = self._count % len(self._values)
        first = min(len(new), len(self._values) - start)
        self._values[start:start + first] = new[:first]
        self._values[:len(new) - first] = new[first:]
        self._count += len(new)

    def values(self) -> np.ndarray:
        """The values held, oldest first."""
        if self._count <= len(self._values):
            return self._values[:self._count].copy()
        start = self._count % len(self._values)
        return np.concatenate((self._values[start:], self._values[:start]))


@dataclass
class _Running:
    """Running sums that make one ``Figures``: O(1) memory per step except two bounded windows."""

    steps: int = 0
    timed: int = 0
    compute: float = 0.0
    non_compute: float = 0.0
    idle: float = 0.0
    comm_overhead: float = 0.0
    hidden_comm: float = 0.0
    talking: int = 0
    overlap: float = 0.0
    records: int = 0
    calls_total: int = 0
    all_reduce_ms: float = 0.0
    waited_ms: float = 0.0
    samples: int = 0
    tokens: int = 0
    walls_ms: FloatRing = field(default_factory=FloatRing)
    algbw: FloatRing = field(default_factory=FloatRing)
    calls_by_kind: dict[str, int] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)

    def add_record(self, f: StepFigures, waited_ms: float) -> None:
        """Zero-length windows are left out of the percentage means: they carry no time."""
        self.records += 1
        if f.step_ms > 0:
            self.timed += 1
            self.compute += f.compute_pct
            self.non_compute += f.non_compute_pct
            self.idle += f.idle_pct
            self.comm_overhead += f.comm_overhead_pct
            self.hidden_comm += f.overlap_pct * f.comm_overhead_pct / 100.0  # |C∩M|/|M| * |M|/K
            if f.comm_overhead_pct > 0:
                self.talking += 1
                self.overlap += f.overlap_pct
        self.calls_total += f.all_reduce_calls
        totals = self.calls_by_kind  # a plain loop: Counter.update costs 3x, 2,048 times a step at 1,024 ranks
        for kind, calls in f.calls_by_kind.items():
            totals[kind] = totals.get(kind, 0) + calls
        if f.memory:  # one report in ten carries it
            for kind, nbytes in f.memory.items():
                self.memory[kind] = max(nbytes, self.memory.get(kind, 0))
        self.all_reduce_ms += f.all_reduce_ms
        self.waited_ms += waited_ms
        self.samples += f.samples
        self.tokens += f.tokens
        self.algbw.extend(f.algbw_gbps)

    def add_step_wall(self, wall_ms: float) -> None:
        self.steps += 1
        self.walls_ms.append(wall_ms)

    def figures(self, all_reduce_ranks: int, wall_s: float) -> Figures:
        """``wall_s``: the time these steps took, from the accumulator's clock alignment;
        ``all_reduce_ranks``: how many ranks each all-reduce spans (``all_reduce_ranks``)."""
        def mean(total: float, n: int) -> float:
            return total / n if n else 0.0

        (p50, p95), interval = percentiles_and_median_interval(self.walls_ms.values(), (50, 95))
        factor = bus_factor("all_reduce", all_reduce_ranks)
        return Figures(
            steps=self.steps,
            compute_pct=mean(self.compute, self.timed),
            non_compute_pct=mean(self.non_compute, self.timed),
            idle_pct=mean(self.idle, self.timed),
            overlap_pct=mean(self.overlap, self.talking),
            comm_overhead_pct=mean(self.comm_overhead, self.timed),
            hidden_comm_pct=mean(self.hidden_comm, self.timed),
            all_reduce_calls=mean(float(self.calls_total), self.records),
            all_reduce_calls_total=self.calls_total,
            all_reduce_ms=mean(self.all_reduce_ms, self.records),
            step_ms_p50=p50,
            step_ms_p95=p95,
            step_ms_p50_interval=interval,
            wall_s=wall_s,
            samples_per_s=self.samples / wall_s if wall_s > 0 else 0.0,
            tokens_per_s=self.tokens / wall_s if wall_s > 0 else 0.0,
            busbw_gbps=median_of(self.algbw.values()) * factor if len(self.algbw) and factor is not None else None,
            waited_for_others_ms=mean(self.waited_ms, self.records),
            calls_by_kind={kind: mean(float(n), self.records) for kind, n in sorted(self.calls_by_kind.items())},
            memory=dict(self.memory),
        )


class SegmentAccumulator:
    """Folds a segment's steps in one at a time, so a live dashboard can forget old steps.

    Means, totals and throughput are exact over every step folded in; step-time percentiles and
    the median bandwidth are over the last ``RESERVOIR`` steps and collectives, clock offsets over
    the last ``ALIGNMENT_STEPS`` steps of each rank, the straggler over the last
    ``STRAGGLER_STEPS`` complete steps.
    """

    def __init__(self, world_size: int, groups: Groups | None = None) -> None:
        """``groups``: who meets whom in the all-reduces (None: every rank): waits are paired
        within them, and busbw counts each all-reduce over their size."""
        self.world_size = world_size
        self.groups = groups
        self.all_reduce_ranks = all_reduce_ranks(groups, world_size)
        self.overall = _Running()
        self.per_rank: dict[int, _Running] = defaultdict(_Running)
        self.clocks = ClockAlignment()
        self.recent_complete: list[StepWaits] = []  # the last STRAGGLER_STEPS steps every rank reported
        self.desyncs: list[Desync] = []
        self.desync: DesyncRange | None = None
        self.other_algbw: dict[str, FloatRing] = {}  # by kind, over every rank: see SegmentFigures.other_busbw_gbps

    def add_step(self, figures: Mapping[int, StepFigures], calls: Mapping[int, CallTimes],
                 waits: Mapping[int, float] | None = None) -> None:
        """One step: each rank's ``step_figures`` and all-reduces (``call_times``), computed
        centrally from spans or sent by the rank in a ``StepSummary``: the same either way.
        ``waits``: the step's ``step_waits(calls, figures, groups)[0]`` (its all-reduces' and its
        reduce-scatters' and all-gathers' waits) where the caller made them already (a session
        does, once a step: at 1,024 ranks a pass over 300 calls each)."""
        if not figures:
            return
        waits = step_waits(calls, figures, self.groups)[0] if waits is None else waits
        step = next(iter(figures.values())).step
        desync = find_desync(calls, step, {rank: f.calls_by_kind for rank, f in figures.items()})
        if desync is not None:
            self.desync = DesyncRange.of(desync) if self.desync is None else self.desync.including(desync)
            if len(self.desyncs) < 100:
                self.desyncs.append(desync)
        walls = []
        times: dict[int, StepTimes] = {}
        for rank, f in sorted(figures.items()):
            for kind, alg in f.other_algbw_gbps.items():
                ring = self.other_algbw.get(kind)
                if ring is None:
                    ring = self.other_algbw[kind] = FloatRing()
                ring.extend(alg)
            self.overall.add_record(f, waits.get(rank, 0.0))
            self.per_rank[rank].add_record(f, waits.get(rank, 0.0))
            self.per_rank[rank].add_step_wall(f.step_ms)
            walls.append(f.step_ms)
            times[rank] = f.times
        self.overall.add_step_wall(max(walls))
        self.clocks.add_step(times)
        if len(figures) >= self.world_size > 1:
            self.recent_complete.append(StepWaits(step, waits, max(walls)))
            if len(self.recent_complete) > STRAGGLER_STEPS:
                self.recent_complete.sort(key=lambda s: s.step)
                del self.recent_complete[:-STRAGGLER_STEPS]

    def regroup(self, world_size: int, groups: Groups | None) -> None:
        """The world and groups as the hellos now name them. A dashboard started mid-run can fold
        a segment's first steps before every hello (resent every 2 s) is in: busbw and the
        straggler are worked out from these when asked, so the whole segment then reads within
        the groups; the steps' waits already folded stay as they were paired."""
        if world_size != self.world_size or (groups is not self.groups and groups != self.groups):
            self.world_size, self.groups = world_size, groups
            self.all_reduce_ranks = all_reduce_ranks(groups, world_size)

    def copy(self) -> SegmentAccumulator:
        return copy.deepcopy(self)

    @property
    def records(self) -> int:
        return self.overall.records

    def figures(self, per_rank: bool = True) -> SegmentFigures:
        """An empty segment gives zeros, ``busbw_gbps=None``, ``per_rank={}``, no straggler.
        ``per_rank=False`` skips the per-rank figures (a percentile pass per rank)."""
        overall = self.overall.figures(self.all_reduce_ranks, self.clocks.wall_s())
        slow = find_straggler(self.recent_complete, self.groups)
        spanned = shard_ranks(self.groups, self.world_size)  # a broadcast's factor is 1 whatever it spans
        other_busbw = {kind: median_of(ring.values()) * factor for kind, ring in sorted(self.other_algbw.items())
                       if len(ring) and (factor := bus_factor(kind, spanned)) is not None}
        return SegmentFigures(
            **{f.name: getattr(overall, f.name) for f in fields(Figures)},
            world_size=self.world_size,
            per_rank={rank: running.figures(self.all_reduce_ranks, self.clocks.own_wall_s(rank))
                      for rank, running in sorted(self.per_rank.items())} if per_rank else {},
            straggler_rank=slow.rank if slow is not None else None,
            straggler=slow,
            desyncs=tuple(self.desyncs),
            desync=self.desync,
            other_busbw_gbps=other_busbw,
        )


def segment_figures(records: Iterable[StepRecordLike], world_size: int,
                    folded: SegmentAccumulator | None = None, per_rank: bool = True,
                    groups: Groups | None = None) -> SegmentFigures:
    """Aggregate a run of steps (on top of the steps already ``folded``, if any); a repeated
    (rank, step) record replaces the earlier one. ``groups``: see ``SegmentAccumulator``."""
    latest: dict[tuple[int, int], StepRecordLike] = {}
    for rec in records:
        latest[(rec.step, rec.rank)] = rec
    by_step: dict[int, dict[int, StepRecordLike]] = defaultdict(dict)
    for (step, rank), rec in sorted(latest.items(), key=lambda kv: kv[0]):
        by_step[step][rank] = rec
    accumulator = folded.copy() if folded is not None else SegmentAccumulator(world_size, groups)
    for step in sorted(by_step):
        both = {rank: figures_and_calls(rec, world_size) for rank, rec in by_step[step].items()}
        accumulator.add_step({rank: f for rank, (f, _) in both.items()}, {rank: c for rank, (_, c) in both.items()})
    return accumulator.figures(per_rank)
