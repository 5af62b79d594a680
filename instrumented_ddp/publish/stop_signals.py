"""A rank stopped from outside says so: *interrupted*, not *failed*, and never silently *lost*.

Why: the usual end of a run nobody let finish is a signal. Ctrl-C at torchrun makes torchrun send
SIGINT to every rank (Python raises ``KeyboardInterrupt``); torchrun stops the ranks left with
SIGTERM when one rank fails; a scheduler (SLURM, Kubernetes) preempts a job with SIGTERM. Python's
default SIGTERM action kills the process on the spot, with no exception, no ``finally`` and no
exit handler, so an attached script would send no goodbye and every rank would read *lost*; and a
``KeyboardInterrupt`` would read as the training's own failure (*ERROR: rank 1 failed first …
KeyboardInterrupt*), naming a cause where the user only pressed Ctrl-C.

``stop_on_sigterm`` turns SIGTERM into ``StoppedBySignal``, a ``SystemExit`` raised in the main
thread, so the loop unwinds as it does on Ctrl-C and the exit handlers send the goodbye; the
process still exits at once, with the shell's code for the signal (143). It is installed only
where SIGTERM has its default action: a script that handles SIGTERM itself (a checkpoint on
preemption) keeps its own handler. Where the process is already ending (an exception being
handled, or its exit handlers running) the signal is noted, not raised: raised there, it would cut
off the goodbye being sent. Noted in an exception's handling, it is sent again two seconds later
and then raised wherever it lands (the exit handlers aside): an ``except`` block of a loop that
went on is not left to ignore it. A child forked from the process (a DataLoader worker, which
torchrun's stop reaches through the process group) gets the default action back as it starts: it
has no loop to unwind. Once stopped, the process puts a handler that does nothing in place of a
Python SIGCHLD handler (the DataLoader's, which would raise *worker … is killed by signal* in the
middle of the goodbye as the same stop kills its workers).

A handler of Python's runs only between two bytecodes of the main thread: a rank blocked in C++
(a collective's ``wait()`` for a peer that hung, a CUDA sync, a store's wait) does not run it
until the call returns, and would outlive the stop it would have died of at once by as long, up
to torchrun's SIGKILL 30 s later. So the C side of the
handler also writes the signal's number to a socket (``signal.set_wakeup_fd``, where no one else
uses it), which a thread of ours reads as it comes: where the main thread has not taken the
signal ``STUCK_AFTER_S`` later, that thread runs what was asked of it (``when_stuck``: the
goodbye) and ends the process with the signal's exit code.

A stop that comes while ddpwatch's own code runs in the main thread (``held``: a hook making a
step's report and sending it) is noted and raised as that code returns: raised inside it, it
would cut a step in two, its report made but never sent, or sent while the goodbye counts a step
fewer.
Ctrl-C too (``hold_ctrl_c``): Python's own SIGINT handler raises ``KeyboardInterrupt`` at the
next bytecode, wherever that is, and Ctrl-C is the commonest stop of all.

``interruption_reason`` is what the goodbye then says: a rank blocked in a collective when the
stop came may see its peer leave first, and fail, before its own handler runs; the stop is still
what ended it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

from instrumented_ddp.wire.messages import INTERRUPTED

RAISE_AGAIN_AFTER_S = 2.0  # a stop noted while an exception was handled: time for its goodbye
#: How long a SIGTERM may wait for the main thread to take it (it is blocked in C++ meanwhile)
#: before the process is ended from another thread: SIGTERM's own action ends it at once.
STUCK_AFTER_S = 2.0

#: The process that installed the handler: a child forked from it inherits the handler but not
#: the loop.
_installed_in: int | None = None
_fork_hook_registered = False
#: The signal that stopped this process, once one did: the exit handlers read it (``SystemExit``
#: never reaches ``sys.excepthook``).
received: StoppedBySignal | None = None
_deferred = False  # a stop was noted, not raised, while an exception was handled: the next one raises
_held_depth = 0  # how deep the main thread is in ``held`` blocks
_held_signal: int | None = None  # a stop that came inside one, raised as the outermost ends
_ctrl_c_held = False  # a Ctrl-C that came inside one: ``KeyboardInterrupt`` as the outermost ends


class StoppedBySignal(SystemExit):
    """The process was sent ``signal_name`` and ends: exit code 128 + the signal's number, as a
    shell reports a process a signal killed."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name


