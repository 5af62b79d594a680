"""Ends the spans of collectives whose work has no future to call back from.

gloo's reduce-scatter returns a plain ``Work`` whose ``get_future()`` raises "Work::getFuture not
implemented" (torch 2.13), so no completion callback can stamp its end. One daemon thread waits
on such works in issue order and stamps each end as its ``wait()`` returns: the order gloo serves
them in, so a stamp is late only when a later work finished before an earlier one (gloo runs two
at a time), by at most the earlier one's remaining time. Nothing waits on the training thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class WorkWaiter:
    def __init__(self) -> None:
        self._works: queue.SimpleQueue[tuple[Any, Callable[[], None], Callable[[BaseException], None]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, work: Any, on_done: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        """Call ``on_done`` (or ``on_error``) on the waiter thread once ``work`` completes."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ddpwatch-work-waiter", daemon=True)
                self._thread.start()
        self._works.put((work, on_done, on_error))

    def _run(self) -> None:
        while True:
            work, on_done, on_error = self._works.get()
            try:
                work.wait()
            except BaseException as error:  # a failed collective: its span fails, training sees the error itself
                on_error(error)
                continue
            on_done()


#: One per process: its thread starts at the first work that needs it.
WORK_WAITER = WorkWaiter()
