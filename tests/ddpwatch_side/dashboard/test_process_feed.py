"""The live feed's receiver process: what it hands the UI is every message, recorded, decoded and
figured exactly as the session would figure it in one process."""

from __future__ import annotations

import time
from msgspec.structs import replace
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ddpwatch.dashboard.feeds import Arrival
from ddpwatch.dashboard.process_feed import KnownJob, ProcessFeed
from ddpwatch.demo import free_loopback_address
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.session_file import read_session_file
from instrumented_ddp.wire.codec import Envelope, ProtocolError, decode, encode
from instrumented_ddp.wire.messages import Hello, SpanRequest, StepReport
from instrumented_ddp.publish.span_policy import SpanPolicy
from instrumented_ddp.wire.step_figures import summarize
from instrumented_ddp.wire.endpoints import routing_id
from synthetic_session import hello, session_messages, step_report


def _with_summaries(messages: list[bytes]) -> list[bytes]:
    """What a large job's ranks send: summaries, and on every other step the spans after it."""
    policy = SpanPolicy(2)
    policy.on_request(SpanRequest(full=False, sample_every=2))
    edited, seq = [], {0: 0, 1: 0}
    for data in messages:
        envelope = decode(data)
        outgoing = policy.messages_for(envelope.message) if isinstance(envelope.message, StepReport) else [envelope.message]
        for message in outgoing:
            edited.append(encode(message, seq[envelope.rank], envelope.dropped))
            seq[envelope.rank] += 1
    return edited


class Ranks:
    """Two ranks' sockets, each message sent from its rank's own, as ranks send them. Kept
    here: a socket collected with messages unsent drops them."""

    def __init__(self, context: zmq.Context, address: str, session: str = "fixed-session") -> None:
        self.sockets = {}
        for rank in (0, 1):
            self.sockets[rank] = context.socket(zmq.DEALER)
            self.sockets[rank].setsockopt(zmq.ROUTING_ID, routing_id(session, rank))
            self.sockets[rank].setsockopt(zmq.LINGER, 0)
            self.sockets[rank].connect(address)

    def send(self, messages: list[bytes]) -> None:
        for data in messages:
            self.sockets[decode(data).rank].send(data)


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[tuple[ProcessFeed, Ranks]]:
    """A started feed (its session file in ``tmp_path``) and two ranks connected to it."""
    address = free_loopback_address()
    feed = ProcessFeed(address, tmp_path / "session.ddpwatch")
    feed.start()
    context = zmq.Context()
    try:
        yield feed, Ranks(context, address)
    finally:
        feed.stop()
        context.destroy(linger=0)


def _drain(feed: ProcessFeed, count: int) -> list[Arrival]:
    arrivals: list[Arrival] = []
    deadline = time.monotonic() + 30
    while len(arrivals) < count and time.monotonic() < deadline:
        arrivals += feed.drain()
        time.sleep(0.02)
    return arrivals


@pytest.mark.timeout(60)
def test_process_feed_hands_over_every_message_recorded_and_figured_as_one_process_would(
        tmp_path: Path, listening: tuple[ProcessFeed, Ranks]) -> None:
    feed, ranks = listening
    messages = _with_summaries(session_messages(steps=8))
    hellos = {envelope.rank: envelope.message for envelope in map(decode, messages) if isinstance(envelope.message, Hello)}
    messages += [encode(hellos[0], 1000), encode(replace(hellos[1], device_note="changed"), 1000)]  # repeated; changed
    ranks.send(messages)
    ranks.sockets[1].send(b"\xc1garbage")  # rejected, counted, and handed over as such
    arrivals = _drain(feed, len(messages) + 1)
    feed.stop()  # the session file is complete once the child closed it
    (rejected,) = [a for a in arrivals if isinstance(a.item, ProtocolError)]  # the ranks' sockets interleave
    arrivals.remove(rejected)
    assert isinstance(rejected.item, ProtocolError) and rejected.item.category == "garbage" and rejected.prepared is None
    assert len(arrivals) == len(messages) and all(isinstance(a.item, Envelope) for a in arrivals)
    reports = [a for a in arrivals if isinstance(a.item, Envelope) and hasattr(a.item.message, "step")]
    summaries_and_reports = [a for a in reports if a.prepared is not None]  # figured in the child ...
    assert len(reports) == 24 and len(summaries_and_reports) == 16  # ... all but the spans sent after a summary
    assert sum(type(a.item.message).__name__ == "StepSummary" for a in reports) == 16  # 8 steps x 2 ranks

    handed_hellos = {rank: [a.item.message for a in arrivals if isinstance(a.item.message, Hello) and a.item.rank == rank]
                     for rank in (0, 1)}
    assert handed_hellos[0][0] is handed_hellos[0][1]  # went over as a SameHello: the very object again
    assert handed_hellos[1][0] is not handed_hellos[1][1] and handed_hellos[1][1].device_note == "changed"
    summaries = [a for a in reports if type(a.item.message).__name__ == "StepSummary"]
    assert all(a.item.message.all_reduce_seconds == b"" == a.item.message.algbw_gbps for a in summaries)  # figured only

    handed_over, in_one_process = Session(), Session()
    for arrival in arrivals:
        assert handed_over.ingest(arrival.item, arrival.at, arrival.prepared) is None  # type: ignore[arg-type]
    ingest(in_one_process, messages)
    assert in_one_process.details == handed_over.details == 8  # steps 2, 4, 6, 8 of both: spans after the summary
    assert sorted(handed_over.reports) == sorted(in_one_process.reports) == list(range(1, 9))
    for step in range(1, 9):
        assert handed_over.step_figures(step) == in_one_process.step_figures(step)
        assert handed_over.step_calls(step) == in_one_process.step_calls(step)
        assert handed_over.reports[step] == in_one_process.reports[step]
    recorded = sorted(data for _, data in read_session_file(tmp_path / "session.ddpwatch"))
    assert recorded == sorted([*messages, b"\xc1garbage"])  # the child recorded every message as it came


