"""Telemetry end to end on loopback: the publisher never blocks and counts what it drops, the
receiver gets hello, reports and goodbye in order, and ingest logs every raw message."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpwatch.ingest.receiver import TelemetryReceiver, ingest
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionRecord, SessionWriter, read_session_file, read_session_records
from instrumented_ddp.publish import publisher as telemetry
from instrumented_ddp.wire.codec import Envelope, decode, encode
from instrumented_ddp.wire.messages import Goodbye, Heartbeat, Hello, Span, SpanRequest, StepReport, StepSummary
from instrumented_ddp.wire.step_figures import summarize
from instrumented_ddp.publish.publisher import TelemetryPublisher
from launch import wait_for

HELLO = Hello(
    rank=0, world_size=1, session="s-1", host="localhost", pid=1, device="cpu", backend="gloo",
    strategy="hook", settings={}, model_parameters=10,
)


def _report(step: int, rank: int = 0) -> StepReport:
    return StepReport(
        rank=rank, step=step, strategy="hook", settings={}, start=float(step), end=step + 0.5,
        spans=[Span("forward", float(step), step + 0.1), Span("all_reduce", step + 0.2, step + 0.3, True, 16, "p0", "float32")],
        samples=4, tokens=32, loss=1.0 / step,
    )


def _free_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.timeout(60)
def test_publishing_with_nobody_listening_never_blocks_and_counts_the_drops() -> None:
    publisher = TelemetryPublisher(_free_address(), HELLO)
    try:
        for step in range(20_000):
            publisher.publish(Heartbeat(0, float(step), step))
    finally:
        publisher.close(steps=0)
    # every message is accounted for: nothing could be sent, and no dashboard ever saw a loss
    assert publisher.unsent_before_connect + publisher.dropped >= 20_000
    assert publisher.sent == 0


@pytest.mark.timeout(60)
def test_close_returns_when_the_sender_queue_is_full() -> None:
    publisher = TelemetryPublisher(_free_address(), HELLO, queue_size=4)
    for step in range(100):
        publisher.publish(Heartbeat(0, float(step), step))
    publisher.close(steps=0, timeout_s=0.2)
    assert publisher.dropped > 0  # the full queue: counted as dropped


class Collector:
    """Decodes what a receiver gets, in arrival order."""

    def __init__(self, receiver: TelemetryReceiver) -> None:
        self.receiver = receiver
        self.envelopes: list[Envelope] = []
        self.peers: set[bytes] = set()

    def until(self, condition: Callable[[list[Envelope]], bool], seconds: float = 10.0) -> bool:
        deadline = time.monotonic() + seconds
        while not condition(self.envelopes) and time.monotonic() < deadline:
            for peer, data in self.receiver.receive(50):
                self.peers.add(peer)
                self.envelopes.append(decode(data))
        return condition(self.envelopes)


@pytest.fixture
def quiet_publisher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No periodic hello or heartbeat during the test: any hello must come from the connection."""
    monkeypatch.setattr(telemetry, "HELLO_EVERY_S", 3600.0)
    monkeypatch.setattr(telemetry, "HEARTBEAT_EVERY_S", 3600.0)


@pytest.mark.timeout(60)
def test_receiver_gets_hello_on_connection_reports_in_order_and_goodbye(quiet_publisher: None) -> None:
    address = _free_address()
    publisher = TelemetryPublisher(address, HELLO)
    receiver: TelemetryReceiver | None = None
    closed = False
    try:
        # The first hello and heartbeat go out while nobody listens: unsent, not a reported loss.
        assert wait_for(lambda: publisher.unsent_before_connect >= 2)
        receiver = TelemetryReceiver(address)
        collector = Collector(receiver)
        assert collector.until(lambda got: any(isinstance(e.message, Hello) for e in got))
        assert collector.envelopes[0].message == HELLO

        for step in range(1, 6):
            publisher.publish(_report(step))
        assert collector.until(lambda got: sum(isinstance(e.message, StepReport) for e in got) >= 5)
        publisher.close(steps=5)
        closed = True
        assert collector.until(lambda got: any(isinstance(e.message, Goodbye) for e in got))
    finally:
        if not closed:
            publisher.close(steps=0, timeout_s=0.2)
        if receiver is not None:
            receiver.close()

    envelopes = collector.envelopes
    steps = [e.message for e in envelopes if isinstance(e.message, StepReport)]
    assert steps == [_report(step) for step in range(1, 6)]
    assert envelopes[-1].message == Goodbye(0, 5, "finished")
    seqs = [e.seq for e in envelopes]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: nothing lost on the way
    assert seqs[0] >= 2  # the two unsent messages used up their numbers
    assert all(e.rank == 0 for e in envelopes)
    assert collector.peers == {telemetry.routing_id(HELLO.session, HELLO.rank)}
    assert all(e.dropped == publisher.dropped == 0 for e in envelopes)
    assert publisher.unsent_before_connect == 2


