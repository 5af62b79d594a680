"""Stream a rank's telemetry to ddpwatch without ever slowing or stopping training.

The training thread only puts messages into a bounded queue (``put_nowait``); a daemon thread
owns the ZeroMQ socket (sockets are not thread-safe), encodes and sends with ``NOBLOCK``. A DEALER
socket with ``IMMEDIATE`` queues nothing while no dashboard is connected, a high-water mark bounds
what it queues when one is slow, and ``LINGER=0`` lets the process exit with messages unsent.
Whatever is discarded, at either place, is counted and reported in every later message.

The same socket carries control the other way: the dashboard's ROUTER addresses a rank by its
routing id, and the sender thread hands any command it receives to ``commands``, which the
training loop reads at an optimizer-step boundary.

What a step report costs the listener grows with the spans in it, so the sender thread sends a
step's full spans only where the listener asked for them (a ``SpanRequest``: every step, every
N-th step, or steps the user pinned, from the last ``HELD_STEPS`` kept here), and otherwise a
``StepSummary``: the step's figures, computed here by the same ``step_figures`` the dashboard
runs on full spans. Until a listener says otherwise, every step goes out in full.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .protocol import (
    ClientKeys,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    SpanRequest,
    StepReport,
    SwitchCommand,
    decode,
    encode,
)
from .step_figures import summarize

HEARTBEAT_EVERY_S = 1.0
HELLO_EVERY_S = 2.0  # a dashboard started late learns who the ranks are within this
HELD_STEPS = 64  # recent step reports kept, so a pinned step's spans can still be sent


class TelemetryPublisher:
    """Non-blocking sender of one rank's messages."""

    def __init__(
        self,
        address: str,
        hello: Hello,
        queue_size: int = 2048,
        high_water_mark: int = 1000,
        current_step: Callable[[], int] = lambda: 0,
        keys: ClientKeys | None = None,
    ) -> None:
        self.address = address
        self.hello = hello
        self.dropped = 0  # discarded while a dashboard was (or had been) connected: reported
        self.unsent_before_connect = 0  # nobody was listening yet: not a loss anyone saw
        self.sent = 0
        self._ever_connected = False
        self._seq = 0
        self._queue: queue.Queue[Message | None] = queue.Queue(maxsize=queue_size)
        self._current_step = current_step
        self._context = zmq.Context()
        self.commands: queue.Queue[SwitchCommand] = queue.Queue(maxsize=64)
        self.rejected_commands = 0
        self.span_request = SpanRequest(full=True)  # the listener's latest wish; set on the sender thread
        self.summaries_sent = 0
        self._held: deque[tuple[StepReport, list[bool]]] = deque(maxlen=HELD_STEPS)  # (report, [spans sent])
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.ROUTING_ID, routing_id(hello.session, hello.rank))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        for name, value in keys.socket_options() if keys else []:  # CURVE: a dashboard beyond loopback
            setattr(self._socket, name, value)
        # A (re)connected dashboard gets the hello at once instead of at the next repeat.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._socket.connect(address)
        self._thread = threading.Thread(target=self._run, name=f"ddpwatch-publisher-{hello.rank}", daemon=True)
        self._thread.start()

    def publish(self, message: Message) -> None:
        """Queue a message; never blocks, never raises."""
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.dropped += 1

    def close(self, steps: int, reason: str = "finished", timeout_s: float = 1.0) -> None:
        """Say goodbye, give the sender up to ``timeout_s`` to drain, then drop what is left."""
        self.publish(Goodbye(self.hello.rank, steps, reason))
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._socket.disable_monitor()
        self._context.destroy(linger=0)

    # -- the sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        next_heartbeat = next_hello = time.monotonic()
        while True:
            now = time.monotonic()
            if self._dashboard_connected():
                next_hello = now
            if now >= next_hello:
                self._send(self.hello)
                next_hello = now + HELLO_EVERY_S
            if now >= next_heartbeat:
                self._send(Heartbeat(self.hello.rank, time.time(), self._current_step()))
                next_heartbeat = now + HEARTBEAT_EVERY_S
            self._receive_commands()
            try:
                message = self._queue.get(timeout=max(0.0, min(next_heartbeat, next_hello, now + 0.05) - now))
            except queue.Empty:
                continue
            if message is None:
                return
            if isinstance(message, StepReport):
                self._send_step(message)
            else:
                self._send(message)

    def _receive_commands(self) -> None:
        while self._socket.poll(0, zmq.POLLIN):
            try:
                message = decode(self._socket.recv(zmq.NOBLOCK)).message
            except (ProtocolError, zmq.ZMQError):
                self.rejected_commands += 1
                continue
            if isinstance(message, SwitchCommand):
                try:
                    self.commands.put_nowait(message)
                except queue.Full:
                    self.rejected_commands += 1
            elif isinstance(message, SpanRequest):
                self.span_request = message
                self._send_pinned(set(message.pinned_steps))

    # -- spans or a summary ------------------------------------------------------------------------
    def wants_spans(self, step: int) -> bool:
        request = self.span_request
        return request.full or (request.sample_every > 0 and step % request.sample_every == 0)

    def _send_step(self, report: StepReport) -> None:
        """The report itself where its spans are wanted, else its summary (figured here, off the
        training thread); kept either way for a later pin."""
        sent = [self.wants_spans(report.step)]
        self._held.append((report, sent))
        if sent[0]:
            self._send(report)
            return
        try:
            summary = summarize(report, self.hello.world_size)
        except Exception:  # a report the figures cannot take: sent whole, the receiver judges it
            sent[0] = True
            self._send(report)
            return
        self._send(summary)
        self.summaries_sent += 1

    def _send_pinned(self, steps: set[int]) -> None:
        """The spans of pinned steps still held and not sent in full yet (a request is repeated
        every few seconds: each step's spans go out once)."""
        for report, sent in self._held:
            if report.step in steps and not sent[0]:
                sent[0] = True
                self._send(report)

    def _dashboard_connected(self) -> bool:
        connected = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            connected = connected or event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        self._ever_connected = self._ever_connected or connected
        return connected

    def _send(self, message: Message) -> None:
        try:
            data = encode(message, self._seq, self.dropped)
            self._seq += 1
            self._socket.send(data, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            if self._ever_connected:
                self.dropped += 1
            else:
                self.unsent_before_connect += 1
        except Exception:  # the context going away at exit, or a message that would not encode:
            self.dropped += 1  # counted, and the sender thread lives on


def routing_id(session: str, rank: int) -> bytes:
    """How the dashboard's ROUTER tells ranks apart (and finds rank 0 to send it commands)."""
    return f"rank-{rank}-{session}".encode()
