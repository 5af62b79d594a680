"""The session file: every message exactly as it arrived, appended with its arrival time.

Raw bytes rather than decoded records, so replay and later versions see what the dashboard saw,
rejected messages included. Each record is ``<f8 arrival time><u4 length><bytes>``; a crash can
only cut the last record short, and the reader stops cleanly there. A record whose sender was a
rank of a run (``endpoints.run_of_sender``) sets the length's top bit and carries that run's id
after the header, ``<u1 size><id>``, so a replay tells two runs that sent at once apart as the
live dashboard did; a file written before has no such record, and reads as before.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from instrumented_ddp.wire.codec import ProtocolError, decode

SESSION_FILE_NAME = "session.ddpwatch"
_HEADER = struct.Struct("<dI")
_RUN_SIZE = struct.Struct("<B")
_HAS_RUN = 1 << 31  # in the length: a run id follows the header (a message is never 2 GiB: the listener caps it)
MAX_RUN_BYTES = 255  # what a size byte holds; ZeroMQ's routing ids, where runs come from, are at most 255 bytes too
FLUSH_EVERY_S = 1.0
WRITE_BUFFER_BYTES = 1 << 20


class SessionWriter:
    """Appends records; flushes at least every second so a crash loses at most a second."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # A large buffer: at 1,024 ranks ~3,000 messages a second, most of them a few KB, each one
        # a write call with the default 8 KB buffer; flushed every second either way.
        self._file: BinaryIO = open(path, "ab", buffering=WRITE_BUFFER_BYTES)
        self._last_flush = time.monotonic()
        self.records = 0

    def append(self, data: bytes, received_at: float, run: str = "") -> None:
        """One message; ``run``: the run whose rank sent it, where the listener knows it."""
        run_id = run.encode()[:MAX_RUN_BYTES]
        self._file.write(_HEADER.pack(received_at, len(data) | (_HAS_RUN if run_id else 0)))
        if run_id:
            self._file.write(_RUN_SIZE.pack(len(run_id)) + run_id)
        self._file.write(data)
        self.records += 1
        self.flush_if_due()

    def flush_if_due(self) -> None:
        if time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._file.close()


class SessionRecord(NamedTuple):
    received_at: float
    data: bytes
    run: str  # the run whose rank sent it; "" where the sender was none or is not known


def read_session_records(path: Path) -> Iterator[SessionRecord]:
    """Every record in arrival order; a cut-short last record is skipped."""
    with open(path, "rb") as file:
        while True:
            header = file.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return
            received_at, length = _HEADER.unpack(header)
            run = ""
            if length & _HAS_RUN:
                length &= ~_HAS_RUN
                size = file.read(_RUN_SIZE.size)
                if len(size) < _RUN_SIZE.size:
                    return
                (run_size,) = _RUN_SIZE.unpack(size)
                run_id = file.read(run_size)
                if len(run_id) < run_size:
                    return
                run = run_id.decode("utf-8", errors="replace")
            data = file.read(length)
            if len(data) < length:
                return
            yield SessionRecord(received_at, data, run)


def read_session_file(path: Path) -> Iterator[tuple[float, bytes]]:
    """(arrival time, raw message) in arrival order, for readers that do not tell runs apart."""
    for record in read_session_records(path):
        yield record.received_at, record.data


def session_file_in(path: Path) -> Path:
    """Accept either the session directory or the file itself."""
    return path / SESSION_FILE_NAME if path.is_dir() else path


def not_a_session_file(path: Path) -> str | None:
    """Why ``path`` holds nothing to replay or summarize, or None once one of its records is a
    ddpwatch message (the first, in any file the recorder wrote: read no further). A session file
    has no magic number, being appended to as messages arrive, so any file reads as records until
    one is cut short: a summary.md or a trace given instead came back as an empty session, an
    empty dashboard or a table of no rows, unexplained."""
    records = 0
    for record in read_session_records(path):
        records += 1
        try:
            decode(record.data, max_bytes=len(record.data))  # whatever cap it was recorded under
        except ProtocolError:
            continue  # a rogue's message is recorded too: a real session may hold some
        return None
    if records == 0 and path.stat().st_size == 0:
        return f"{path} is empty: nothing was recorded there (no rank connected?)"
    what = "not one whole record" if records == 0 else f"no ddpwatch message in its {records} record{'s' if records > 1 else ''}"
    return f"{path} is not a ddpwatch session (a recording's session.ddpwatch): {what}"