@pytest.mark.timeout(60)
def test_a_run_that_ends_at_once_is_heard_saying_who_it_was_and_how_it_ended(quiet_publisher: None) -> None:
    """Closed before a listening dashboard's handshake (a loop refused, or raising, at its first
    step: an attached Lightning loop detached 20 ms after attaching), the hello and the goodbye
    went unsent, and the rank read *lost*. The sender waits for the handshake within
    ``CONNECT_GRACE_S`` of its start: hello, then goodbye, and nothing after it."""
    address = _free_address()
    receiver = TelemetryReceiver(address)
    try:
        publisher = TelemetryPublisher(address, HELLO)
        publisher.close(steps=0, reason="failed: RuntimeError: boom")
        collector = Collector(receiver)
        assert collector.until(lambda got: any(isinstance(e.message, Goodbye) for e in got))
        time.sleep(0.2)
        collector.until(lambda got: False, seconds=0.1)  # anything more that came
    finally:
        receiver.close()
    # A heartbeat may come anywhere before the goodbye, the first one too: the sender's first hello
    # can find the pipe not yet attached, and the heartbeat after it not (a session takes a
    # heartbeat from a rank it has no hello from yet).
    messages = [e.message for e in collector.envelopes if not isinstance(e.message, Heartbeat)]
    assert messages == [HELLO, Goodbye(0, 0, "failed: RuntimeError: boom")]
    assert isinstance(collector.envelopes[-1].message, Goodbye)
    assert publisher.dropped == 0  # what went unsent went before the handshake, as the first hello and heartbeat can


@pytest.mark.timeout(60)
def test_a_hello_that_went_out_before_its_handshake_was_read_is_not_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's first hello can go out on a pipe whose handshake event it has not read yet
    (seen once in a suite run: the run that ends at once sent two hellos before its goodbye). Held
    back here until the hello has gone out, that event is the connection the hello went out on:
    the goodbye follows the one hello."""
    real_look = TelemetryPublisher._dashboard_newly_connected

    def look_once_the_hello_went_out(self: TelemetryPublisher) -> bool:
        return real_look(self) if self.sent else False

    monkeypatch.setattr(TelemetryPublisher, "_dashboard_newly_connected", look_once_the_hello_went_out)
    # Unseen, the handshake does not hurry the hello: it goes out at the first repeat its pipe is
    # there for, and the run closes well before the next one.
    monkeypatch.setattr(telemetry, "HELLO_EVERY_S", 0.5)
    monkeypatch.setattr(telemetry, "HEARTBEAT_EVERY_S", 3600.0)
    monkeypatch.setattr(telemetry, "CONNECT_GRACE_S", 0.0)  # the goodbye's wait for a handshake, not needed: the hello went out
    address = _free_address()
    receiver = TelemetryReceiver(address)
    try:
        publisher = TelemetryPublisher(address, HELLO)
        collector = Collector(receiver)
        assert collector.until(lambda got: any(isinstance(e.message, Hello) for e in got))
        time.sleep(0.1)  # the handshake event is surely in the monitor by now, unread
        publisher.close(steps=0, reason="failed: RuntimeError: boom")
        assert collector.until(lambda got: any(isinstance(e.message, Goodbye) for e in got))
        collector.until(lambda got: False, seconds=0.2)  # anything more that came
    finally:
        receiver.close()
    messages = [e.message for e in collector.envelopes if not isinstance(e.message, Heartbeat)]
    assert messages == [HELLO, Goodbye(0, 0, "failed: RuntimeError: boom")]


@pytest.mark.timeout(60)
def test_the_publisher_knows_whether_a_dashboard_is_connected_now(quiet_publisher: None) -> None:
    """``connected`` (what ``Watch`` spaces its agreements by) follows the connection: off with
    nobody listening, on once a dashboard's handshake is done, off again when it goes away."""
    address = _free_address()
    publisher = TelemetryPublisher(address, HELLO)
    receiver: TelemetryReceiver | None = None
    try:
        time.sleep(0.2)  # a few turns of the sender thread with nobody listening
        assert not publisher.connected
        receiver = TelemetryReceiver(address)
        assert Collector(receiver).until(lambda got: any(isinstance(e.message, Hello) for e in got))
        assert wait_for(lambda: publisher.connected)
        receiver.close()
        receiver = None
        assert wait_for(lambda: not publisher.connected)
    finally:
        publisher.close(steps=0, timeout_s=0.2)
        if receiver is not None:
            receiver.close()


