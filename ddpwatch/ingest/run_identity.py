"""Which run a session holds, and the messages of other runs heard meanwhile.

A run is named by its session id: each rank's hello carries it, and a live listener knows the run
of each sender (``endpoints.run_of_sender``). A second script pointed at the same address is
another run: its messages are counted, never mixed into this run's figures.
"""

from __future__ import annotations

from collections import Counter

from instrumented_ddp.wire.messages import Hello, Message


class RunIdentity:
    """The run this session holds, and how many messages each other run sent meanwhile."""

    def __init__(self) -> None:
        self.session_id = ""
        #: Messages of another run (its session id -> how many) heard while this one went on, left
        #: out: the dashboard's warnings name it (``is_another_run``; a run that is over gives way
        #: instead). Its hellos, always; its other messages where the sender's run is known.
        self.other_runs: Counter[str] = Counter()
        #: Whether messages came with the run that sent them (``Session.ingest``'s ``run``: a live
        #: listener, a recording made since): then another run's reports are left out, not mixed in.
        self.runs_told_apart = False

    def hear_sender_run(self, run: str) -> None:
        """A message came from a rank of ``run``: the session holds the run heard first, even
        before any hello."""
        self.runs_told_apart = True
        self.session_id = self.session_id or run

    def hear_hello(self, hello: Hello) -> None:
        """A hello of this run (``other_run`` said so) names the run the session holds."""
        self.session_id = hello.session

    def is_another_run(self, hello: Hello) -> bool:
        """A hello of a run other than the one this session holds (its ranks carry another session id)."""
        return bool(self.session_id) and hello.session != self.session_id

    def other_run(self, message: Message, run: str = "") -> str:
        """The run other than this session's that ``message`` comes from, or "": the run its rank
        sent from (``run``, where known), else the run its hello names. The one rule by which
        ``Session.ingest`` leaves a message out and ``Session.next_run`` begins a session."""
        if run and self.session_id and run != self.session_id:
            return run
        return message.session if isinstance(message, Hello) and self.is_another_run(message) else ""
