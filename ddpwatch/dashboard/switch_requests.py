"""The switches this dashboard asks for, and rank 0's answers to them and to switches asked elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from instrumented_ddp.wire.messages import Ack

from ddpwatch.control.relay import GIVE_UP_AFTER_S, new_command
from ddpwatch.dashboard.feeds import Feed
from ddpwatch.ingest.session import Session


@dataclass
class AskedSwitch:
    """A switch this dashboard asked for, until rank 0 answers it."""

    strategy: str
    at: float  # time.monotonic() when asked
    said_unanswered: bool = False  # said once, when the relay stopped resending it


class SwitchRequests:
    """Sends switch commands through the feed, keeps each until rank 0 answers it, and says
    through ``notify`` what was asked, what rank 0 answered and what went unanswered."""

    def __init__(self, feed: Feed, notify: Callable[[str], None]) -> None:
        self.feed = feed
        self.notify = notify
        self.pending: dict[str, AskedSwitch] = {}  # by command id, until rank 0 answers
        self.answered: set[str] = set()  # command ids whose answer was said: rank 0 answers each resend again

    def clear(self) -> None:
        """Forgets every switch asked and answered (a new run on screen)."""
        self.pending.clear()
        self.answered.clear()

    def request(self, session: Session, strategy: str, bucket_mb: float | None = None,
                grad_accum: int | None = None, switching_off: str | None = None) -> None:
        """Asks every rank to switch, unless ``switching_off`` says why not or the run's rank 0
        said goodbye: either is said instead."""
        if switching_off is not None:
            self.notify(switching_off)
            return
        if (rank0 := session.ranks.get(0)) is not None and rank0.goodbye is not None:
            # the relay would refuse it at once, to no one, and the screen would say, GIVE_UP_AFTER_S on, that it might still land
            self.notify(f"switch to {strategy} not sent: the run is over (its rank 0 said goodbye)")
            return
        command = new_command(strategy, bucket_mb, grad_accum)
        self.pending[command.command_id] = AskedSwitch(strategy, time.monotonic())
        self.feed.request_switch(command)
        settings = ", ".join(f"{k}={v:g}" for k, v in (("bucket_mb", bucket_mb), ("grad_accum", grad_accum)) if v is not None)
        self.notify(f"asked every rank to switch to {strategy}{f' ({settings})' if settings else ''}; waiting for rank 0")

    def say_unanswered(self, now: float) -> None:
        """A switch rank 0 has not answered once the relay stopped resending it is said so, once,
        beyond the notice *waiting for rank 0*. It is still announced if it lands (rank 0 heard
        it and a long step or a pause holds it)."""
        for asked in self.pending.values():
            if not asked.said_unanswered and now - asked.at > GIVE_UP_AFTER_S:
                asked.said_unanswered = True
                self.notify(f"no answer from rank 0 to the switch to {asked.strategy} in {GIVE_UP_AFTER_S:g} s: no longer "
                            "resent (it lands if rank 0 heard it and a long step or a pause holds it)")

    def acknowledged(self, ack: Ack) -> None:
        """Rank 0's answer, said once: to this dashboard's own switch, and to one asked from
        elsewhere (``ddpwatch switch``, ``tune``, another dashboard), which rank 0's ack names
        (``Ack.strategy``; an older rank's names none, and is not said: an applied switch still
        shows as a segment), so that a switch asked elsewhere and refused shows here too."""
        if ack.rank != 0 or ack.command_id in self.answered:
            return
        asked = self.pending.pop(ack.command_id, None)
        strategy = asked.strategy if asked is not None else ack.strategy
        if not strategy:
            return
        self.answered.add(ack.command_id)
        elsewhere = "" if asked is not None else " (asked from elsewhere)"
        if ack.applied:
            self.notify(f"every rank switched to {strategy} at step {ack.step}{elsewhere}")
        else:
            self.notify(f"switch to {strategy}{elsewhere} refused: {ack.detail}")