@pytest.mark.timeout(60)
def test_a_report_published_while_no_dashboard_is_connected_is_numbered_counted_and_never_encoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It could not be sent (``IMMEDIATE``): the sender numbers and counts it without encoding it
    (nor, for a step report, summarizing it)."""
    encoded: list[type] = []
    def counted_encode(message: Any, *args: Any) -> bytes:
        encoded.append(type(message))
        return encode(message, *args)

    monkeypatch.setattr(telemetry, "encode", counted_encode)
    publisher = TelemetryPublisher(_free_address(), HELLO)
    try:
        for step in range(1, 4):
            publisher.publish(_report(step))
        assert wait_for(lambda: publisher.unsent_before_connect >= 3)
        time.sleep(0.3)  # several more turns of the sender thread
        assert StepReport not in encoded and publisher.dropped == 0
    finally:
        publisher.close(steps=3, timeout_s=0.2)


@pytest.mark.timeout(60)
def test_a_rank_sends_the_spans_asked_for_and_summaries_of_the_rest(quiet_publisher: None) -> None:
    address = _free_address()
    receiver = TelemetryReceiver(address)
    publisher = TelemetryPublisher(address, HELLO)
    rates: list[float] = []
    publisher.on_device_rate = rates.append  # the rank's sampler, in Watch
    collector = Collector(receiver)

    def steps_got(kind: type) -> list[int]:
        return [e.message.step for e in collector.envelopes if isinstance(e.message, kind)]

    try:
        assert collector.until(lambda got: any(isinstance(e.message, Hello) for e in got))
        publisher.publish(_report(1))  # nobody asked yet: spans
        assert collector.until(lambda got: steps_got(StepReport) == [1])
        peer = telemetry.routing_id(HELLO.session, HELLO.rank)
        receiver.send(peer, encode(SpanRequest(full=False, sample_every=3, device_every_s=1.0)))
        assert wait_for(lambda: not publisher.spans.request.full)
        assert wait_for(lambda: rates == [1.0])
        for step in range(2, 8):
            publisher.publish(_report(step))
        # every step summarized; a sampled step's spans follow its summary
        assert collector.until(lambda got: len(steps_got(StepSummary)) == 6 and steps_got(StepReport) == [1, 3, 6])
        assert steps_got(StepSummary) == [2, 3, 4, 5, 6, 7]
        summary = next(e.message for e in collector.envelopes if isinstance(e.message, StepSummary))
        assert summary == summarize(_report(2), HELLO.world_size)
        for _ in range(2):  # a pin repeated: each step's spans go out once
            receiver.send(peer, encode(SpanRequest(full=False, sample_every=3, pinned_steps=[4, 6, 99])))
        assert collector.until(lambda got: steps_got(StepReport) == [1, 3, 6, 4])
        assert not collector.until(lambda got: len(steps_got(StepReport)) > 4, seconds=0.5)
        assert publisher.spans.summaries == 6
    finally:
        publisher.close(steps=0, timeout_s=0.2)
        receiver.close()


def test_close_with_a_backlog_it_cannot_send_in_time_drops_the_rest_and_still_says_goodbye(
        quiet_publisher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand reports queued, each taking 5 ms to send (a summary of a large step takes ~3):
    the goodbye, queued behind them, never went out (the rank read *lost*), and the context was
    destroyed under the sender, whose thread died printing a traceback."""
    address = _free_address()
    receiver = TelemetryReceiver(address)
    publisher = TelemetryPublisher(address, HELLO)
    collector = Collector(receiver)
    died: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    slow = publisher.spans.messages_for
    def slowed(report: StepReport) -> Any:
        time.sleep(0.005)
        return slow(report)

    monkeypatch.setattr(publisher.spans, "messages_for", slowed)
    try:
        assert collector.until(lambda got: any(isinstance(e.message, Hello) for e in got))
        for step in range(1, 1001):
            publisher.publish(_report(step))
        publisher.close(steps=1000, timeout_s=1.0)
        assert not publisher._thread.is_alive() and died == []
        assert collector.until(lambda got: any(isinstance(e.message, Goodbye) for e in got))
        (goodbye,) = [e for e in collector.envelopes if isinstance(e.message, Goodbye)]
        sent = [e.message.step for e in collector.envelopes if isinstance(e.message, StepReport)]
        assert len(sent) < 1000 and goodbye.dropped == 1000 - len(sent)  # the rest dropped, and said so
    finally:
        receiver.close()


