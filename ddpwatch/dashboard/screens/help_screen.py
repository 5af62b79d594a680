"""``?``: every key the dashboard knows."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("?", "this help"),
    ("q", "quit (the session is already on disk)"),
    ("space", "pause / follow the latest step"),
    ("← / →", "previous / next step (pauses)"),
    ("end", "back to the latest step"),
    ("s", "pick a strategy and settings to switch to"),
    ("1 … 6", "switch to simple, ga, hook, async, bucket, ddp"),
    ("+ / -", "double / halve bucket_mb (switches)"),
    ("] / [", "grad_accum + 1 / - 1 (switches)"),
    ("e", "export summary.json/.md/.csv, trace.json and an SVG screenshot"),
    ("> / <", "replay: twice / half the speed"),
    ("mouse", "click a rank row to highlight it in the timeline; click tabs; scroll any panel"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        rows = "\n".join(f"[b]{escape(key):>8}[/b]  {what}" for key, what in KEYS)
        with Vertical(id="help-box"):
            yield Static("[b]ddpwatch keys[/b]\n\n" + rows + "\n\n[dim]escape to close[/dim]")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
