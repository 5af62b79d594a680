"""Which run a session holds and which messages are another run's (``ddpwatch.ingest.run_identity``)."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.ingest.run_identity import RunIdentity
from instrumented_ddp.wire.messages import Heartbeat
from synthetic_session import hello


def test_the_run_heard_first_is_held_and_a_sender_of_another_run_is_named() -> None:
    identity = RunIdentity()
    identity.hear_sender_run("first")
    identity.hear_sender_run("second")
    assert (identity.session_id, identity.runs_told_apart) == ("first", True)
    heartbeat = Heartbeat(0, 0.0, 1)
    assert identity.other_run(heartbeat, "second") == "second"
    assert identity.other_run(heartbeat, "first") == "" and identity.other_run(heartbeat) == ""


def test_without_the_senders_run_only_a_hello_naming_another_session_is_another_runs() -> None:
    identity = RunIdentity()
    ours = hello(0)  # session "fixed-session"
    assert not identity.is_another_run(ours) and identity.other_run(ours) == ""  # nothing held yet
    identity.hear_hello(ours)
    theirs = replace(ours, session="second-session")
    assert identity.is_another_run(theirs) and identity.other_run(theirs) == "second-session"
    assert identity.other_run(Heartbeat(0, 0.0, 1)) == ""  # a heartbeat names no run
    assert not identity.runs_told_apart
