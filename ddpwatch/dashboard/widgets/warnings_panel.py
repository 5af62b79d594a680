"""Desyncs, lost ranks, stragglers, unresolved steps, dropped or rejected telemetry, said in plain
words; below them, marked apart, what is worth knowing but not wrong (late reports, device notes,
switch notices)."""

from __future__ import annotations

from rich.markup import escape
from textual.widgets import Static


class WarningsPanel(Static):
    def show(self, warnings: tuple[str, ...], notices: tuple[str, ...] = ()) -> None:
        """``warnings`` in red (a desync, the run's one error, comes first); ``notices`` in cyan.
        Both are escaped: a device note or a refusal's detail is text a rank sent, not markup."""
        lines = [f"[b red]![/] {escape(w)}" for w in warnings] + [f"[b cyan]i[/] {escape(n)}" for n in notices]
        text = "\n".join(lines) if lines else "[green]no warnings[/green]"
        if text != getattr(self, "_shown", None):  # an update is a layout pass: its height follows the text
            self._shown = text
            self.update(text)
        self.set_class(bool(warnings), "has-warnings")
