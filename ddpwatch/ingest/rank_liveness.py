"""Which ranks make up the run and how each is doing: heard lately, lost, left behind, held by a
lost peer, or gone with a goodbye saying why.

The world is what the ranks' hellos declare (the ranks heard from, before any hello); every
question about the run as a whole (``finished``, ``run_is_over``) ranges over it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from ddpwatch.ingest.rank_state import RankState
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import (
    MAX_PAUSED_FOR, Goodbye, Heartbeat, Hello, detachment_of, failure_of, interruption_of)

LOST_AFTER_S = 2.5  # heartbeats come every second: a killed rank shows as lost within 3 s
STOPPED_STEPS = 5  # ranks move in step (each step's collectives need them all): this far behind, one has stopped
STOPPED_AFTER_S = 3.0  # ... and unmoved this long: not a rank whose reports are still resolving


def goodbyes_saying(said: Callable[[str], str | None], goodbyes: Iterable[tuple[int, Goodbye | None]]
                    ) -> dict[int, tuple[int, str]]:
    """``{rank: (steps done, what)}`` for each goodbye whose reason ``said`` reads (``failure_of``,
    ``interruption_of``), by rank: the session's and a summary's goodbyes alike."""
    return {rank: (goodbye.steps, what) for rank, goodbye in sorted(goodbyes, key=lambda pair: pair[0])
            if goodbye is not None and (what := said(goodbye.reason)) is not None}


def ranks_left_behind(last_steps: Mapping[int, int]) -> dict[int, int]:
    """The ranks ``STOPPED_STEPS`` or more behind the newest step any rank passed, with the step
    each is at: the one rule the dashboard's note (``RankLiveness.stopped_ranks``, which also asks
    that the rank be unmoved a while and not lost) and summary.md (from summary.json) apply."""
    newest = max(last_steps.values(), default=0)
    return {rank: step for rank, step in sorted(last_steps.items()) if newest - step >= STOPPED_STEPS}


class RankLiveness:
    """Every rank heard from (``ranks``: one made on first asking), the world the hellos declare,
    and what the ranks' messages say of whether each still trains."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankState] = defaultdict(RankState)
        self.declared_world = 0  # the largest world a rank's newest hello declares (0 before any)
        #: The rank whose goodbye said its training failed before any other's did: the cause,
        #: where the others' next collectives then failed on a dead peer (``failed_ranks_lines``).
        self.first_failed_rank: int | None = None

    @property
    def world_size(self) -> int:
        return self.declared_world or len(self.ranks)

    # -- hearing ---------------------------------------------------------------------------------
    def hear(self, envelope: Envelope, now: float) -> RankState:
        """The sending rank's state, with the envelope's sequence number, its sender's drop count
        and the time it was heard noted: a gap in the sequence is messages lost on the way."""
        rank = self.ranks[envelope.rank]
        if envelope.seq > rank.last_seq + 1 and rank.last_seq >= 0:
            rank.lost_messages += envelope.seq - rank.last_seq - 1
        rank.last_seq = max(rank.last_seq, envelope.seq)
        rank.sender_dropped = max(rank.sender_dropped, envelope.dropped)
        rank.last_seen = now
        return rank

    def note_rejected(self, envelope: Envelope) -> None:
        """A rejected message's sequence number, where its rank is known: rejected, not also lost."""
        if (state := self.ranks.get(envelope.rank)) is not None:
            state.last_seq = max(state.last_seq, envelope.seq)

    def note_hello(self, rank: RankState, hello: Hello) -> None:
        """Ranks repeat their hello every few seconds: the declared world is recomputed over all
        ranks only when the largest may have shrunk."""
        previous, rank.hello = rank.hello, hello
        if hello.world_size >= self.declared_world:
            self.declared_world = hello.world_size
        elif previous is not None and previous.world_size == self.declared_world:
            self.declared_world = max((r.hello.world_size for r in self.ranks.values() if r.hello), default=0)

    @staticmethod
    def note_heartbeat(rank: RankState, heartbeat: Heartbeat, now: float) -> None:
        rank.last_step = max(rank.last_step, heartbeat.step)
        rank.phase, rank.probe = heartbeat.phase, heartbeat.probe
        pausing = heartbeat.pausing[:MAX_PAUSED_FOR]
        if pausing != rank.pausing:
            rank.pausing, rank.pausing_since = pausing, now

    def note_goodbye(self, rank: RankState, goodbye: Goodbye) -> None:
        rank.goodbye = goodbye
        if self.first_failed_rank is None and failure_of(goodbye.reason) is not None:
            self.first_failed_rank = goodbye.rank

    def forget_detailed_below(self, step: int) -> None:
        """Drop each rank's record of steps before ``step`` whose spans came after their summary:
        a detail of a step the session no longer keeps is unused anyway."""
        for state in self.ranks.values():
            state.detailed.forget_below(step)

    # -- reading ---------------------------------------------------------------------------------
    def status(self, rank: int, now: float | None = None, recording_ended: bool = False) -> str:
        """``live``, ``lost`` (nothing heard for ``LOST_AFTER_S``), or, once it said goodbye,
        ``finished``, ``failed`` (its training raised: the goodbye says what), ``interrupted``
        (a signal stopped it) or ``detached`` (ddpwatch stopped watching it; it trains on).
        ``recording_ended``: nothing more will come (a replay at the end of its file): a rank
        heard to the end without a goodbye is ``cut``, not ``live``: the recording stopped before
        its run did, and how the run went on is not in it."""
        state = self.ranks[rank]
        if state.goodbye is not None:
            reason = state.goodbye.reason
            return ("failed" if failure_of(reason) is not None else "interrupted" if interruption_of(reason) is not None
                    else "detached" if detachment_of(reason) is not None else "finished")
        now = time.monotonic() if now is None else now
        return "lost" if now - state.last_seen > LOST_AFTER_S else "cut" if recording_ended else "live"

    @property
    def finished(self) -> bool:
        """Every rank of the world said goodbye."""
        return self.world_size > 0 and all((state := self.ranks.get(r)) is not None and state.goodbye is not None
                                           for r in range(self.world_size))

    @property
    def trains_again(self) -> bool:
        """Every rank said goodbye saying its process trains again at once, a run of its own
        (``Goodbye.trains_again``: a Trainer begun again after running out of memory)."""
        return self.finished and all(state.goodbye is not None and state.goodbye.trains_again for state in self.ranks.values())

    def run_is_over(self, now: float) -> bool:
        """Every rank of the world said goodbye or is lost at ``now``: nothing more will come of
        this run, and a new run may begin the next session (``Session.next_run``)."""
        ranks = range(self.world_size)
        return bool(ranks) and all(r in self.ranks and self.status(r, now) != "live" for r in ranks)

    def stopped_ranks(self, now: float) -> dict[int, int]:
        """Ranks not lost whose steps stopped while the others' went on: the step each is at, for
        those ``STOPPED_STEPS`` or more behind the newest and unmoved for ``STOPPED_AFTER_S``. The
        collectives of a step hold every rank to it, so a rank left behind is one the others no
        longer need: out of data under DDP's ``join()`` (uneven inputs), which shadows their
        collectives outside any step, or a loop that left the training step."""
        behind = ranks_left_behind({rank: state.last_step for rank, state in self.ranks.items()})
        return {rank: step for rank, step in behind.items()
                if now - self.ranks[rank].last_step_at >= STOPPED_AFTER_S and self.status(rank, now) != "lost"}

    def ranks_held_by_lost(self, now: float) -> tuple[dict[int, int], dict[int, float]]:
        """Live ranks that have passed no step since a lost rank went silent, unmoved for
        ``STOPPED_AFTER_S``, with the step each is at; and every lost rank, with when each was
        last heard (what the lines of lost ranks say too: one pass over the ranks for both).

        Every collective of a step needs every rank, so a rank that dies or freezes holds the
        others in their next one, heartbeating (their sender is a thread of its own) but passing
        no step: until the process group's timeout, unless the launcher stops them (gloo fails a
        collective at once on a peer whose connection closes, but not one whose send was half
        written when it did: it waits out its timeout). A rank passed its last step no later than
        its lost peer died, at most ``LOST_AFTER_S`` after that peer was last heard; a rank that
        went on past that is training without it (the lost one's telemetry alone went silent),
        and is not said held; nor is one that has passed no step at all (still starting: loading
        its data, compiling)."""
        lost = {rank: state.last_seen for rank, state in sorted(self.ranks.items()) if self.status(rank, now) == "lost"}
        if not lost:
            return {}, {}
        died_by = min(lost.values()) + LOST_AFTER_S
        held = {rank: state.last_step for rank, state in sorted(self.ranks.items())
                if rank not in lost and self.status(rank, now) == "live" and state.last_step > 0
                and state.last_step_at <= died_by and now - state.last_step_at >= STOPPED_AFTER_S}
        return held, lost

    @property
    def failed_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose goodbye says their training failed: ``{rank: (steps done, why)}``."""
        return self._goodbyes_saying(failure_of)

    @property
    def interrupted_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose goodbye says a signal stopped them from outside (Ctrl-C, torchrun's or a
        scheduler's SIGTERM): ``{rank: (steps done, which signal)}``."""
        return self._goodbyes_saying(interruption_of)

    @property
    def detached_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose goodbye says ddpwatch stopped watching them while they trained on
        (``messages.DETACHED``): ``{rank: (steps done, why)}``."""
        return self._goodbyes_saying(detachment_of)

    def _goodbyes_saying(self, said: Callable[[str], str | None]) -> dict[int, tuple[int, str]]:
        return goodbyes_saying(said, ((rank, state.goodbye) for rank, state in self.ranks.items()))
