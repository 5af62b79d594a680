"""A stop from outside is said as *interrupted* (``instrumented_ddp.publish.stop_signals``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from instrumented_ddp.publish import stop_signals
from instrumented_ddp.publish.stop_signals import (
    StoppedBySignal,
    default_on_sigterm,
    hold_ctrl_c,
    interruption_reason,
    release_ctrl_c,
    stop_on_sigterm,
)
from instrumented_ddp.publish.watch import goodbye_reason
from launch import REPO_ROOT


@pytest.fixture
def default_sigterm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SIGTERM at its default action before and after the test, whatever it installs."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    previous_sigchld = signal.getsignal(signal.SIGCHLD)
    monkeypatch.setattr(stop_signals, "_installed_in", None)
    monkeypatch.setattr(stop_signals, "received", None)
    monkeypatch.setattr(stop_signals, "_deferred", False)
    monkeypatch.setattr(stop_signals, "_held_depth", 0)
    monkeypatch.setattr(stop_signals, "_held_signal", None)
    monkeypatch.setattr(stop_signals, "_ctrl_c_held", False)
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous)
    signal.signal(signal.SIGCHLD, previous_sigchld)
    signal.signal(signal.SIGINT, previous_sigint)


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


def raised_while_handling(first: BaseException, then: BaseException) -> BaseException:
    try:
        try:
            raise first
        except BaseException:
            raise then
    except BaseException as error:
        return error


def test_a_stop_anywhere_in_the_chain_or_noted_by_the_handler_is_what_ended_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop unwinds the loop, and what is raised on the way (a DataLoader whose workers the same
    stop killed: *worker … is killed by signal*) is its consequence; a rank blocked in a collective
    when Ctrl-C came sees its peer leave first, and fails, before its own interrupt is raised; a
    rank whose SIGTERM landed while it already failed notes it (``received``)."""
    monkeypatch.setattr(stop_signals, "received", None)
    killed_worker = RuntimeError("DataLoader worker (pid 9568) is killed by signal: Terminated.")
    peer_left = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert goodbye_reason(raised_while_handling(StoppedBySignal(signal.SIGTERM), killed_worker)) == "interrupted: SIGTERM"
    assert goodbye_reason(raised_while_handling(peer_left, KeyboardInterrupt())) == (
        "interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)")
    assert goodbye_reason(peer_left) == f"failed: RuntimeError: {peer_left}"
    monkeypatch.setattr(stop_signals, "received", StoppedBySignal(signal.SIGTERM))
    assert goodbye_reason(peer_left) == "interrupted: SIGTERM"


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


def test_a_forked_child_dies_of_sigterm_at_once(default_sigterm: None) -> None:
    """A DataLoader worker, which torchrun's stop reaches through the process group, has no loop
    to unwind: it starts with SIGTERM's default action back, and dies at once, in the middle of
    work in C (with the handler inherited it lived on until that work returned: its parent's
    DataLoader then raised as the parent exited)."""
    stop_on_sigterm()
    ready, told = os.pipe()
    child = os.fork()
    if child == 0:  # the child: wait to be stopped
        try:
            os.write(told, b"1")  # a signal in the instant after fork is dropped by Python: sent after this
            sum(range(10**10))  # minutes in C, as a worker collating a batch: a Python handler runs only after
        finally:
            os._exit(7)  # reached only if the signal raised here instead of killing
    assert os.read(ready, 1) == b"1"
    os.close(ready)
    os.close(told)
    sent = time.monotonic()
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM and time.monotonic() - sent < 10
    assert signal.getsignal(signal.SIGTERM) is stop_signals._stop  # the parent's stays


def test_a_stop_while_an_exception_is_handled_is_noted_then_raised_once_the_loop_goes_on(default_sigterm: None) -> None:
    """Raised inside an ``except`` block, it would cut off the goodbye a failing rank is sending
    (``Watch.sends_failure``); but a loop that handled an exception and went on must still stop."""
    stop_on_sigterm()
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError:
        os.kill(os.getpid(), signal.SIGTERM)
        sent = time.monotonic()  # the handler runs at the next bytecode: the timer starts no later than ~now
        wait_for_a_signal(0.3)  # noted, not raised
    assert isinstance(stop_signals.received, StoppedBySignal)
    with pytest.raises(StoppedBySignal):
        wait_for_a_signal(10)
    assert stop_signals.RAISE_AGAIN_AFTER_S - 0.1 < time.monotonic() - sent < stop_signals.RAISE_AGAIN_AFTER_S + 2


