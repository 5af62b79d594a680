"""The main thread's native stack read by py-spy where the user asked for it
(``instrumented_ddp.publish.native_stack``): once per stall, off the heartbeat's thread, and one
line, said once, where it cannot be had."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from instrumented_ddp.publish.native_stack import NativeStack, asked_for, thread_lines


def answer(native: NativeStack, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while not native.lines and not native.error:
        assert time.monotonic() < deadline, "py-spy never answered"
        time.sleep(0.05)


def test_it_is_asked_for_by_the_environment() -> None:
    assert asked_for({"DDPWATCH_NATIVE_STACKS": "1"}) and asked_for({"DDPWATCH_NATIVE_STACKS": "yes"})
    assert not asked_for({}) and not asked_for({"DDPWATCH_NATIVE_STACKS": "0"})


def test_the_dump_is_the_main_threads_outermost_first() -> None:
    dump = [{"os_thread_id": 7, "frames": [{"name": "poll", "short_filename": "libc.so.6", "line": 0}]},
            {"os_thread_id": 5, "frames": [{"name": "clock_nanosleep", "short_filename": "libc.so.6", "line": 0},
                                           {"name": "time_sleep", "short_filename": "libpython3.11.so.1.0", "line": 0},
                                           {"name": "main", "short_filename": "train.py", "line": 31}]}]
    assert thread_lines(dump, 5) == ["train.py:31 main", "libpython3.11.so.1.0:0 time_sleep", "libc.so.6:0 clock_nanosleep"]
    assert thread_lines(dump, 9) is None


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_py_spy_reads_where_this_thread_sleeps_in_c() -> None:
    native = NativeStack(threading.get_native_id(), say=lambda line: None)
    native.request()
    time.sleep(1.0)  # the main thread sits in time.sleep's C code while py-spy looks
    answer(native)
    if native.error.startswith("py-spy could not read this process"):
        pytest.skip(f"this system refuses ptrace: {native.error}")
    assert native.error == "", native.error
    assert any("test_native_stack.py" in line and "test_py_spy_reads_where_this_thread_sleeps_in_c" in line
               for line in native.lines), native.lines
    assert any("sleep" in line for line in native.lines[-3:]), native.lines  # innermost: the C sleep


def test_a_refusal_or_a_missing_py_spy_is_one_line_said_once_and_carried() -> None:
    said: list[str] = []
    missing = NativeStack(1, say=said.append, py_spy="")
    for _ in range(2):  # two stalls
        missing.request()
        missing.reset()
    missing.request()
    assert said == ["ddpwatch: no native stack: DDPWATCH_NATIVE_STACKS is set, but py-spy is not installed (pip install py-spy)"]
    assert missing.error.startswith("DDPWATCH_NATIVE_STACKS is set") and missing.lines == []
    refused = NativeStack(1, say=said.append, py_spy=shutil.which("false") or "/bin/false")  # exits 1, says nothing
    refused.request()
    answer(refused)
    assert refused.error.startswith("py-spy could not read this process") and "\n" not in refused.error
    assert said[-1] == f"ddpwatch: no native stack: {refused.error}"


def test_it_is_dumped_once_a_stall() -> None:
    runs: list[int] = []
    native = NativeStack(1, say=lambda line: None, py_spy="py-spy")
    native._dump = lambda: runs.append(1)  # type: ignore[method-assign]
    for _ in range(5):  # five heartbeats of one stall
        native.request()
    time.sleep(0.1)
    native.reset()
    native.request()
    time.sleep(0.1)
    assert len(runs) == 2
