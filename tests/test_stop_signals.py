"""A stop from outside is said as *interrupted* (``instrumented_ddp.stop_signals``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from instrumented_ddp import stop_signals
from instrumented_ddp.stop_signals import StoppedBySignal, default_on_sigterm, interruption_reason, stop_on_sigterm
from instrumented_ddp.watch import goodbye_reason


@pytest.fixture
def default_sigterm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SIGTERM at its default action before and after the test, whatever it installs."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    monkeypatch.setattr(stop_signals, "_installed_in", None)
    monkeypatch.setattr(stop_signals, "received", None)
    yield
    signal.signal(signal.SIGTERM, previous)


def wait_for_a_signal(seconds: float = 30.0) -> None:
    """Short sleeps: a signal that lands just before a blocking call does not interrupt it (the
    handler runs once the call returns), so one long wait could run to its end."""
    for _ in range(int(seconds / 0.05)):
        time.sleep(0.05)


def test_a_signal_is_an_interruption_and_anything_else_a_failure() -> None:
    assert goodbye_reason(StoppedBySignal(signal.SIGTERM)) == "interrupted: SIGTERM"
    assert goodbye_reason(KeyboardInterrupt()) == "interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)"
    assert goodbye_reason(RuntimeError("Connection reset by peer\nmore")) == "failed: RuntimeError: Connection reset by peer"
    assert goodbye_reason(SystemExit(3)) == "failed: SystemExit: 3"  # a script's own exit is not a signal
    assert interruption_reason(RuntimeError()) is None


def test_sigterm_raises_in_the_main_thread_with_the_shells_exit_code(default_sigterm: None) -> None:
    assert stop_on_sigterm() and stop_on_sigterm()  # twice: still ours
    with pytest.raises(StoppedBySignal) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for_a_signal()
    assert stopped.value.code == 143 and stopped.value.signal_name == "SIGTERM"
    assert stop_signals.received is stopped.value  # what the exit handlers read
    default_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_set_before_or_after_is_left_alone(default_sigterm: None) -> None:
    def own(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, own)
    assert not stop_on_sigterm() and signal.getsignal(signal.SIGTERM) is own
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert stop_on_sigterm()
    signal.signal(signal.SIGTERM, own)  # the script's, set after attach
    default_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) is own


def test_no_handler_is_set_outside_the_main_thread(default_sigterm: None) -> None:
    """Python lets only the main thread set one: a loop run in a thread is left as it was."""
    installed: list[bool] = []
    thread = threading.Thread(target=lambda: installed.append(stop_on_sigterm()))
    thread.start()
    thread.join()
    assert installed == [False] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_forked_child_still_dies_of_sigterm(default_sigterm: None) -> None:
    """A DataLoader worker inherits the handler, and torchrun's stop reaches it through the
    process group: it has no loop to unwind, and dies of the signal as it would have."""
    stop_on_sigterm()
    ready, told = os.pipe()
    child = os.fork()
    if child == 0:  # the child: wait to be stopped
        try:
            os.write(told, b"1")  # a signal in the instant after fork is dropped by Python: sent after this
            wait_for_a_signal()
        finally:
            os._exit(7)  # reached only if the signal raised here instead of killing
    assert os.read(ready, 1) == b"1"
    os.close(ready)
    os.close(told)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
