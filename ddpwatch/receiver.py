"""The listening side of the wire: bind, receive, decode, count what is rejected.

Both the headless recorder and the dashboard use it; it binds loopback by default, so nobody
else on the network can talk to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from instrumented_ddp.protocol import DEFAULT_MAX_MESSAGE_BYTES, ProtocolError, decode

from .session import Session
from .session_file import SessionWriter


class TelemetryReceiver:
    """A PULL socket bound at ``address``; every rank's PUSH connects to it."""

    def __init__(self, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        # Messages over the cap are cut by ZeroMQ itself, before they take memory.
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 1024)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            raise OSError(f"cannot listen on {address}: {error}") from None

    def receive(self, timeout_ms: int, limit: int = 10_000) -> list[bytes]:
        """Whatever arrived within ``timeout_ms`` (up to ``limit`` messages)."""
        if not self._socket.poll(timeout_ms):
            return []
        batch: list[bytes] = []
        while len(batch) < limit:
            try:
                batch.append(self._socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        return batch

    def close(self) -> None:
        self._context.destroy(linger=0)


def ingest(
    session: Session,
    raw_messages: list[bytes],
    writer: SessionWriter | None = None,
    on_reject: Callable[[str], None] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> None:
    """Log every message as it came, then fold the valid ones into ``session``."""
    now = time.time()
    for data in raw_messages:
        if writer is not None:
            writer.append(data, now)
        try:
            envelope = decode(data, max_message_bytes)
        except ProtocolError as error:
            session.reject(error.category)
            if on_reject is not None:
                on_reject(str(error))
            continue
        session.ingest(envelope)
