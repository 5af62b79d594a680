"""A rank stopped from outside says so: *interrupted*, not *failed*, and never silently *lost*.

Why: the usual end of a run nobody let finish is a signal. Ctrl-C at torchrun makes torchrun send
SIGINT to every rank (Python raises ``KeyboardInterrupt``); torchrun stops the ranks left with
SIGTERM when one rank fails; a scheduler (SLURM, Kubernetes) preempts a job with SIGTERM. Python's
default SIGTERM action kills the process on the spot, with no exception, no ``finally`` and no
exit handler, so an attached script sent no goodbye and every rank read *lost*; a ``KeyboardInterrupt``
read as the training's own failure (*ERROR: rank 1 failed first … KeyboardInterrupt*), naming a
cause where the user had only pressed Ctrl-C.

``stop_on_sigterm`` turns SIGTERM into ``StoppedBySignal``, a ``SystemExit`` raised in the main
thread, so the loop unwinds as it does on Ctrl-C and the exit handlers send the goodbye; the
process still exits at once, with the shell's code for the signal (143). It is installed only
where SIGTERM has its default action: a script that handles SIGTERM itself (a checkpoint on
preemption) keeps its own handler. ``interruption_reason`` is what the goodbye then says.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from .protocol import INTERRUPTED

#: The process that installed the handler: a child forked from it (a DataLoader worker, which
#: torchrun's stop reaches too, through the process group) inherits the handler but not the loop.
_installed_in: int | None = None
#: The signal that stopped this process, once one did: the exit handlers read it (``SystemExit``
#: never reaches ``sys.excepthook``).
received: StoppedBySignal | None = None


class StoppedBySignal(SystemExit):
    """The process was sent ``signal_name`` and ends: exit code 128 + the signal's number, as a
    shell reports a process a signal killed."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name


def interruption_reason(error: BaseException) -> str | None:
    """A goodbye's reason where ``error`` is a stop from outside: ``interrupted: SIGTERM``,
    ``interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)``; None for anything else."""
    if isinstance(error, StoppedBySignal):
        return f"{INTERRUPTED}{error.signal_name}"
    if isinstance(error, KeyboardInterrupt):
        return f"{INTERRUPTED}SIGINT (KeyboardInterrupt, Ctrl-C)"
    return None


def stop_on_sigterm() -> bool:
    """Install the SIGTERM handler where SIGTERM has its default action and this is the main
    thread (the only one Python lets set a handler); whether it is installed now."""
    global _installed_in
    if _installed_in == os.getpid() and signal.getsignal(signal.SIGTERM) is _stop:
        return True
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _stop)
    _installed_in = os.getpid()
    return True


def default_on_sigterm() -> None:
    """Give SIGTERM its default action back where ``stop_on_sigterm`` set ours (an attachment
    detached: the loop it watched is over); a handler set since is left alone."""
    global _installed_in
    if (_installed_in == os.getpid() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _stop):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed_in = None


def _stop(signum: int, _frame: FrameType | None) -> None:
    global received
    if os.getpid() != _installed_in:  # a forked child: die of the signal, as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    received = StoppedBySignal(signum)
    raise received
