"""Desyncs, lost ranks, stragglers, dropped or rejected telemetry, said in plain words."""

from __future__ import annotations

from textual.widgets import Static


class WarningsPanel(Static):
    def show(self, warnings: tuple[str, ...], notices: tuple[str, ...] = ()) -> None:
        lines = [f"[b red]![/] {w}" for w in warnings] + [f"[b cyan]i[/] {n}" for n in notices]
        text = "\n".join(lines) if lines else "[green]no warnings[/green]"
        if text != getattr(self, "_shown", None):  # an update is a layout pass: its height follows the text
            self._shown = text
            self.update(text)
        self.set_class(bool(warnings), "has-warnings")
