"""What ``ddpwatch record`` says of faults as they happen (``ddpwatch/record/live_faults.py``): a rank
lost and the live ranks it holds, each once, looked at once a second."""

from __future__ import annotations

from ddpwatch.record.live_faults import LiveFaultReporter
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import decode, encode
from instrumented_ddp.wire.messages import Heartbeat
from synthetic_session import session_messages

HELD = ("rank 0 has passed no step since rank 1 went silent {} s ago (at step 10): waiting for it in a collective, until "
        "the process group's timeout (by default 10 min on NCCL, 30 min on gloo) unless the launcher stops the job")


def beat(session: Session, rank: int, at: float, step: int = 10) -> None:
    session.ingest(decode(encode(Heartbeat(rank, at, step), seq=100 + int(at * 10))), received_at=at)


def test_a_frozen_rank_is_said_lost_then_the_rank_it_holds_each_once() -> None:
    """Both ranks' steps 1-10 heard at 5.0 s; rank 1 then freezes, rank 0 beats on at step 10.
    Lost at 7.5 s (said at the look at 8.0), held from 8.0 s (3 s unmoved): looks at 6.0, 7.0
    say nothing, 8.0 says both, 9.0 and 10.0 nothing new."""
    said: list[str] = []
    faults = LiveFaultReporter(said.append)
    session = Session(120)
    for message in session_messages(goodbye=False):
        session.ingest(decode(message), received_at=5.0)
    for now in (6.0, 7.0, 8.0, 9.0, 10.0):
        beat(session, 0, now - 0.5)
        faults.look(session, now)
        faults.look(session, now + 0.5)  # within the second: not looked at again
    assert said == ["rank 1 lost: nothing heard from it for 3.0 s", HELD.format(3)]


def test_a_rank_heard_again_and_lost_again_is_said_again_and_a_rank_stepping_on_is_not_held() -> None:
    """Rank 1 comes back at 9.0 s (a frozen rank let go: SIGCONT) and both step on; it freezes
    again after step 11 (heard last at 9.0 s): lost again at 11.5 s, said at the look at 12.0,
    and rank 0 held again from 12.0 s (its step 11 came at 9.0 s)."""
    said: list[str] = []
    faults = LiveFaultReporter(said.append)
    session = Session(120)
    for message in session_messages(goodbye=False):
        session.ingest(decode(message), received_at=5.0)
    for now in (6.0, 7.0, 8.0):
        beat(session, 0, now - 0.5)
        faults.look(session, now)
    beat(session, 0, 9.0, step=11)
    beat(session, 1, 9.0, step=11)
    faults.look(session, 9.0)
    for now in (10.0, 11.0, 12.0, 13.0):
        beat(session, 0, now - 0.5, step=11)
        faults.look(session, now)
    assert said == ["rank 1 lost: nothing heard from it for 3.0 s", HELD.format(3),
                    "rank 1 lost: nothing heard from it for 3.0 s",
                    HELD.format(3).replace("(at step 10)", "(at step 11)")]


def test_many_lost_ranks_are_said_in_one_line_and_a_run_that_ends_says_nothing() -> None:
    said: list[str] = []
    faults = LiveFaultReporter(said.append)
    session = Session(120)
    for message in session_messages(world_size=8, goodbye=False):
        session.ingest(decode(message), received_at=5.0)
    faults.look(session, 9.0)
    assert said == ["8 ranks lost: nothing heard from them for 4-4 s: ranks 0-7"]  # none live: none held
    ended = Session(120)
    quiet: list[str] = []
    for message in session_messages(goodbye=True):
        ended.ingest(decode(message), received_at=5.0)
    LiveFaultReporter(quiet.append).look(ended, 60.0)
    assert quiet == []  # every rank said goodbye: finished, not lost