def interruption_reason(error: BaseException | None) -> str | None:
    """A goodbye's reason where a stop from outside ended the run, as ``interrupted: SIGTERM`` or
    ``interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)``: the stop is in ``error``'s chain (what
    a stop's unwinding raised, or what it was raised while handling), or this process's handler
    noted one (``received``); None where no stop did."""
    for link in exception_chain(error) if error is not None else []:
        if isinstance(link, StoppedBySignal):
            return f"{INTERRUPTED}{link.signal_name}"
        if isinstance(link, KeyboardInterrupt):
            return f"{INTERRUPTED}SIGINT (KeyboardInterrupt, Ctrl-C)"
    return f"{INTERRUPTED}{received.signal_name}" if received is not None else None


def exception_chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised while handling, newest first (``__context__``,
    which ``raise … from`` sets too), each once."""
    chain = [error]
    while (earlier := chain[-1].__context__) is not None and all(earlier is not seen for seen in chain):
        chain.append(earlier)
    return chain


def stop_on_sigterm() -> bool:
    """Install the SIGTERM handler where SIGTERM has its default action and this is the main
    thread (the only one Python lets set a handler); whether it is installed now."""
    global _installed_in, _watch
    if _installed_in == os.getpid() and signal.getsignal(signal.SIGTERM) is _stop:
        return True
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _stop)
    _installed_in = os.getpid()
    if _watch is None or _watch.pid != os.getpid():
        _watch = _SignalWatch()
    _watch.listen()
    _reset_in_children()
    return True


def _reset_in_children() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:  # registered once for the process's life: it cannot be removed
        os.register_at_fork(after_in_child=_default_in_child)
        _fork_hook_registered = True


class _SignalWatch:
    """The thread that reads the signals' numbers off the wakeup socket as they come (the C side
    of Python's handlers writes them, whatever the main thread is doing), and ends a process
    whose main thread has not taken a SIGTERM ``STUCK_AFTER_S`` later."""

    def __init__(self) -> None:
        self._reading, self._writing = socket.socketpair()
        self._writing.setblocking(False)
        self.when_stuck: list[Callable[[], None]] = []
        self.pid = os.getpid()
        threading.Thread(target=self._read, name="ddpwatch-signal-watch", daemon=True).start()

    def listen(self) -> bool:
        """Be the process's wakeup socket (from the main thread), unless another is: whether it is."""
        try:
            previous = signal.set_wakeup_fd(self._writing.fileno(), warn_on_full_buffer=False)
        except ValueError:
            return False
        if previous not in (-1, self._writing.fileno()):  # asyncio's, say: theirs, left as it was
            signal.set_wakeup_fd(previous)
            return False
        return True

    def stop_listening(self) -> None:
        try:
            if signal.set_wakeup_fd(-1) not in (-1, self._writing.fileno()):  # another's since: theirs again
                signal.set_wakeup_fd(self._writing.fileno(), warn_on_full_buffer=False)
        except ValueError:
            pass

    def _read(self) -> None:
        while True:
            try:
                numbers = self._reading.recv(64)
            except OSError:
                return
            if signal.SIGTERM in numbers and os.getpid() == self.pid and (received is None or _held_signal is not None):
                self._end_if_stuck(signal.SIGTERM)

    def _end_if_stuck(self, signum: int) -> None:
        deadline = time.monotonic() + STUCK_AFTER_S
        while (received is None or _held_signal is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        if (received is not None and _held_signal is None) or signal.getsignal(signum) is not _stop:
            return  # the main thread took it (a held one: and raised it, its ``held`` block over)
        print(f"instrumented_ddp: {signal.Signals(signum).name} came while the main thread was blocked in a call "
              f"that does not return to Python (a collective waiting for a peer, a device sync) for {STUCK_AFTER_S:g} s: "
              "the process ends now, as the signal's default action would have ended it", file=sys.stderr, flush=True)
        for call in list(self.when_stuck):
            try:
                call()
            except Exception:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)


_watch: _SignalWatch | None = None


