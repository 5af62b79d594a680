"""Where a script will write its results, checked before it trains.

A ``--profile`` directory the profiler cannot make failed as a traceback at step 8, when the
first trace was written, and a ``--save-final`` file whose directory did not exist failed after
the last step: the run, or its result, lost to a flag that could have been refused at once.
Pure standard library, shared by ``train.py`` and the examples.
"""

from __future__ import annotations

import os
from pathlib import Path


def directory_problem(flag: str, path: str) -> str | None:
    """Make the directory ``path`` (and its parents) now, as the profiler would later; why it
    cannot be made or written to, or None."""
    if Path(path).exists() and not Path(path).is_dir():
        return f"{flag} {path}: is a file, not a directory"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{flag} {path}: cannot make the directory ({error.strerror or error})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{flag} {path}: the directory is not writable"
    return None


def file_problem(flag: str, path: str) -> str | None:
    """Make the directory of the file ``path`` now; why the file could not be written there at
    the end, or None. The file itself is not touched: an earlier run's stays until this one ends."""
    target = Path(path)
    if target.is_dir():
        return f"{flag} {path}: is a directory, not a file"
    if target.parent.exists() and not target.parent.is_dir():
        return f"{flag} {path}: {target.parent} is a file, not a directory"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{flag} {path}: cannot make its directory ({error.strerror or error})"
    if not os.access(target.parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{flag} {path}: not writable"
    return None
