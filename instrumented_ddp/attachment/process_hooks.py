"""What a live attachment holds of its process: its address among the live ones, a note of an
exception no one caught, a detach at the exit, and the stop signals. A rank stopped from outside
(Ctrl-C at torchrun, torchrun's SIGTERM to the ranks left when one fails, a scheduler's
preemption) says goodbye as *interrupted*: while attached, SIGTERM, whose default action kills at
once, raises instead where the script set no handler of its own (``stop_signals``)."""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from instrumented_ddp.publish import stop_signals
from instrumented_ddp.publish.watch import Watch
from instrumented_ddp.wire.messages import INTERRUPTED


class NotesUncaught(Protocol):
    """A live attachment, as the process's hooks see it."""

    uncaught: BaseException | None  # what ended the process, if the loop raised


#: The address each live attachment of this process sends to: a dashboard watches one run, and
#: a second model attached to the same address (a GAN's two DDPs) is another run, which it
#: leaves out whole.
ATTACHED_AT: dict[str, NotesUncaught] = {}


class _UncaughtNoted:
    """Python's hook for an exception no one caught, which runs before the exit's: the loop
    raised, and each live attachment's goodbye says so (not *finished*). One for the process,
    installed with the first attachment and taken out with the last, reading the live ones as it
    runs: a hook of each attachment's own, chained, would be put back by the later one's detach,
    and hold the earlier one's model for the rest of the process."""

    def __init__(self) -> None:
        self.previous: Callable[..., Any] | None = None

    def __call__(self, kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        for attachment in list(ATTACHED_AT.values()):
            attachment.uncaught = error
        (self.previous or sys.__excepthook__)(kind, error, trace)

    def install(self) -> None:
        if sys.excepthook is not self:
            self.previous, sys.excepthook = sys.excepthook, self

    def remove_if_unused(self) -> None:
        """Put the hook before it back once no attachment is live, unless one set after it is
        there now (it chains to this one, which then passes every exception on)."""
        if not ATTACHED_AT and sys.excepthook is self:
            sys.excepthook, self.previous = self.previous or sys.__excepthook__, None


_NOTE_UNCAUGHT = _UncaughtNoted()


class ProcessHooks:
    """The process's hooks one attachment holds from ``install`` to ``remove``. ``at_exit``:
    what the exit runs where the script did not detach; ``attached``: whether the attachment
    still watches (its goodbye goes out once)."""

    def __init__(self, attachment: NotesUncaught, address: str, watch: Watch, at_exit: Callable[[], None],
                 attached: Callable[[], bool]) -> None:
        self._attachment, self._address, self._watch = attachment, address, watch
        self._at_exit, self._attached = at_exit, attached
        self._stops_on_sigterm = self._holds_ctrl_c = False

    def install(self) -> None:
        ATTACHED_AT[self._address] = self._attachment
        _NOTE_UNCAUGHT.install()
        atexit.register(self._at_exit)
        self._stops_on_sigterm = stop_signals.stop_on_sigterm()  # torchrun's stop, a preemption: a goodbye, not *lost*
        stop_signals.when_stuck(self._goodbye_while_blocked)
        self._holds_ctrl_c = stop_signals.hold_ctrl_c()  # a Ctrl-C in a hook: raised as it returns

    def remove(self) -> None:
        if ATTACHED_AT.get(self._address) is self._attachment:
            del ATTACHED_AT[self._address]
        atexit.unregister(self._at_exit)
        _NOTE_UNCAUGHT.remove_if_unused()
        stop_signals.not_when_stuck(self._goodbye_while_blocked)
        if self._stops_on_sigterm and not ATTACHED_AT:  # the last attachment: SIGTERM kills again
            stop_signals.default_on_sigterm()
        if self._holds_ctrl_c and not ATTACHED_AT:
            stop_signals.release_ctrl_c()

    def _goodbye_while_blocked(self) -> None:
        """A SIGTERM found the loop blocked in C++, and the process ends from another thread
        (``stop_signals``): the goodbye goes out from there, the publisher's alone (what the
        main thread holds, the timeline's lock among it, is not waited for)."""
        publisher = self._watch.publisher
        if publisher is not None and self._attached():
            publisher.close(self._watch.steps, f"{INTERRUPTED}SIGTERM")