def test_receiver_on_a_busy_address_raises_oserror() -> None:
    address = _free_address()
    first = TelemetryReceiver(address)
    try:
        with pytest.raises(OSError, match="cannot listen"):
            TelemetryReceiver(address)
    finally:
        first.close()


def test_receive_returns_nothing_when_nothing_arrives() -> None:
    receiver = TelemetryReceiver(_free_address())
    try:
        assert receiver.receive(10) == []
    finally:
        receiver.close()


# -- ingest and the session file -------------------------------------------------------------------


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[SessionWriter]:
    writer = SessionWriter(tmp_path / "run" / SESSION_FILE_NAME)
    try:
        yield writer
    finally:
        if not writer._file.closed:
            writer.close()


def _mixed_messages() -> list[bytes]:
    return [
        encode(HELLO, seq=0),
        encode(_report(1), seq=1),
        b"\xc1not msgpack",
        encode(_report(2), seq=2)[:-3],
        encode(_report(3), seq=3),
        b"\x93\x01\x02\x03",  # a list, not a map
        encode(Goodbye(0, 3), seq=4),
    ]


def test_ingest_folds_valid_messages_and_counts_rejections_by_category(writer: SessionWriter) -> None:
    session = Session()
    rejections: list[str] = []
    raw = _mixed_messages()
    accepted = ingest(session, raw, writer=writer, on_reject=rejections.append)

    assert [e.message for e in accepted] == [HELLO, _report(1), _report(3), Goodbye(0, 3)]

    assert session.rejected == Counter({"garbage": 2, "truncated": 1})
    assert len(rejections) == 3 and all(isinstance(r, str) and r for r in rejections)
    assert session.messages == 4
    assert session.ranks[0].hello == HELLO
    assert session.reports[1][0] == _report(1) and session.reports[3][0] == _report(3)
    assert 2 not in session.reports
    assert session.ranks[0].lost_messages == 1  # seq 2 never made it in
    assert session.finished
    assert writer.records == len(raw)  # every raw message logged, rejected ones included


def test_ingest_rejects_oversized_messages_by_the_receiver_cap(writer: SessionWriter) -> None:
    session = Session()
    data = encode(_report(1))
    ingest(session, [data], writer=writer, max_message_bytes=len(data) - 1)
    assert session.rejected == Counter({"oversized": 1})
    assert session.reports == {}


