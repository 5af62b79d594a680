"""The checks a message passes before a session folds it in: valid on the wire
(``codec.decode`` checked that), and possible in this session."""

from __future__ import annotations

from ddpwatch.ingest.rank_liveness import RankLiveness
from ddpwatch.ingest.rank_state import STEP_REORDER_SLACK
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Hello, StepReport, StepSummary


class MessageChecks:
    """What makes a well-formed message impossible given the world and the ranks heard so far."""

    def __init__(self, liveness: RankLiveness) -> None:
        self._liveness = liveness

    def impossible(self, envelope: Envelope) -> str | None:
        """The rejection category of a message valid on the wire but impossible in this session,
        else None: a rank outside the world (``unknown_rank``), a message whose body names
        another rank than its envelope (``rank_mismatch``), a step the rank already reported
        (``step_repeated``), a report older than the rank's own earlier reports
        (``step_backwards``: a rank's reports leave it in step order on one connection).

        A report for a step the rank has passed is not impossible: it is late
        (``RankState.note_report`` counts it). Nor are the spans of a step the rank summarized
        (``RankState.is_detail``): the step's figures are in, its spans are new."""
        message = envelope.message
        world = self._liveness.declared_world
        if world and envelope.rank >= world and not isinstance(message, Hello):
            return "unknown_rank"
        if envelope.rank < 0:  # a listener's own (a span request relayed), not a rank's
            return "unknown_rank"
        if getattr(message, "rank", envelope.rank) != envelope.rank:
            return "rank_mismatch"
        if isinstance(message, Hello) and not 0 <= message.rank < message.world_size:
            return "unknown_rank"
        ranks = self._liveness.ranks
        if isinstance(message, (StepReport, StepSummary)) and envelope.rank in ranks:
            state = ranks[envelope.rank]
            if message.step in state.reported:
                return None if state.is_detail(message) else "step_repeated"
            if message.step < state.last_reported - STEP_REORDER_SLACK:
                return "step_backwards"
        return None
