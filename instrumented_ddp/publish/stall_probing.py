"""What each heartbeat says of the rank's progress: its phase always, a ``StallProbe`` once stalled.

Run on the sender thread, once a heartbeat (a second). While steps finish, a heartbeat costs a
few attribute reads. Once none has finished for ``PROBE_AFTER_S`` (or twice the rank's recent
median step, whichever is longer), each heartbeat also carries the collectives in flight
(``timing.in_flight``), the timeline's count of those issued on each group, and the main
thread's Python stack from ``sys._current_frames()``: no signal is sent, the main thread is not
interrupted, and no device is synchronised. Where the user asked, it carries the native stack
too, once py-spy has answered (``native_stack``).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

from instrumented_ddp.publish.native_stack import NativeStack
from instrumented_ddp.timing.in_flight import collectives_in_flight
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.timing.users_code import is_users_file
from instrumented_ddp.wire.stall_probe import MAX_GROUPS, MAX_LINE, MAX_NAME, MAX_STACK_LINES, PROBE_AFTER_S, StallProbe

RECENT_STEPS = 16  # the steps whose median sets how long a step may take before the rank probes itself
#: Frames of these say torch.compile is compiling: a long step, not a stall.
COMPILING_IN = ("_dynamo/", "_inductor/")  # as ``main_stack`` writes a file: its last two path parts


class StallProbing:
    """The rank's side of stall detection; ``state`` is what the next heartbeat says."""

    def __init__(self, timeline: StepTimeline, steps_done: Callable[[], int],
                 pausing: Callable[[], str] = lambda: "", native: NativeStack | None = None) -> None:
        self.timeline = timeline
        self.steps_done = steps_done
        self.pausing = pausing  # what the loop pauses training for now ("" while it trains: ``Watch.pausing``)
        self._paused = False  # the last heartbeat found training paused
        self.native = native  # the main thread's native stack, once a stall, where the user asked
        #: What the main thread is in; ``attach`` reads it from its step boundaries instead.
        self.phase_of: Callable[[], str] = lambda: timeline.current_phase
        self.main_thread = threading.get_ident()  # made on the training thread (``Watch.start``)
        self._steps = -1
        self._progress_at = time.perf_counter()
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def state(self) -> tuple[str, StallProbe | None]:
        """(phase, probe): the probe only once the rank has finished no step for a while."""
        now = time.perf_counter()
        steps = self.steps_done()
        phase = self.phase_of()[:16]
        if self.pausing() or self._paused:  # a marked pause is neither a step's time nor idle time
            self._paused = bool(self.pausing())
            self._steps, self._progress_at = steps, now
            return phase, None
        if steps != self._steps:
            if self._steps >= 1 and steps > self._steps:  # (from 0, the interval holds the start-up)
                self._recent.append((now - self._progress_at) / (steps - self._steps))
            self._steps, self._progress_at = steps, now
            if self.native is not None:
                self.native.reset()
        idle = now - self._progress_at
        if idle < self.probe_after_s():
            return phase, None
        native, native_error = [], ""
        if self.native is not None:
            self.native.request()
            native, native_error = self.native.lines, self.native.error
        stack, place = main_stack(self.main_thread)
        issued = dict(list(self.timeline.issued.items())[:MAX_GROUPS])
        return phase, StallProbe(idle_s=idle, in_step=self.timeline.current_step,
                                 in_flight=collectives_in_flight(self.timeline, now),
                                 issued={group[:MAX_NAME]: count for group, count in issued.items()},
                                 stack=stack, compiling=any(part in line for line in stack for part in COMPILING_IN), place=place,
                                 native_stack=native, native_error=native_error)

    def probe_after_s(self) -> float:
        return max(PROBE_AFTER_S, 2.0 * statistics.median(self._recent)) if self._recent else PROBE_AFTER_S


def main_stack(thread: int) -> tuple[list[str], str]:
    """The thread's Python stack, outermost first, ``file:line function: source`` a frame (the
    file as its last two path parts), the innermost ``MAX_STACK_LINES``; and the innermost of
    those lines in the user's own code (``users_code``), "" for none. ([], "") where it has ended."""
    frame = sys._current_frames().get(thread)
    if frame is None:
        return [], ""
    lines, place = [], ""
    for entry in traceback.extract_stack(frame, limit=MAX_STACK_LINES):
        where = "/".join(entry.filename.replace("\\", "/").split("/")[-2:])
        lines.append(f"{where}:{entry.lineno} {entry.name}: {(entry.line or '').strip()}"[:MAX_LINE])
        if is_users_file(entry.filename):
            place = lines[-1]
    return lines, place