def test_session_file_returns_every_raw_message_in_arrival_order(writer: SessionWriter) -> None:
    raw = _mixed_messages()
    before = time.time()
    ingest(Session(), raw, writer=writer)
    ingest(Session(), [encode(_report(9))], writer=writer)
    writer.close()
    records = list(read_session_file(writer.path))
    assert [data for _, data in records] == [*raw, encode(_report(9))]
    times = [received for received, _ in records]
    assert times == sorted(times) and all(t >= before - 1 for t in times)


@pytest.mark.parametrize("cut", [3, 12, 20], ids=["inside-header", "header-only", "inside-body"])
def test_session_file_stops_cleanly_at_a_cut_short_last_record(writer: SessionWriter, cut: int) -> None:
    raw = _mixed_messages()
    for data in raw:
        writer.append(data, 1.0)
    writer.append(encode(_report(4)), 2.0)
    writer.close()
    whole = writer.path.read_bytes()
    last_record = 12 + len(encode(_report(4)))
    writer.path.write_bytes(whole[: len(whole) - last_record + cut])  # a crash mid-write

    assert [data for _, data in read_session_file(writer.path)] == raw


def test_session_file_keeps_the_run_that_sent_each_message_beside_records_that_have_none(writer: SessionWriter) -> None:
    """A record without a run is written as before this field existed (an older file reads the same)."""
    writer.append(b"from run A", 1.0, "20261126-142929-929556")
    writer.append(b"from no rank", 2.0)
    writer.append(b"from run B", 3.0, "second")
    writer.close()
    assert list(read_session_records(writer.path)) == [SessionRecord(1.0, b"from run A", "20261126-142929-929556"),
                                                       SessionRecord(2.0, b"from no rank", ""), SessionRecord(3.0, b"from run B", "second")]
    assert writer.path.read_bytes()[12 + 1 + 22 + 10:][:12] == struct.pack("<dI", 2.0, len(b"from no rank"))  # the old record
    assert [data for _, data in read_session_file(writer.path)] == [b"from run A", b"from no rank", b"from run B"]


@pytest.mark.parametrize("cut", [12, 15, 20], ids=["before-the-run-id", "inside-the-run-id", "inside-body"])
def test_session_file_stops_cleanly_inside_a_last_record_that_names_its_run(writer: SessionWriter, cut: int) -> None:
    writer.append(b"whole", 1.0, "run-a")
    writer.append(b"cut short", 2.0, "run-b")  # 12 header + 1 + 5 run id + 9 bytes
    writer.close()
    whole = writer.path.read_bytes()
    writer.path.write_bytes(whole[: len(whole) - (12 + 1 + 5 + 9) + cut])
    assert list(read_session_records(writer.path)) == [SessionRecord(1.0, b"whole", "run-a")]


def test_session_writer_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / SESSION_FILE_NAME
    for payload in (b"first", b"second"):
        session_writer = SessionWriter(path)
        session_writer.append(payload, 1.0)
        session_writer.close()
    assert [data for _, data in read_session_file(path)] == [b"first", b"second"]


def test_empty_session_file_reads_as_no_records(tmp_path: Path) -> None:
    path = tmp_path / SESSION_FILE_NAME
    path.write_bytes(b"")
    assert list(read_session_file(path)) == []



@pytest.mark.timeout(60)
def test_heartbeats_say_what_the_loop_pauses_training_for_while_it_does() -> None:
    """The watch's ``pausing`` (an evaluation under way), read at each heartbeat."""
    address = _free_address()
    pausing = ["evaluate"]
    receiver = TelemetryReceiver(address)
    publisher = TelemetryPublisher(address, HELLO, current_pause=lambda: pausing[0])
    try:
        collector = Collector(receiver)

        def heartbeats(envelopes: list[Envelope]) -> list[str]:
            return [e.message.pausing for e in envelopes if isinstance(e.message, Heartbeat)]

        assert collector.until(lambda envelopes: "evaluate" in heartbeats(envelopes))
        pausing[0] = ""
        assert collector.until(lambda envelopes: heartbeats(envelopes)[-1] == "")
    finally:
        publisher.close(steps=0)
        receiver.close()
