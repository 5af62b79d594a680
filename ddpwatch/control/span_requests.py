"""What a listener asks of each rank's spans, sent to every rank it has heard from.

A large job cannot send every span of every rank to one process (see ``StepSummary``): the
dashboard asks for full spans from the ranks it draws (the slowest, the fastest, the selected),
for every ``sample_every``-th step from all, and for the step the user pinned from all; the
recorder asks for everything unless told to sample. The wish is resent every ``RESEND_EVERY_S``
(a rank that missed it, or joined late, is set right) and at once when it changes. Owned by the
thread that owns the receiving socket; ``send(peer, data)`` never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from instrumented_ddp.wire.codec import Envelope, encode
from instrumented_ddp.wire.messages import SpanRequest, SwitchCommand

RESEND_EVERY_S = 2.0
RETRY_AFTER_S = 0.2  # a request the socket would not take is tried again this soon
#: A large job's dashboard wants every rank's spans of one step in this many: the recorder can
#: rebuild a whole step's timeline that often, and ``ddpwatch replay`` shows it.
SAMPLE_EVERY_STEPS = 25
#: ... and a device sample of each rank every this many seconds (a rank's own rate is 5 a second):
#: a sparkline per rank still moves, and the messages a 1,024-rank job sends fall by half.
LARGE_JOB_DEVICE_EVERY_S = 1.0


@dataclass(frozen=True)
class SpanWish:
    """``full_ranks``: ranks whose every step is wanted whole (None: every rank);
    ``pinned_steps``: steps wanted whole from ``pinned_ranks`` (None: every rank), from what the
    ranks still hold."""

    full_ranks: frozenset[int] | None = None
    sample_every: int = 0
    pinned_steps: tuple[int, ...] = field(default_factory=tuple)
    pinned_ranks: frozenset[int] | None = None
    device_every_s: float = 0.0  # seconds between a rank's device samples (0: the rank's own rate)

    @classmethod
    def everything(cls) -> SpanWish:
        return cls()

    @classmethod
    def sampled(cls, every: int, full_ranks: Collection[int] = (), pinned_steps: Collection[int] = (),
                pinned_ranks: Collection[int] | None = None, device_every_s: float = 0.0) -> SpanWish:
        return cls(frozenset(full_ranks), every, tuple(sorted(pinned_steps)),
                   None if pinned_ranks is None else frozenset(pinned_ranks), device_every_s)

    def request_for(self, rank: int) -> SpanRequest:
        full = self.full_ranks is None or rank in self.full_ranks
        pinned = self.pinned_ranks is None or rank in self.pinned_ranks
        return SpanRequest(full=full, sample_every=self.sample_every, pinned_steps=list(self.pinned_steps) if pinned else [],
                           device_every_s=self.device_every_s)


class SpanRequester:
    """Learns each rank's address from its traffic and tells it what to send."""

    def __init__(self, send: Callable[[bytes, bytes], bool], wish: SpanWish | None = None) -> None:
        self._send = send
        self.wish = wish or SpanWish.everything()
        self.peers: dict[int, bytes] = {}
        self._sent: dict[int, tuple[SpanRequest, float]] = {}  # rank -> (request, when)
        self._settled: tuple[SpanWish, int, float] | None = None  # (wish, peers, next resend) of the last full pass

    def note(self, peer: bytes, envelope: Envelope) -> None:
        if not isinstance(envelope.message, SwitchCommand) and envelope.rank >= 0:
            self.peers[envelope.rank] = peer

    def want(self, wish: SpanWish) -> None:
        self.wish = wish

    def tick(self, now: float | None = None) -> int:
        """Send each rank its request where it changed or is due again; returns how many went."""
        now = time.monotonic() if now is None else now
        if self._settled is not None and self._settled[:2] == (self.wish, len(self.peers)) and now < self._settled[2]:
            return 0  # nothing changed and nothing is due: a 1,024-rank pass is not made 50 times a second
        sent, next_resend = 0, now + RESEND_EVERY_S
        for rank, peer in self.peers.items():
            request = self.wish.request_for(rank)
            last = self._sent.get(rank)
            if last is not None and last[0] == request and now - last[1] < RESEND_EVERY_S:
                next_resend = min(next_resend, last[1] + RESEND_EVERY_S)
                continue
            if self._send(peer, encode(request)):
                self._sent[rank] = (request, now)
                sent += 1
            else:  # not sent (the peer is gone, or its queue is full): tried again shortly
                next_resend = min(next_resend, now + RETRY_AFTER_S)
        self._settled = (self.wish, len(self.peers), next_resend)
        return sent
