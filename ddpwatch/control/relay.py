"""Switch commands on their way to a run: relayed to rank 0, resent until acknowledged.

The dashboard and ``ddpwatch record`` both relay: a command from the UI or from
``ddpwatch switch`` goes to rank 0 (found by its routing id), is resent every second until rank
0 acknowledges it, and the acknowledgement goes back to whoever asked. Where two runs send to one
address at once, the command goes to the rank 0 of the run heard first, the one the dashboard
shows (``Session.ingest``), until that rank 0 said goodbye or fell silent.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from msgspec.structs import replace
from typing import Protocol

from instrumented_ddp.wire.codec import Envelope, ProtocolError, decode, encode
from instrumented_ddp.wire.messages import Ack, Goodbye, SwitchCommand
from instrumented_ddp.wire.endpoints import run_of_sender

RESEND_EVERY_S = 1.0
#: As long as ``ddpwatch switch`` waits by default, so that a command it stopped waiting for, having
#: said it failed, is not resent on and applied by a run that comes up later. A command
#: that says how long its asker waits (``SwitchCommand.expires_after_s``) is given up that long and
#: ``ACK_GRACE_S`` after it was asked for instead.
GIVE_UP_AFTER_S = 30.0
#: How long after a command's expiry its acknowledgement may still come: rank 0 applies it up to the
#: expiry, then re-wraps the model (seconds for a large one) before it acknowledges.
ACK_GRACE_S = 5.0
#: A rank 0 silent this long (heartbeats come every second) gives way to another run's: as
#: ``rank_liveness.LOST_AFTER_S`` judges a rank lost.
RANK0_QUIET_AFTER_S = 2.5


def new_command(strategy: str, bucket_mb: float | None = None, grad_accum: int | None = None,
                expires_after_s: float | None = None) -> SwitchCommand:
    """A command with an id of its own; ``expires_after_s``: how long its asker waits (None: the
    run may apply it whenever it hears it)."""
    return SwitchCommand(uuid.uuid4().hex[:12], strategy, bucket_mb, grad_accum, expires_after_s)


@dataclass
class PendingSwitch:
    command: SwitchCommand
    requester: bytes | None
    first_sent: float
    last_sent: float = 0.0
    sends: int = 0
    sent_to: bytes | None = None  # the rank 0 it first went to: the run it is for


class Relay(Protocol):
    """What a driver of switches (``tune.SweepDriver``) needs of a relay: requests out,
    acknowledgements in. ``SwitchRelay`` is the one; a test's fake notes the requests in a list."""

    acks: list[Ack]

    def request(self, command: SwitchCommand, requester: bytes | None = None) -> None: ...


