"""Which well-formed messages cannot be true in a session (``ddpwatch.ingest.message_checks``)."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.ingest.message_checks import MessageChecks
from ddpwatch.ingest.rank_liveness import RankLiveness
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Heartbeat, Message, SpanRequest
from instrumented_ddp.wire.step_figures import summarize
from synthetic_session import hello, step_report


def checked(checks: MessageChecks, message: Message, rank: int) -> str | None:
    return checks.impossible(Envelope(message, rank, 0, 0))


def test_a_rank_outside_the_declared_world_or_not_the_envelopes_is_impossible() -> None:
    liveness = RankLiveness()
    checks = MessageChecks(liveness)
    assert checked(checks, Heartbeat(5, 0.0, 1), 5) is None  # no hello yet: no world to be outside of
    liveness.note_hello(liveness.ranks[0], hello(0, world_size=2))
    assert checked(checks, Heartbeat(2, 0.0, 1), 2) == "unknown_rank"
    assert checked(checks, hello(2, world_size=4), 2) is None  # a hello may grow the world
    assert checked(checks, hello(2, world_size=2), 2) == "unknown_rank"  # ... but must lie in its own
    assert checked(checks, SpanRequest(full=True), -1) == "unknown_rank"  # a listener's own, not a rank's
    assert checked(checks, Heartbeat(0, 0.0, 1), 1) == "rank_mismatch"


def test_a_step_reported_twice_is_repeated_and_one_behind_the_ranks_earlier_reports_backwards() -> None:
    liveness = RankLiveness()
    checks = MessageChecks(liveness)
    state = liveness.ranks[1]
    for step in (1, 2, 3, 4, 5):
        state.note_report(step_report(1, step, "simple"), folded=False)
    assert checked(checks, step_report(1, 5, "simple"), 1) == "step_repeated"
    assert checked(checks, replace(step_report(1, 1, "simple"), step=0), 1) == "step_backwards"  # 5 - 0 > 2
    assert checked(checks, step_report(1, 7, "simple"), 1) is None


def test_the_spans_of_a_step_sent_as_a_summary_are_not_repeated_the_first_time() -> None:
    liveness = RankLiveness()
    checks = MessageChecks(liveness)
    state = liveness.ranks[0]
    state.note_report(summarize(step_report(0, 3, "bucket"), 2), folded=False)
    assert checked(checks, summarize(step_report(0, 3, "bucket"), 2), 0) == "step_repeated"
    assert checked(checks, step_report(0, 3, "bucket"), 0) is None  # the dashboard asked for its spans
    state.detailed.add(3)
    assert checked(checks, step_report(0, 3, "bucket"), 0) == "step_repeated"
