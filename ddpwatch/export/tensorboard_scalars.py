"""``--tensorboard DIR``: the step and segment scalars (``step_scalars``) as TensorBoard event
files, a run folder per session (``DIR/<session>``), written by the listener, never the ranks.

Written with tensorboard's own ``EventFileWriter`` (the ``tensorboard`` extra), which needs
neither torch nor TensorFlow: the dashboard imports no torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ddpwatch.export.step_scalars import ScalarRows
from ddpwatch.ingest.session import Session

TENSORBOARD_EXTRA = "--tensorboard needs the tensorboard extra: pip install 'ddpwatch[tensorboard]'"
WRITE_EVERY_S = 1.0  # rows are written and flushed at most this often: TensorBoard reloads every few seconds


class TensorBoardScalars:
    """One event file per session under ``directory``; ``ImportError`` with ``TENSORBOARD_EXTRA``
    where tensorboard is not installed, said at start."""

    name = "--tensorboard"

    def __init__(self, directory: Path) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ImportError(TENSORBOARD_EXTRA) from None
        self._event, self._summary, self._writer_class = event_pb2.Event, summary_pb2.Summary, EventFileWriter
        self.directory = directory
        self._session: Session | None = None
        self._rows = ScalarRows()
        self._writer: Any = None
        self._written_at = float("-inf")

    def look(self, session: Session, now: float) -> None:
        if now - self._written_at >= WRITE_EVERY_S:
            self._write(session, final=False)
            self._written_at = now

    def finish(self, session: Session, now: float) -> None:
        self._write(session, final=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, session: Session, final: bool) -> None:
        if session is not self._session:  # the next run: a run folder of its own
            if not session.session_id:
                return  # no hello yet: no name for its folder
            self.close()
            self._session, self._rows = session, ScalarRows()
            self._writer = self._writer_class(str(self.directory / session.session_id), flush_secs=3600)
        rows = self._rows.new_rows(session, final)
        for step, row in rows:
            values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in row.items()]
            self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        if rows:
            self._writer.flush()
