"""The main thread's native stack, read by py-spy, once a stalled rank probes itself: only where
the user asks for it (``DDPWATCH_NATIVE_STACKS=1``) and py-spy is installed.

A Python stack ends at the call into torch's C++ (``work.wait()``, a CUDA sync, a data loader's
``recv``); the native one says where inside it the thread sits. ``py-spy dump --native`` reads it
from outside the interpreter, through ``ptrace``: it pauses the process for tens of milliseconds
and may take seconds, so it runs once per stall, on its own thread, and the heartbeats carry its
lines once it has answered. An operating system that refuses (Yama's ``ptrace_scope``, a container
without ``CAP_SYS_PTRACE``) costs one line, said once on the rank's stderr and carried in place
of the stack.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from instrumented_ddp.wire.stall_probe import MAX_LINE, MAX_STACK_LINES

ENV = "DDPWATCH_NATIVE_STACKS"
DUMP_TIMEOUT_S = 10.0  # a dump of a few dozen threads answers in well under a second


def asked_for(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the user asked for native stacks."""
    return environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


class NativeStack:
    """One py-spy dump of this process's thread ``native_id`` per stall; ``lines`` (outermost
    first, ``file:line function`` a frame) once it answered, else ``error``, one line."""

    def __init__(self, native_id: int, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                 py_spy: str | None = None) -> None:
        self.native_id = native_id
        self._say = say
        self._py_spy = py_spy if py_spy is not None else shutil.which("py-spy") or ""
        self.lines: list[str] = []
        self.error = ""
        self._asked = False  # a dump was asked for in this stall
        self._said: set[str] = set()  # errors said on stderr already: each once a process
        self._lock = threading.Lock()

    def request(self) -> None:
        """A stall is probed: dump the stack, once for this stall, on a thread of its own."""
        with self._lock:
            if self._asked:
                return
            self._asked = True
        if not self._py_spy:
            self._fail(f"{ENV} is set, but py-spy is not installed (pip install py-spy)")
            return
        threading.Thread(target=self._dump, name="ddpwatch-py-spy", daemon=True).start()

    def reset(self) -> None:
        """Steps resumed: the next stall takes a dump of its own."""
        with self._lock:
            self._asked = False
            self.lines, self.error = [], ""

    def _dump(self) -> None:
        try:
            done = subprocess.run([self._py_spy, "dump", "--pid", str(os.getpid()), "--native", "--json"],
                                  capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._fail(f"py-spy did not answer within {DUMP_TIMEOUT_S:.0f} s")
            return
        except OSError as error:
            self._fail(f"py-spy could not be run: {error}")
            return
        if done.returncode != 0:
            first = next((line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()), "no output")
            self._fail(f"py-spy could not read this process (the system may refuse ptrace: kernel.yama.ptrace_scope, "
                       f"CAP_SYS_PTRACE): {first}")
            return
        try:
            lines = thread_lines(json.loads(done.stdout), self.native_id)
        except (ValueError, TypeError, KeyError) as error:
            self._fail(f"py-spy's dump could not be read: {error}")
            return
        if lines is None:
            self._fail("py-spy's dump holds no main thread")
            return
        with self._lock:
            if self._asked:  # not reset meanwhile: this stall's
                self.lines = lines

    def _fail(self, line: str) -> None:
        line = line[:MAX_LINE]
        with self._lock:
            self.error = line
            fresh = line not in self._said
            self._said.add(line)
        if fresh:
            self._say(f"ddpwatch: no native stack: {line}")


def thread_lines(dump: Any, native_id: int) -> list[str] | None:
    """The frames of thread ``native_id`` in py-spy's JSON dump, outermost first, the innermost
    ``MAX_STACK_LINES``; None where the dump holds no such thread."""
    for thread in dump:
        if thread.get("os_thread_id") == native_id:
            frames = [f"{frame.get('short_filename') or frame.get('filename', '?')}:{frame.get('line', 0)} {frame.get('name', '?')}"[:MAX_LINE]
                      for frame in thread.get("frames", [])]
            return list(reversed(frames[:MAX_STACK_LINES]))
    return None