class SwitchRelay:
    """Owned by the thread that owns the receiving socket; ``send(peer, data)`` never blocks."""

    def __init__(self, send: Callable[[bytes, bytes], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._clock = clock
        self.rank0: bytes | None = None
        self._rank0_heard_at = float("-inf")
        self._rank0_gone = False  # it said goodbye
        self.pending: dict[str, PendingSwitch] = {}
        self.acks: list[Ack] = []

    def note(self, peer: bytes, envelope: Envelope) -> None:
        """Learn rank 0's address from its traffic; pick up requests and acknowledgements."""
        message = envelope.message
        if isinstance(message, SwitchCommand):
            self.request(message, requester=peer)
            return
        if envelope.rank == 0 and self._takes_rank0(peer):
            self.rank0, self._rank0_heard_at = peer, self._clock()
            self._rank0_gone = isinstance(message, Goodbye)
        if isinstance(message, Ack):
            self.acks.append(message)
            pending = self.pending.get(message.command_id)
            if pending is not None and message.rank == 0:
                del self.pending[message.command_id]
                if pending.requester is not None:
                    self._send(pending.requester, encode(message))

    def _takes_rank0(self, peer: bytes) -> bool:
        """Whether a rank 0 speaking from ``peer`` is where commands go from now: the first heard,
        the same one again, one whose run is not known (a sender without a rank's routing id), or
        another run's once the one followed is over for commands (its rank 0 said goodbye or has
        been silent ``RANK0_QUIET_AFTER_S``), so that with two runs at once a key pressed for the
        run on screen never switches the other."""
        if self.rank0 is None or peer == self.rank0:
            return True
        if not run_of_sender(peer) or not run_of_sender(self.rank0):
            return True
        return self._rank0_gone or self._clock() - self._rank0_heard_at >= RANK0_QUIET_AFTER_S

    def request(self, command: SwitchCommand, requester: bytes | None = None) -> None:
        self.pending[command.command_id] = PendingSwitch(command, requester, self._clock())
        self.tick()

    def tick(self, now: float | None = None) -> None:
        """Send what is due; give up on a command nobody acknowledged within ``GIVE_UP_AFTER_S``,
        and on one whose run is over: commands go to a rank 0 of another run once the one followed
        said goodbye or fell silent, and a command sent to the run before (answered by no step:
        asked in its last moments) must not go on to the next run and switch a run no one asked to."""
        now = self._clock() if now is None else now
        for command_id, pending in list(self.pending.items()):
            expires_after_s = pending.command.expires_after_s
            if expires_after_s is not None and now - pending.first_sent > expires_after_s + ACK_GRACE_S:
                self._give_up(command_id, pending, f"no rank 0 acknowledged the command within the {expires_after_s:g} s "
                                                   "its asker waits (it will not be applied)")
                continue
            if expires_after_s is None and now - pending.first_sent > GIVE_UP_AFTER_S:
                self._give_up(command_id, pending, f"no rank 0 acknowledged the command within {GIVE_UP_AFTER_S:g} s")
                continue
            if pending.sent_to is not None and (self.rank0 != pending.sent_to or self._rank0_gone):
                self._give_up(command_id, pending, "the run it was sent to is over (its rank 0 said goodbye or fell "
                                                   "silent): not sent on to the next")
                continue
            if self._rank0_gone:  # nothing will answer it until another run speaks: said now, not at the timeout
                self._give_up(command_id, pending, "no run is training there now: the last one's rank 0 said goodbye")
                continue
            if self.rank0 is not None and now - pending.last_sent >= RESEND_EVERY_S:
                if self._send(self.rank0, encode(self._as_sent(pending, now))):
                    pending.last_sent, pending.sends, pending.sent_to = now, pending.sends + 1, self.rank0

    def stop(self, arrived: Iterable[tuple[bytes, bytes]], why: str) -> None:
        """The relay is stopping (the recorder or the dashboard closes): every pending command, and
        every one that ``arrived`` but was not read yet, is refused to whoever asked, never sent on
        to rank 0: a ``ddpwatch switch`` asking as the recorder stops hears why at once, instead of
        waiting out its timeout."""
        for peer, data in arrived:
            try:
                message = decode(data).message
            except ProtocolError:
                continue
            if isinstance(message, SwitchCommand):
                self._refuse(peer, message.command_id, why)
        for command_id, pending in list(self.pending.items()):
            self._give_up(command_id, pending, why)

    @staticmethod
    def _as_sent(pending: PendingSwitch, now: float) -> SwitchCommand:
        """The command as rank 0 is to read it now: what is left of its asker's wait, not all of it
        (a resend heard first would have given rank 0 the whole wait again, from its own hearing)."""
        command = pending.command
        if command.expires_after_s is None:
            return command
        return replace(command, expires_after_s=max(0.0, command.expires_after_s - (now - pending.first_sent)))

    def _give_up(self, command_id: str, pending: PendingSwitch, why: str) -> None:
        del self.pending[command_id]
        if pending.requester is not None:
            self._refuse(pending.requester, command_id, why)

    def _refuse(self, requester: bytes, command_id: str, why: str) -> None:
        """The relay's own answer to whoever asked: not applied, and why."""
        self._send(requester, encode(Ack(0, command_id, False, 0, why)))
