"""The files of a step gate (``step_gate``), read and written by the test and by the gated ranks
(``workers/gated_train.py``): the last step allowed, and the step rank 0 waits at. Standard library
only: the ranks import it as they start."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Replaced at once (``os.replace``): a reader never sees it half-written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def allowed_step(gate: Path) -> int:
    """The last step the gate lets a run take."""
    return int(gate.read_text())


def waiting_file(gate: Path) -> Path:
    """Where rank 0 notes the step it waits at, beside the gate."""
    return gate.with_name(gate.name + ".waiting")


def note_waiting_at(gate: Path, step: int) -> None:
    """Rank 0's note that it waits at the gate for ``step``."""
    write_whole(waiting_file(gate), str(step))
