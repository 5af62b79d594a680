"""The listening side of the wire: bind, receive, decode, count what is rejected.

Both the headless recorder and the dashboard use it; it binds loopback by default, so nobody
else on the network can talk to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import zmq
from zmq.utils.monitor import recv_monitor_message

from instrumented_ddp.wire.codec import DEFAULT_MAX_MESSAGE_BYTES, Envelope, ProtocolError, decode
from instrumented_ddp.wire.endpoints import address_problem, is_loopback

from instrumented_ddp.wire.curve_keys import ServerKeys
from ddpwatch.ingest.curve_server import secure_server
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.session_file import SessionWriter

#: How long the last answers get to go out as the listener closes (see ``TelemetryReceiver.close``).
CLOSE_LINGER_MS = 200
#: How long a listener that stops waits for what is on its way (``TelemetryReceiver.last_arrivals``).
LAST_ARRIVALS_WAIT_MS = 50


class TelemetryReceiver:
    """A ROUTER socket bound at ``address``; every rank's DEALER (and ``ddpwatch switch``) connects
    to it. Messages come with the sender's routing id, so commands can go back to rank 0 and
    acknowledgements back to whoever asked. Used from one thread only."""

    def __init__(self, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keys: ServerKeys | None = None) -> None:
        if (problem := address_problem(address)) is not None:
            raise OSError(f"cannot listen on {address}: {problem}")
        if keys is None and not is_loopback(address):
            raise OSError(f"listening on {address} (not loopback) needs authentication: pass --keys DIR (ZeroMQ CURVE)")
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.unauthenticated = 0  # handshakes refused: senders or controllers without the key
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._authenticator = secure_server(self._context, self._socket, keys) if keys else None
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        # Messages over the cap are cut by ZeroMQ itself, before they take memory.
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 1024)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as error:
            self.close()
            raise OSError(f"cannot listen on {address}: {error}") from None

    def take_refused_handshakes(self) -> int:
        """Handshakes refused since the last call (each a peer without the CURVE key)."""
        refused = 0
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            refused += 1
        self.unauthenticated += refused
        return refused

    def receive(self, timeout_ms: int, limit: int = 10_000) -> list[tuple[bytes, bytes]]:
        """(sender id, message) for whatever arrived within ``timeout_ms`` (up to ``limit``)."""
        if not self._socket.poll(timeout_ms):
            return []
        batch: list[tuple[bytes, bytes]] = []
        while len(batch) < limit:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 2:
                batch.append((frames[0], frames[1]))
            else:  # a raw peer that did not frame its message as a DEALER does
                batch.append((frames[0], b"".join(frames[1:])))
        return batch

    def send(self, peer: bytes, data: bytes) -> bool:
        """To one peer; False when it is gone or its queue is full (never blocks)."""
        try:
            self._socket.send_multipart([peer, data], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def last_arrivals(self, wait_ms: int = LAST_ARRIVALS_WAIT_MS) -> list[tuple[bytes, bytes]]:
        """Stop taking connections, then what arrived unread (waiting up to ``wait_ms`` for what
        is on its way): what a relay that stops answers (``SwitchRelay.stop``). Still bound, the
        socket took a ``ddpwatch switch``'s connection after the last read, and the asker waited
        out its timeout."""
        try:
            self._socket.unbind(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError:
            pass
        return self.receive(wait_ms)

    def close(self) -> None:
        """Answers sent last (a relay's refusals as it stops) get ``CLOSE_LINGER_MS`` to go out:
        destroyed at once, a ``ddpwatch switch`` that asked as the recorder stopped heard nothing
        and waited out its timeout. A message to a peer that is gone is dropped at once, so only
        a live peer's answer is waited for."""
        self._socket.close(linger=CLOSE_LINGER_MS)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.destroy(linger=0)


def log_and_decode(data: bytes, writer: SessionWriter | None = None,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, run: str = "") -> Envelope | ProtocolError:
    """Append the raw message to the session file (rejected ones too), with the run that sent it
    where known, then decode it."""
    if writer is not None:
        writer.append(data, time.time(), run)
    try:
        return decode(data, max_message_bytes)
    except ProtocolError as error:
        return error


def ingest(
    session: Session,
    raw_messages: Iterable[bytes],
    writer: SessionWriter | None = None,
    on_reject: Callable[[str], None] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    run: str = "",
) -> list[Envelope]:
    """Log every message as it came, then fold the valid ones into ``session`` (and return them).
    ``run``: the run whose rank sent them, where the listener knows it (``endpoints.run_of_sender``)."""
    accepted: list[Envelope] = []
    for data in raw_messages:
        envelope = log_and_decode(data, writer, max_message_bytes, run)
        if isinstance(envelope, ProtocolError):
            session.reject(envelope.category)
            if on_reject is not None:
                on_reject(str(envelope))
            continue
        problem = session.ingest(envelope, run=run)
        if problem is None:
            accepted.append(envelope)
        elif on_reject is not None:
            on_reject(problem)
    return accepted
