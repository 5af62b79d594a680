"""Where a command will write, checked before it starts.

A ``--profile`` directory the profiler could not make failed as a traceback at step 8, when the
first trace was written; a ``--save-final`` file whose directory did not exist, after the last
step, the run's result lost; a dashboard's ``--out`` it could not make, unseen (its receiver
ended, and quitting said the session was recorded there). Each could have been refused at once.
Pure standard library, shared by ``train.py``, the examples and ``ddpwatch``.
"""

from __future__ import annotations

import os
from pathlib import Path


def file_in_the_way(directory: Path) -> str | None:
    """*X is a file, not a directory*, X the file at ``directory`` or at the nearest of its
    parents that exists, where a directory is wanted, or None: what makes ``mkdir`` fail with a
    bare *File exists* or *Not a directory*."""
    nearest = next((part for part in (directory, *directory.parents) if part.exists()), None)
    return f"{nearest} is a file, not a directory" if nearest is not None and not nearest.is_dir() else None


def _why_not_a_directory(directory: Path) -> str | None:
    """Make ``directory`` (and its parents) now, as the writer would later; why it cannot be
    made or written to, or None."""
    if (in_the_way := file_in_the_way(directory)) is not None:
        return in_the_way
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot make {directory} ({error.strerror or error})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    return None


def directory_problem(flag: str, path: str) -> str | None:
    """Why the directory ``path``, given as ``flag``, cannot be written in (made now), or None."""
    why = _why_not_a_directory(Path(path))
    return None if why is None else f"{flag} {path}: {why}"


def file_problem(flag: str, path: str) -> str | None:
    """Why the file ``path``, given as ``flag``, could not be written at the end (its directory
    made now), or None. The file itself is not touched: an earlier run's stays until this one ends."""
    target = Path(path)
    if target.is_dir():
        return f"{flag} {path}: is a directory, not a file"
    why = _why_not_a_directory(target.parent)
    if why is None and target.exists() and not os.access(target, os.W_OK):
        why = f"{target} is not writable"
    return None if why is None else f"{flag} {path}: {why}"


def outputs_problem(profile: str | None = None, save_final: str | None = None) -> str | None:
    """The scripts' two output flags checked at once: ``--profile DIR`` (the profiler's traces,
    written from step 8) and ``--save-final FILE`` (written after the last step)."""
    return (profile and directory_problem("--profile", profile)) or (save_final and file_problem("--save-final", save_final)) or None
