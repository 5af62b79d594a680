"""What holds a stalled run: the ranks' own probes paired into one verdict. Pure.

A run is stalled once no rank has finished a step for ``stall_after_s`` (``ingest.stall_watch``
keeps the clock). Each rank's heartbeat then carries a ``StallProbe``: the collectives it has
issued and not seen complete, oldest first, and how many it has issued on each group. The same
collective has the same number on every rank of its group, so pairing the probes says who
holds the others up:

* **lost**: a rank fell silent (``RankLiveness``); the others wait for it.
* **behind**: ranks wait in a collective that others have not issued (their count on its group
  is below its number) and that are in no collective themselves: those are the culprits, and
  their stacks say where they are. One behind that waits in a collective of its own (on a
  subgroup, for a third rank) is not a culprit: the idle rank it waits for is.
* **in_collective**: every rank is in the same collective (same group, number, kind and size):
  the collective itself is slow, or the link is.
* **desync**: nobody idle is behind, yet the ranks' oldest collectives differ in group, number,
  kind or size: they issued different collectives, and none can complete. The culprits are
  the minority (both sides of an even split).

A rank with nothing in flight and no collective it has not reached is simply where its stack
says; where no rank is in a collective at all, every rank is a culprit ("behind" with no one
waiting): the whole job stopped outside communication (a data loader, a checkpoint).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from instrumented_ddp.wire.stall_probe import InFlight, StallProbe

#: A stall is named once no rank has finished a step for this many times the segment's p95 step:
#: the p95 already holds a slow step's ordinary hiccups (a loader, a GC pause), so three of them
#: end to end is no hiccup.
STALL_P95_FACTOR = 3.0
#: ... and never sooner than this: a rank's probe comes after 1.5 s (``PROBE_AFTER_S``), and a
#: heartbeat a second later, so every rank's probe is in hand; and a killed rank reads lost
#: (2.5 s of silence) before it would read stalled.
STALL_FLOOR_S = 3.0

KINDS = ("behind", "in_collective", "desync", "lost")


def stall_after_s(p95_step_s: float | None) -> float:
    """How long no rank may finish a step before the run is called stalled."""
    return max(STALL_FLOOR_S, STALL_P95_FACTOR * p95_step_s) if p95_step_s is not None else STALL_FLOOR_S


class RankView(NamedTuple):
    """A rank as the listener last heard it: what ``classify`` pairs."""

    phase: str = ""  # Heartbeat.phase
    probe: StallProbe | None = None  # None: no probe yet (a rank still stepping, or an older one)
    lost: bool = False
    pausing: str = ""  # Heartbeat.pausing: the loop paused training on purpose


class Verdict(NamedTuple):
    kind: str  # one of KINDS
    culprits: tuple[int, ...]  # the ranks that hold the others (all ranks of a desync's minority)
    waiting: tuple[int, ...]  # the ranks held in a collective
    collective: InFlight | None  # what the waiting ranks are in; None where none is
    sides: Mapping[int, InFlight]  # each probed rank's oldest collective in flight


@dataclass
class Stall:
    """One stall: ``since`` is when the last step before it was finished, ``named_at`` when the
    watch named it, ``ended_at`` when a step was finished again (None while it lasts).
    ``probes`` and ``phases``: what each rank last said while it lasted."""

    step: int  # the step the run is stalled in
    since: float
    named_at: float
    verdict: Verdict
    probes: dict[int, StallProbe] = field(default_factory=dict)
    phases: dict[int, str] = field(default_factory=dict)
    ended_at: float | None = None
    looked_at: float = 0.0  # the watch's latest look while the stall lasted

    def __post_init__(self) -> None:
        self.looked_at = max(self.looked_at, self.named_at)

    @property
    def named_after_s(self) -> float:
        return self.named_at - self.since

    @property
    def stacks(self) -> dict[int, list[str]]:
        return {rank: list(probe.stack) for rank, probe in sorted(self.probes.items()) if probe.stack}

    def duration_s(self, now: float) -> float:
        return (self.ended_at if self.ended_at is not None else now) - self.since

    def as_dict(self) -> dict[str, Any]:
        """The stall as ``stalls.json`` and ``summary.json`` hold it."""
        call = self.verdict.collective
        probes = sorted(self.probes.items())
        return {
            "step": self.step,
            "kind": self.verdict.kind,
            "culprits": list(self.verdict.culprits),
            "waiting": list(self.verdict.waiting),
            "collective": None if call is None else {"kind": call.kind, "tag": call.tag, "bytes": call.nbytes,
                                                     "group": call.group or "default", "seq": call.seq},
            "named_after_s": round(self.named_after_s, 3),
            "duration_s": None if self.ended_at is None else round(self.duration_s(self.ended_at), 3),
            "stalled_s": round(self.duration_s(self.looked_at if self.ended_at is None else self.ended_at), 3),
            "phases": {str(rank): phase for rank, phase in sorted(self.phases.items())},
            "in_flight": {str(rank): {"kind": c.kind, "tag": c.tag, "bytes": c.nbytes, "group": c.group or "default",
                                      "seq": c.seq, "waited_s": round(c.waited_s, 3)}
                          for rank, c in sorted(self.verdict.sides.items())},
            "issued": {str(rank): {group or "default": n for group, n in sorted(probe.issued.items())} for rank, probe in probes},
            "places": {str(rank): probe.place for rank, probe in probes if probe.place},
            "stacks": {str(rank): lines for rank, lines in self.stacks.items()},
            "native_stacks": {str(rank): list(probe.native_stack) for rank, probe in probes if probe.native_stack},
            "native_errors": {str(rank): probe.native_error for rank, probe in probes if probe.native_error},
        }


def excused(ranks: Mapping[int, RankView]) -> str:
    """Why no step coming is not a stall ("" where nothing excuses it): a pause the loop marked
    (an evaluation, a checkpoint inside ``watch.paused``), or torch.compile compiling."""
    for rank in sorted(ranks):
        view = ranks[rank]
        if view.pausing and not view.lost:
            return f"rank {rank} is pausing training: {view.pausing}"
        if view.probe is not None and view.probe.compiling:
            return f"rank {rank} is compiling"
    return ""


def classify(ranks: Mapping[int, RankView]) -> Verdict:
    """The verdict on a stalled run from every rank's latest view (see the module docstring)."""
    alive = {rank: view for rank, view in ranks.items() if not view.lost}
    oldest = {rank: view.probe.in_flight[0] for rank, view in alive.items() if view.probe is not None and view.probe.in_flight}
    lost = tuple(sorted(rank for rank, view in ranks.items() if view.lost))
    held = _held_longest(oldest)
    if lost:
        return Verdict("lost", lost, tuple(sorted(oldest)), held[1] if held else None, oldest)
    if held is None:  # nobody in a collective: the whole job stopped outside communication
        return Verdict("behind", tuple(sorted(alive)), (), None, oldest)
    waiting, collective = held
    behind = tuple(sorted(rank for rank, view in alive.items() if rank not in waiting and _not_reached(view, collective)))
    idle = tuple(rank for rank in behind if rank not in oldest)
    if idle:  # those behind that are in a collective of their own wait too: for the idle ones
        return Verdict("behind", idle, waiting, collective, oldest)
    # Every rank behind is itself in another collective: each side waits for the other's.
    signatures = Counter(_signature(call) for call in oldest.values())
    if len(signatures) == 1 and len(oldest) == len(alive):
        return Verdict("in_collective", (), tuple(sorted(oldest)), collective, oldest)
    most, count = signatures.most_common(1)[0]
    tied = sum(1 for n in signatures.values() if n == count) > 1
    culprits = tuple(sorted(rank for rank, call in oldest.items() if tied or _signature(call) != most))
    if not culprits:  # every probed rank agrees: the unprobed ones are where nothing says
        culprits = tuple(sorted(rank for rank in alive if rank not in oldest))
    return Verdict("desync", culprits, tuple(sorted(oldest)), collective, oldest)


def _signature(call: InFlight) -> tuple[str, int, str, int]:
    return (call.group, call.seq, call.kind, call.nbytes)


def _held_longest(oldest: Mapping[int, InFlight]) -> tuple[tuple[int, ...], InFlight] | None:
    """The collective waited in longest (by group and number) and the ranks waiting in it."""
    if not oldest:
        return None
    longest = max(oldest.values(), key=lambda call: call.waited_s)
    waiting = tuple(sorted(rank for rank, call in oldest.items() if (call.group, call.seq) == (longest.group, longest.seq)))
    return waiting, longest


def _not_reached(view: RankView, call: InFlight) -> bool:
    """Whether this rank has yet to issue ``call``: its count on the call's group is below the
    call's number. A rank that never used a named group is not taken to belong to it."""
    if view.probe is None:
        return False
    issued = view.probe.issued
    if call.group and call.group not in issued:
        return False
    return issued.get(call.group, 0) < call.seq