@pytest.mark.parametrize(("signum", "install", "raised"), [(signal.SIGTERM, stop_on_sigterm, StoppedBySignal),
                                                      (signal.SIGINT, hold_ctrl_c, KeyboardInterrupt)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_inside_ddpwatchs_own_code_is_raised_as_the_outermost_held_block_ends(
        default_sigterm: None, signum: int, install: Callable[[], bool], raised: type[BaseException]) -> None:
    """Raised inside, it cut a step in two: its report made and never sent (``Watch._publish_completed``).
    Ctrl-C too: Python's handler raised ``KeyboardInterrupt`` at the next bytecode, inside the
    hook as well, and Ctrl-C is the commonest stop of all."""
    assert install()
    reached = []
    with pytest.raises(raised):
        with stop_signals.held:
            with stop_signals.held:
                os.kill(os.getpid(), signum)
                wait_for_a_signal(0.3)
                reached.append("inner")
            wait_for_a_signal(0.1)
            reached.append("outer")
        reached.append("after")
    assert reached == ["inner", "outer"] and stop_signals._held_signal is None and not stop_signals._ctrl_c_held


def test_a_stop_in_a_held_block_an_exception_leaves_is_deferred_then_raised(default_sigterm: None) -> None:
    """The exception is on its way (the guard's own fault, a loop's failure): as in any ``except``."""
    stop_on_sigterm()
    with pytest.raises(RuntimeError):
        with stop_signals.held:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_a_signal(0.3)
            raise RuntimeError("ddpwatch's own fault")
    with pytest.raises(StoppedBySignal):
        wait_for_a_signal(10)


def test_a_ctrl_c_outside_a_held_block_raises_at_once_as_pythons_own_handler_does(default_sigterm: None) -> None:
    hold_ctrl_c()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        wait_for_a_signal(10)


def test_a_ctrl_c_in_a_held_block_an_exception_leaves_is_raised_with_it_as_its_context(default_sigterm: None) -> None:
    """As Python's handler raises inside an ``except`` block: the user asked to stop."""
    hold_ctrl_c()
    with pytest.raises(KeyboardInterrupt) as interrupted:
        with stop_signals.held:
            os.kill(os.getpid(), signal.SIGINT)
            wait_for_a_signal(0.3)
            raise RuntimeError("ddpwatch's own fault")
    assert isinstance(interrupted.value.__context__, RuntimeError)


def test_a_scripts_own_sigint_handler_is_left_alone_and_ours_is_given_back(default_sigterm: None) -> None:
    def theirs(signum: int, frame: object) -> None: ...

    signal.signal(signal.SIGINT, theirs)
    assert not hold_ctrl_c() and signal.getsignal(signal.SIGINT) is theirs
    release_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is theirs
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert hold_ctrl_c() and hold_ctrl_c()  # twice: still ours
    release_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_block_in_another_thread_holds_nothing(default_sigterm: None) -> None:
    """The handler runs in the main thread, between its bytecodes: an autograd thread's hook
    cannot hold it (nor could it raise it there)."""
    stop_on_sigterm()
    inside, leave = threading.Event(), threading.Event()

    def hook_in_another_thread() -> None:
        with stop_signals.held:
            inside.set()
            leave.wait(30)

    other = threading.Thread(target=hook_in_another_thread)
    other.start()
    inside.wait(30)
    try:
        with pytest.raises(StoppedBySignal):
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_a_signal()
    finally:
        leave.set()
        other.join(30)
    assert stop_signals._held_depth == 0 and stop_signals._held_signal is None


HELD_THEN_BLOCKED = """
import os, signal, socket
from instrumented_ddp.publish import stop_signals
stop_signals.stop_on_sigterm()
stop_signals.when_stuck(lambda: print("goodbye sent from the watch", flush=True))
waiting, _ = socket.socketpair()
with stop_signals.held:
    os.kill(os.getpid(), signal.SIGTERM)
    print("noted", flush=True)  # the handler has run by now: the stop is held
    waiting.recv(1)  # and the hook blocks: nothing ever comes
"""


def test_a_held_stop_whose_block_then_blocks_ends_the_process_as_a_stop_blocked_in_cpp_does() -> None:
    """Noted in the hook, then the hook blocks (a device sync, a collective): the watch thread took
    the noted stop as raised, and the process outlived it until torchrun's SIGKILL."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", HELD_THEN_BLOCKED], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert result.stdout == "noted\ngoodbye sent from the watch\n"
    assert time.monotonic() - started < 30


def test_a_stop_during_the_exit_handlers_is_noted_not_raised(default_sigterm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """By then the interpreter counts the main thread as stopped, and the goodbye is being sent."""
    stop_on_sigterm()
    monkeypatch.setattr(threading, "main_thread", lambda: threading.Thread())  # not started: not alive
    os.kill(os.getpid(), signal.SIGTERM)
    wait_for_a_signal(0.3)
    assert isinstance(stop_signals.received, StoppedBySignal)


def test_a_stopped_process_drops_a_python_sigchld_handler(default_sigterm: None) -> None:
    """A DataLoader's raises when a worker dies; the same stop kills its workers, and it raised in
    the middle of the goodbye (*Exception ignored in atexit callback … worker … is killed by signal*)."""
    def dataloader_handler(signum: int, frame: object) -> None:
        raise RuntimeError("DataLoader worker (pid 9568) is killed by signal: Terminated.")

    signal.signal(signal.SIGCHLD, dataloader_handler)
    stop_on_sigterm()
    with pytest.raises(StoppedBySignal):
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for_a_signal()
    assert signal.getsignal(signal.SIGCHLD) is stop_signals._children_end_too