def when_stuck(call: Callable[[], None]) -> None:
    """``call`` (from another thread, briefly: a goodbye) where a SIGTERM finds the main thread
    blocked in C++ and the process is ended without it."""
    if _watch is not None:
        _watch.when_stuck.append(call)


def not_when_stuck(call: Callable[[], None]) -> None:
    if _watch is not None and call in _watch.when_stuck:
        _watch.when_stuck.remove(call)


def default_on_sigterm() -> None:
    """Give SIGTERM its default action back where ``stop_on_sigterm`` set ours (an attachment
    detached: the loop it watched is over); a handler set since is left alone."""
    global _installed_in
    if (_installed_in == os.getpid() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _stop):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed_in = None
        if _watch is not None:
            _watch.stop_listening()


class _Held:
    """``held``'s block: counted in the main thread only (the one a handler runs in; an
    autograd thread's hook holds nothing)."""

    def __enter__(self) -> None:
        global _held_depth
        if threading.current_thread() is threading.main_thread():
            _held_depth += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        global _held_depth, _held_signal, _ctrl_c_held
        if threading.current_thread() is not threading.main_thread():
            return
        _held_depth -= 1
        if _held_depth > 0:
            return
        if _held_signal is not None:  # with ``error`` on its way: deferred, as in any ``except``
            signum, _held_signal, _ctrl_c_held = _held_signal, None, False
            _land(signum)
        if _ctrl_c_held:  # with ``error`` on its way too, as Python's handler raises in an ``except``
            _ctrl_c_held = False
            raise KeyboardInterrupt


#: ``with held:`` around ddpwatch's own code in the loop (the making and sending of a step's
#: report): a SIGTERM coming inside is raised as the block ends, in the loop's code.
held = _Held()


def hold_ctrl_c() -> bool:
    """Have a Ctrl-C (SIGINT) that comes inside a ``held`` block raise its ``KeyboardInterrupt``
    as the outermost one ends, as a SIGTERM does; anywhere else it raises at once, as Python's
    own handler does. Installed only where SIGINT has Python's handler and this is the main
    thread: a script's own SIGINT handler stays. Whether ours is in place now."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
        _reset_in_children()
        return True
    return current is _interrupt


def release_ctrl_c() -> None:
    """Python's own SIGINT handler again where ``hold_ctrl_c`` put ours; one set since stays."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _ctrl_c_held
    if _held_depth > 0:  # ddpwatch's own code runs: raised as it returns
        _ctrl_c_held = True
        return
    signal.default_int_handler(signum, frame)


def _default_in_child() -> None:
    """Run in a forked child as it starts: SIGTERM kills it again, at once, and Ctrl-C is
    Python's again (a DataLoader worker's own ``KeyboardInterrupt`` handling expects it)."""
    if signal.getsignal(signal.SIGINT) is _interrupt:
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:
            pass
    if signal.getsignal(signal.SIGTERM) is _stop:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if _watch is not None:
                _watch.stop_listening()  # its signals are not the parent's
        except ValueError:  # forked from a thread Python does not count as the child's main one
            pass


def _children_end_too(_signum: int, _frame: FrameType | None) -> None:
    """SIGCHLD once the process is stopped: nothing to do. A Python handler still: with the
    default action back, a SIGCHLD already pending prints *Signal 17 ignored due to race
    condition*."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    global received, _held_signal
    if os.getpid() != _installed_in:  # a child that kept the handler: die of the signal, as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    received = StoppedBySignal(signum)
    if callable(signal.getsignal(signal.SIGCHLD)):  # the process ends: its children's deaths are expected
        signal.signal(signal.SIGCHLD, _children_end_too)
    if not threading.main_thread().is_alive():  # the exit handlers run (the goodbye among them)
        return
    if _held_depth > 0:  # ddpwatch's own code runs: raised as it returns
        _held_signal = signum
        return
    _land(signum)


def _land(signum: int) -> None:
    """Raise the stop in the main thread's code, unless an exception is being handled there."""
    global _deferred
    if received is None:
        return
    if sys.exc_info()[1] is not None and not _deferred:  # an exception is being handled: ending the process, or not
        _deferred = True
        again = threading.Timer(RAISE_AGAIN_AFTER_S, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    raise received
