"""The frame's first part: what the feed delivered, folded into the session within a time budget."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Ack

from ddpwatch.dashboard.feeds import Arrival, Feed
from ddpwatch.ingest.session import Session


class FrameIngest:
    """Drains ``feed`` and folds each arrival into the session ``session()`` returns: a new run's
    hello goes to ``begin_next_run`` first (which replaces the session), an ack the session
    does not keep to ``acknowledged``, a message that cannot be read to the session's rejects."""

    def __init__(self, feed: Feed, session: Callable[[], Session], begin_next_run: Callable[[str], None],
                 acknowledged: Callable[[Ack], None]) -> None:
        self.feed = feed
        self.session = session
        self.begin_next_run = begin_next_run
        self.acknowledged = acknowledged
        self.arrivals: deque[Arrival] = deque()  # drained from the feed, not folded in yet

    def fold(self, budget_s: float | None = None) -> None:
        """Folds in what arrived; with ``budget_s``, only as much as that time allows (at least
        one arrival), the rest at the next calls. Each message is dated by its arrival, so a
        late fold does not make a rank look alive longer."""
        self.arrivals.extend(self.feed.drain())
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        while self.arrivals:  # at least one a frame, however small the budget
            arrived_at, item, prepared, run = self.arrivals.popleft()
            if isinstance(item, Envelope):
                if next_run := self.session().next_run(item.message, arrived_at, run):
                    self.begin_next_run(next_run)
                if self.session().ingest(item, arrived_at, prepared, run) is None and isinstance(item.message, Ack):
                    self.acknowledged(item.message)
            else:
                self.session().reject(item.category)
            if deadline is not None and time.perf_counter() >= deadline:
                return
