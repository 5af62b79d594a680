"""What ``attach`` returns under ``DDPWATCH_DISABLE=1``: a watch that does nothing.

The loop's own calls on its watch (``paused``, ``computing``, ``record_loss``,
``record_evaluation``, ``pause_begins``/``pause_ends``, ``wait_begins``/``wait_ends``, ``detach``)
stay in the script and run their blocks; no hook is installed, no socket opened, no collective
issued, and the model and optimizer are not looked at: the switch that takes ddpwatch out of a
job takes out its checks too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


class DisabledWatch:
    """``Attachment``'s calls a loop makes, each doing nothing (a block still runs)."""

    address = ""
    broken: Exception | None = None

    def detach(self, reason: str = "finished", trains_again: bool = False) -> None:
        """Nothing was attached."""

    def record_loss(self, loss: Any) -> None:
        """Not read."""

    def record_evaluation(self, metrics: Mapping[str, Any]) -> None:
        """Not sent."""

    @contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """The block runs, unmarked."""
        yield

    @contextmanager
    def computing(self, what: str) -> Iterator[None]:
        """The block runs, unmarked."""
        yield

    def pause_begins(self, what: str) -> None:
        """Not said."""

    def pause_ends(self, what: str) -> None:
        """Not said."""

    def wait_begins(self) -> Any:
        """No stamp: ``wait_ends`` is given None."""
        return None

    def wait_ends(self, start: Any, tag: str = "") -> None:
        """Not timed."""