def test_process_feed_says_in_one_line_when_it_cannot_listen(tmp_path: Path) -> None:
    address = free_loopback_address()
    context = zmq.Context()
    taken = context.socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    taken.bind(address)
    try:
        with pytest.raises(OSError, match=f"cannot listen on {address}: Address already in use"):
            ProcessFeed(address, tmp_path / "session.ddpwatch")
    finally:
        context.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_ui_behind_holds_a_bounded_backlog_and_loses_nothing(listening: tuple[ProcessFeed, Ranks],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """While ``MAX_BACKLOG`` arrivals wait to be folded the feed stops reading: the child, then
    ZeroMQ, hold the rest, and all of it comes once the UI drains again."""
    from ddpwatch.dashboard import process_feed

    monkeypatch.setattr(process_feed, "MAX_BACKLOG", 10)
    feed, ranks = listening
    messages = session_messages(steps=20)  # 2 hellos, 40 reports, 40 device samples, 2 goodbyes
    ranks.send(messages)
    time.sleep(1.0)  # the UI folds nothing for a second
    assert len(feed._items) < 10 + process_feed.BATCH_MAX  # one batch past the bound at most
    arrivals = _drain(feed, len(messages))
    assert not [a.item for a in arrivals if isinstance(a.item, ProtocolError)]
    assert [(a.item.rank, a.item.seq) for a in arrivals if a.item.rank == 0] == [(0, seq) for seq in range(len(messages) // 2)]
    assert len(arrivals) == len(messages)


def test_a_receiver_process_that_dies_is_said_where_the_address_was(listening: tuple[ProcessFeed, Ranks]) -> None:
    feed, _ = listening
    assert feed.description.startswith("listening on tcp://127.0.0.1:")
    feed._process.kill()
    deadline = time.monotonic() + 10
    while "ended" not in feed.description and time.monotonic() < deadline:
        time.sleep(0.05)
    assert feed.description.startswith("the receiver process ended (exit code -9): nothing more is received;")


def test_a_summary_handed_over_is_never_figured_again_even_for_another_world() -> None:
    """Its packed floats went over only as the figures and calls prepared in the child; a rank's
    figures do not depend on the world size, so a session of another size takes them as they are."""
    job = KnownJob()
    job.declared_world = 4  # the child has heard of 4 ranks, the session below of 2
    summary = summarize(step_report(1, 3, "bucket"), 2)
    arrival = job.prepared(Arrival(0.0, Envelope(summary, 1, 0, 0)))
    assert arrival.prepared is not None and arrival.prepared.world_size == 4
    session = Session()
    session.ingest(Envelope(hello(1), 1, 0, 0))
    assert session.ingest(arrival.item, arrival.at, arrival.prepared) is None  # type: ignore[arg-type]
    assert session.step_figures(3)[1] == arrival.prepared.figures and len(session.step_calls(3)[1].seconds) > 0


@pytest.mark.timeout(60)
def test_two_runs_sending_at_once_are_told_apart_live_and_in_the_recording(tmp_path: Path) -> None:
    """Four DEALER sockets, two runs' ranks 0 and 1 each with its run in its routing id, sending
    to one listener at once: every arrival carries its run, the session folded from the arrivals
    holds the first run's reports alone, and the recording read back (``ddpwatch summary``, a
    replay) tells them apart the same way. Before, the second run's reports were mixed in or
    rejected as repeated steps, and a recording could not tell them apart at all."""
    from ddpwatch.record.recorder import load_session

    address = free_loopback_address()
    feed = ProcessFeed(address, tmp_path / "session.ddpwatch")
    feed.start()
    context = zmq.Context()
    try:
        first, second = Ranks(context, address), Ranks(context, address, session="second-session")
        ours = session_messages(steps=6)
        theirs = session_messages(steps=4, goodbye=False, hellos={rank: replace(hello(rank), session="second-session")
                                                                  for rank in (0, 1)})
        first.send(ours[:2])  # the hellos: the run on screen is the one heard first
        arrivals = _drain(feed, 2)
        steps, goodbyes = ours[2:-2], ours[-2:]
        assert len(theirs) <= len(steps)
        for index, data in enumerate(steps):  # then both at once, message for message
            first.send([data])
            second.send(theirs[index:index + 1])
        arrivals += _drain(feed, len(steps) + len(theirs))
        first.send(goodbyes)  # once every message of the other run is in: its run is over after them
        arrivals += _drain(feed, 2)
    finally:
        feed.stop()
        context.destroy(linger=0)
    assert {a.run for a in arrivals} == {"fixed-session", "second-session"}
    sent_by_second = sum(a.run == "second-session" for a in arrivals)
    live, alone = Session(), Session()
    for arrival in arrivals:
        live.ingest(arrival.item, arrival.at, arrival.prepared, arrival.run)  # type: ignore[arg-type]
    ingest(alone, ours)
    replayed = load_session(tmp_path / "session.ddpwatch")
    for session in (live, replayed):
        assert session.session_id == "fixed-session" and not session.rejected
        assert session.other_runs == {"second-session": sent_by_second} and sent_by_second > 0
        assert all(session.step_figures(step) == alone.step_figures(step) for step in range(1, 7))
