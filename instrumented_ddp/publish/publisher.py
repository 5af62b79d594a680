"""Stream a rank's telemetry to ddpwatch without ever slowing or stopping training.

The training thread only puts messages into a bounded queue (``put_nowait``); a daemon thread
owns the ZeroMQ socket (sockets are not thread-safe), encodes and sends with ``NOBLOCK``. A DEALER
socket with ``IMMEDIATE`` queues nothing while no dashboard is connected, a high-water mark bounds
what it queues when one is slow, and ``LINGER=0`` lets the process exit with messages unsent.
While none is connected the sender does not even encode what it takes from the queue: it numbers
and counts it as unsent, as a send would have.
Whatever is discarded, at either place, is counted and reported in every later message.

The same socket carries control the other way: the dashboard's ROUTER addresses a rank by its
routing id, and the sender thread hands any command it receives to ``commands``, which the
training loop reads at an optimizer-step boundary.

Each step report goes out as its full spans or as a summary, as the listener asked
(``span_policy``); the summary is figured on the sender thread, never on the training thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from instrumented_ddp.wire.codec import ProtocolError, decode, encode
from instrumented_ddp.wire.messages import Goodbye, Heartbeat, Hello, Message, SpanRequest, StepReport, SwitchCommand
from instrumented_ddp.wire.endpoints import routing_id
from instrumented_ddp.wire.curve_keys import ClientKeys
from instrumented_ddp.wire.stall_probe import StallProbe
from instrumented_ddp.publish.span_policy import SpanPolicy

HEARTBEAT_EVERY_S = 1.0
HELLO_EVERY_S = 2.0  # a dashboard started late learns who the ranks are within this
#: A run that ends this soon after it began waits this long at most, from its start, for a
#: listening dashboard's handshake, so that its goodbye is heard (``_connected_in_time``).
CONNECT_GRACE_S = 0.5
#: How long the hello and goodbye at the end may wait to go out (the connection's pipe is attached
#: to the socket a moment after the handshake event: a send that does not wait may miss it).
LAST_SEND_WAIT_MS = 200


class TelemetryPublisher:
    """Non-blocking sender of one rank's messages."""

    def __init__(
        self,
        address: str,
        hello: Hello,
        queue_size: int = 2048,
        high_water_mark: int = 1000,
        current_step: Callable[[], int] = lambda: 0,
        current_pause: Callable[[], str] = lambda: "",
        keys: ClientKeys | None = None,
        current_state: Callable[[], tuple[str, StallProbe | None]] = lambda: ("", None),
    ) -> None:
        self.address = address
        self.hello = hello
        self.dropped = 0  # discarded while a dashboard was (or had been) connected: reported
        self.unsent_before_connect = 0  # nobody was listening yet: not a loss anyone saw
        self.sent = 0
        #: Whether a dashboard is connected now, as the sender thread last saw (``Watch`` spaces the
        #: ranks' command agreements wider while none is: no command can come then).
        self.connected = False
        self._ever_connected = False
        self._seq = 0
        self._queue: queue.Queue[Message | None] = queue.Queue(maxsize=queue_size)
        self._current_step = current_step
        self._current_pause = current_pause  # what the loop pauses training for now: each heartbeat says it
        self._current_state = current_state  # the phase and, once stalled, the probe (``StallProbing.state``)
        self._context = zmq.Context()
        self._started = time.monotonic()
        self._hello_owed = True  # the last hello did not go out: sent before the goodbye (``_say_goodbye``)
        self._connected_at = float("-inf")  # when the sender last saw a dashboard's handshake
        self._closing_by: float | None = None  # how long ``close`` lets the sender wait for a dashboard
        self._ending = threading.Lock()  # ``close`` giving up on the sender, or the sender ending: one closes the context
        self._closed = False  # ``close`` has returned
        self.commands: queue.Queue[SwitchCommand] = queue.Queue(maxsize=64)
        #: By command id, the ``time.monotonic()`` after which rank 0 must not apply it: from when
        #: this thread heard it, not when the loop reads it (up to a step later).
        self.command_deadlines: dict[str, float] = {}
        self.rejected_commands = 0
        self.spans = SpanPolicy(hello.world_size)  # spans or a summary per step; used on the sender thread
        #: Told the device-sample period each span request asks for (the rank's sampler), if set.
        self.on_device_rate: Callable[[float], None] | None = None
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.ROUTING_ID, routing_id(hello.session, hello.rank))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        for name, value in keys.socket_options() if keys else []:  # CURVE: a dashboard beyond loopback
            setattr(self._socket, name, value)
        # A (re)connected dashboard gets the hello at once instead of at the next repeat.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self._thread = threading.Thread(target=self._run, name=f"ddpwatch-publisher-{hello.rank}", daemon=True)
        self._thread.start()

    def publish(self, message: Message) -> None:
        """Queue a message; never blocks, never raises."""
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.dropped += 1

    def close(self, steps: int, reason: str = "finished", timeout_s: float = 1.0, trains_again: bool = False) -> None:
        """Say goodbye, give the sender up to ``timeout_s`` to drain, then drop what is left.

        The goodbye is queued behind what is still to send, so that it goes out within the time
        given whatever the backlog, the sender drops what is left once the drain's time is up
        (``_closing_by``, counted as dropped) and then says goodbye. The context is closed by
        whichever of ``close`` and the sender ends last, never under a sender still sending."""
        goodbye_s = 2 * LAST_SEND_WAIT_MS / 1000  # at most a hello and the goodbye, each waiting that long
        self._closing_by = time.monotonic() + max(0.0, timeout_s - goodbye_s)  # the rest to send, then the goodbye
        waiting_until = time.monotonic() + timeout_s
        while self._queue.full() and time.monotonic() < waiting_until:  # the sender frees a place: not dropped by it
            time.sleep(0.005)
        self.publish(Goodbye(self.hello.rank, steps, reason, trains_again))
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s + goodbye_s)
        with self._ending:
            self._closed = True
            if self._thread.is_alive():
                return  # the sender closes the context as it ends
            self._socket.disable_monitor()
            self._context.destroy(linger=0)

    # -- the sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        """The sender's loop, then the context closed if ``close`` stopped waiting for it; what
        it raises (the context gone at the process's exit) ends it quietly: never a traceback in
        the training's output."""
        try:
            self._send_until_goodbye()
        except Exception:
            pass
        finally:
            with self._ending:
                if self._closed:
                    self._context.destroy(linger=0)

    def _heartbeat(self) -> Heartbeat:
        """A heartbeat with the phase and the stall probe; without them where reading them raised
        (a probe is telemetry: its fault must never stop the heartbeat that says the rank lives)."""
        try:
            phase, probe = self._current_state()
        except Exception:
            phase, probe = "", None
        return Heartbeat(self.hello.rank, time.time(), self._current_step(), self._current_pause(), phase, probe)

    def _send_until_goodbye(self) -> None:
        next_heartbeat = next_hello = time.monotonic()
        while True:
            now = time.monotonic()
            if self._dashboard_newly_connected():
                next_hello = now
            if now >= next_hello:
                self._hello_owed = not self._send(self.hello)
                # just connected, yet it did not go out (the connection's pipe attaches a moment after
                # the handshake event): again at the next turn, not in two seconds
                retry_soon = self._hello_owed and now - self._connected_at < 1.0
                next_hello = now + (0.05 if retry_soon else HELLO_EVERY_S)
            if now >= next_heartbeat:
                self._send(self._heartbeat())
                next_heartbeat = now + HEARTBEAT_EVERY_S
            self._receive_commands()
            try:
                message = self._queue.get(timeout=max(0.0, min(next_heartbeat, next_hello, now + 0.05) - now))
            except queue.Empty:
                continue
            if message is None:
                return
            if isinstance(message, Goodbye):
                self._say_goodbye(message)
                return
            if self._closing_by is not None and time.monotonic() >= self._closing_by:
                self._seq += 1  # no time left to send it: dropped, so the goodbye still goes out
                self._count_unsent()
                continue
            if not self.connected:
                self._seq += 1  # numbered as if sent: the gap says it was lost, as the count does
                self._count_unsent()
                continue
            for outgoing in self.spans.messages_for(message) if isinstance(message, StepReport) else [message]:
                self._send(outgoing)

    def _receive_commands(self) -> None:
        while self._socket.poll(0, zmq.POLLIN):
            try:
                message = decode(self._socket.recv(zmq.NOBLOCK)).message
            except (ProtocolError, zmq.ZMQError):
                self.rejected_commands += 1
                continue
            if isinstance(message, SwitchCommand):
                if message.expires_after_s is not None:  # a resend says what is left of the wait: the earliest stands
                    deadline = time.monotonic() + message.expires_after_s
                    self.command_deadlines[message.command_id] = min(deadline, self.command_deadlines.get(message.command_id, deadline))
                try:
                    self.commands.put_nowait(message)
                except queue.Full:
                    self.rejected_commands += 1
            elif isinstance(message, SpanRequest):
                for report in self.spans.on_request(message):
                    self._send(report)
                if self.on_device_rate is not None:
                    self.on_device_rate(message.device_every_s)

    def _say_goodbye(self, goodbye: Goodbye) -> None:
        """The last message. A dashboard whose handshake is not yet looked at, or comes within the
        grace (``_connected_in_time``), or whose last hello did not go out, gets this rank's hello
        first: the next loop turn, which would repeat it, never comes."""
        newly_connected = self._dashboard_newly_connected() or (not self.connected and self._connected_in_time())
        self._socket.setsockopt(zmq.SNDTIMEO, LAST_SEND_WAIT_MS)
        if newly_connected or (self._hello_owed and self.connected):
            self._send(self.hello, waits=True)
        if self.connected:
            self._send(goodbye, waits=True)
        else:
            self._seq += 1
            self._count_unsent()

    def _connected_in_time(self) -> bool:
        """Whether a dashboard connects before ``CONNECT_GRACE_S`` from the publisher's start (and
        before ``close`` stops waiting): else a run that ends at once (a loop refused or raising
        at its first step) says goodbye before the handshake of a dashboard already listening,
        both its hello and its goodbye go unsent, and the rank reads *lost* instead of how it
        ended. A run with no dashboard waits only what is left of the grace, never more."""
        deadline = min(self._started + CONNECT_GRACE_S, self._closing_by if self._closing_by is not None else float("inf"))
        try:
            while not self._dashboard_newly_connected():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._monitor.poll(timeout=max(1, int(left * 1000)))
        except zmq.ZMQError:  # the context closed under it
            return False
        return True

    def _dashboard_newly_connected(self) -> bool:
        """Whether a dashboard (re)connected since the sender last looked; ``connected`` follows
        the last connection event seen. A handshake read while ``connected`` already holds (a send
        went out on its pipe before its event was read: the only pipe, with ``IMMEDIATE``) is the
        connection the sender already knows of, not a new one: its hello has gone out, and
        sending it again would put two hellos before a run's goodbye."""
        newly_connected = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                newly_connected = newly_connected or not self.connected
                self.connected = self._ever_connected = True
                self._connected_at = time.monotonic()
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
        return newly_connected

    def _send(self, message: Message, waits: bool = False) -> bool:
        """Send ``message`` now, or count it unsent; ``waits``: up to the socket's ``SNDTIMEO``.
        Whether it went out."""
        try:
            data = encode(message, self._seq, self.dropped)
            self._seq += 1
            self._socket.send(data, 0 if waits else zmq.NOBLOCK)
            self.sent += 1
            # gone out, so a dashboard is connected, even before its handshake event is read
            self.connected = self._ever_connected = True
            return True
        except zmq.Again:
            self._count_unsent()
        except Exception:  # the context going away at exit, or a message that would not encode:
            self.dropped += 1  # counted, and the sender thread lives on
        return False

    def _count_unsent(self) -> None:
        """A message that could not go out: a loss a dashboard saw, once one has been connected;
        before that, nobody was listening yet."""
        if self._ever_connected:
            self.dropped += 1
        else:
            self.unsent_before_connect += 1

