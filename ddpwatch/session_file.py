"""The session file: every message exactly as it arrived, appended with its arrival time.

Raw bytes rather than decoded records, so replay and later versions see what the dashboard saw,
rejected messages included. Each record is ``<f8 arrival time><u4 length><bytes>``; a crash can
only cut the last record short, and the reader stops cleanly there.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

SESSION_FILE_NAME = "session.ddpwatch"
_HEADER = struct.Struct("<dI")
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

    def append(self, data: bytes, received_at: float) -> None:
        self._file.write(_HEADER.pack(received_at, len(data)))
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


def read_session_file(path: Path) -> Iterator[tuple[float, bytes]]:
    """(arrival time, raw message) in arrival order; a cut-short last record is skipped."""
    with open(path, "rb") as file:
        while True:
            header = file.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return
            received_at, length = _HEADER.unpack(header)
            data = file.read(length)
            if len(data) < length:
                return
            yield received_at, data


def session_file_in(path: Path) -> Path:
    """Accept either the session directory or the file itself."""
    return path / SESSION_FILE_NAME if path.is_dir() else path
