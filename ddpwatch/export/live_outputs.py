"""What the listener feeds while it receives: ``--prometheus``, ``--tensorboard``, ``--wandb``.

Each output is handed the session at every turn of the listener's loop (``look``: it decides
itself how often it does anything), the session of each run once it is over (``finish``) and
closed at exit. An output that raises is said in one line and dropped: the recording, the
dashboard and the training go on without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

from ddpwatch.ingest.session import Session


class ListenerOutput(Protocol):
    name: str  # the flag that asked for it, for the line that says it failed

    def look(self, session: Session, now: float) -> None:
        """The session as it is now (``now``: its clock); called many times a second."""

    def finish(self, session: Session, now: float) -> None:
        """The run of ``session`` is over: its final figures (as the exports count them)."""

    def close(self) -> None:
        """Nothing more comes: flush and release what the output holds."""


class LiveOutputs:
    """The outputs a listener feeds, each kept apart: one that raises is dropped, said once."""

    def __init__(self, outputs: list[ListenerOutput],
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        self.outputs = outputs
        self._log = log

    def __bool__(self) -> bool:
        return bool(self.outputs)

    def look(self, session: Session, now: float) -> None:
        for output in list(self.outputs):
            self._guarded(output, lambda: output.look(session, now))

    def finish(self, session: Session, now: float) -> None:
        for output in list(self.outputs):
            self._guarded(output, lambda: output.finish(session, now))

    def close(self) -> None:
        for output in self.outputs:
            try:
                output.close()
            except Exception as error:  # at exit: said, and the others still closed
                self._log(f"ddpwatch: {output.name}: could not close ({type(error).__name__}: {error})")
        self.outputs = []

    def _guarded(self, output: ListenerOutput, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as error:  # a bug or a full disk in one output must not stop the listener
            self._log(f"ddpwatch: {output.name} stopped: {type(error).__name__}: {error}; the rest goes on")
            self.outputs.remove(output)
            try:
                output.close()
            except Exception:
                pass
