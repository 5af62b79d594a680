"""One line above the timeline while the run is stalled: who holds it, in what, and where."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class StallBanner(Static):
    """The current stall in words (``wording.stall_text``), and the key that opens the stall
    view; hidden while the run is not stalled. Styled text, not markup: a stack line holds
    brackets of its own."""

    def show(self, text: str) -> None:
        if text == getattr(self, "_shown", None):
            return
        self._shown = text
        self.display = bool(text)
        if text:
            self.update(Content.assemble(("STALLED ", "bold"), text, ("  (w: each rank's stack)", "dim")))
