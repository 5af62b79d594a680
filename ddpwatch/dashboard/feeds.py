"""Where the dashboard's messages come from: a live socket, a recorded session, or a fixed list.

A feed runs off the UI thread and only queues what it got; the app drains the queue on its
frame timer, so a flood of messages costs one drain per frame, never one redraw per message.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

from instrumented_ddp.wire.codec import DEFAULT_MAX_MESSAGE_BYTES, Envelope, ProtocolError
from instrumented_ddp.wire.messages import SwitchCommand
from instrumented_ddp.wire.endpoints import run_of_sender

from instrumented_ddp.wire.curve_keys import ServerKeys
from ddpwatch.control.relay import SwitchRelay
from ddpwatch.ingest.receiver import TelemetryReceiver, log_and_decode
from ddpwatch.ingest.step_store import PreparedReport
from ddpwatch.ingest.session_file import SessionWriter, read_session_records
from ddpwatch.control.span_requests import SpanRequester, SpanWish

Item = Envelope | ProtocolError


class Arrival(NamedTuple):
    """An item and when it arrived (``time.monotonic()`` on the feed's thread or process: one
    clock across processes). A rank is lost after a silence measured from arrivals, not from when
    the UI got round to folding them in (a frame late, or a long garbage collection later).
    ``prepared``: a step report's figures, where the feed figured them (``ProcessFeed``). ``run``:
    the run whose rank sent it (``endpoints.run_of_sender``), where a listener or a recording knows."""

    at: float
    item: Item
    prepared: PreparedReport | None = None
    run: str = ""


class Feed:
    """Queues decoded envelopes (or the errors of rejected messages) for the app to drain."""

    can_switch = False
    #: Nothing more will come (a replay at the end of its file): the header says "ended", not "live".
    ended = False

    def __init__(self) -> None:
        self._items: deque[Arrival] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.description = ""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"ddpwatch-{type(self).__name__}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def drain(self) -> list[Arrival]:
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def _arrived(self, item: Item) -> None:
        self._items.append(Arrival(time.monotonic(), item))

    def heard_clock(self) -> float:
        """Now, on the clock the arrivals are stamped with: a rank silent on it past
        ``LOST_AFTER_S`` is lost (``SnapshotBuilder.build``'s ``heard_now``)."""
        return time.monotonic()

    def request_switch(self, command: SwitchCommand) -> None:
        raise RuntimeError("this feed cannot switch strategies")

    def want_spans(self, wish: SpanWish) -> None:
        """What the app wants of the ranks' spans; only a live feed can ask the ranks."""

    def _run(self) -> None:
        raise NotImplementedError


class Listener:
    """The socket side of a live feed, for whichever thread or process owns it: binds at once
    (an error reaches the caller), records every message to the session file as it comes (the
    file is opened by the first ``receive``), decodes it, and relays switch commands and span
    requests. ``LiveFeed`` runs it on a thread, ``ProcessFeed`` in a child process."""

    def __init__(self, address: str, session_file: Path, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keys: ServerKeys | None = None) -> None:
        self.receiver = TelemetryReceiver(address, max_message_bytes, keys)
        self.max_message_bytes = max_message_bytes
        self.relay = SwitchRelay(self.receiver.send)
        self.requester = SpanRequester(self.receiver.send)
        self._session_file = session_file
        self._writer: SessionWriter | None = None

    def receive(self, timeout_ms: int, limit: int = 10_000) -> list[Arrival]:
        """What came within ``timeout_ms`` (up to ``limit`` messages), recorded and decoded, and a
        rejection for each handshake refused; a request from ``ddpwatch switch`` is relayed, not
        returned."""
        if self._writer is None:
            self._writer = SessionWriter(self._session_file)
        arrivals: list[Arrival] = []
        for peer, data in self.receiver.receive(timeout_ms, limit):
            arrived_at = time.monotonic()
            run = run_of_sender(peer)
            item = log_and_decode(data, self._writer, self.max_message_bytes, run)
            if isinstance(item, Envelope):
                self.relay.note(peer, item)
                self.requester.note(peer, item)
                if isinstance(item.message, SwitchCommand):
                    continue
            arrivals.append(Arrival(arrived_at, item, run=run))
        for _ in range(self.receiver.take_refused_handshakes()):
            arrivals.append(Arrival(time.monotonic(), ProtocolError("unauthenticated", "a peer without the CURVE key was refused")))
        return arrivals

    def tick(self) -> None:
        """Resend what is due (switch commands until acknowledged, span requests) and flush the file."""
        self.relay.tick()
        self.requester.tick()
        if self._writer is not None:
            self._writer.flush_if_due()

    def close(self) -> None:
        self.relay.stop(self.receiver.last_arrivals(), "the dashboard closed before rank 0 acknowledged it: nothing relays it now")
        if self._writer is not None:
            self._writer.close()
        self.receiver.close()


class LiveFeed(Feed):
    """A ``Listener`` on the feed's thread, in the UI's process (``ProcessFeed`` is what
    ``ddpwatch`` runs; the load bench compares the two)."""

    can_switch = True

    def __init__(self, address: str, session_file: Path, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keys: ServerKeys | None = None) -> None:
        super().__init__()
        self.listener = Listener(address, session_file, max_message_bytes, keys)  # binds now: errors reach the caller
        self.session_file = session_file
        self._outbox: queue.Queue[SwitchCommand] = queue.Queue()
        self.description = f"listening on {address}{' (CURVE)' if keys else ''} · recording {session_file}"

    def request_switch(self, command: SwitchCommand) -> None:
        self._outbox.put(command)

    def want_spans(self, wish: SpanWish) -> None:
        self.listener.requester.want(wish)  # one attribute, read by the feed thread at its next tick

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._items.extend(self.listener.receive(timeout_ms=50))
                while not self._outbox.empty():
                    self.listener.relay.request(self._outbox.get_nowait())
                self.listener.tick()
        finally:
            self.listener.close()


class ReplayFeed(Feed):
    """Plays a session file back at its recorded pace times ``speed`` (0 = as fast as possible).

    Each message is stamped with the time it was recorded, and ``heard_clock`` runs on that
    clock, at ``speed``, from the last message played: a rank is lost in the replay where it
    was silent in the recording, at any speed, and the end of the file stops the clock, so a
    replay's ranks do not read "lost" once it has ended (they only stopped being recorded)."""

    def __init__(self, path: Path, speed: float = 1.0) -> None:
        super().__init__()
        self.path = path
        self.speed = speed
        self.description = f"replaying {path}"
        self._played: tuple[float, float] | None = None  # (recorded time, monotonic time) of the last message played

    def heard_clock(self) -> float:
        played = self._played
        if played is None:
            return 0.0  # nothing heard: no rank to judge
        recorded, at = played
        return recorded if self.ended else recorded + (time.monotonic() - at) * self.speed

    def _run(self) -> None:
        previous: float | None = None
        for received_at, data, run in read_session_records(self.path):
            if self._stop.is_set():
                return
            if previous is not None and self.speed > 0:
                delay = (received_at - previous) / self.speed
                while delay > 0 and not self._stop.is_set():  # re-read speed while waiting
                    time.sleep(min(delay, 0.05))
                    delay -= 0.05
            previous = received_at
            self._played = (received_at, time.monotonic())
            self._items.append(Arrival(received_at, log_and_decode(data), run=run))
        self.description = f"replayed {self.path} to its end"
        self.ended = True


class StaticFeed(Feed):
    """A fixed list of messages, delivered at once (tests, snapshots), standing for a live run:
    it offers the switch keys, and a switch asked for goes to ``request_switch``, which does
    nothing until a test puts its own there."""

    can_switch = True

    def __init__(self, messages: list[bytes]) -> None:
        super().__init__()
        self._messages = messages
        self.description = "fixed data"

    def _run(self) -> None:
        for data in self._messages:
            self._arrived(log_and_decode(data))
