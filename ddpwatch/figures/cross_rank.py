"""Ranks against each other within one step: who met whom, who waited for whom, who is late.

A step's collectives are paired across ranks by tag (the k-th call with a tag), within the
groups that meet; each call's shortest duration over the ranks is its transfer and the rest of
each rank's is waiting. From those come each rank's waits, the straggler and a desync. Pure; the
dashboard, the recorder and the exporters read them from here, and their sentences are
``wording.cross_rank_text``'s.
"""

from __future__ import annotations

from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from instrumented_ddp.wire.time_ranges import TimeRange, total_length
from instrumented_ddp.wire.kinds import BARRIER_TAG
from instrumented_ddp.wire.step_figures import (CallTimes, SpanLike, StepFigures, StepRecordLike, all_reduces, call_times,
                                           sharded_collectives)

from ddpwatch.wording.cross_rank_text import desync_text, overlapping_groups_text, straggler_text

STRAGGLER_STEPS = 10  # a straggler is judged over this many complete steps: one step is noise
STRAGGLER_SHARE = 0.10  # ... and only when the others waited over this share of the step time for it


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
                return None, overlapping_groups_text(rank, owner[rank], group)
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
    return [list(shard) for shard in zip(*(sorted(group) for group in groups), strict=True)]


def shard_ranks(groups: Groups | None, world_size: int) -> int:
    """How many ranks a reduce-scatter or an all-gather spans, the ``n`` of its bus factor: a
    shard group's (``shard_groups``), else the world. 2 x 4 on 8 ranks names four groups of 2
    ({0, 4}, ...), and each shard group spans 4."""
    shards = shard_groups(groups)
    return len(shards[0]) if shards else world_size


