"""Stream a rank's telemetry to ddpwatch without ever slowing or stopping training.

The training thread only puts messages into a bounded queue (``put_nowait``); a daemon thread
owns the ZeroMQ socket (sockets are not thread-safe), encodes and sends with ``NOBLOCK``. A PUSH
socket with ``IMMEDIATE`` queues nothing while no dashboard is connected, a high-water mark bounds
what it queues when one is slow, and ``LINGER=0`` lets the process exit with messages unsent.
Whatever is discarded, at either place, is counted and reported in every later message.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .protocol import Goodbye, Heartbeat, Hello, Message, encode

HEARTBEAT_EVERY_S = 1.0
HELLO_EVERY_S = 2.0  # a dashboard started late learns who the ranks are within this


class TelemetryPublisher:
    """Non-blocking sender of one rank's messages."""

    def __init__(
        self,
        address: str,
        hello: Hello,
        queue_size: int = 2048,
        high_water_mark: int = 1000,
        current_step: Callable[[], int] = lambda: 0,
    ) -> None:
        self.address = address
        self.hello = hello
        self.dropped = 0
        self.sent = 0
        self._seq = 0
        self._queue: queue.Queue[Message | None] = queue.Queue(maxsize=queue_size)
        self._current_step = current_step
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
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
            try:
                message = self._queue.get(timeout=max(0.0, min(next_heartbeat, next_hello, now + 0.1) - now))
            except queue.Empty:
                continue
            if message is None:
                return
            self._send(message)

    def _dashboard_connected(self) -> bool:
        connected = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            connected = connected or event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return connected

    def _send(self, message: Message) -> None:
        try:
            data = encode(message, self._seq, self.dropped)
            self._seq += 1
            self._socket.send(data, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1
        except zmq.ZMQError:  # the context is going away at exit
            self.dropped += 1
