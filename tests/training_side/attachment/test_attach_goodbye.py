"""How an attached run ends, as the dashboard hears it: a loop that raises says *failed* and what
it raised, a signal says *interrupted*, a script's own SIGTERM handler is kept, and the end of
the process says goodbye without ``detach``."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from ddpwatch.record.recorder import load_session
from instrumented_ddp.publish import stop_signals
from instrumented_ddp.wire.messages import Goodbye
from launch import REPO_ROOT, Recorder
from attach_helpers import attach_for_test, attached, make_ddp, train


def test_a_loop_that_raises_says_goodbye_as_failed_with_what_it_raised(one_rank_group: None, sent: list[Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python calls ``sys.excepthook`` on an exception no one caught, then the exit's handlers, one
    of which detaches: its goodbye said *finished*, and the dashboard showed the rank so."""
    shown: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: shown.append(error))  # the interpreter's printer
    ddp, optimizer = make_ddp()
    watch = attach_for_test(ddp, optimizer)
    train(ddp, optimizer, steps=2)
    error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(the rest of torch's message)")
    sys.excepthook(RuntimeError, error, None)  # what the interpreter does with the loop's exception
    watch._detach_at_exit()  # then its exit's handlers
    assert shown == [error]  # still printed, by the hook that was there before
    (goodbye,) = [m for m in sent if isinstance(m, Goodbye)]
    assert (goodbye.steps, goodbye.reason) == (2, "failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert sys.excepthook.__name__ == "<lambda>"  # detach put it back


def test_two_models_attached_and_detached_in_turn_put_the_hook_back_and_free_the_first(
        one_rank_group: None, sent: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A GAN's two DDPs, each attached to an address of its own: each had a hook of its own,
    chained; the second's detach put the first's back, which held the first attachment, its DDP
    and its model (on a GPU, its memory) for the rest of the process."""
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: None)  # the interpreter's printer
    original = sys.excepthook
    first, first_optimizer = make_ddp()
    second, second_optimizer = make_ddp()
    first_watch, second_watch = attach_for_test(first, first_optimizer), attach_for_test(second, second_optimizer)
    error = RuntimeError("the loop raised")
    sys.excepthook(RuntimeError, error, None)
    assert first_watch.uncaught is error and second_watch.uncaught is error  # each goodbye will say so
    first_watch.detach()
    second_watch.detach()
    assert sys.excepthook is original
    freed = weakref.ref(first)
    del first, first_optimizer, first_watch
    gc.collect()
    assert freed() is None


def test_a_loop_stopped_by_a_signal_says_goodbye_as_interrupted_not_failed(one_rank_group: None, sent: list[Any],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C at torchrun sends every rank SIGINT (``KeyboardInterrupt``, through the excepthook);
    torchrun's stop of the ranks left, or a scheduler's preemption, SIGTERM, which attach turns
    into ``StoppedBySignal`` (a ``SystemExit``: the excepthook never sees it). Before, the first
    read *failed: KeyboardInterrupt* (a cause named where there was none) and the second *lost*."""
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: None)  # the interpreter's printer
    monkeypatch.setattr(stop_signals, "received", None)

    def goodbye_after(stop: Any) -> tuple[int, str]:
        ddp, optimizer = make_ddp()
        watch = attach_for_test(ddp, optimizer)
        assert signal.getsignal(signal.SIGTERM) is stop_signals._stop  # the script set no handler: ours
        train(ddp, optimizer, steps=2)
        stop()
        watch._detach_at_exit()  # the exit's handlers
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the last detach gave the default back
        (goodbye,) = [m for m in sent if isinstance(m, Goodbye)]
        sent.clear()
        return goodbye.steps, goodbye.reason

    def sigterm() -> None:
        with pytest.raises(stop_signals.StoppedBySignal) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs in this thread between two bytecodes: after a sleep at worst
                time.sleep(0.05)
        assert stopped.value.code == 128 + signal.SIGTERM  # the shell's exit code for it

    assert goodbye_after(lambda: sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)) == (
        2, "interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)")
    assert goodbye_after(sigterm) == (2, "interrupted: SIGTERM")


def test_a_script_that_handles_sigterm_itself_keeps_its_handler(one_rank_group: None, sent: list[Any]) -> None:
    """A checkpoint on preemption is the script's: attach changes no handler it set."""
    def checkpoint_and_exit(signum: int, frame: Any) -> None:
        raise AssertionError("not called here")

    previous = signal.signal(signal.SIGTERM, checkpoint_and_exit)
    try:
        ddp, optimizer = make_ddp()
        with attached(ddp, optimizer):
            assert signal.getsignal(signal.SIGTERM) is checkpoint_and_exit
        assert signal.getsignal(signal.SIGTERM) is checkpoint_and_exit
    finally:
        signal.signal(signal.SIGTERM, previous)


END_WITHOUT_DETACH = """
import sys
import time
import weakref
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import instrumented_ddp
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
watch = instrumented_ddp.attach(ddp, optimizer, address=sys.argv[1])
deadline = time.monotonic() + 30
while watch.publisher.sent == 0 and time.monotonic() < deadline:  # connected (nothing is queued before)
    time.sleep(0.01)
for _ in range(3):
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_the_end_of_the_process_says_goodbye_without_detach(tmp_path: Path) -> None:
    """A user who never calls ``detach``: the recorder still hears every step and the goodbye."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        subprocess.run([sys.executable, "-c", END_WITHOUT_DETACH, recorder.address], cwd=REPO_ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, timeout=120)
        assert "every rank said goodbye" in recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    assert sorted(session.reports) == [1, 2, 3] and not session.ranks[0].hello.switchable


TRAIN_UNTIL_STOPPED = END_WITHOUT_DETACH + """
print("trained 3 steps", flush=True)
while True:  # until a signal stops it
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_process_sent_sigterm_exits_at_once_and_its_goodbye_says_interrupted(tmp_path: Path) -> None:
    """torchrun's SIGTERM (the ranks left when one fails, its own Ctrl-C) or a scheduler's: by
    default it killed the process with no exit handler run, and the rank read *lost*."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        process = subprocess.Popen([sys.executable, "-c", TRAIN_UNTIL_STOPPED, recorder.address], cwd=REPO_ROOT,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout.readline() == "trained 3 steps\n"
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 128 + signal.SIGTERM  # a shell's code for SIGTERM; no traceback
        finally:
            process.kill()
            process.stdout.close()
        err = recorder.wait()
    assert "every rank said goodbye" in err
    (line,) = [line for line in err.splitlines() if "interrupted" in line]
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    steps = session.ranks[0].goodbye.steps
    assert line == f"ddpwatch record: rank 0 interrupted after step {steps}: SIGTERM" and steps >= 3
    assert session.status(0) == "interrupted" and sorted(session.reports)[-1] == steps


STOPPED_AS_STEP_2_IS_SENT = ("""
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as under a terminal (a background job inherits it ignored)
""" + END_WITHOUT_DETACH).replace("for _ in range(3):", """
import os, signal
from instrumented_ddp.wire.messages import StepReport
publish = watch.publisher.publish
def publish_then_stop(message):
    if isinstance(message, StepReport) and message.step == 2:  # a stop as ddpwatch has taken the report
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    publish(message)
watch.publisher.publish = publish_then_stop
for _ in range(10):""")


@pytest.mark.parametrize(("stop", "exit_code", "said"), [
    ("SIGTERM", 128 + signal.SIGTERM, "interrupted: SIGTERM"),
    ("SIGINT", -signal.SIGINT, "interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)"),  # Ctrl-C: Python dies of it
], ids=["SIGTERM", "SIGINT"])
def test_a_stop_as_a_steps_report_is_being_sent_lands_after_it_is_sent(tmp_path: Path, stop: str, exit_code: int,
                                                                        said: str) -> None:
    """Raised at the next bytecode, inside ddpwatch's hook, the stop lost the report it had in
    hand (the goodbye said step 2, no step 2 came) or, a step earlier, sent a report past the
    goodbye's count. Held (``stop_signals.held``), it lands in the loop once the hook returns."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        result = subprocess.run([sys.executable, "-c", STOPPED_AS_STEP_2_IS_SENT, recorder.address, stop], cwd=REPO_ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
        assert result.returncode == exit_code, result.stderr[-2000:]
        recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    goodbye = session.ranks[0].goodbye
    assert goodbye is not None and goodbye.reason == said
    assert sorted(session.reports) == list(range(1, goodbye.steps + 1)) and goodbye.steps >= 2


BLOCKED_IN_CPP = END_WITHOUT_DETACH + """
import datetime
print("trained 3 steps", flush=True)
dist.distributed_c10d._get_default_store().wait(["never set"], datetime.timedelta(seconds=300))  # C++, as a hung peer's collective
"""


def test_a_process_sent_sigterm_while_blocked_in_cpp_ends_and_says_goodbye_without_waiting_for_the_call(
        tmp_path: Path) -> None:
    """Python's handler runs only once the blocked call returns (a collective waiting for a hung
    peer): the process outlived the stop by as long, up to torchrun's SIGKILL 30 s later, which
    ended it with no goodbye anyway. Now it ends ``STUCK_AFTER_S`` later, its goodbye sent."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        process = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_CPP, recorder.address], cwd=REPO_ROOT,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            assert process.stdout.readline() == "trained 3 steps\n"
            time.sleep(0.5)  # into the store's wait (a signal before it is taken between two bytecodes: the same end)
            process.send_signal(signal.SIGTERM)
            assert process.wait(120) == 128 + signal.SIGTERM  # long before the 300 s wait returned
        finally:
            process.kill()
            process.stdout.close()
            process.stderr.close()
        assert "every rank said goodbye" in recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    assert session.status(0) == "interrupted" and session.ranks[0].goodbye.reason == "interrupted: SIGTERM"
