"""What ``ddpwatch record`` says of a job's faults as they happen, not only once it stops.

Why: a rank that dies or freezes holds every other rank in its next collective, and they go on
heartbeating, so a headless recorder (a cluster job, CI) is never idle, and its last lines come
only once the process group's timeout (30 min on gloo) ends the job: until then, a user tailing
its output would see a job that looks alive. So it says, once each as it happens, a rank lost
(silent past ``rank_liveness.LOST_AFTER_S``) and the live ranks a lost one holds
(``Session.ranks_held_by_lost``), in the dashboard's words (``rank_lists``). A rank heard again
and lost again is said again.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpwatch.wording.rank_lists import held_by_lost_lines, lost_ranks_lines
from ddpwatch.ingest.session import Session

#: How often the session is looked at: a rank is lost 2.5 s after its last message, and held
#: 3 s after its last step; a second more is soon enough, and a look costs O(ranks).
LOOK_EVERY_S = 1.0


class LiveFaultReporter:
    """Looks at a session every ``LOOK_EVERY_S`` and says each new fault once through ``say``."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._next_look = 0.0
        self._said_lost: set[int] = set()
        self._said_held: set[int] = set()

    def look(self, session: Session, now: float) -> None:
        """Say the ranks lost and held since the last look, at ``now`` on the session's clock."""
        if now < self._next_look:
            return
        self._next_look = now + LOOK_EVERY_S
        held, lost = session.ranks_held_by_lost(now)
        newly_lost = {rank: now - last_seen for rank, last_seen in lost.items() if rank not in self._said_lost}
        for line in lost_ranks_lines(newly_lost):
            self._say(line)
        self._said_lost = set(lost)
        if not set(held) <= self._said_held:
            for line in held_by_lost_lines(held, lost, now):
                self._say(line)
        self._said_held = set(held)
