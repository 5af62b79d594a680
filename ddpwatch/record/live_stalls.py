"""What ``ddpwatch record`` (and ``tune``) says of a stall as it happens, and the file it leaves.

A hung job's ranks go on heartbeating until NCCL's watchdog or the process group's timeout kills
it, minutes later, and a killed job writes no exports. So each stall is said in one line as soon
as it is named, and again when it ends, and ``OUT/stalls.json`` is rewritten at each change
(atomically: a job killed meanwhile leaves the last whole one), holding the diagnosis whatever
ends the job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ddpwatch.export.exporters import write_atomic
from ddpwatch.ingest.session import Session
from ddpwatch.wording.stall_text import stall_line

STALLS_FILE = "stalls.json"


class LiveStallReporter:
    """Says each stall named and ended through ``say``, and keeps ``stalls.json`` in ``out_dir``."""

    def __init__(self, say: Callable[[str], None], out_dir: Path) -> None:
        self._say = say
        self._path = Path(out_dir) / STALLS_FILE
        self._changes = 0
        self._named = 0  # stalls said so far
        self._ended = 0  # ... of which said ended

    def look(self, session: Session, now: float) -> None:
        """Look for a stall at ``now`` on the session's clock; say and write what changed."""
        watch = session.stall_watch
        watch.look(now)
        if watch.changes == self._changes:
            return
        self._changes = watch.changes
        for stall in watch.stalls[self._named:]:
            self._say(f"STALL: {stall_line(stall.as_dict(), stall.duration_s(now))}")
        self._named = len(watch.stalls)
        ended = [stall for stall in watch.stalls if stall.ended_at is not None]
        for stall in ended[self._ended:]:
            self._say(f"the stall at step {stall.step} ended: no step for {stall.duration_s(now):.1f} s")
        self._ended = len(ended)
        try:
            write_atomic(self._path, json.dumps({"stalls": watch.as_list()}, indent=2, allow_nan=False) + "\n")
        except OSError as error:  # a full disk costs the file, never the recording
            self._say(f"{self._path} could not be written: {error}")