def step_waits(calls_of_one_step: Mapping[int, CallTimes], figures: Mapping[int, StepFigures],
               groups: Groups | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """:func:`waits_both_ways` of a step's all-reduces within ``groups`` and its reduce-scatters
    and all-gathers (``StepFigures.sharded_calls``) within the shard groups, together, per rank:
    ``zero1``, ``zero2`` and FSDP issue few or no all-reduces, and their ranks wait for each
    other in those. Where both kinds waited at once on one rank (on a GPU, HSDP's all-reduce
    across replicas on FSDP2's own stream beside the next unit's reduce-scatter), that waiting
    counts once, as two all-reduces waiting at once do: each kind's starts are kept wherever a
    call of one overlapped a call of the other (``instrumented_ddp.wire.step_figures``)."""
    passes, met = _paired_waits(calls_of_one_step, groups)
    sharded = {rank: f.sharded_calls for rank, f in figures.items() if f.sharded_calls.tags}
    if len(sharded) > 1:
        for calls, among, _ in sharded_pairings(sharded, groups):
            more, more_met = _paired_waits(calls, among)
            passes, met = passes + more, met + more_met
    return _settled_waits(passes, met)


#: How a barrier's wait is tagged among a step's sharded calls (``StepFigures.sharded_calls``).
BARRIER_CALL = f"wait:{BARRIER_TAG}"


def sharded_pairings(sharded: Mapping[int, CallTimes], groups: Groups | None) -> list[
        tuple[Mapping[int, CallTimes], Groups | None, Callable[[StepRecordLike], Sequence[SpanLike]]]]:
    """Who meets whom in the step's sharded calls: each pairing's calls by rank, its groups, and
    the spans its calls were read from (``waiting_intervals``' ``collectives``). The
    reduce-scatters and all-gathers meet within the shard groups (``shard_groups``); a loop's
    barrier on the world (``BARRIER_CALL``) is every rank's, so where the shard groups are not
    the world (HSDP's mesh, a DDP on subgroups) those barriers are a pairing of their own over
    the world: paired within a shard group, the group's last to arrive would pass for the
    barrier's last, and a rank the rest of the world waits for would go unnamed. A barrier on a
    group of the loop's own (``kinds.barrier_tag``) stays with the rest."""
    shards = shard_groups(groups)
    if shards is None or not any(BARRIER_CALL in calls.tags for calls in sharded.values()):
        return [(sharded, shards, sharded_collectives)]
    barriers = {rank: _world_barriers_or_rest(calls, True) for rank, calls in sharded.items()}
    rest = {rank: _world_barriers_or_rest(calls, False) for rank, calls in sharded.items()}
    return [({rank: c for rank, c in rest.items() if c.tags}, shards, _collectives_but_barriers),
            ({rank: c for rank, c in barriers.items() if c.tags}, None, _barrier_waits)]


def _world_barriers_or_rest(calls: CallTimes, barriers: bool) -> CallTimes:
    """``calls``' world barriers (``barriers``), or all but them, in issue order, their starts kept."""
    kept = [index for index, tag in enumerate(calls.tags) if (tag == BARRIER_CALL) == barriers]
    return CallTimes(tuple(calls.tags[i] for i in kept), array("d", (calls.seconds[i] for i in kept)),
                     None if calls.starts is None else array("d", (calls.starts[i] for i in kept)))


def _world_barrier(span: SpanLike) -> bool:
    """The span ``_world_barriers_or_rest`` reads as ``BARRIER_CALL``: a barrier's wait on the world, not a group's."""
    return span.kind == "wait" and span.tag == BARRIER_TAG


def _collectives_but_barriers(record: StepRecordLike) -> list[SpanLike]:
    return [s for s in sharded_collectives(record) if not _world_barrier(s)]


def _barrier_waits(record: StepRecordLike) -> list[SpanLike]:
    return [s for s in sharded_collectives(record) if _world_barrier(s)]


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
    (:func:`_settled_waits`): gloo runs two collectives at a time, and two calls waiting for the
    same late rank at once count that waiting once; where they do, each call's share of what is
    put down to the rank it waited for is scaled alike, so the totals still agree. The usual step
    (every rank made the same calls) is one array operation over ranks x calls.
    With ``groups`` each group's calls are paired among its own ranks only: a rank waits only
    for those it all-reduces with."""
    return _settled_waits(*_paired_waits(calls_of_one_step, groups))


def call_waits(calls_of_one_step: Mapping[int, CallTimes], groups: Groups | None = None) -> dict[int, dict[int, float]]:
    """Per rank, the ms it waited in each of its calls that every rank of its group made: the
    call's index among the rank's calls (``CallTimes`` order) to its duration less the call's
    shortest over those ranks, the waiting :func:`waits_both_ways` adds up before counting calls
    that waited at once once. A call some rank of the group did not make is absent."""
    out: dict[int, dict[int, float]] = {}
    for paired in _paired_waits(calls_of_one_step, groups)[0]:
        for row, rank in enumerate(paired.ranks):
            mine = out.setdefault(rank, {})
            for column, position in enumerate(paired.positions[row]):
                mine[position] = float(paired.in_call[row, column])
    return out


class _PairedWaits(NamedTuple):
    """One group's calls of one kind, paired across its ranks (:func:`_paired_calls`)."""

    ranks: list[int]
    in_call: np.ndarray  # ms each rank waited in each call, ranks x calls
    last: np.ndarray  # per call, the row of the rank that arrived last: it waited least (ties: the lowest rank)
    positions: list[list[int]]  # per row, each paired call's index among the rank's calls
    #: Per row, the rank's calls' starts (seconds after the step's), where they were sent; None
    #: where they were not: its calls overlapped no other call.
    starts: list[array[float] | None]

    def waiting(self, row: int, in_call: list[float]) -> list[TimeRange]:
        """Each call's waiting on the rank's own clock, from its start (the row has starts)."""
        starts = self.starts[row]
        if starts is None:
            raise ValueError(f"row {row}'s calls overlapped no other call: no starts were sent")
        return [(starts[i], starts[i] + ms / 1000.0) for i, ms in zip(self.positions[row], in_call, strict=True)]


def _paired_waits(calls_of_one_step: Mapping[int, CallTimes],
                  groups: Groups | None) -> tuple[list[_PairedWaits], list[int]]:
    """Each group's calls paired, and every rank met (each waited 0 ms or more)."""
    passes: list[_PairedWaits] = []
    met: list[int] = []
    for calls in (_by_group(calls_of_one_step, groups) if groups is not None else (calls_of_one_step,)):
        met.extend(calls)
        paired = _paired_calls(calls)
        if paired is None or paired[2].size == 0:
            continue
        ranks, positions, seconds = paired
        in_call = 1000.0 * (seconds - seconds.min(axis=0))
        # argmin takes the first of equals: ranks are sorted, so the lowest
        passes.append(_PairedWaits(ranks, in_call, seconds.argmin(axis=0), positions, [calls[rank].starts for rank in ranks]))
    return passes, met


def _settled_waits(passes: Sequence[_PairedWaits], met: Iterable[int]) -> tuple[dict[int, float], dict[int, float]]:
    """(each rank's waiting, what the others waited for each rank) over one or more pairings
    (the all-reduces' groups; the reduce-scatters' and all-gathers' too). A rank's waiting is
    the wall time its calls' waiting covers, C: calls that waited at once count their common
    waiting once. Calls sent without starts overlapped no other call (starts are kept wherever
    two did), so theirs is their sum. Each pairing's calls on a rank are scaled by U/R x C/ΣU,
    R their summed waiting, U what they cover among themselves and ΣU over the pairings: one
    pairing alone (or pairings that never waited at once) keeps U/R, and the rank's waiting put
    down to the ranks it waited for still totals C."""
    waited = dict.fromkeys(met, 0.0)
    waited_on = dict(waited)
    scales: list[np.ndarray | None] = [None] * len(passes)
    if any(starts is not None for p in passes for starts in p.starts):  # gloo; never NCCL: no row walked at 1,024 ranks
        summed: list[list[float]] = [p.in_call.sum(axis=1).tolist() for p in passes]
        own: list[list[float]] = []  # U per pass and row
        own_total: dict[int, float] = {}  # ΣU per rank
        timed: dict[int, list[tuple[_PairedWaits, int]]] = {}  # per rank, the pairings whose rows have starts
        timed_total: dict[int, float] = {}  # their U summed, per rank
        for p, sums in zip(passes, summed, strict=True):
            row_covered = []
            for row, (rank, ms) in enumerate(zip(p.ranks, sums, strict=True)):
                if p.starts[row] is not None:
                    ms = 1000.0 * total_length(p.waiting(row, p.in_call[row].tolist()))
                    timed.setdefault(rank, []).append((p, row))
                    timed_total[rank] = timed_total.get(rank, 0.0) + ms
                row_covered.append(ms)
                own_total[rank] = own_total.get(rank, 0.0) + ms
            own.append(row_covered)
        covered = dict(own_total)  # C: ΣU, but for a rank whose waiting in two pairings both had starts
        for rank, rows in timed.items():
            if len(rows) > 1:  # their common waiting, once: the union of all of it in place of their U
                union = total_length([w for p, row in rows for w in p.waiting(row, p.in_call[row].tolist())])
                covered[rank] += 1000.0 * union - timed_total[rank]
        for index, (p, sums, row_covered) in enumerate(zip(passes, summed, own, strict=True)):
            scales[index] = np.array([(u / r if r > 0 else 1.0) * (covered[rank] / own_total[rank] if own_total[rank] > 0 else 1.0)
                                      for rank, r, u in zip(p.ranks, sums, row_covered, strict=True)])
    for p, scale in zip(passes, scales, strict=True):
        in_call = p.in_call if scale is None else p.in_call * scale[:, None]
        for rank, ms in zip(p.ranks, in_call.sum(axis=1).tolist(), strict=True):  # one pass over rows, not 1,024 numpy calls
            waited[rank] += ms
        for rank, ms in zip(p.ranks, np.bincount(p.last, weights=in_call.sum(axis=0), minlength=len(p.ranks)).tolist(), strict=True):
            waited_on[rank] += ms
    return waited, waited_on


def transfers(calls_of_one_step: Mapping[int, CallTimes], groups: Groups | None = None) -> list[tuple[tuple[str, int], float]]:
    """Each call every rank made, keyed by its tag and occurrence (``collective_key``), with its
    transfer: its shortest duration over the ranks (:func:`_paired_calls`), the time the
    collective itself took once its last participant joined. [] with fewer than two ranks.
    Read from the durations alone, which a ``StepSummary`` carries too: one array of C doubles
    and one ``min`` over it, no span read.

    With ``groups`` each group's call is a collective of its own, its transfer the shortest
    duration among the group's ranks (over the world, a slow group's transfers would be lost
    behind a fast group's), and the call's is the mean over the groups that made it: one sample
    a call, however many groups, so the cost model's samples do not grow with the groups (the
    line fitted through the means is the same)."""
    minima: list[tuple[tuple[str, ...], list[int], np.ndarray]] = []
    for calls in (_by_group(calls_of_one_step, groups) if groups is not None else (calls_of_one_step,)):
        paired = _paired_calls(calls)
        if paired is not None and paired[2].size:
            ranks, positions, seconds = paired
            minima.append((calls[ranks[0]].tags, positions[0], seconds.min(axis=0)))
    if not minima:
        return []
    tags = minima[0][0]
    if all(theirs == tags and len(made) == len(tags) for theirs, made, _ in minima):  # every group made every call
        return list(zip(_collective_keys(tags), np.mean([shortest for *_, shortest in minima], axis=0).tolist(), strict=True))
    sums: dict[tuple[str, int], list[float]] = {}  # key -> [sum over groups, groups]
    for theirs, made, shortest in minima:
        keys = _collective_keys(theirs)
        for index, transfer_s in zip(made, shortest.tolist(), strict=True):
            total = sums.setdefault(keys[index], [0.0, 0])
            total[0] += transfer_s
            total[1] += 1
    return [(key, total / groups_made) for key, (total, groups_made) in sums.items()]


def _collective_keys(tags: Sequence[str]) -> list[tuple[str, int]]:
    seen: Counter[str] = Counter()
    return [collective_key(tag, seen) for tag in tags]


def waiting_intervals(calls_of_one_step: Mapping[int, CallTimes], records: Mapping[int, StepRecordLike],
                      groups: Groups | None = None,
                      collectives: Callable[[StepRecordLike], Sequence[SpanLike]] = all_reduces) -> dict[int, list[TimeRange]]:
    """Per rank of ``records`` (those whose spans are at hand), the part of each all-reduce spent
    waiting for the others to arrive, on the rank's own clock, in issue order: from the call's
    start until its transfer (see :func:`_paired_calls`), which ends the call on every rank.
    The transfer is judged over every rank in ``calls_of_one_step`` (with ``groups``, over the
    rank's own group). With fewer than two ranks nobody waits. ``collectives``: the spans the
    calls were read from (``sharded_collectives`` for ``StepFigures.sharded_calls``)."""
    if groups is not None:
        waiting_by_group: dict[int, list[TimeRange]] = {}
        for calls in _by_group(calls_of_one_step, groups):
            waiting_by_group.update(waiting_intervals(calls, {rank: records[rank] for rank in calls if rank in records},
                                                      collectives=collectives))
        return {rank: waiting_by_group.get(rank, []) for rank in records}
    waiting: dict[int, list[TimeRange]] = {rank: [] for rank in records}
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
    seconds = np.array([[calls_of_one_step[rank].seconds[i] for i in row] for rank, row in zip(ranks, positions, strict=True)],
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
        return straggler_text(self.rank, self.first_step, self.last_step, self.waited_ms_per_step, self.share_pct)

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
    did", ranks that wait for each other by turns (a balanced run on gloo) would name one of
    them; without the groups, a rank would be said to keep waiting ranks that never all-reduce
    with it. Of several groups' stragglers, the one its group waited for longest.
    """
    window = sorted(complete_steps, key=lambda s: s.step)[-STRAGGLER_STEPS:]
    totals: dict[int, float] = defaultdict(float)
    wall_ms = 0.0
    for s in window:
        wall_ms += s.wall_ms
        for rank, waited in s.waits_ms.items():
            totals[rank] += waited
    if wall_ms <= 0:  # no steps, or steps of no length (a rank's hostile reports): no share of them to name
        return None
    found: tuple[float, int] | None = None  # (the others' excess, the rank)
    for members in groups if groups is not None else (list(totals),):
        waited_by_rank = {rank: totals[rank] for rank in members if rank in totals}
        slow = straggler(waited_by_rank)
        others = [w for r, w in waited_by_rank.items() if r != slow]
        if slow is None or not others:
            continue
        excess = min(others) - waited_by_rank[slow]
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
    counted (``StepFigures.calls_by_kind``), by name. The all-reduces of a user's own DDP
    communication hook (``h<k>``, ``attach``) are not counted: how many of them are timed can
    differ between ranks with no fault in the run (PowerSGD on gloo chains a bucket's second
    and third from completion callbacks, timed only where a race puts them on the backward's
    thread)."""
    calls = {rank: sum(not is_user_hook_tag(tag) for tag in c.tags) for rank, c in sorted(calls_of_one_step.items())}
    if len(set(calls.values())) > 1:
        return Desync(step=step, calls_per_rank=calls)
    for kind in sorted({k for counts in (kinds_of_one_step or {}).values() for k in counts} - {"all_reduce"}):
        counts = {rank: int(c.get(kind, 0)) for rank, c in sorted((kinds_of_one_step or {}).items())}
        if len(set(counts.values())) > 1:
            return Desync(step=step, calls_per_rank=counts, kind=kind)
    return None


def is_user_hook_tag(tag: str) -> bool:
    """``h<k>``: the k-th all-reduce a user's DDP communication hook issued in a backward, timed as
    issued (``instrumented_ddp.timing.hooked_collectives``)."""
    return tag[:1] == "h" and tag[1:].isdigit()


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
        return desync_text(self.first_step, self.last_step, self.steps, self.first.kind, self.first.calls_per_rank,
                           self.last.calls_per_rank)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DesyncRange:
        """From summary.json, whose keys are strings."""
        return cls(int(data["first_step"]), int(data["last_step"]), int(data["steps"]),
                   Desync.from_dict(data["first"]), Desync.from_dict(data["last"]))
